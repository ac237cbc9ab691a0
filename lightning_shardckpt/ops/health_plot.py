"""`shardckpt health ROOT --plot OUT.png`: one picture that answers "is anything wrong, since when, and how
far outside its normal range".

A panel per rule and series whose values move or that fired; every series that stayed constant, and every
rule without data, is folded into the text panel on top (a flat line says nothing a number does not), which
also lists each rule's owner and mitigation. Each panel's y-range holds its values and its band's edges, so
the band is never cut off; firing periods are shaded from the evaluation's transitions (the same fired /
resolved steps the table and the run's alerts report).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..policies.health.evaluate import FIRED, RESOLVED, SeriesState, range_text
from ..policies.health.rules import METRIC_UNITS, ROOT, RUN, HealthRule
from .health_report import HealthReport

PANEL_HEIGHT_IN, LINE_HEIGHT_IN, WIDTH_IN, DPI = 2.1, 0.19, 11.0, 80
TEXT_WIDTH_CHARS = 108


@dataclass(frozen=True)
class Panel:
    """One drawn rule and series: what a reader (or a test) can check against the figure."""

    rule: str
    key: str
    unit: str
    firing_spans: list[tuple[float, float]]  # (fired at step, resolved at step or the last step seen)
    band_edges: list[float]  # every finite edge the normal range had
    ylim: tuple[float, float]


@dataclass
class HealthPlot:
    figure: Any  # the matplotlib Figure, saved and released from pyplot (still inspectable)
    panels: list[Panel] = field(default_factory=list)
    constant: list[str] = field(default_factory=list)  # "skipped = 0 (60x, in range)": folded into the text
    no_data: list[str] = field(default_factory=list)  # rules that never saw a value


def plot(report: HealthReport, path: str) -> HealthPlot:
    """Draw the report to `path` (PNG, or any format matplotlib knows by the suffix)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib (it is in the dev extra)") from err
    spans = firing_spans(report)
    drawn: list[tuple[HealthRule, str, SeriesState]] = []
    result = HealthPlot(figure=None)
    for rule in report.config.rules:
        observed = sorted((key, state) for key, state in report.evaluator.series[rule.name].items() if state.history)
        if not observed:
            result.no_data.append(f"{rule.name} ({rule.metric})")
        for key, state in observed:
            values = [row[1] for row in state.history]
            if len(set(values)) > 1 or spans.get((rule.name, key)):
                drawn.append((rule, key, state))
            else:
                inside = all(_inside(value, low, high) for _, value, low, high, _ in state.history)
                result.constant.append(
                    f"{rule.metric}{_where(rule, key)} = {values[0]:.4g}{_spaced_unit(rule.metric)} "
                    f"({len(values)}x, {'in range' if inside else 'OUT OF RANGE'})"
                )
    if not drawn and not result.constant:
        raise ConfigError("nothing to plot: no rule has observed a value in this root yet")
    lines = _text_lines(report, result, spans)
    text_height = LINE_HEIGHT_IN * len(lines) + 0.3
    figure, axes = plt.subplots(
        len(drawn) + 1,
        1,
        figsize=(WIDTH_IN, text_height + PANEL_HEIGHT_IN * len(drawn)),
        gridspec_kw={"height_ratios": [text_height] + [PANEL_HEIGHT_IN] * len(drawn)},
        squeeze=False,
    )
    text_axis, panel_axes = axes[0, 0], axes[1:, 0]
    text_axis.axis("off")
    text_axis.text(0.0, 1.0, "\n".join(lines), va="top", ha="left", fontsize=9.5, family="monospace")
    for axis in panel_axes[1:]:
        axis.sharex(panel_axes[0])
    first = min((state.history[0][0] for _, _, state in drawn), default=0)
    last = max((state.history[-1][0] for _, _, state in drawn), default=1)
    margin = max((last - first) * 0.02, 0.5)
    for axis, (rule, key, state) in zip(panel_axes, drawn):
        result.panels.append(_draw_panel(axis, rule, key, state, spans.get((rule.name, key), []), last + margin))
    if len(panel_axes):
        panel_axes[0].set_xlim(first - margin, last + margin)
        panel_axes[-1].set_xlabel("training step", fontsize=10)
    figure.tight_layout(h_pad=0.6)
    figure.savefig(path, dpi=DPI, pil_kwargs={"optimize": True} if str(path).endswith(".png") else None)
    plt.close(figure)
    result.figure = figure
    return result


