"""The main recipe as 2 "nodes" × 2 ranks with peer copies, node 0 lost mid-run, resumed three ways.

Every rank gets the environment torchrun gives it and is forked from the tests' forkserver (torch and Lightning
imported once, not per rank: tests.helpers.recipe_nodes.start_forked_node); how torchrun itself starts a node
is tests/e2e/test_tiers_multinode.py's to show.

Each node's fast tier is its own directory (`.../node{node_rank}`), `tiers.fast.peers={factor:2,jump:2}` copies
every rank's files to a rank of the other node, and S3 (the loopback server, behind a proxy that records every
request) is the durable tier. Once a checkpoint is complete on node 1 (its peer copy committed there), both
nodes' processes are SIGKILLed (node 0 lost; the job dies with it) and node 0's root is deleted, original
manifests included. Then, from that same state (node 1's root as the kill left it, S3 empty):

(a) one node of 3 ranks (node rank 0: an empty root) assembles its root from node 1's root on this machine's
    disk (node 0's files are node 1's peer copies) and loads the checkpoint resharded 4 -> 3;
(b) two nodes of 2 ranks, node 0 an empty replacement that does not see node 1's disk
    (`scan_local_roots=false`): node 0's files come from node 1's ranks over the process group;
(c) after (b), both nodes lost (the whole clique): the resume on one node of 2 ranks finds no complete peer
    copy, says so, and reads the checkpoint (b) left on S3 at its close.

(a) and (b) load bit-exact against the checkpoint (every byte checked against its checksums), at the exact data
position, and read not one byte of a checkpoint from S3.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from lightning_shardckpt.engine.storage import fsio
from tests.helpers.recipe_nodes import start_forked_node, tiers_env
from tests.helpers.spawn import ForkedMain, free_port

DATA_READ = r"/step-\d+-[0-9a-f]+/(__\d+_\d+\.distcp|\.metadata)"  # a checkpoint's bytes (not a listing's records)

pytestmark = pytest.mark.timeout(900)


def _overrides(tmp_path: Path, phase: str, run_name: str, peers: str = "{factor:2,jump:2}") -> list[str]:
    return [
        f"hydra.run.dir={tmp_path / phase}",
        "tiers=local+s3",
        f"tiers.fast.peers={peers}",
        "tiers.durable.every_n_checkpoints=1000",  # no durable copy before the kill: the peers are all there is
        f"run_name={run_name}",
        "~logger",
        "checkpoint.every_n_train_steps=4",
        "checkpoint.drill.every_n_checkpoints=null",
        "trainer.enable_progress_bar=false",
        "tiers.collective_timeout_s=60",
    ]


def _kill(ranks: list[ForkedMain]) -> None:
    """SIGKILL a node's ranks at once (the node is lost) and reap them."""
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
    for rank in ranks:
        rank.wait()


