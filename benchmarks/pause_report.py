"""`benchmarks/pause.py`'s report: the slowest rank's medians per method, ratios, targets, table and plot."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from common import phase_medians, ratio_or_none
from pause_methods import LABELS, METHODS, OUR_PHASES, BenchConfig, bytes_per_rank

PAUSE_VS_COPY_TARGET = 1.5  # our pause may be at most this multiple of the raw copy
PAUSE_VS_PL_TARGET = 20.0  # our pause must be at least this many times shorter than Lightning's sync save
TOTAL_VS_DCP_TARGET = 1.10  # our total may be at most this multiple of plain dcp.save


def summarize(world_size: int, config: BenchConfig, per_rank: list[dict[str, Any]] | str) -> dict[str, Any]:
    """Per method: the slowest rank's pause and total per timed round, medians, errors; ratios; targets."""
    summary: dict[str, Any] = {
        "ranks": world_size,
        "bytes_per_rank": bytes_per_rank(config, world_size),
        "methods": {
            m: {"pause_s": [], "total_s": [], "warmup_pause_s": [], "warmup_total_s": [], "errors": []}
            for m in (*METHODS, "ours_cold")
        },
    }
    methods = summary["methods"]
    phases: list[list[dict[str, float]]] = []
    if isinstance(per_rank, str):
        for method in methods:
            methods[method]["errors"].append(f"run failed: {per_rank}")
    else:
        summary["per_rank_samples"] = [r["samples"] for r in per_rank]
        summary["pause_pieces_median_s_per_rank"] = [r["pieces"] for r in per_rank]
        summary["ours_staging_allocations"] = [r["staging_allocations"] for r in per_rank]
        first_ours = True
        for same in zip(*(r["samples"] for r in per_rank)):  # every rank's view of one (round, method)
            head = same[0]
            entry = methods[head["method"]]
            errors = [f"rank {rank}: {s['error']}" for rank, s in enumerate(same) if s["error"]]
            entry["errors"].extend(
                f"{'warm-up' if head['warmup'] else 'timed'} round {head['round']}: {e}" for e in errors
            )
            cold = head["method"] == "ours" and first_ours
            if head["method"] == "ours":
                first_ours = False
            if errors:
                continue
            pause, total = max(s["pause_s"] for s in same), max(s["total_s"] for s in same)
            if cold:  # the saver's first save: staging buffers are allocated inside its pause
                methods["ours_cold"]["pause_s"].append(pause)
                methods["ours_cold"]["total_s"].append(total)
            prefix = "warmup_" if head["warmup"] else ""
            entry[prefix + "pause_s"].append(pause)
            entry[prefix + "total_s"].append(total)
            if head["method"] == "ours" and not head["warmup"] and all(s.get("phases") for s in same):
                phases.append([s["phases"] for s in same])
    for entry in methods.values():
        entry["median_pause_s"] = statistics.median(entry["pause_s"]) if entry["pause_s"] else None
        entry["median_total_s"] = statistics.median(entry["total_s"]) if entry["total_s"] else None
    median = {m: (methods[m]["median_pause_s"], methods[m]["median_total_s"]) for m in methods}
    copy_s = median["copy"][1]
    pl_s = median["pl_sync"][1]
    for m, (pause, total) in median.items():
        methods[m]["ratios"] = {
            "pause/copy": ratio_or_none(pause, copy_s),
            "total/copy": ratio_or_none(total, copy_s),
            "pl_sync/pause": ratio_or_none(pl_s, pause),
            "total/pl_sync": ratio_or_none(total, pl_s),
        }
    ours_pause, ours_total = median["ours"]
    summary["targets"] = {
        f"ours pause <= {PAUSE_VS_COPY_TARGET}x raw copy": _verdict(
            ratio_or_none(ours_pause, copy_s), lambda r: r <= PAUSE_VS_COPY_TARGET, "{:.2f}x"
        ),
        f"ours pause >= {PAUSE_VS_PL_TARGET:.0f}x shorter than Lightning sync": _verdict(
            ratio_or_none(pl_s, ours_pause), lambda r: r >= PAUSE_VS_PL_TARGET, "{:.1f}x shorter"
        ),
        f"ours total <= {TOTAL_VS_DCP_TARGET}x dcp.save": _verdict(
            ratio_or_none(ours_total, median["dcp"][1]), lambda r: r <= TOTAL_VS_DCP_TARGET, "{:.2f}x"
        ),
    }
    summary["ours_phases"] = {
        "per_save_per_rank": phases,
        "median_of_slowest_rank_s": phase_medians(phases, OUR_PHASES),
    }
    return summary


def _verdict(ratio: float | None, ok: Callable[[float], bool], fmt: str) -> dict[str, Any]:
    if ratio is None:
        return {"ratio": None, "met": None, "text": "no result"}
    met = ok(ratio)
    return {"ratio": ratio, "met": met, "text": f"{'met' if met else 'MISSED'} ({fmt.format(ratio)})"}


