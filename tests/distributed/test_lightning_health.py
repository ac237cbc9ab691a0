"""Health rules through Lightning on 2 spawned ranks: slow storage makes the throughput rule fire after
exactly its persistence, the save interval doubles on every rank at the same step, a W&B alert lands in
the offline run, and the rule resolves and restores the interval once storage is fast again; the rule
state resumes on another world size; failed commits fire commit completeness and drill the newest
committed checkpoint; a failing drill stops training after a final save; `shardckpt health` replays the
same verdicts offline."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import WandbLogger

from lightning_shardckpt import ShardedCheckpoint, ShardedStrategy, register_mitigation
from lightning_shardckpt.cli import main as cli
from lightning_shardckpt.engine import catalog, metrics
from lightning_shardckpt.engine.format import drill_records
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.policies.health.health_plugin import HealthWatch
from tests.helpers.faults import DiskFullOnOccurrences
from tests.helpers.health_rules import static_rule
from tests.helpers.lightning_run import TinyData, TinyModule, ddp_trainer, lightning_env
from tests.helpers.scripted_fs import scripted_url
from tests.helpers.spawn import run_ranks
from tests.helpers.wandb_reader import find_run_file, read_run

OWNER = "storage-oncall@example"
THROUGHPUT_RULE = static_rule(
    "write_throughput",
    "write_gbps",
    # a ~60 KB shard file written in under 1.5 s is above this; a write held up 3 s is below. A 5x margin both ways:
    # with the threshold at 0.3 s, a fast write on a loaded 2-core host (0.5 s at nice 19) fired the rule
    low=4e-5,
    fire_after=2,
    resolve_after=2,
    slice="rank",
    owner=OWNER,
    severity="warning",
    mitigation="lower_frequency",
    mitigation_options={"factor": 2},
)
SLOW_STEPS = [6, 8, 10, 12, 14]  # the saves whose shard writes are throttled


class ScheduleProbe(pl.Callback):
    """Every rank: the interval factor it applies at each step (runs before ShardedCheckpoint's batch end)."""

    def __init__(self, checkpoint: ShardedCheckpoint, step_sleep_s: float = 0.0) -> None:
        self.checkpoint, self.step_sleep_s = checkpoint, step_sleep_s
        self.factors: dict[int, float] = {}
        self.when_busy: dict[int, str] = {}
        self.at_start: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        health = self.checkpoint.plugins.get(HealthWatch)
        self.at_start = {"state": health.state_dict(), "firing": [(r.name, k) for r, k, _ in health.evaluator.firing()]}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.factors[trainer.global_step] = self.checkpoint.plugins.get(HealthWatch).interval_factor()
        saver = trainer.strategy.existing_saver(self.checkpoint.root)
        if saver is not None:
            self.when_busy[trainer.global_step] = saver.config.when_busy
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)  # a step that takes a while, so a drill can finish during training


def health_fit(
    rank: int,
    world_size: int,
    root: str,
    workdir: str,
    max_steps: int,
    ckpt_path: Any,
    health: dict,
    storage: dict,
    drill: dict | None = None,
    step_sleep_s: float = 0.0,
    fault_hook: Any = None,
    every: int = 2,
) -> dict:
    lightning_env(rank, world_size)
    # scripted:// only where a test scripts slow saves: drills run in fresh processes that know no test protocol
    dirpath = scripted_url(root) if storage else root
    checkpoint = ShardedCheckpoint(
        dirpath,
        every_n_train_steps=every,
        keep_last=None,
        log_artifact=False,
        health=health,
        drill=drill,
        save={"storage_options": storage},
    )
    probe = ScheduleProbe(checkpoint, step_sleep_s)
    logger = WandbLogger(project="health", save_dir=workdir, offline=True)
    strategy = ShardedStrategy(parallelism="ddp", fault_hook=fault_hook)
    trainer = ddp_trainer(world_size, max_steps, [checkpoint, probe], logger=logger, strategy=strategy)
    trainer.fit(TinyModule(parallelism="ddp"), datamodule=TinyData(), ckpt_path=ckpt_path)
    health_watch = checkpoint.plugins.get(HealthWatch)
    if trainer.is_global_zero:
        logger.experiment.finish()  # flush the offline run file: a spawned rank exits without W&B's atexit hook
    return {
        "factors": probe.factors,
        "when_busy": probe.when_busy,
        "at_start": probe.at_start,
        "global_step": trainer.global_step,
        "transitions": [t.as_dict() for t in health_watch.transitions] if trainer.is_global_zero else None,
    }


