"""The door core driven directly, one process, no process group: the save loop, the saver host and the resume
sequence (training/resume_sequence.py) over a fake `Agreement` (training/savers.py) that answers every collective
with this rank's own value and records what it was asked. The doors' own tests drive the same code through
Lightning, Fabric and the plain loop; these pin the core's steps where no door hides them."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine import metrics
from lightning_shardckpt.engine.catalog import list_checkpoints
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.policies.plan import CheckpointPlan
from lightning_shardckpt.training.door_targets import DoorTarget
from lightning_shardckpt.training.finished_saves import CallableReporter
from lightning_shardckpt.training.resume import resume_metrics
from lightning_shardckpt.training.resume_sequence import announce_resume, load_resumed
from lightning_shardckpt.training.save_loop import SaveLoop
from tests.helpers.checkpointer_loop import checkpointer_loop
from tests.helpers.faults import Stall


class OneRankAgreement:
    """An `Agreement` of a world of one: every collective returns this rank's value; `asked` records the calls."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def broadcast(self, value: Any) -> Any:
        self.asked.append("broadcast")
        return value

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - the protocol's name
        self.asked.append("reduce_boolean_decision")
        return bool(decision)

    def all_reduce_max(self, values: list[float]) -> list[float]:
        self.asked.append("all_reduce_max")
        return list(values)


def make_loop(root: str, *, keep_last: int | None = None, fault_hook: Any = None, **save: Any) -> SaveLoop:
    """A door's save loop as the Checkpointer builds one, on a saver host over the fake agreement."""
    logged: list[dict[str, float]] = []
    loop = checkpointer_loop(
        root,
        SaveConfig(**save),
        agreement=OneRankAgreement(),
        reporter=CallableReporter(lambda values, step: logged.append(dict(values)), lambda: 0),
        keep_last=keep_last,
        fault_hook=fault_hook,
    )
    loop.logged = logged  # type: ignore[attr-defined] - what the reporter got, for the tests
    loop.setup("fit")
    return loop


def weights(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((16,), value)}


def request_of(step: int) -> Any:
    return lambda saver, never_skip: saver.save(weights(float(step)), step, never_skip=never_skip)


def target_of(state: dict[str, torch.Tensor]) -> DoorTarget:
    return DoorTarget({(key,): value for key, value in state.items()}, model=None, optimizers=(), own=None, strict=True)


def save_as(root: str, run_id: str, step: int) -> None:
    saver = CheckpointSaver(root, SaveConfig(async_save=False, write_events=False, run_id=run_id))
    assert saver.save(weights(float(step)), step).result(timeout=60).committed
    saver.close()


def steps_in(root: str) -> list[int]:
    return [entry.step for entry in list_checkpoints(resolve(root)) if entry.committed]


def resume_events(root: str) -> list[dict[str, Any]]:
    return [event for event in metrics.read_events(root) if event.get("event") == "resume"]


def test_a_save_loop_on_a_fake_agreement_saves_commits_and_keeps_the_last_two(tmp_path):
    root = str(tmp_path / "run")
    loop = make_loop(root, keep_last=2, async_save=False)
    run_id = loop.start(None)
    assert run_id and loop.run_ids.current == run_id
    assert "broadcast" in loop.host.agreement.asked  # the new run id is rank 0's, agreed
    for step in (1, 2, 3):
        assert loop.save_now(step, request_of(step)).result(timeout=60).committed
        loop.drain()
    loop.finish()
    assert steps_in(root) == [2, 3]


def test_the_resume_sequence_waits_for_a_save_in_flight_before_it_loads(tmp_path):
    loop = make_loop(str(tmp_path / "run"), fault_hook=Stall("before_manifest", 1.5))
    loop.start(None)
    pending = loop.save_now(1, request_of(1))  # committing in the background for 1.5 s more
    other = str(tmp_path / "other")
    save_as(other, "run-x", 4)
    state = weights(0.0)
    started = time.monotonic()
    resumed = load_resumed(loop.plan, loop.host, target_of(state), other, strict=True, rank=0)
    assert pending.done() and pending.result().committed  # the load's collectives never overlapped the save's
    assert time.monotonic() - started >= 1.0
    assert resumed is not None and resumed.loaded.step == 4 and torch.equal(state["w"], weights(4.0)["w"])
    loop.finish()


def test_the_resume_sequence_starts_fresh_on_an_empty_root_and_announces_nothing(tmp_path):
    root = str(tmp_path / "run")
    loop = make_loop(root)
    assert load_resumed(loop.plan, loop.host, target_of(weights(0.0)), "latest", strict=True, rank=0) is None
    assert resume_events(root) == [] and loop.logged == []