def _wait(ranks: list[ForkedMain], timeout_s: float) -> list[int | None]:
    """Exit statuses within `timeout_s` overall; None for a rank still running then."""
    deadline, codes = time.monotonic() + timeout_s, []
    for rank in ranks:
        try:
            codes.append(rank.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def _complete_on_node1(local: Path) -> list[str]:
    """Checkpoints node 1's root holds committed: only a complete peer copy commits there."""
    return sorted(p.parent.name for p in (local / "node1").glob("step-*/manifest.json"))


class LostNode:
    """What the kill left: node 1's root (saved aside, to restore before each resume), the checkpoint it holds whole."""

    def __init__(self, tmp_path: Path, s3_root, proxy) -> None:
        self.tmp_path, self.s3_root, self.proxy = tmp_path, s3_root, proxy
        self.env = tiers_env(tmp_path, s3_root, proxy.endpoint)
        self.run_name = s3_root.prefix
        self.local = tmp_path / "local" / self.run_name
        self.saved = tmp_path / "node1-after-the-kill"

    def train_and_lose_node0(self) -> None:
        port = free_port()
        args = ["trainer.max_steps=100000"]
        nodes = [
            start_forked_node(
                n,
                port,
                [*args, *_overrides(self.tmp_path, f"node{n}", self.run_name)],
                self.tmp_path,
                self.env,
                self.tmp_path / f"node{n}.log",
            )
            for n in (0, 1)
        ]
        deadline = time.monotonic() + 300
        try:
            while not _complete_on_node1(self.local) and time.monotonic() < deadline:
                if any(rank.poll() is not None for node in nodes for rank in node):
                    break
                time.sleep(0.2)
        finally:
            for node in nodes:  # node 0 lost: its processes die at once; the job dies with it
                _kill(node)
        complete = _complete_on_node1(self.local)
        assert complete, (self.tmp_path / "node0.log").read_text()[-6000:]
        shutil.rmtree(self.local / "node0")  # ... and its disk, with the original manifests
        # the newest checkpoint node 1 holds whole (its own ranks' files, node 0's peer copies, the manifest)
        self.newest = max(complete, key=lambda name: int(name.split("-")[1]))
        self.step = int(self.newest.split("-")[1])
        manifest = json.loads((self.local / "node1" / self.newest / "manifest.json").read_text())
        self.samples = manifest["samples_consumed"]
        shutil.copytree(self.local / "node1", self.saved)

    def back_to_the_kill(self) -> None:
        """Node 1's root as the kill left it, node 0's gone, nothing on S3 (each resume is another future)."""
        shutil.rmtree(self.local, ignore_errors=True)
        shutil.copytree(self.saved, self.local / "node1")
        durable = fsio.resolve(  # conf/tiers/local+s3.yaml's durable dirpath
            f"s3://{self.s3_root.bucket}/checkpoints/{self.run_name}", self.s3_root.storage_options
        )
        if durable.fs.exists(durable.path):
            durable.fs.rm(durable.path, recursive=True)
        durable.fs.invalidate_cache()
        self.proxy.clear()

    def resume_on_one_node(self, phase: str, devices: int, to_step: int) -> str:
        """The main recipe with `resume=latest` on one node of `devices` ranks; its output (every rank must exit 0)."""
        args = [f"trainer.max_steps={to_step}", "resume=latest", *_overrides(self.tmp_path, phase, self.run_name)]
        log = self.tmp_path / f"{phase}.log"
        ranks = start_forked_node(0, free_port(), args, self.tmp_path, self.env, log, nodes=1, per_node=devices)
        try:
            codes = _wait(ranks, 400)
        finally:
            _kill(ranks)
        out = log.read_text()
        assert codes == [0] * devices, f"({phase}) resume on {devices} ranks exited {codes}\n{out[-8000:]}"
        return out

    def s3_reads(self) -> list[str]:
        return [r.path for r in self.proxy.requests("GET", DATA_READ)]


@pytest.fixture
def lost_node(tmp_path, s3_root, s3_fault_proxy) -> LostNode:
    lost = LostNode(tmp_path, s3_root, s3_fault_proxy)
    lost.train_and_lose_node0()
    return lost


def _resume_line(out: str) -> re.Match | None:
    return re.search(r"resumed from (\S+) \(step (\d+)\) on (\d+) -> (\d+) ranks, (fast|durable) tier", out)


def test_a_lost_node_resumes_from_peer_copies_on_any_world_without_s3_and_a_lost_clique_from_s3(lost_node):
    lost = lost_node
    # (a) one node of 3 ranks: node 0's root is assembled from node 1's root on this machine's disk
    lost.back_to_the_kill()
    resume = [f"trainer.max_steps={lost.step + 1}", "resume=latest"]
    out = lost.resume_on_one_node("a", devices=3, to_step=lost.step + 1)
    line = _resume_line(out)
    assert line and line.groups()[1:] == (str(lost.step), "4", "3", "fast"), out[-4000:]
    assert line[1].endswith(f"/node0/{lost.newest}"), line[0]
    assert f"resuming epoch 0 at global sample {lost.samples} of" in out  # the exact data position, on 3 ranks
    copied = re.search(r"assembled from peer copies: (\d+) bytes copied on the same machine, 0 bytes fetched", out)
    assert copied and int(copied[1]) > 0, out[-4000:]
    assert lost.s3_reads() == []  # not one byte of a checkpoint from the durable tier
    events = [json.loads(p.read_text()) for p in (lost.local / "node0" / "events").glob("resume-*.json")]
    assert [(e["from_id"], e["step"], e["world_size"], e["from_world_size"]) for e in events] == [
        (lost.newest.split("-")[2], lost.step, 3, 4)
    ]

    # (b) two nodes of 2 ranks, node 0 an empty replacement that cannot see node 1's disk: fetched over the group
    lost.back_to_the_kill()
    port = free_port()
    no_scan = "{factor:2,jump:2,scan_local_roots:false}"  # a replacement node does not see node 1's disk
    nodes = [
        start_forked_node(
            n,
            port,
            [*resume, *_overrides(lost.tmp_path, f"b{n}", lost.run_name, no_scan)],
            lost.tmp_path,
            lost.env,
            lost.tmp_path / f"b{n}.log",
        )
        for n in (0, 1)
    ]
    try:
        codes = _wait([rank for node in nodes for rank in node], 400)
    finally:
        for node in nodes:
            _kill(node)
    out = (lost.tmp_path / "b0.log").read_text()
    assert codes == [0] * 4, f"(b) exited {codes}\n{out[-6000:]}\n{(lost.tmp_path / 'b1.log').read_text()[-3000:]}"
    line = _resume_line(out)
    assert line and line.groups()[1:] == (str(lost.step), "4", "4", "fast"), out[-4000:]
    assert f"resuming epoch 0 at global sample {lost.samples} of" in out
    fetched = re.search(r"assembled from peer copies: 0 bytes copied on the same machine, (\d+) bytes fetched", out)
    assert fetched and int(fetched[1]) > 0, out[-4000:]
    assert lost.s3_reads() == []
    # the replacement root now holds the checkpoint whole and committed, like the survivor's
    assert (lost.local / "node0" / lost.newest / "manifest.json").exists()

    # (c) both nodes lost after (b): no complete copy on any node; the reason is logged and S3 is read
    final = [p.parent.name for p in lost.local.glob("node0/step-*/manifest.json")]
    on_s3 = max(final, key=lambda name: int(name.split("-")[1]))  # (b)'s close copies its newest to S3
    shutil.rmtree(lost.local)
    lost.proxy.clear()
    out = lost.resume_on_one_node("c", devices=2, to_step=int(on_s3.split("-")[1]) + 1)
    assert re.search(
        r"no complete peer copy on the fast tier: no fast-tier checkpoint survives on any node; reading the durable "
        r"tier",
        out,
    ), out[-4000:]
    line = _resume_line(out)
    assert line and line[1].startswith("s3://") and line[1].endswith(on_s3), out[-4000:]
    assert line.groups()[2:] == ("4", "2", "durable"), line[0]
    assert lost.s3_reads(), "the durable copy was read"
