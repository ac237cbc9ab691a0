"""SaveConfig(writer="process"): the write runs in a per-rank writer process fed from shared-memory staging.

One spawn of 2 gloo ranks saves through a writer-process saver and a writer-thread saver side by side:
two committed saves (the same shared-memory staging reused), one failed in the writer (an injected
fault on rank 1 after its shard was written), and one more committed after the failure. The tests
assert on what the ranks report.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_shardckpt import CheckpointSaver, SaveConfig, load_checkpoint
from tests.helpers.spawn import run_ranks

WORLD = 2
FAILING_RANK = 1
FAILED_STEP = 3


class InjectedFault(RuntimeError):
    pass


class FailWhileArmed:
    """Picklable fault hook (it runs inside the writer process): raises after the shard on `rank`
    while the file `marker` exists, so the parent arms it for one save without reaching into the child."""

    def __init__(self, marker: str, rank: int) -> None:
        self.marker, self.rank = marker, rank

    def __call__(self, point: str) -> None:
        if point == "after_write" and dist.get_rank() == self.rank and os.path.exists(self.marker):
            raise InjectedFault(f"injected at {point} on rank {self.rank}")


def _state(rank: int, step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 32, generator=generator), "b": torch.randn(32, generator=generator)},
        "optim": {"exp_avg": [torch.full((16,), float(step)), torch.arange(8) * step]},
        "rank_own": {f"r{rank}": torch.full((4,), float(rank * 100 + step))},
        "step": step,
    }


def _copy_into(live, fresh) -> None:
    for key in live if isinstance(live, dict) else range(len(live)):
        if isinstance(live[key], torch.Tensor):
            live[key].copy_(fresh[key])
        elif isinstance(live[key], (dict, list)):
            _copy_into(live[key], fresh[key])


def _zeros_like(state: dict) -> dict:
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else state


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _saves(rank: int, world_size: int, tmp: str) -> dict:
    marker = os.path.join(tmp, "armed")
    hook = FailWhileArmed(marker, FAILING_RANK)
    outcomes: dict = {"records": []}
    by_writer = {}
    for writer in ("process", "thread"):
        saver = CheckpointSaver(os.path.join(tmp, writer), SaveConfig(writer=writer), fault_hook=hook)
        if writer == "process":
            saver.add_listener(lambda record: outcomes["records"].append(record.outcome))
        by_writer[writer] = saver
    process = by_writer["process"]
    live = _state(rank, 0)
    results = {}
    for step in (1, 2, FAILED_STEP, 4):
        _copy_into(live, _state(rank, step))  # in place: the staged buffers are refilled, not replaced
        live["step"] = step
        if step == FAILED_STEP:
            if rank == 0:
                open(marker, "w").close()
            dist.barrier()
        for writer, saver in by_writer.items():
            results[(writer, step)] = saver.save(live, step=step).result(timeout=120)
        if step == FAILED_STEP:
            dist.barrier()
            if rank == 0:
                os.remove(marker)
    outcomes["allocations"] = [slot.allocations for slot in process.slots]
    outcomes["shared"] = [slot.shared for slot in process.slots]
    for saver in by_writer.values():
        saver.close()
    outcomes["results"] = {
        key: (r.committed, type(r.error).__name__ if r.error is not None else None) for key, r in results.items()
    }
    outcomes["failed_text"] = str(results[("process", FAILED_STEP)].error)
    loaded = {}
    for step in (1, 2, 4):
        expected = _state(rank, step)
        target = _zeros_like(expected)
        loaded[("ours", step)] = load_checkpoint(target, os.path.join(tmp, "process"), which=step).step == step and (
            _equal(target, expected)
        )
        plain = _zeros_like(expected)
        dcp.load(plain, checkpoint_id=results[("process", step)].path)
        loaded[("dcp", step)] = _equal(plain, expected)
    outcomes["loaded"] = loaded
    return outcomes


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("writer-process"))
    return [o.value for o in run_ranks(_saves, WORLD, tmp, timeout_s=240, pg_timeout_s=120)]


def test_writer_process_commits_saves_that_load_bit_exact_with_ours_and_plain_dcp(ranks):
    for outcome in ranks:
        assert all(outcome["loaded"].values()), outcome["loaded"]
        for step in (1, 2, 4):
            assert outcome["results"][("process", step)] == (True, None)


def test_writer_process_refills_the_same_shared_memory_staging_every_save(ranks):
    for outcome in ranks:
        assert outcome["shared"] == [True]
        assert outcome["allocations"] == [1]


def test_a_failure_in_the_writer_process_surfaces_as_the_thread_path_reports_it(ranks):
    for outcome in ranks:
        results = outcome["results"]
        assert results[("process", FAILED_STEP)] == results[("thread", FAILED_STEP)]
        assert results[("process", FAILED_STEP)][0] is False
        assert results[("process", FAILED_STEP)][1] == "CommitFailed"
        assert f"step {FAILED_STEP}" in outcome["failed_text"]
        assert outcome["records"] == ["committed", "committed", "failed", "committed"]