def test_a_resume_is_announced_once_with_its_event_line_and_metrics(tmp_path, caplog):
    root = str(tmp_path / "run")
    save_as(root, "run-a", 3)
    loop = make_loop(root, run_id="run-a")
    resumed = load_resumed(loop.plan, loop.host, target_of(weights(0.0)), "latest", strict=True, rank=0)
    assert resumed is not None and resumed.not_restored == ()
    with caplog.at_level(logging.INFO, logger="lightning_shardckpt.console"):
        event = announce_resume(resumed, plan=loop.plan, loop=loop, rank=0, world_size=1, metrics=resume_metrics)
        again = announce_resume(resumed, plan=loop.plan, loop=loop, rank=0, world_size=1, metrics=resume_metrics)
    assert event is not None and again is event  # a second announce of one resume repeats nothing
    assert [(e["step"], e["from"], e["world_size"]) for e in resume_events(root)] == [(3, resumed.loaded.path, 1)]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lightning_shardckpt: resumed")]
    assert len(lines) == 1 and "(step 3)" in lines[0]
    assert [sorted(values) for values in loop.logged] == [["checkpoint/resume_s", "checkpoint/resumed_step"]]
    assert loop.run_ids.current == "run-a"  # a resume of this run's checkpoint continues its id


def test_a_resume_with_write_events_off_writes_no_resume_event(tmp_path):
    root = str(tmp_path / "run")
    save_as(root, "run-a", 3)
    loop = make_loop(root, run_id="run-a", write_events=False)
    resumed = load_resumed(loop.plan, loop.host, target_of(weights(0.0)), "latest", strict=True, rank=0)
    event = announce_resume(resumed, plan=loop.plan, loop=loop, rank=0, world_size=1)
    assert event is not None and event["step"] == 3  # the plug-ins still get it at train start
    assert resume_events(root) == []


def test_a_resume_that_continues_another_run_after_start_starts_the_plug_ins_again(tmp_path):
    # run-b's checkpoint in this (shared) root; this loop started as a run of its own, then loads run-b's step 2:
    # it continues run-b, whose saver replaces its own, so the plug-ins (retention's listener) must start again
    root = str(tmp_path / "run")
    save_as(root, "run-b", 2)
    loop = make_loop(root, async_save=False, allow_shared_root=True)
    own = loop.start(None)
    assert own != "run-b" and loop.save_now(3, request_of(3)).result(timeout=60).committed
    resumed = load_resumed(loop.plan, loop.host, target_of(weights(0.0)), 2, strict=True, rank=0)
    announce_resume(resumed, plan=loop.plan, loop=loop, rank=0, world_size=1)
    assert loop.run_ids.current == "run-b"
    assert not loop.started  # the door starts the loop again (plug-ins on run-b's saver) before its next save
    loop.start(resumed.loaded)
    assert loop.started and loop.saver().run_id == "run-b"
    loop.finish()


def test_a_resume_that_keeps_the_run_id_leaves_a_started_loop_running(tmp_path):
    root = str(tmp_path / "run")
    loop = make_loop(root, async_save=False)
    own = loop.start(None)
    assert loop.save_now(3, request_of(3)).result(timeout=60).committed
    resumed = load_resumed(loop.plan, loop.host, target_of(weights(0.0)), "latest", strict=True, rank=0)
    announce_resume(resumed, plan=loop.plan, loop=loop, rank=0, world_size=1)
    assert loop.started and loop.run_ids.current == own
    loop.finish()


@pytest.fixture
def trainer_strategy(tmp_path):
    """A ShardedStrategy attached to a Trainer and a module, never fitted (no process group): its load runs as in
    a fit; the fault hook stalls a save's commit."""
    import lightning.pytorch as pl

    from lightning_shardckpt import ShardedStrategy
    from tests.helpers.lightning_run import TinyModule

    strategy = ShardedStrategy(parallelism="ddp", fault_hook=Stall("before_manifest", 1.5))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False)
    module = TinyModule(parallelism="ddp")
    module.trainer = trainer
    strategy.connect(module)
    yield strategy
    strategy.host.close()


def test_the_trainer_strategy_waits_for_a_save_in_flight_before_it_loads(tmp_path, trainer_strategy):
    strategy = trainer_strategy
    root = str(tmp_path / "empty")
    strategy.use_plan(CheckpointPlan(root=root, save=strategy.save_config))
    pending = strategy.host.saver_for(str(tmp_path / "other")).save(weights(1.0), 1)  # in flight for 1.5 s
    checkpoint = strategy.load_checkpoint("latest")  # nothing committed: a fresh start, after the save
    assert not checkpoint
    assert pending.done() and pending.result().committed
