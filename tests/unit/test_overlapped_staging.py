"""Overlapped staging in one process: what is copied at the request, what later, and what a failed copy does."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, ConfigError, SaveConfig, load_checkpoint
from lightning_shardckpt.engine.save.staging import StagingBuffers, StagingFailed
from tests.helpers.held_staging import held_staging_copy


def model_like_state() -> dict:
    return {
        "model": {"weight": torch.randn(256, 64), "running_mean": torch.zeros(64)},
        "optim": {
            "state": {"weight": {"exp_avg": torch.randn(256, 64), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "params": ["weight"]}],
        },
        "progress": {"step": 3},
    }


def defer(fqn: str) -> bool:
    return fqn == "model.weight" or fqn.startswith("optim.")


def test_overlap_staging_must_be_a_bool():
    with pytest.raises(ConfigError, match="overlap_staging='yes' must be true or false"):
        SaveConfig(overlap_staging="yes")


def test_deferred_tensors_are_copied_after_stage_returns_and_the_rest_before():
    state = model_like_state()
    expected = {
        "weight": state["model"]["weight"].clone(),
        "exp_avg": state["optim"]["state"]["weight"]["exp_avg"].clone(),
    }
    slot = StagingBuffers()
    gate = threading.Event()
    with held_staging_copy(gate=gate):
        staged = slot.stage(state, defer)
        # forward changes a buffer and the step counter of the loop right after the request: copied already
        state["model"]["running_mean"].add_(1.0)
        state["progress"]["step"] = 4
        state["optim"]["param_groups"][0]["lr"] = 0.5
        assert torch.equal(staged["model"]["running_mean"], torch.zeros(64))
        assert staged["progress"]["step"] == 3 and staged["optim"]["param_groups"][0]["lr"] == 0.1
        # the deferred part has not been copied yet: the buffers still hold nothing of the state
        assert slot.deferred is not None and not slot.deferred.done()
        assert slot.deferred.nbytes == 2 * 256 * 64 * 4 + 4  # weight, exp_avg, step: exactly the deferred tensors
        gate.set()
        assert slot.deferred.fence() >= 0.0
    state["model"]["weight"].mul_(-1)  # the optimizer step, after the fence
    state["optim"]["state"]["weight"]["exp_avg"].zero_()
    slot.wait_until_ready()
    assert torch.equal(staged["model"]["weight"], expected["weight"])
    assert torch.equal(staged["optim"]["state"]["weight"]["exp_avg"], expected["exp_avg"])
    assert float(staged["optim"]["state"]["weight"]["step"]) == 3.0


def test_without_overlap_everything_is_copied_before_stage_returns():
    state = model_like_state()
    before = state["model"]["weight"].clone()
    slot = StagingBuffers()
    staged = slot.stage(state)  # no defer: the pre-overlap behaviour
    assert slot.deferred is None
    state["model"]["weight"].zero_()
    assert torch.equal(staged["model"]["weight"], before)


def test_saver_guard_fences_before_the_optimizer_step_and_the_checkpoint_holds_the_request(tmp_path):
    weight = torch.nn.Parameter(torch.randn(512, 32))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    saver = CheckpointSaver(str(tmp_path), SaveConfig(write_events=False))
    saver.guard(optimizer)

    def state() -> dict:
        return {"model": {"weight": weight}, "optim": {"state": {"weight": optimizer.state[weight]}}}

    expected = {"weight": weight.detach().clone(), "exp_avg": optimizer.state[weight]["exp_avg"].clone()}
    with held_staging_copy(delay_s=0.3):
        pending = saver.save(state(), step=1, defer=defer)
        optimizer.step()  # the pre-hook fences first: the held copy completes before the update
    result = pending.result(timeout=60)
    record = saver.poll_records()[0]
    saver.close()
    assert result.committed, result.error
    assert record.overlap_wait_s > 0.1, "the optimizer step did not wait for the held copy"
    assert record.pause_s < 0.3, "the request waited for the deferred copy"
    target = {
        "model": {"weight": torch.zeros(512, 32)},
        "optim": {
            "state": {
                "weight": {
                    "exp_avg": torch.zeros(512, 32),
                    "exp_avg_sq": torch.zeros(512, 32),
                    "step": torch.tensor(0.0),
                }
            }
        },
    }
    load_checkpoint(target, str(tmp_path))
    assert torch.equal(target["model"]["weight"], expected["weight"])
    assert torch.equal(target["optim"]["state"]["weight"]["exp_avg"], expected["exp_avg"])
    assert float(target["optim"]["state"]["weight"]["step"]) == 1.0


def test_a_failed_background_copy_fails_that_save_only_and_training_goes_on(tmp_path):
    saver = CheckpointSaver(str(tmp_path), SaveConfig(write_events=False))
    state = {"weight": torch.randn(64), "buffer": torch.zeros(4)}
    first = saver.save(state, step=1, defer=lambda fqn: fqn == "weight")
    saver.wait()
    # same layout, so the buffers are reused; a source that cannot be copied into them fails the copy
    broken = {"weight": torch.randn(64), "buffer": torch.zeros(4)}
    slot = saver.slots[0]
    slot._buffers["weight"] = torch.empty(0)  # fault injection: a buffer the background copy cannot fill
    failed = saver.save(broken, step=2, defer=lambda fqn: fqn == "weight")
    saver.fence()  # never raises on the training thread
    outcome = failed.result(timeout=60)
    saver.close()
    assert first.result().committed
    assert not outcome.committed and isinstance(outcome.error, StagingFailed)
    assert "staging copy failed" in str(outcome.error)
    assert saver.counters.snapshot()["failed"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_deferred_copy_lands_in_pinned_buffers_and_the_training_stream_waits_at_the_fence():
    weight = torch.randn(1024, 1024, device="cuda")
    buffer = torch.zeros(16, device="cuda")
    expected = weight.cpu()
    slot = StagingBuffers()
    staged = slot.stage({"weight": weight, "buffer": buffer}, lambda fqn: fqn == "weight")
    buffer.add_(1.0)  # forward on the training stream: ordered after the small copy
    assert slot.deferred is not None
    assert slot.deferred.fence() == 0.0  # the GPU orders the update after the copy; the CPU does not block
    weight.mul_(-1)  # the optimizer step, queued behind the copy on the training stream
    slot.wait_until_ready()
    assert staged["weight"].is_pinned()
    assert torch.equal(staged["weight"], expected)
    assert torch.equal(staged["buffer"], torch.zeros(16))
