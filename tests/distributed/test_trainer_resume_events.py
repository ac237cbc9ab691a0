"""`SaveConfig(write_events=False)` is honoured by the Trainer's resume as by the other doors': the resume
happens, announced by its line, and nothing is written under ROOT/events/ (training/resume_sequence.py)."""

from __future__ import annotations

from lightning_shardckpt.engine import metrics
from tests.helpers.lightning_run import fit_on_rank
from tests.helpers.spawn import run_ranks


def test_a_trainer_resume_with_write_events_off_writes_no_resume_event(tmp_path):
    root = str(tmp_path / "ckpt")
    options = {"every": 3, "save": {"write_events": False}}
    run_ranks(fit_on_rank, 1, root, "ddp", 3, None, options, timeout_s=240)
    [resumed] = run_ranks(fit_on_rank, 1, root, "ddp", 6, "latest", options, timeout_s=240)

    assert resumed.value["at_start"]["global_step"] == 3  # it resumed from step 3
    assert [event for event in metrics.read_events(root) if event.get("event") == "resume"] == []