def _committed_steps(root: str) -> list[int]:
    return [entry.step for entry in catalog.list_checkpoints(fsio.resolve(root)) if entry.committed]


def _health_events(root: str) -> list[dict[str, Any]]:
    return [e for e in metrics.read_events(fsio.resolve(root)) if e.get("event") == "health"]


def test_slow_storage_fires_throughput_rule_after_its_persistence_doubles_interval_alerts_and_resolves(
    tmp_path, capsys
):
    root, workdir = str(tmp_path / "ckpt"), str(tmp_path / "wandb")
    storage = {"slow_steps": SLOW_STEPS, "delay_s": 3.0}
    results = run_ranks(
        health_fit, 2, root, workdir, 30, None, {"rules": [THROUGHPUT_RULE], "alert_every_s": 0}, storage, timeout_s=300
    )
    online = results[0].value["transitions"]
    # both ranks were throttled; each rank's series fires at the second slow save and resolves at the
    # second fast one after the throttle ends (saves at 16 and 20: the interval was 4 by then)
    fired = sorted((t["key"], t["step"]) for t in online if t["transition"] == "fired")
    resolved = sorted((t["key"], t["step"]) for t in online if t["transition"] == "resolved")
    assert fired == [("rank0", 8), ("rank1", 8)], online
    assert resolved == [("rank0", 20), ("rank1", 20)], online
    assert all(t["owner"] == OWNER for t in online)

    factors = [result.value["factors"] for result in results]
    assert factors[0] == factors[1], "every rank applies the same interval at the same step"
    doubled = [step for step, factor in factors[0].items() if factor == 2.0]
    assert doubled and min(doubled) <= 14 and max(doubled) >= 20, factors[0]
    steps = _committed_steps(root)
    assert {12, 16, 20} <= set(steps) and not {14, 18} & set(steps), steps  # every 4 steps while firing
    assert any(step > 20 and step % 4 == 2 for step in steps), steps  # every 2 steps again once resolved

    events = _health_events(root)
    assert {(e["key"], e["transition"], e["step"]) for e in events} == {(k, "fired", s) for k, s in fired} | {
        (k, "resolved", s) for k, s in resolved
    }
    assert all("save interval" in e["mitigation_result"] for e in events)
    run = read_run(find_run_file(workdir))
    firing = [value for _, value in run.series("health/write_throughput/firing")]
    assert 1.0 in firing and firing[-1] == 0.0, firing  # the metric operators chart: up while firing, down after
    alerts = run.alerts
    titles = [alert["title"] for alert in alerts]
    assert (
        "shardckpt health: write_throughput firing" in titles
        and "shardckpt health: write_throughput resolved" in titles
    )
    assert any(OWNER in alert["text"] and alert["level"] == "WARN" for alert in alerts)

    # offline: the same rules (recorded in the root by the run) give the same verdicts
    assert cli.main(["health", root, "--json"]) == 0  # resolved by the end: exit 0
    report = json.loads(capsys.readouterr().out)
    offline = [(t["rule"], t["key"], t["transition"], t["step"]) for t in report["transitions"]]
    assert offline == [(t["rule"], t["key"], t["transition"], t["step"]) for t in online]
    assert cli.main(["health", root, "--plot", str(tmp_path / "health.png")]) == 0
    text = capsys.readouterr().out
    assert OWNER in text and "write_throughput" in text and "rank1" in text
    assert (tmp_path / "health.png").stat().st_size > 5_000

    # resumed on 1 rank from step 12, while the rule fired: counters, firing state and the doubled interval
    # come back, and the rule resolves at the same step as in the uninterrupted run
    resume_from = next(e for e in catalog.list_checkpoints(fsio.resolve(root)) if e.step == 12)
    again = run_ranks(
        health_fit,
        1,
        root,
        workdir + "2",
        22,
        scripted_url(resume_from.path),
        {"rules": [THROUGHPUT_RULE], "alert_every_s": 0},
        {"slow_steps": []},
        timeout_s=300,
    )[0].value
    assert ("write_throughput", "rank0") in again["at_start"]["firing"], again["at_start"]
    assert again["factors"][14] == 2.0  # applied by the first batch end's exchange, before any save
    resumed_resolved = [(t["key"], t["step"]) for t in again["transitions"] if t["transition"] == "resolved"]
    assert ("rank0", 20) in resumed_resolved, again["transitions"]


