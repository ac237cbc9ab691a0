"""PluginList (policies/plugin.py): every hook reaches every plug-in in order; merged answers."""

from __future__ import annotations

from lightning_shardckpt.engine.config import SaveConfig
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.policies.drills.drills_plugin import DrillConfig, TrainingDrills
from lightning_shardckpt.policies.health.health_plugin import HealthWatch
from lightning_shardckpt.policies.health.rules import health_config_from
from lightning_shardckpt.policies.plan import CheckpointPlan, Placement
from lightning_shardckpt.policies.plugin import Plugin, PluginContext, PluginList, Reporter


class Recording(Plugin):
    def __init__(self, name: str, calls: list, **answers) -> None:
        self.name, self.calls, self.answers = name, calls, answers
        self.state_key = answers.get("state_key")

    def start(self, context: PluginContext) -> None:
        self.calls.append((self.name, "start"))

    def sync(self, preempted: bool, context: PluginContext) -> bool | None:
        return self.answers.get("sync")

    def interval_factor(self) -> float:
        return self.answers.get("factor", 1.0)

    def spare(self, keep_last):
        return self.answers.get("spare", set())

    def counters(self):
        return self.answers.get("counters", {})

    def state_dict(self):
        return {"from": self.name}

    def load_state_dict(self, state) -> None:
        self.calls.append((self.name, "load", state))


def test_hooks_run_in_order_and_answers_merge():
    calls: list = []
    plugins = PluginList(
        [
            Recording("a", calls, sync=None, factor=2.0, spare={"x"}, counters={"n": 1}, state_key="a_state"),
            Recording("b", calls, sync=False, factor=1.5, spare={"y"}, counters={"m": 2}),
        ]
    )
    plugins.start(PluginContext())
    assert calls == [("a", "start"), ("b", "start")]
    assert plugins.sync(True, PluginContext()) is False  # one plug-in ran the collective: its verdict counts
    assert PluginList([Recording("c", calls)]).sync(True, PluginContext()) is None  # none ran one
    assert plugins.interval_factor() == 3.0
    assert plugins.spare(3) == {"x", "y"} and plugins.counters() == {"n": 1, "m": 2}
    assert plugins.state_dict() == {"a_state": {"from": "a"}}  # stateless plug-ins add no key
    plugins.load_state_dict({"a_state": {"saved": 1}})
    assert calls[-1] == ("a", "load", {"saved": 1})
    assert plugins.get(Recording).name == "a" and plugins.get(HealthWatch) is None


def test_health_state_key_stays_health_and_is_none_without_rules(tmp_path):
    watch = HealthWatch(health_config_from(None), fsio.resolve(str(tmp_path)))
    assert PluginList([watch]).state_dict() == {"health": None if not watch.enabled else watch.state_dict()}


def test_published_events_reach_every_plugin_and_a_failing_one_does_not_stop_the_rest():
    seen: list = []

    class Broken(Plugin):
        def on_event(self, event):
            raise RuntimeError("boom")

    class Listening(Plugin):
        def on_event(self, event):
            seen.append(event)

    plugins = PluginList([Broken(), Listening()])
    context = PluginContext()
    plugins.setup(context)
    context.publish({"event": "drill"})
    assert seen == [{"event": "drill"}]


def test_drills_shape_the_plan_fallback_and_go_off_on_node_local_tiers_across_nodes(tmp_path):
    drills = TrainingDrills(DrillConfig(every_n_checkpoints=1, fallback_to_last_good=True))
    plan = drills.shape_plan(CheckpointPlan(root=str(tmp_path)), Placement())
    assert plan.fallback_to_last_good and drills.config.every_n_checkpoints == 1
    node_local = CheckpointPlan(root=str(tmp_path), save=SaveConfig(node_local=True))
    drills.shape_plan(node_local, Placement(num_nodes=2))
    assert drills.config.every_n_checkpoints is None


def test_drill_results_are_logged_through_the_reporter(tmp_path):
    logged: list = []

    class Collect(Reporter):
        def log_metrics(self, values):
            logged.append(values)

    drills = TrainingDrills(DrillConfig(every_n_checkpoints=1), fsio.resolve(str(tmp_path)))
    drills.record_result({"verdict": "passed", "step": 4, "checkpoint": "step-4"})  # what the drill thread calls
    drills.log(Collect())
    assert logged and logged[0]["drill/ok"] == 1.0 and logged[0]["drill/step"] == 4.0
