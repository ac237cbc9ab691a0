"""The health rule engine on its own: ranges, persistence, slices, state, validation, mitigations."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from lightning_shardckpt import ConfigError, HealthConfig, register_mitigation
from lightning_shardckpt.engine import metrics
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.policies.health.evaluate import FIRED, RESOLVED, HealthEvaluator
from lightning_shardckpt.policies.health.health_plugin import HealthWatch
from lightning_shardckpt.policies.health.observe import failure_cause
from lightning_shardckpt.policies.health.rules import health_config_from, load_rules_file, rule_from
from tests.helpers.health_rules import static_rule

CONF = Path(__file__).resolve().parents[2] / "conf" / "health"


def _rule(**overrides):
    rule = static_rule("pause", "pause_s", high=1.0, fire_after=3, resolve_after=2, owner="infra")
    rule.update(overrides)
    return rule


def _attempt(step, outcome="committed", run_id="r1", **fields):
    return {
        "outcome": outcome,
        "step": step,
        "created_at": 1000.0 + step,
        "run_id": run_id,
        "pause_s": 0.1,
        "total_s": 1.0,
        "counters": {},
        **fields,
    }


def _feed(evaluator, pauses, start=1):
    transitions = []
    for offset, pause in enumerate(pauses):
        transitions += evaluator.observe_event(_attempt(start + offset, pause_s=pause))
    return [(t.kind, t.step) for t in transitions]


def test_static_rule_fires_after_exactly_its_persistence_and_resolves_after_its_own():
    evaluator = HealthEvaluator(health_config_from([_rule()]))
    assert _feed(evaluator, [0.5, 2.0, 2.0]) == []  # two out of range: not yet
    assert _feed(evaluator, [2.0], start=4) == [(FIRED, 4)]
    assert _feed(evaluator, [0.5], start=5) == []  # one in range: still firing
    assert _feed(evaluator, [0.5], start=6) == [(RESOLVED, 6)]


def test_alternating_values_neither_fire_nor_resolve_a_rule_in_the_other_state():
    evaluator = HealthEvaluator(health_config_from([_rule()]))
    assert _feed(evaluator, [2.0, 0.5] * 10) == []  # never 3 out in a row
    _feed(evaluator, [2.0, 2.0, 2.0], start=21)
    assert _feed(evaluator, [0.5, 2.0] * 10, start=24) == []  # never 2 in a row: no flapping


def test_duration_persistence_fires_once_out_of_range_long_enough():
    evaluator = HealthEvaluator(
        health_config_from([_rule(persistence={"fire_after": 100, "fire_after_s": 2.5, "resolve_after": 1})])
    )
    assert _feed(evaluator, [2.0, 2.0, 2.0]) == []  # 0 s, 1 s, 2 s out of range
    assert _feed(evaluator, [2.0], start=4) == [(FIRED, 4)]  # 3 s


def test_learned_range_waits_for_its_warmup_and_never_learns_from_out_of_range_values():
    rule = _rule(
        range={"kind": "learned", "warmup": 5, "window": 20, "k": 3.0, "floor": 0.05, "direction": "above"},
        persistence={"fire_after": 1, "resolve_after": 1},
    )
    evaluator = HealthEvaluator(health_config_from([rule]))
    assert _feed(evaluator, [5.0, 5.0, 5.0, 5.0]) == []  # warming up: no verdict, however large
    assert _feed(evaluator, [1.0] * 20, start=5) == []  # the window now holds mostly 1.0
    state = evaluator.series["pause"]["r1"]
    assert state.high == pytest.approx(1.05)  # MAD 0: the floor sets the band
    assert _feed(evaluator, [9.0] * 30, start=25) == [(FIRED, 25)]  # a long anomaly is never learned as normal
    assert evaluator.series["pause"]["r1"].high == pytest.approx(1.05)
    assert _feed(evaluator, [0.2], start=55) == [(RESOLVED, 55)]  # direction=above: low is fine


def test_relative_floor_keeps_a_steady_run_quiet_and_a_halving_fires():
    rule = {
        "name": "tput",
        "metric": "write_gbps",
        "slice": "rank",
        "owner": "storage",
        "range": {"kind": "learned", "warmup": 5, "k": 4.0, "relative_floor": 0.6, "direction": "below"},
        "persistence": {"fire_after": 2, "resolve_after": 2},
    }
    evaluator = HealthEvaluator(health_config_from([rule]))
    noise = random.Random(0)
    for step in range(1, 101):  # ±30 % noise around 2 GB/s on two ranks
        ranks = [{"rank": r, "write_gbps": 2.0 * noise.uniform(0.7, 1.3)} for r in (0, 1)]
        assert evaluator.observe_event(_attempt(step, ranks=ranks)) == []
    slow = [{"rank": 0, "write_gbps": 2.0}, {"rank": 1, "write_gbps": 0.5}]
    transitions = evaluator.observe_event(_attempt(101, ranks=slow)) + evaluator.observe_event(
        _attempt(102, ranks=slow)
    )
    assert [(t.key, t.kind, t.step) for t in transitions] == [("rank1", FIRED, 102)]  # names the slow rank


def test_a_commit_clears_every_failure_cause_series():
    rule = static_rule("causes", "failed", high=0, fire_after=1, resolve_after=1, slice="cause", owner="storage")
    evaluator = HealthEvaluator(health_config_from([rule]))
    full = evaluator.observe_event(_attempt(1, "failed", cause="rank 0: OSError: [Errno 28] No space left on device"))
    late = evaluator.observe_event(_attempt(2, "failed", cause="collective 'checkpoint-id' timed out after 600s"))
    assert [(t.key, t.kind) for t in full + late] == [("storage_full", FIRED), ("timeout", FIRED)]
    cleared = evaluator.observe_event(_attempt(3))
    assert sorted((t.key, t.kind) for t in cleared) == [("storage_full", RESOLVED), ("timeout", RESOLVED)]


@pytest.mark.parametrize(
    "cause, expected",
    [
        ("rank 1 did not report 3 planned chunk(s)", "rank_incomplete"),
        ("cannot reach http://127.0.0.1:9/ (Connection refused)", "storage_unavailable"),
        ("checksum mismatch in __0_0.distcp", "corrupt"),
        ("something else", "other"),
    ],
)
def test_failure_causes_are_classified_for_the_cause_slice(cause, expected):
    assert failure_cause(cause) == expected


def test_state_is_json_and_a_restored_evaluator_continues_the_counters():
    config = health_config_from([_rule()])
    first = HealthEvaluator(config)
    _feed(first, [2.0, 2.0])
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint holds is plain data
    second = HealthEvaluator(config)
    second.load_state_dict(state)
    assert _feed(second, [2.0], start=3) == [(FIRED, 3)]  # the third consecutive value, across the restart


def test_drill_and_resume_events_feed_the_restore_rules():
    rules = [
        static_rule("drills", "drill_ok", low=1, fire_after=1, resolve_after=1, owner="infra"),
        static_rule("lag", "drill_lag_checkpoints", high=2, fire_after=1, resolve_after=1, owner="infra"),
        static_rule("resume", "resume_s", high=60, fire_after=1, resolve_after=1, owner="infra"),
    ]
    evaluator = HealthEvaluator(health_config_from(rules))
    failed = evaluator.observe_event(
        {"event": "drill", "verdict": "failed", "step": 4, "created_at": 1.0, "lag_checkpoints": 3, "run_id": "r1"}
    )
    slow = evaluator.observe_event({"event": "resume", "seconds": 75.0, "step": 4, "created_at": 2.0, "run_id": "r1"})
    assert sorted(t.rule.name for t in failed + slow) == ["drills", "lag", "resume"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"metric": "pause"}, "metric 'pause' is unknown"),
        ({"slice": "rank"}, "has no values per 'rank'"),
        ({"owner": " "}, "has no owner"),
        ({"mitigation": ""}, "has no mitigation"),
        ({"severity": "loud"}, "severity 'loud' is unknown"),
        ({"range": {"kind": "static"}}, "needs min, max or both"),
        ({"range": {"kind": "learned", "warmup": 10, "window": 5}}, "window >= max(2, warmup)"),
        ({"persistence": {"fire_after": 0}}, "persistence.fire_after=0 is below 1"),
        ({"threshold": 3}, "unknown field(s) ['threshold']"),
        ({"range": {"kind": "static", "max": 1, "ceiling": 2}}, "unknown range field(s) ['ceiling']"),
    ],
)
def test_a_bad_rule_is_refused_with_the_field_and_the_fix(change, message):
    with pytest.raises(ConfigError) as err:
        rule_from(_rule(**change))
    assert message in str(err.value)


def test_duplicate_rule_names_are_refused():
    with pytest.raises(ConfigError, match="defined twice"):
        health_config_from([_rule(), _rule()])


def test_shipped_rule_files_load_and_cover_the_three_families():
    default = load_rules_file(CONF / "default.yaml")
    assert isinstance(default, HealthConfig) and not load_rules_file(CONF / "off.yaml").enabled
    metrics_watched = {rule.metric for rule in default.rules}
    assert {"pause_s", "write_gbps", "skipped"} <= metrics_watched  # pause and throughput
    assert {"committed", "failed", "failed_dirs_left"} <= metrics_watched  # commit completeness
    assert {"drill_ok", "time_to_resume_s", "resume_s"} <= metrics_watched  # restore success, time to resume
    assert all(rule.mitigation != "stop_training" for rule in default.rules)  # off by default


def test_a_registered_mitigation_is_called_on_fire_and_resolve_and_its_result_recorded(tmp_path):
    calls = []

    def page_oncall(context, transition):
        calls.append((transition.kind, transition.key))
        return f"paged {transition.rule.owner}"

    register_mitigation("page_oncall", page_oncall)
    watch = HealthWatch(
        health_config_from([_rule(mitigation="page_oncall", persistence={"fire_after": 1, "resolve_after": 1})]),
        fsio.resolve(str(tmp_path)),
    )
    watch.on_event(_attempt(1, pause_s=3.0))
    watch.on_event(_attempt(2, pause_s=0.1))
    assert watch.finish_mitigations(5.0)  # a user's mitigation runs on the watch's own thread, in order
    assert calls == [(FIRED, "r1"), (RESOLVED, "r1")]
    events = [e for e in metrics.read_events(str(tmp_path)) if e.get("event") == "health"]
    assert [(e["transition"], e["mitigation_result"], e["owner"]) for e in events] == [
        (FIRED, "paged infra", "infra"),
        (RESOLVED, "paged infra", "infra"),
    ]


def test_an_unknown_mitigation_fails_before_training(tmp_path):
    with pytest.raises(ConfigError, match="cannot be imported"):
        HealthWatch(health_config_from([_rule(mitigation="no_such_module:act")]), fsio.resolve(str(tmp_path)))
    with pytest.raises(ConfigError, match="mitigation 'reboot' is unknown"):
        HealthWatch(health_config_from([_rule(mitigation="reboot")]), fsio.resolve(str(tmp_path)))


def test_lower_frequency_holds_while_any_rank_fires_and_lifts_when_the_last_resolves(tmp_path):
    rule = static_rule(
        "tput",
        "write_gbps",
        low=1.0,
        fire_after=1,
        resolve_after=1,
        slice="rank",
        owner="storage",
        mitigation="lower_frequency",
        mitigation_options={"factor": 3},
    )
    watch = HealthWatch(health_config_from([rule]), fsio.resolve(str(tmp_path)))
    both_slow = [{"rank": 0, "write_gbps": 0.1}, {"rank": 1, "write_gbps": 0.1}]
    watch.on_event(_attempt(1, ranks=both_slow))
    assert watch.context.control.interval_factor == 3  # once, not once per firing rank
    watch.on_event(_attempt(2, ranks=[{"rank": 0, "write_gbps": 5.0}, {"rank": 1, "write_gbps": 0.1}]))
    assert watch.context.control.interval_factor == 3  # rank 1 still slow
    watch.on_event(_attempt(3, ranks=[{"rank": 0, "write_gbps": 5.0}, {"rank": 1, "write_gbps": 5.0}]))
    assert watch.context.control.interval_factor == 1
    watch.on_event(_attempt(4, ranks=both_slow))
    watch.forget_ranks(1)  # resized to one rank: rank 1's series can never resolve, so it is dropped
    assert list(watch.evaluator.series["tput"]) == ["rank0"] and watch.context.control.interval_factor == 3


def test_health_howto_table_lists_every_default_rule_with_its_metric_and_mitigation():
    howto = (CONF.parents[1] / "docs/howto/health.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in howto.splitlines() if line.startswith("| `")}
    for rule in load_rules_file(CONF / "default.yaml").rules:
        row = rows.get(f"`{rule.name}`")
        assert row is not None, f"docs/howto/health.md's rule table has no row for {rule.name}"
        assert f"`{rule.metric}`" in row and f"`{rule.mitigation}`" in row and rule.owner in row
