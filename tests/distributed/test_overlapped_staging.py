"""Overlapped staging on real gloo ranks: every checkpoint holds the state of its request, although
parameters, optimizer moments and step counters, BatchNorm buffers, RNG and Lightning's loops change
while its copy is still running."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig, load_checkpoint
from tests.helpers import training_state as ts
from tests.helpers.held_staging import held_staging_copy
from tests.helpers.overlap_run import HOLD_S, overlap_fits_on_rank
from tests.helpers.spawn import run_ranks


def _parameters_and_optimizer(fqn: str) -> bool:
    return fqn.startswith(("model.", "optim."))


def _buffers(value: float) -> dict[str, torch.Tensor]:
    return {"running_mean": torch.full((7,), value), "num_batches_tracked": torch.tensor(int(value))}


def engine_worker(rank, world_size, root, fence):
    model, optimizer = ts.build("fsdp", seed=1, world_size=world_size)
    ts.train_steps(model, optimizer, steps=1, seed=2)
    saver = CheckpointSaver(root, SaveConfig(parallelism="fsdp"))
    if fence:
        saver.guard(optimizer)
    buffers = _buffers(1.0)
    expected = ts.full_state(model, optimizer)
    gate = threading.Event()
    with held_staging_copy(gate=gate):
        pending = saver.save(
            {**ts.sharded_state(model, optimizer), "buffers": buffers}, step=1, defer=_parameters_and_optimizer
        )
        for value in buffers.values():
            value.add_(1)  # forward changes buffers right after the request: they were copied at it
        if fence:
            gate_opener = threading.Timer(HOLD_S, gate.set)  # the copy stays pending into the next step
            gate_opener.start()
            ts.train_steps(model, optimizer, steps=1, seed=3)  # guard: the step waits for the copy first
        else:
            ts.train_steps(model, optimizer, steps=1, seed=3)  # nothing waits: the step lands in the copy
            gate.set()
        result = pending.result(timeout=60)
    record = saver.poll_records()[0]
    saver.close()
    assert result.committed, result.error
    fresh_model, fresh_optimizer = ts.build("fsdp", seed=5, world_size=world_size)
    loaded_buffers = _buffers(0.0)
    state = {**ts.sharded_state(fresh_model, fresh_optimizer), "buffers": loaded_buffers}
    load_checkpoint(state, root)
    ts.apply_state(fresh_model, fresh_optimizer, state)
    return {
        "expected": expected,
        "loaded": ts.full_state(fresh_model, fresh_optimizer),
        "buffers": loaded_buffers,
        "wait_s": record.overlap_wait_s,
        "pause_s": record.pause_s,
    }


def test_engine_overlapped_copy_holds_the_request_when_the_optimizer_step_is_guarded(tmp_path):
    outcomes = run_ranks(engine_worker, 2, str(tmp_path / "ckpt"), True)
    first = outcomes[0].value
    ts.assert_bit_exact(first["expected"], first["loaded"])  # params, AdamW moments and step of the request
    for outcome in outcomes:
        assert torch.equal(outcome.value["buffers"]["running_mean"], torch.full((7,), 1.0))
        assert int(outcome.value["buffers"]["num_batches_tracked"]) == 1
        assert outcome.value["wait_s"] > 0.0, "the optimizer step did not wait at the fence"


def test_engine_overlapped_copy_really_runs_after_the_request_so_an_unfenced_step_reaches_it(tmp_path):
    # the negative control: proves the copy is in the background, and that the fence is what keeps it right
    outcomes = run_ranks(engine_worker, 2, str(tmp_path / "ckpt"), False)
    first = outcomes[0].value
    changed = [name for name in first["expected"] if not torch.equal(first["expected"][name], first["loaded"][name])]
    assert any(name.startswith("model.") for name in changed), "an unfenced step did not reach the held copy"
    assert torch.equal(first["buffers"]["running_mean"], torch.full((7,), 1.0)), "buffers must be copied at the request"


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_lightning_checkpoints_hold_the_request_with_accumulation_and_manual_optimizers(tmp_path, parallelism):
    outcomes = run_ranks(overlap_fits_on_rank, 2, str(tmp_path), parallelism, timeout_s=300)
    for outcome in outcomes:
        for name, run in outcome.value.items():
            assert run["steps"] == [2, 4, 6], (name, run["steps"])
            assert run["outcomes"] == ["committed"] * 3, (name, run["outcomes"])
            assert run["mismatched"] == {2: [], 4: [], 6: []}, f"rank {outcome.rank}, {name}: {run['mismatched']}"
            # the held copy ran behind training: the step after a request waited at the fence, the request did not
            assert all(seconds < HOLD_S for seconds in run["stages"]), (name, run["stages"])
            assert max(run["waits"][:2]) > 0.0, (name, run["waits"])