COMMIT_RULES = [
    static_rule(
        "commit_failures",
        "committed",
        low=1,
        fire_after=2,
        resolve_after=1,
        owner="infra",
        mitigation="drill_now",
        severity="error",
    ),
    static_rule(
        "failures_by_cause",
        "failed",
        high=0,
        fire_after=1,
        resolve_after=3,
        slice="cause",
        owner="storage",
        mitigation="alert",
        severity="error",
    ),
]


def test_failed_commits_fire_commit_completeness_and_drill_the_newest_committed_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    disk_full = DiskFullOnOccurrences("before_write", occurrences=(3, 4))  # the saves of steps 6 and 8
    value = run_ranks(
        health_fit,
        2,
        root,
        str(tmp_path / "wandb"),
        12,
        None,
        {"rules": COMMIT_RULES},
        {},
        {"timeout_s": 120},
        0.3,
        disk_full,
        timeout_s=300,
    )[0].value
    transitions = [(t["rule"], t["key"], t["transition"], t["step"]) for t in value["transitions"]]
    assert ("failures_by_cause", "storage_full", "fired", 6) in transitions
    fired = [t for t in value["transitions"] if t["rule"] == "commit_failures" and t["transition"] == "fired"]
    assert [t["step"] for t in fired] == [8], transitions
    assert any(t[0] == "commit_failures" and t[2] == "resolved" and t[3] == 10 for t in transitions), transitions
    # drill_now proved the newest committed checkpoint (step 4) although drills were not scheduled
    location = fsio.resolve(root)
    entries = catalog.list_checkpoints(location)
    states = drill_records.trust_states(location, entries)
    assert {e.step: states[e.name] for e in entries if e.committed}[4] == drill_records.DRILLED, states
    assert _committed_steps(root) == [2, 4, 10, 12]


STOP_RULE = static_rule(
    "restore_drills",
    "drill_ok",
    low=1,
    fire_after=1,
    resolve_after=1,
    owner="infra",
    severity="critical",
    mitigation="stop_training",
)


def test_failing_drill_fires_restore_rule_and_stop_training_saves_then_stops(tmp_path):
    root = str(tmp_path / "ckpt")
    drill = {"every_n_checkpoints": 1, "probe": "tests.helpers.drill_probes:differs_every_call", "timeout_s": 120}
    results = run_ranks(
        health_fit, 2, root, str(tmp_path / "wandb"), 200, None, {"rules": [STOP_RULE]}, {}, drill, 0.1, timeout_s=300
    )
    value = results[0].value
    assert value["global_step"] < 200, "training stopped early"
    assert [result.value["global_step"] for result in results] == [value["global_step"]] * 2
    assert value["transitions"][0]["rule"] == "restore_drills" and value["transitions"][0]["transition"] == "fired"
    steps = _committed_steps(root)
    assert steps[-1] == value["global_step"], "the final blocking save committed the stop step"


def test_default_rules_stay_quiet_over_a_clean_run_of_100_checkpoints(tmp_path, capsys):
    """The learned ranges leave warm-up and hold this machine's normal noise (two ranks sharing two cores)."""
    root = str(tmp_path / "ckpt")
    default_rules = str(Path(__file__).resolve().parents[2] / "conf" / "health" / "default.yaml")
    value = run_ranks(
        health_fit, 2, root, str(tmp_path / "wandb"), 200, None, default_rules, {}, None, 0.0, None, 1, timeout_s=600
    )[0].value
    assert value["transitions"] == [], value["transitions"]
    assert len(_committed_steps(root)) >= 100
    assert cli.main(["health", root, "--json"]) == 0
    rows = {(row["rule"], row["key"]): row for row in json.loads(capsys.readouterr().out)["rules"]}
    learned = [rows[("checkpoint_pause", key)] for rule, key in rows if rule == "checkpoint_pause"]
    assert learned and learned[0]["normal"] != "learning" and learned[0]["evaluations"] >= 100
    assert {key for rule, key in rows if rule == "write_throughput"} == {"rank0", "rank1"}


