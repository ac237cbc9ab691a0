"""Asynchronous saves on real gloo ranks: the loop keeps running collectives, snapshots are consistent."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_shardckpt import CheckpointSaver, SaveConfig, load_checkpoint
from tests.helpers import training_state as ts
from tests.helpers.faults import Stall
from tests.helpers.spawn import run_ranks


def overlap_worker(rank, world_size, root):
    model, optimizer = ts.build("fsdp", seed=1, world_size=world_size)
    ts.train_steps(model, optimizer, steps=1, seed=2)
    # the background save stalls while writing, so the main thread's collectives overlap it for sure
    saver = CheckpointSaver(root, SaveConfig(parallelism="fsdp"), fault_hook=Stall("before_write", 1.0))
    expected = ts.full_state(model, optimizer)
    pending = saver.save(ts.sharded_state(model, optimizer), step=1)

    # the snapshot is taken: mutate parameters and optimizer state at once
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1000.0)
        for state in optimizer.state.values():
            state["exp_avg"].mul_(-1)
    # training-group collectives on the main thread while the save runs in the background
    # (one all_reduce per iteration on every rank, until every rank's save is done)
    collectives = 0
    while True:
        all_done = torch.tensor([1.0 if pending.done() else 0.0])
        dist.all_reduce(all_done, op=dist.ReduceOp.MIN)
        collectives += 1
        if all_done.item() == 1.0:
            break
    result = pending.result(timeout=60)
    saver.close()
    assert result.committed, result.error

    fresh_model, fresh_optimizer = ts.build("fsdp", seed=5, world_size=world_size)
    state = ts.sharded_state(fresh_model, fresh_optimizer)
    load_checkpoint(state, root)
    ts.apply_state(fresh_model, fresh_optimizer, state)
    loaded = ts.full_state(fresh_model, fresh_optimizer)
    records = saver.poll_records()
    return {"expected": expected, "loaded": loaded, "collectives": collectives, "record": records[0].as_dict()}


def test_background_save_overlaps_training_collectives_and_commits_the_snapshot_of_the_call(tmp_path):
    outcomes = run_ranks(overlap_worker, 2, str(tmp_path / "ckpt"))
    first = outcomes[0].value
    assert first["expected"], "rank 0 gathered no reference"
    ts.assert_bit_exact(first["expected"], first["loaded"])  # values of the call, not the mutated ones
    assert all(o.value["collectives"] > 0 for o in outcomes), "no collective overlapped the background save"
    for outcome in outcomes:
        record = outcome.value["record"]
        assert record["outcome"] == "committed"
        assert record["pause_s"] < record["total_s"], "the caller waited for the whole save"
        assert record["bytes_rank"] > 0


def skip_worker(rank, world_size, root):
    # only rank 1 is slow: rank 0 alone would see a free slot; the skip decision must still agree
    saver = CheckpointSaver(root, SaveConfig(when_busy="skip"), fault_hook=Stall("before_write", 1.5, ranks=(1,)))
    state = {"weights": torch.full((1000,), float(rank)), "progress": {"step": 0}}
    first = saver.save({"weights": state["weights"]}, step=1)
    import time

    time.sleep(0.3)  # rank 0's part is done by now; rank 1 still stalls
    second = saver.save({"weights": state["weights"]}, step=2)
    time.sleep(0.3)
    last = saver.save({"weights": state["weights"]}, step=3, never_skip=True)  # a run's last save waits instead
    saver.close()
    return {
        "first": first.result().committed,
        "second_skipped": second.result().skipped,
        "last": last.result().committed,
        "counters": saver.counters.snapshot(),
    }


def test_skip_policy_decides_the_same_on_every_rank(tmp_path):
    outcomes = run_ranks(skip_worker, 2, str(tmp_path / "ckpt"))
    for outcome in outcomes:
        assert outcome.value["first"] is True
        assert outcome.value["second_skipped"] is True
        assert outcome.value["last"] is True
        assert outcome.value["counters"] == {"attempted": 3, "committed": 2, "failed": 0, "skipped": 1}
