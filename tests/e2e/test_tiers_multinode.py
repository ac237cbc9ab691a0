"""Two simulated nodes × 2 ranks with `tiers=local+s3`, then a resume on 1 node × 3 ranks from the durable tier.

Phase 1 runs two `torchrun --nnodes=2 --node-rank={0,1}` processes on loopback, as a cluster would run
one per node; each node's fast tier is its own directory (`.../node{node_rank}`), the durable tier is the
loopback S3 server. Phase 2 is a resized cluster: one node, 3 ranks. Node 0's directory holds the
manifest but not node 1's shards, so no rank can read the fast copy whole: the ranks agree on the
durable copy, load it (every byte checked against the manifest's checksums) and train on (its ranks forked from
the tests' forkserver with torchrun's environment: tests.helpers.spawn.fork_launched_ranks).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.recipe_nodes import TRAIN, node_command, tiers_env
from tests.helpers.spawn import fork_launched_ranks, free_port, wait_for_ranks

pytestmark = pytest.mark.timeout(600)


def _overrides(tmp_path: Path, phase: str, run_name: str) -> list[str]:
    return [
        f"hydra.run.dir={tmp_path / phase}",
        "tiers=local+s3",
        f"run_name={run_name}",
        "~logger",
        "checkpoint.every_n_train_steps=4",
        "trainer.enable_progress_bar=false",
        "tiers.retry_backoff_s=0.5",
        "tiers.retry_backoff_max_s=2",
        "tiers.collective_timeout_s=120",
    ]


def _check(proc: subprocess.Popen, out: str, what: str) -> None:
    if proc.returncode != 0:
        pytest.fail(f"{what} exited {proc.returncode}\n{out[-8000:]}")


def test_two_nodes_write_node_local_fast_tiers_and_s3_then_three_ranks_resume_from_s3(tmp_path, s3_root):
    env = tiers_env(tmp_path, s3_root)
    run_name = s3_root.prefix  # a fresh prefix on the shared bucket
    port = free_port()
    nodes = []
    for node in (0, 1):
        command = node_command(node, port, "trainer.max_steps=8", *_overrides(tmp_path, f"node{node}", run_name))
        nodes.append(
            subprocess.Popen(
                command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [proc.communicate(timeout=400)[0] for proc in nodes]
    for node, (proc, out) in enumerate(zip(nodes, outputs)):
        _check(proc, out, f"node {node}")
    # the recipe's drills (every 5th checkpoint) cannot restore from a node-local fast tier on 2 nodes: off, said so
    assert "restore drills are off" in outputs[0]

    local = tmp_path / "local" / run_name
    durable_url = f"s3://{s3_root.bucket}/checkpoints/{run_name}"
    durable = fsio.resolve(durable_url, s3_root.storage_options)
    committed = [e for e in catalog.list_checkpoints(durable) if e.committed]
    assert committed and committed[-1].step == 8, [(e.step, e.state) for e in committed]
    newest = committed[-1]
    manifest = newest.manifest
    assert manifest["topology"]["world_size"] == 4 and manifest["replicated_from"]["tier"] == "fast"
    # every node wrote only its own ranks' shards into its own fast directory; node 0 holds the manifest
    node0, node1 = local / "node0" / newest.name, local / "node1" / newest.name
    assert (node0 / "manifest.json").exists() and not (node1 / "manifest.json").exists()
    # format v4: each rank's shard file and its part (the manifest lists no files, its parts table names them)
    written = {
        p.name: p for d in (node0, node1) for pattern in ("__*_0.distcp", "__*_0.part.json") for p in d.glob(pattern)
    }
    assert sorted(written) == sorted(f["path"] for f in manifest_format.files_of(manifest))
    assert {p.name for p in node1.glob("__*_0.distcp")} <= {"__2_0.distcp", "__3_0.distcp"}
    for name, path in written.items():  # the durable copy is bit-exact, file by file
        assert (
            s3_root.server.object_bytes(s3_root.bucket, f"checkpoints/{run_name}/{newest.name}/{name}")
            == path.read_bytes()
        ), name

    # a resized cluster: 1 node × 3 ranks; the fast tier here (node0) lacks node 1's shards. How torchrun starts
    # nodes is phase 1's: these ranks are forked with its environment, so none re-imports torch and Lightning
    argv = [
        str(TRAIN),
        "trainer.devices=3",
        "trainer.max_steps=10",
        "resume=latest",
        "checkpoint.drill.every_n_checkpoints=null",
        *_overrides(tmp_path, "resume", run_name),
    ]
    log = tmp_path / "resume.log"
    codes = wait_for_ranks(fork_launched_ranks(argv, 3, tmp_path, [log] * 3, **env), 400)
    out = log.read_text()
    if codes != [0, 0, 0]:
        pytest.fail(f"resume on 3 ranks: ranks exited {codes}\n{out[-8000:]}")
    assert f"resuming from the durable tier: {durable_url}/{newest.name} (step 8)" in out, out[-4000:]
    assert "not readable by every rank" in out
    events = [json.loads(p.read_text()) for p in (local / "node0" / "events").glob("resume-*.json")]
    assert [(e["from"], e["step"], e["world_size"], e["from_world_size"]) for e in events] == [
        (f"{durable_url}/{newest.name}", 8, 3, 4)
    ]
    # it trained on and saved on both tiers, as one run (the resumed run id)
    again = [e for e in catalog.list_checkpoints(durable) if e.committed]
    assert again[-1].step == 10 and again[-1].run_id == newest.run_id