def firing_spans(report: HealthReport) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(rule, key) -> its firing periods, from the transitions; one still firing ends at its last step seen."""
    spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
    open_since: dict[tuple[str, str], float] = {}
    for transition in report.transitions:
        series = (transition.rule.name, transition.key)
        if transition.kind == FIRED:
            open_since[series] = transition.step
        elif transition.kind == RESOLVED and series in open_since:
            spans.setdefault(series, []).append((open_since.pop(series), transition.step))
    for (rule, key), start in open_since.items():
        history = report.evaluator.series[rule][key].history
        spans.setdefault((rule, key), []).append((start, history[-1][0] if history else start))
    return spans


def _draw_panel(
    axis: Any, rule: HealthRule, key: str, state: SeriesState, spans: list[tuple[float, float]], x_end: float
) -> Panel:
    steps = [row[0] for row in state.history]
    values = [row[1] for row in state.history]
    # a range holds from its evaluation until the next one; the last holds to the right edge (a sparse
    # series, e.g. drills, would otherwise show its current band as a zero-width sliver)
    band_steps = steps + [x_end]
    lows = [row[2] for row in state.history]
    highs = [row[3] for row in state.history]
    lows, highs = lows + lows[-1:], highs + highs[-1:]
    edges = [edge for edge in lows + highs if edge is not None]
    # the y-range holds the values, the band's edges and zero (every watched metric is >= 0): how far a value
    # is from its edge reads off the axis
    bottom, top = min(values + edges + [0.0]), max(values + edges + [0.0])
    edges = sorted(set(edges))
    pad = (top - bottom) * 0.08 or 0.5
    ylim = (bottom - pad * 0.5, top + pad)
    nan = float("nan")
    banded = [low is not None or high is not None for low, high in zip(lows, highs)]
    if any(banded):
        axis.fill_between(
            band_steps,
            [ylim[0] if low is None else low for low in lows],
            [ylim[1] if high is None else high for high in highs],
            where=banded,
            step="post",
            color="tab:green",
            alpha=0.15,
            lw=0,
            label="normal range",
        )
    for bound in (lows, highs):
        if any(edge is not None for edge in bound):
            edge_line = [nan if edge is None else edge for edge in bound]
            axis.step(band_steps, edge_line, where="post", color="tab:green", lw=1, ls="--")
    learning = [step for step, row in zip(steps, state.history) if row[2] is None and row[3] is None]
    if learning:  # a learned range before its warm-up: values seen, no verdict yet
        ends = [step for step, row in zip(band_steps, state.history) if row[2] is not None or row[3] is not None]
        axis.axvspan(learning[0], ends[0] if ends else x_end, color="gray", alpha=0.12, lw=0, label="learning")
    axis.plot(steps, values, marker=".", ms=4, lw=1, color="tab:blue", label=rule.metric)
    outside = [(row[0], row[1]) for row in state.history if not _inside(row[1], row[2], row[3])]
    if outside:
        axis.plot(*zip(*outside), ls="", marker="o", ms=5, color="tab:red", label="out of range")
    width = max((steps[-1] - steps[0]) * 0.004, 0.5)  # a span fired and resolved at one step stays visible
    for start, end in spans:
        axis.axvspan(start, max(end, start + width), color="tab:red", alpha=0.22, lw=0, label="firing")
    axis.set_ylim(*ylim)
    axis.set_ylabel(METRIC_UNITS.get(rule.metric, rule.metric), fontsize=9)
    axis.set_title(f"{rule.name}: {rule.metric}, {rule.slice} {key}", fontsize=11, loc="left")
    axis.set_title(f"owner {rule.owner} · {rule.mitigation}", fontsize=9, loc="right", color="dimgray")
    firing_now = " · FIRING" if state.firing else ""
    axis.text(
        0.005,
        0.96,
        f"last {values[-1]:.3g}, max {max(values):.3g}{_spaced_unit(rule.metric)}; "
        f"normal {_normal_text(state)}{firing_now}",
        transform=axis.transAxes,
        va="top",
        fontsize=8.5,
        color="tab:red" if state.firing else "black",
        bbox={"facecolor": "white", "alpha": 0.7, "lw": 0},
    )
    handles, labels = axis.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axis.legend(unique.values(), unique.keys(), fontsize=7.5, loc="upper right", ncol=len(unique))
    axis.tick_params(labelsize=8.5)
    return Panel(rule.name, key, METRIC_UNITS.get(rule.metric, ""), spans, edges, ylim)


def _text_lines(report: HealthReport, result: HealthPlot, spans: dict[tuple[str, str], list]) -> list[str]:
    firing = [(rule, key, state) for rule, key, state in report.evaluator.firing()]
    lines = [
        f"{len(firing)} rule(s) firing"
        + (":" if firing else " (red: firing periods; green: normal range; gray: learning it)"),
    ]
    for rule, key, state in firing:
        lines.append(
            f"  {rule.name} on {rule.slice}={key} since step {state.firing_since_step}: {rule.metric} = "
            f"{state.last_value:.4g}{_spaced_unit(rule.metric)}, normal {range_text(state.low, state.high)} "
            f"(owner {rule.owner}; mitigation {rule.mitigation})"
        )
    rules = {rule.name: rule for rule in report.config.rules}
    earlier = [
        f"{name}{_where(rules[name], key)} steps " + ", ".join(f"{start:g}-{end:g}" for start, end in periods)
        for (name, key), periods in spans.items()
        if not report.evaluator.series[name][key].firing
    ]
    if earlier:
        lines += _wrapped("fired and resolved: ", "; ".join(earlier))
    lines += _wrapped("constant: ", "; ".join(result.constant) or "none")
    lines += _wrapped("no data: ", ", ".join(result.no_data) or "none")
    by_owner: dict[str, list[str]] = {}
    for rule in report.config.rules:
        by_owner.setdefault(rule.owner, []).append(f"{rule.name} ({rule.mitigation})")
    for owner, named in by_owner.items():
        lines += _wrapped(f"owner {owner}: ", ", ".join(named))
    return lines


def _wrapped(head: str, body: str) -> list[str]:
    return textwrap.wrap(head + body, TEXT_WIDTH_CHARS, subsequent_indent=" " * len(head)) or [head]


def _normal_text(state: SeriesState) -> str:
    if state.low is None and state.high is None:
        return "not learned yet (no verdict)"
    return range_text(state.low, state.high)


def _where(rule: HealthRule, key: str) -> str:
    """The series in text: named where a rule has several (rank, cause), not for the run or root."""
    return "" if rule.slice in (RUN, ROOT) else f"[{rule.slice} {key}]"


def _inside(value: float, low: float | None, high: float | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def _spaced_unit(metric: str) -> str:
    """The unit after a number in text: " s", " GB/s", " checkpoints"; none for 0/1 and ratio metrics."""
    unit = METRIC_UNITS.get(metric, "")
    return "" if "(" in unit else " " + {"seconds": "s", "retries per save": "retries"}.get(unit, unit)
