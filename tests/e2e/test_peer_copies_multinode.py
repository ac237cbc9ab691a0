"""The main recipe as 2 torchrun "nodes" × 2 ranks with peer copies, node 0 lost mid-run, resumed on 1 node × 3.

Each node's fast tier is its own directory (`.../node{node_rank}`), `tiers.fast.peers={factor:2,jump:2}` copies
every rank's files to a rank of the other node, and S3 (the loopback server, behind a proxy that records every
request) is the durable tier. Once a checkpoint is complete on node 1 (its peer copy committed there), both
nodes' processes are SIGKILLed (node 0 lost; the job dies with it) and node 0's root is deleted, original
manifests included. The resume on one node of 3 ranks (node rank 0: an empty root) assembles its root from
node 1's root on this machine's disk (node 0's files are node 1's peer copies), loads the checkpoint
resharded 4 -> 3 at the exact data position, and reads not one byte of a checkpoint from S3.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.spawn import free_port

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
DATA_READ = r"/step-\d+-[0-9a-f]+/(__\d+_\d+\.distcp|\.metadata)"  # a checkpoint's bytes (not a listing's records)

pytestmark = pytest.mark.timeout(600)


def _env(tmp_path: Path, s3_root, endpoint: str) -> dict[str, str]:
    options = s3_root.storage_options
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        SHARDCKPT_LOCAL_ROOT=str(tmp_path / "local"),
        SHARDCKPT_S3_BUCKET=s3_root.bucket,
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID=options["key"],
        AWS_SECRET_ACCESS_KEY=options["secret"],
    )


def _overrides(tmp_path: Path, phase: str, run_name: str) -> list[str]:
    return [
        f"hydra.run.dir={tmp_path / phase}",
        "tiers=local+s3",
        "tiers.fast.peers={factor:2,jump:2}",
        "tiers.durable.every_n_checkpoints=1000",  # no durable copy before the kill: the peers are all there is
        f"run_name={run_name}",
        "~logger",
        "checkpoint.every_n_train_steps=4",
        "checkpoint.drill.every_n_checkpoints=null",
        "trainer.enable_progress_bar=false",
        "tiers.collective_timeout_s=60",
    ]


def _descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return children + [d for c in children for d in _descendants(c)]


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun and every rank it started (torchrun may start its workers in sessions of their own)."""
    victims = [pid, *_descendants(pid)]
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{v}").exists() and "zombie" not in _state(v) for v in victims[1:]):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


def _complete_on_node1(local: Path) -> list[str]:
    """Checkpoints node 1's root holds committed: only a complete peer copy commits there."""
    return sorted(p.parent.name for p in (local / "node1").glob("step-*/manifest.json"))


def test_node_lost_mid_run_resumes_on_one_node_of_three_ranks_from_peer_copies_without_s3(
    tmp_path, s3_root, s3_fault_proxy
):
    env = _env(tmp_path, s3_root, s3_fault_proxy.endpoint)
    run_name = s3_root.prefix
    local = tmp_path / "local" / run_name
    port = free_port()
    nodes = []
    for node in (0, 1):
        command = [
            str(TORCHRUN),
            "--nnodes=2",
            "--nproc-per-node=2",
            f"--node-rank={node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(TRAIN),
            "trainer.num_nodes=2",
            "trainer.devices=2",
            "trainer.max_steps=100000",
            *_overrides(tmp_path, f"node{node}", run_name),
        ]
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 - closed with the process below
        nodes.append(
            (
                subprocess.Popen(
                    command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                ),
                log,
            )
        )
    deadline = time.monotonic() + 300
    try:
        while not _complete_on_node1(local) and time.monotonic() < deadline:
            if any(proc.poll() is not None for proc, _ in nodes):
                break
            time.sleep(0.2)
    finally:
        for proc, log in nodes:  # node 0 lost: its processes die at once; the job dies with it
            _kill_tree(proc.pid)
            proc.wait()
            log.close()
    complete = _complete_on_node1(local)
    assert complete, (tmp_path / "node0.log").read_text()[-6000:]
    shutil.rmtree(local / "node0")  # ... and its disk, with the original manifests

    # the newest checkpoint node 1 holds whole (its own ranks' files, node 0's peer copies, the manifest)
    newest = max(complete, key=lambda name: int(name.split("-")[1]))
    step = int(newest.split("-")[1])
    samples = json.loads((local / "node1" / newest / "manifest.json").read_text())["samples_consumed"]
    s3_fault_proxy.clear()
    command = [
        sys.executable,
        str(TRAIN),
        "trainer.devices=3",
        f"trainer.max_steps={step + 1}",
        "resume=latest",
        *_overrides(tmp_path, "resume", run_name),
    ]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"resume on 3 ranks exited {proc.returncode}\n{out[-8000:]}")
    assert re.search(rf"resumed from \S+/node0/{newest} \(step {step}\) on 4 -> 3 ranks, fast tier", out), out[-4000:]
    assert f"resuming epoch 0 at global sample {samples} of" in out  # the exact data position, on 3 ranks
    # the new node 0's root was assembled from node 1's root on this machine's disk, every byte checked
    copied = re.search(r"assembled from peer copies: (\d+) bytes copied on the same machine, 0 bytes fetched", out)
    assert copied and int(copied[1]) > 0, out[-4000:]
    # not one byte of a checkpoint read from the durable tier (the replicator's catch-up copy writes there later)
    reads = [r.path for r in s3_fault_proxy.requests("GET", DATA_READ)]
    assert reads == [], reads
    events = [json.loads(p.read_text()) for p in (local / "node0" / "events").glob("resume-*.json")]
    assert [(e["from_id"], e["step"], e["world_size"], e["from_world_size"]) for e in events] == [
        (newest.split("-")[2], step, 3, 4)
    ]