def format_table(summaries: list[dict[str, Any]]) -> str:
    header = (
        f"{'ranks':>5}  {'method':<28}  {'pause s':>8}  {'total s':>8}  {'pause/copy':>10}  {'total/copy':>10}"
        f"  {'pl_sync/pause':>13}  {'total/pl_sync':>13}"
    )
    lines, failures = [header, "-" * len(header)], []
    for summary in summaries:
        for method in (*METHODS[:2], "ours_cold", *METHODS[2:]):
            entry = summary["methods"][method]
            failures.extend(f"{summary['ranks']} rank(s), {method}, {e}" for e in entry["errors"])
            mark = "!" if entry["errors"] else ""
            ratios = entry["ratios"]
            lines.append(
                f"{summary['ranks']:>5}  {LABELS[method] + mark:<28}  {_fmt_s(entry['median_pause_s'])}  {_fmt_s(entry['median_total_s'])}"
                f"  {_fmt_x(ratios['pause/copy'], 10)}  {_fmt_x(ratios['total/copy'], 10)}"
                f"  {_fmt_x(ratios['pl_sync/pause'], 13)}  {_fmt_x(ratios['total/pl_sync'], 13)}"
            )
        lines.append("")
    for summary in summaries:
        gib = summary["bytes_per_rank"] / 2**30
        lines.append(
            f"{summary['ranks']} rank(s), {gib:.2f} GiB per rank ({summary['ranks'] * gib:.2f} GiB in all; "
            "Lightning saves all of it from rank 0):"
        )
        for name, verdict in summary["targets"].items():
            lines.append(f"  target: {name:<48} {verdict['text']}")
        phases = summary["ours_phases"]["median_of_slowest_rank_s"]
        breakdown = ", ".join(f"{name[:-2]} {seconds:.3f}" for name, seconds in phases.items()) or "none recorded"
        lines.append(f"  ours, the saver's own record (median of the slowest rank, s): {breakdown}")
        pieces = [p for p in summary.get("pause_pieces_median_s_per_rank", []) if p]
        if pieces:
            lines.append(
                "  ours pause, pieces timed one by one (--profile, median s, rank 0): "
                + ", ".join(f"{k} {v:.4f}" for k, v in pieces[0].items())
            )
    if failures:
        lines.append("failures (! marks a median over fewer samples than asked):")
        lines.extend(f"  {failure}" for failure in failures)
    return "\n".join(lines)


def _fmt_s(seconds: float | None) -> str:
    return f"{seconds:8.3f}" if seconds is not None else f"{'FAILED':>8}"


def _fmt_x(ratio: float | None, width: int) -> str:
    return f"{ratio:.2f}x".rjust(width) if ratio is not None else "-".rjust(width)


def plot(summaries: list[dict[str, Any]], path: str, config: BenchConfig) -> None:
    """Grouped bars per rank count: pause and total per method, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ("copy", "ours", "ours_cold", "dcp_async", "dcp", "pl_async", "pl_sync")
    fig, axes = plt.subplots(1, len(summaries), figsize=(6.5 * len(summaries), 5.2), sharey=True, squeeze=False)
    width = 0.38
    for ax, summary in zip(axes[0], summaries):
        xs = range(len(order))
        for offset, key, color, label in (
            (-width / 2, "median_pause_s", "#d62728", "pause (training blocked)"),
            (width / 2, "median_total_s", "#1f77b4", "total (until complete)"),
        ):
            values = [summary["methods"][m][key] or 0.0 for m in order]
            bars = ax.bar(
                [x + offset for x in xs],
                [v if v > 0 else float("nan") for v in values],
                width,
                color=color,
                label=label,
            )
            for bar, value in zip(bars, values):
                if value > 0:
                    ax.annotate(
                        f"{value:.2g}",
                        (bar.get_x() + bar.get_width() / 2, value),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        xytext=(0, 2),
                        textcoords="offset points",
                    )
        copy_s = summary["methods"]["copy"]["median_total_s"]
        if copy_s:
            ax.axhline(
                copy_s * PAUSE_VS_COPY_TARGET,
                color="#d62728",
                linestyle=":",
                linewidth=1,
                label=f"pause target: {PAUSE_VS_COPY_TARGET}x raw copy",
            )
        ax.set_yscale("log")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(
            [LABELS[m].replace(" ", "\n", 1) if m != "ours_cold" else "ours,\n1st save" for m in order], fontsize=8
        )
        gib = summary["bytes_per_rank"] / 2**30
        ax.set_title(f"{summary['ranks']} gloo rank(s), {gib:.2f} GiB per rank")
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel("seconds (median, slowest rank; log scale)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        f"Checkpoint pause vs total, {config.tensors} float32 tensors, CPU, {config.repeats} repeat(s)", fontsize=11
    )
    fig.text(
        0.5,
        0.005,
        "pause = training thread blocked; total = until the checkpoint is complete. Lightning's methods write the whole "
        "state (ranks x size) from rank 0; the others write each rank's shard. Dotted: our pause target.",
        ha="center",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