PAUSE_RULE = static_rule(
    "checkpoint_pause",
    "pause_s",
    high=0.4,
    fire_after=2,
    resolve_after=2,
    owner="training-infra",
    severity="warning",
    mitigation="skip_when_busy",
)


def test_saves_queueing_behind_slow_storage_fire_the_pause_rule_and_skip_when_busy_until_it_resolves(tmp_path):
    root = str(tmp_path / "ckpt")
    # each slow save holds the only staging slot 1 s: the next save, 2 fast steps later, waits for it
    storage = {"slow_steps": [4, 6, 8, 10], "delay_s": 1.0}
    results = run_ranks(
        health_fit,
        2,
        root,
        str(tmp_path / "wandb"),
        40,
        None,
        {"rules": [PAUSE_RULE]},
        storage,
        None,
        0.05,
        timeout_s=300,
    )  # 50 ms steps: storage is fast again well before the end
    transitions = [(t["transition"], t["step"]) for t in results[0].value["transitions"]]
    assert transitions[0] == ("fired", 8), transitions  # saves 6 and 8 each waited for the slow one before
    assert transitions[-1][0] == "resolved", transitions
    busy = [result.value["when_busy"] for result in results]
    assert busy[0] == busy[1], "every rank switches when_busy at the same step"
    assert "skip" in busy[0].values() and busy[0][max(busy[0])] == "wait", busy[0]  # switched, then restored
    skipped = [e["step"] for e in metrics.read_events(fsio.resolve(root)) if e.get("outcome") == "skipped"]
    assert skipped, "while the rule fired, a save due during a slow write was skipped instead of waited for"
    assert _committed_steps(root)[-1] == 40, "the run's last step is saved even under when_busy=skip"


PAGE_S = 4.0  # a mitigation that pages someone and waits for the pager's answer
PAGE_RULE = static_rule(
    "every_commit",
    "committed",
    high=0,  # the first committed save is outside: the rule fires once
    fire_after=1,
    resolve_after=1,
    owner="oncall",
    mitigation="page_slowly",
)


class BatchGaps(pl.Callback):
    """Every rank: the longest wall time between two batch ends (it includes ShardedCheckpoint's batch end)."""

    def __init__(self, step_sleep_s: float) -> None:
        self.step_sleep_s, self.longest_s, self._last = step_sleep_s, 0.0, None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.monotonic()
        if self._last is not None:
            self.longest_s = max(self.longest_s, now - self._last)
        self._last = now
        time.sleep(self.step_sleep_s)  # training lasts well past the page, so a stall would show


def slow_mitigation_fit(rank: int, world_size: int, root: str, marker: str) -> dict:
    lightning_env(rank, world_size)

    def page_slowly(context: Any, transition: Any) -> str:
        time.sleep(PAGE_S)
        Path(marker).write_text(f"{transition.rule.name} {transition.kind} at step {transition.step}")
        return "paged oncall"

    register_mitigation("page_slowly", page_slowly)
    checkpoint = ShardedCheckpoint(
        root, every_n_train_steps=2, keep_last=None, log_artifact=False, health={"rules": [PAGE_RULE]}
    )
    gaps = BatchGaps(step_sleep_s=0.1)
    trainer = ddp_trainer(world_size, 80, [gaps, checkpoint])
    trainer.fit(TinyModule(parallelism="ddp"), datamodule=TinyData())
    return {"longest_s": gaps.longest_s, "marker_at_fit_end": Path(marker).exists()}


def test_a_slow_user_mitigation_runs_off_the_training_thread_and_no_batch_waits_for_it(tmp_path):
    root, marker = str(tmp_path / "ckpt"), tmp_path / "paged"
    results = run_ranks(slow_mitigation_fit, 2, root, str(marker), timeout_s=300)
    longest = [result.value["longest_s"] for result in results]
    assert max(longest) < 2.0, f"a batch waited for the {PAGE_S} s mitigation: longest batch gaps {longest}"
    assert results[0].value["marker_at_fit_end"], "fit end waits (bounded) for the mitigation still running"
    assert marker.read_text() == "every_commit fired at step 2"
    events = _health_events(root)
    assert [(e["transition"], e["mitigation_result"]) for e in events] == [("fired", "paged oncall")], events
