"""`shardckpt health --plot` on a root where a rule fired and resolved, built by the real engine: a saver whose
3rd and 4th saves hit a full disk, watched by the real health rules. The figure shades the firing period
the transitions report, every panel's y-range holds its band's edges, and flat series fold into text."""

from __future__ import annotations

import pytest

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.cli import main as cli
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.ops.health_plot import plot
from lightning_shardckpt.ops.health_report import evaluate_root
from lightning_shardckpt.policies.health.evaluate import FIRED, RESOLVED
from lightning_shardckpt.policies.health.health_plugin import HealthWatch
from lightning_shardckpt.policies.health.rules import METRIC_UNITS, METRICS, health_config_from
from tests.helpers.checkpoints import fresh_state
from tests.helpers.faults import DiskFullOnOccurrences
from tests.helpers.health_rules import static_rule

STEPS = [10, 20, 30, 40, 50, 60, 70, 80]  # saves 3 and 4 (steps 30, 40) fail: the commit rule fires at 40
RULES = [
    static_rule("commit_failures", "committed", low=1, fire_after=2, resolve_after=1, owner="infra-oncall"),
    # far above any pause here: its edge must still be on the axis
    static_rule("checkpoint_pause", "pause_s", high=30.0, owner="training-infra", mitigation="alert"),
    static_rule("skipped_saves", "skipped", high=0, owner="training-infra"),
    static_rule("resume_time", "resume_s", high=600, owner="training-infra"),
]


@pytest.fixture(scope="module")
def fired_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("health-plot") / "root")
    saver = CheckpointSaver(
        root,
        SaveConfig(async_save=False, run_id="plotrun"),
        fault_hook=DiskFullOnOccurrences("before_write", occurrences=(3, 4)),
    )
    watch = HealthWatch(health_config_from(RULES), fsio.resolve(root))
    watch.watch(saver, None)  # records the rules in the root and evaluates each attempt, as a training run does
    try:
        outcomes = [saver.save(fresh_state(seed=step), step=step).result(timeout=60).committed for step in STEPS]
    finally:
        saver.close()
    assert outcomes == [True, True, False, False, True, True, True, True]
    assert [(t.rule.name, t.kind, t.step) for t in watch.transitions] == [
        ("commit_failures", FIRED, 40),
        ("commit_failures", RESOLVED, 50),
    ]
    return root


@pytest.fixture(scope="module")
def drawn(fired_root, tmp_path_factory):
    return plot(evaluate_root(fsio.resolve(fired_root)), str(tmp_path_factory.mktemp("plot") / "health.png"))


def test_the_firing_period_is_shaded_from_the_fired_step_to_the_resolved_step(drawn):
    panel = next(p for p in drawn.panels if p.rule == "commit_failures")
    assert panel.firing_spans == [(40, 50)]
    axis = next(a for a in drawn.figure.axes if a.get_title(loc="left").startswith("commit_failures"))
    shaded = [patch for patch in axis.patches if patch.get_label() == "firing"]
    assert len(shaded) == 1
    left, right = shaded[0].get_x(), shaded[0].get_x() + shaded[0].get_width()
    assert left == 40 and right >= 50  # the span drawn covers the steps the rule fired over, in data units
    assert "owner infra-oncall" in axis.get_title(loc="right")


def test_every_panel_shows_its_band_edges_and_its_unit(drawn):
    assert {p.rule for p in drawn.panels} == {"commit_failures", "checkpoint_pause"}
    for panel, axis in zip(drawn.panels, drawn.figure.axes[1:]):
        bottom, top = axis.get_ylim()
        assert panel.band_edges and all(bottom <= edge <= top for edge in panel.band_edges), (panel, axis.get_ylim())
        assert axis.get_ylabel() == panel.unit != ""
    pause = next(p for p in drawn.panels if p.rule == "checkpoint_pause")
    assert pause.band_edges == [30.0] and pause.ylim[1] > 30.0  # pauses are milliseconds; the 30 s edge is shown


def test_constant_series_and_rules_without_data_fold_into_the_text_panel(drawn):
    assert drawn.constant == ["skipped = 0 (8x, in range)"]
    assert drawn.no_data == ["resume_time (resume_s)"]
    text = "\n".join(t.get_text() for t in drawn.figure.axes[0].texts)
    assert "constant: skipped = 0" in text and "no data: resume_time" in text
    assert "owner infra-oncall: commit_failures (alert)" in text


def test_the_command_line_plot_reports_what_it_drew(fired_root, tmp_path, capsys):
    out = tmp_path / "cli.png"
    assert cli.main(["health", fired_root, "--plot", str(out)]) == 0  # resolved by the end: exit 0
    assert "(2 panels; 1 constant series and 1 rules without data listed in its text panel)" in capsys.readouterr().out
    assert out.stat().st_size > 5_000


def test_every_metric_has_a_unit_for_its_axis():
    assert set(METRIC_UNITS) == set(METRICS)
