"""Restore drills through Lightning: checkpoints become `drilled` during training without touching it,
`ckpt_path="last-good"` resumes the newest drilled one on another world size, and a `latest` that
fails to load names it (or, with fallback_to_last_good, resumes from it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_shardckpt import ShardedCheckpoint
from lightning_shardckpt.engine import catalog, metrics
from lightning_shardckpt.engine.format import drill_records
from lightning_shardckpt.engine.storage import fsio
from tests.helpers import training_state as ts
from tests.helpers.lightning_run import CaptureAtStart, TinyData, TinyModule, _full, ddp_trainer, lightning_env
from tests.helpers.spawn import DistributedFailure, run_ranks

PROBE = "tests.helpers.drill_probes:weighted_sum"


class CaptureAtStep(pl.Callback):
    """The full model + optimizer state right after optimizer step `step` (a collective: every rank)."""

    def __init__(self, step: int) -> None:
        self.step, self.state = step, None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step and self.state is None:
            self.state = _full(pl_module, trainer.optimizers[0])


def drill_fit(rank: int, world_size: int, root: str, max_steps: int, ckpt_path: Any, drill: dict | None) -> dict:
    lightning_env(rank, world_size)
    capture, at_six = CaptureAtStart(), CaptureAtStep(6)
    checkpoint = ShardedCheckpoint(root, every_n_train_steps=3, keep_last=None, log_artifact=False, drill=drill)
    trainer = ddp_trainer(world_size, max_steps, [checkpoint, capture, at_six])
    module = TinyModule(parallelism="ddp")
    trainer.fit(module, datamodule=TinyData(), ckpt_path=ckpt_path)
    return {
        "at_start": capture.at_start,
        "at_six": at_six.state,
        "final": _full(module, trainer.optimizers[0]),
        "global_step": trainer.global_step,
    }


def test_drills_prove_checkpoints_during_training_and_last_good_resumes_them_bit_exact(tmp_path):
    root, plain_root = str(tmp_path / "drilled"), str(tmp_path / "plain")
    drill = {"every_n_checkpoints": 2, "probe": PROBE, "timeout_s": 120}  # checkpoints at 3, 6, 9: step 6 is drilled
    drilled = run_ranks(drill_fit, 2, root, 9, None, drill, timeout_s=300)[0].value
    plain = run_ranks(drill_fit, 2, plain_root, 9, None, None, timeout_s=300)[0].value
    ts.assert_bit_exact(plain["final"], drilled["final"])  # a drill reads storage only: training is unchanged

    location = fsio.resolve(root)
    entries = catalog.list_checkpoints(location)
    states = drill_records.trust_states(location, entries)
    assert [states[e.name] for e in entries] == ["committed", "drilled", "committed"], states
    record = _only_record(location, entries[1].name)
    assert record["world_size"] == 1 and record["writer_world_size"] == 2  # resharded 2 -> 1 in fresh processes
    assert record["checks"]["probe"]["compared"] and record["checks"]["lightning_state"]["global_step"] == 6
    drill_events = [e for e in metrics.read_events(location) if e.get("event") == "drill"]
    assert [(e["step"], e["verdict"]) for e in drill_events] == [(6, "passed")]

    # the newest checkpoint goes bad after its commit: `latest` refuses it and names the last known-good
    shard = next(Path(entries[2].path).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DistributedFailure) as failure:
        run_ranks(drill_fit, 1, root, 10, "latest", None, timeout_s=180)
    assert "checksum mismatch" in str(failure.value) and entries[1].name in str(failure.value)
    assert "ckpt_path='last-good'" in str(failure.value)

    # opted in: a `latest` that fails to load resumes from the last known-good instead (this fit commits step 7)
    fallback = run_ranks(drill_fit, 1, root, 7, "latest", {"fallback_to_last_good": True}, timeout_s=180)[0].value
    assert fallback["at_start"]["global_step"] == 6
    ts.assert_bit_exact(drilled["at_six"], fallback["at_start"]["full"])

    # step 7 was never drilled: last-good is still step 6, resharded from 2 ranks onto 3
    resumed = run_ranks(drill_fit, 3, root, 10, "last-good", None, timeout_s=300)[0].value
    assert resumed["at_start"]["global_step"] == 6
    ts.assert_bit_exact(drilled["at_six"], resumed["at_start"]["full"])


def _only_record(location: fsio.Location, name: str) -> dict:
    (record_name,) = drill_records.list_record_names(location)[name]
    return drill_records.read_record(location, record_name)


def test_unknown_drill_options_are_refused_before_training():
    with pytest.raises(ValueError, match=r"unknown drill option\(s\) \['every_n'\]"):
        ShardedCheckpoint("/tmp/x", drill={"every_n": 1})
    with pytest.raises(ValueError, match="every_n_checkpoints=0 is below 1; use an integer >= 1"):
        ShardedCheckpoint("/tmp/x", drill={"every_n_checkpoints": 0})
    with pytest.raises(ValueError, match="must be 'module:function'"):
        ShardedCheckpoint("/tmp/x", drill={"every_n_checkpoints": 1, "probe": "no_colon"})
