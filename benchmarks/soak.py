"""Soak: many consecutive async checkpoints with injected failures, then check that nothing drifted.

Run from the repository root:

    .venv/bin/python benchmarks/soak.py                          # 200 checkpoints, 10% failing, keep_last=3
    .venv/bin/python benchmarks/soak.py --checkpoints 1000 --failure-rate 0.2 --json

One process trains a small MLP (two --width x --width linear layers, AdamW) and after every optimizer
step saves model + optimizer state with CheckpointSaver (async, when_busy=wait, on_error=log). A seeded
fault hook (tests/helpers/faults.py: RandomFailures) fails exactly round(--failure-rate x N) of the saves,
each at a random point before the commit. After each save the training thread drains finished records
and, for every committed one, applies retention (keep_last), as ShardedCheckpoint does.

At the end it checks, and the report says for each check OK or FAILED (exit 1 if any failed):
  counters   attempted = N, committed + failed = N, nothing skipped, failed = faults injected
  retention  the committed checkpoints on storage are exactly the last --keep-last committed steps
  verify     every committed checkpoint passes verify_checkpoint (every byte checksummed); the latest
             loads and holds its step
  gc         gc with the default grace removes nothing younger than it; gc with grace 0 then leaves no
             uncommitted directory at all, and the committed ones untouched
  memory     RSS and peak RSS (VmHWM, reset at the start) at checkpoint 10 and at N: growth stays under
             max(32 MiB, 2 states), far below what keeping one state per checkpoint would add
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: tests.helpers is importable from the repository root
    sys.path.insert(0, str(REPO))

from lightning_shardckpt import CheckpointSaver, SaveConfig, VerifyConfig, load_checkpoint, verify_checkpoint  # noqa: E402
from lightning_shardckpt.engine import catalog  # noqa: E402
from lightning_shardckpt.engine.storage.fsio import resolve  # noqa: E402
from lightning_shardckpt.ops import gc  # noqa: E402
from lightning_shardckpt.policies import retention  # noqa: E402
from tests.helpers.faults import RandomFailures  # noqa: E402

MIB = 2**20
MEMORY_MARK = 10  # the checkpoint at which the baseline memory is taken


@dataclass
class SoakConfig:
    checkpoints: int = 200
    failure_rate: float = 0.1
    keep_last: int = 3
    seed: int = 0
    width: int = 512  # model: Linear(width, width) -> ReLU -> Linear(width, width); AdamW doubles the bytes
    batch: int = 16
    grace_s: float = gc.DEFAULT_GRACE_S

    def __post_init__(self) -> None:
        if self.checkpoints <= MEMORY_MARK:
            raise ValueError(
                f"checkpoints={self.checkpoints}: use more than {MEMORY_MARK} (memory is compared from checkpoint {MEMORY_MARK} on)"
            )
        if self.keep_last < 1:
            raise ValueError(f"keep_last={self.keep_last} must be >= 1")


def memory() -> dict[str, int]:
    """This process's resident set now (VmRSS) and its high-water mark (VmHWM), in bytes."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values["rss" if key == "VmRSS" else "peak"] = int(rest.split()[0]) * 1024
    return values


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so an earlier peak cannot hide growth here."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def run_soak(config: SoakConfig, root: str) -> dict[str, Any]:
    """Run the soak into `root` (a fresh directory) and return the report; `report["ok"]` sums it up."""
    torch.manual_seed(config.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(config.width, config.width), torch.nn.ReLU(), torch.nn.Linear(config.width, config.width)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hook = RandomFailures(config.failure_rate, seed=config.seed, saves=config.checkpoints)
    # failed attempts stay (keep_failed_attempts): the soak checks `shardckpt gc`, the backstop for crashed runs, on them
    save_config = SaveConfig(
        run_id=f"soak-{config.seed}", verify=VerifyConfig(seed=config.seed), keep_failed_attempts=True
    )
    saver = CheckpointSaver(root, save_config, fault_hook=hook)
    location = resolve(root)
    outcomes: dict[int, str] = {}
    records = []
    deleted: list[str] = []
    peak_reset = reset_peak()
    at_mark: dict[str, int] = {}
    one_state = 0

    def drain() -> None:
        for record in saver.poll_records():  # on the training thread, as ShardedCheckpoint._drain
            records.append(record)
            outcomes[record.step] = record.outcome
            if record.outcome == "committed":
                deleted.extend(retention.apply(location, config.keep_last, None))

    started = time.perf_counter()
    for step in range(1, config.checkpoints + 1):
        loss = model(torch.randn(config.batch, config.width)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "progress": {"step": step}}
        one_state = one_state or state_bytes(state)
        saver.save(state, step=step)
        drain()
        if step == MEMORY_MARK:
            saver.wait()
            drain()
            at_mark = memory()
    saver.close()
    drain()
    at_end = memory()
    seconds = time.perf_counter() - started

    checks: dict[str, dict[str, Any]] = {}
    counters = saver.counters.snapshot()
    expected_failures = round(config.failure_rate * config.checkpoints)
    checks["counters"] = {
        "ok": counters["attempted"] == config.checkpoints
        and counters["committed"] + counters["failed"] == config.checkpoints
        and counters["skipped"] == 0
        and counters["failed"] == len(hook.injected) == expected_failures,
        **counters,
        "injected": len(hook.injected),
        "expected_failures": expected_failures,
    }

    committed_steps = sorted(step for step, outcome in outcomes.items() if outcome == "committed")
    expected = committed_steps[-config.keep_last :]
    entries = catalog.list_checkpoints(location)
    on_storage = [entry.step for entry in entries if entry.committed]
    checks["retention"] = {
        "ok": on_storage == expected and len(outcomes) == config.checkpoints,
        "expected": expected,
        "on_storage": on_storage,
        "deleted": len(deleted),
    }

    reports = [verify_checkpoint(location, entry) for entry in entries if entry.committed]
    latest_step = _load_latest_step(root, model, optimizer) if expected else None
    checks["verify"] = {
        "ok": bool(reports) and all(report.ok for report in reports) and latest_step == expected[-1],
        "verified": sum(report.ok for report in reports),
        "committed": len(reports),
        "problems": [problem for report in reports for problem in report.problems][:10],
        "latest_loaded_step": latest_step,
    }

    graced = gc.collect(location, config.grace_s, dry_run=False)
    old_left = [
        item.name
        for item in graced.items
        if item.state == catalog.UNCOMMITTED
        and item.action == "keep"
        and (item.age_s is None or item.age_s >= config.grace_s)
    ]
    swept = gc.collect(location, 0.0, dry_run=False)
    after = catalog.list_checkpoints(location)
    uncommitted_left = [entry.name for entry in after if not entry.committed]
    committed_after = [entry.step for entry in after if entry.committed]
    checks["gc"] = {
        "ok": not old_left
        and not uncommitted_left
        and committed_after == expected
        and len([i for i in swept.items if i.removed]) == sum(1 for e in entries if not e.committed),
        "grace_s": config.grace_s,
        "removed_with_grace": len([item for item in graced.items if item.removed]),
        "kept_younger_than_grace": len([item for item in graced.items if item.reason == gc.KEEP_YOUNG]),
        "removed_with_grace_0": len([item for item in swept.items if item.removed]),
        "uncommitted_left": uncommitted_left,
        "older_than_grace_left": old_left,
    }

    growth_rss = at_end["rss"] - at_mark["rss"]
    growth_peak = at_end["peak"] - at_mark["peak"]
    bound = max(
        32 * MIB, 2 * one_state
    )  # room for the allocator keeping a freed state or two, not for one per checkpoint
    leak = one_state * (config.checkpoints - MEMORY_MARK)
    checks["memory"] = {
        "ok": growth_rss < bound and growth_peak < bound,
        "rss_at_10": at_mark["rss"],
        "rss_at_n": at_end["rss"],
        "peak_at_10": at_mark["peak"],
        "peak_at_n": at_end["peak"],
        "rss_growth": growth_rss,
        "peak_growth": growth_peak,
        "bound": bound,
        "state_bytes": one_state,
        "leak_of_one_state_per_checkpoint": leak,
        "peak_was_reset": peak_reset,
    }

    committed_records = [record for record in records if record.outcome == "committed"]
    points: dict[str, int] = {}
    for _, point in hook.injected:
        points[point] = points.get(point, 0) + 1
    return {
        "ok": all(check["ok"] for check in checks.values()),
        "config": asdict(config),
        "root": root,
        "seconds": round(seconds, 3),
        "pause_s_median": statistics.median(r.pause_s for r in records) if records else None,
        "total_s_median": statistics.median(r.total_s for r in committed_records) if committed_records else None,
        "failure_points": points,
        "checks": checks,
    }


def _load_latest_step(root: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    target = {
        "model": {k: torch.zeros_like(v) for k, v in model_sd.items()},
        "optim": optim_sd,
        "progress": {"step": -1},
    }
    load_checkpoint(target, root)
    return int(target["progress"]["step"])


def render(report: dict[str, Any]) -> str:
    config, checks = report["config"], report["checks"]
    mem = checks["memory"]
    mib = lambda value: f"{value / MIB:.1f}"  # noqa: E731
    flag = lambda name: "OK" if checks[name]["ok"] else "FAILED"  # noqa: E731
    c, r, v, g = checks["counters"], checks["retention"], checks["verify"], checks["gc"]
    lines = [
        f"soak: {config['checkpoints']} async checkpoints of a {mib(mem['state_bytes'])} MiB state, keep_last={config['keep_last']}, "
        f"{config['failure_rate']:.0%} failing (seed {config['seed']}) in {report['seconds']:.1f}s",
        f"  root       {report['root']}",
        f"  counters   attempted {c['attempted']}, committed {c['committed']}, failed {c['failed']} "
        f"(injected {c['injected']}: {report['failure_points']}), skipped {c['skipped']}  {flag('counters')}",
        f"  retention  committed on storage {r['on_storage']}, the last {config['keep_last']} committed: {r['expected']} "
        f"({r['deleted']} deleted)  {flag('retention')}",
        f"  verify     {v['verified']}/{v['committed']} committed checkpoints verify; "
        f"latest loads step {v['latest_loaded_step']}  {flag('verify')}",
        f"  gc         grace {g['grace_s'] / 60:g} min: removed {g['removed_with_grace']}, kept {g['kept_younger_than_grace']} younger; "
        f"grace 0: removed {g['removed_with_grace_0']}; uncommitted left {len(g['uncommitted_left'])}  {flag('gc')}",
        f"  memory     RSS {mib(mem['rss_at_10'])} -> {mib(mem['rss_at_n'])} MiB ({mem['rss_growth'] / MIB:+.1f}), "
        f"peak {mib(mem['peak_at_10'])} -> {mib(mem['peak_at_n'])} MiB ({mem['peak_growth'] / MIB:+.1f}) from checkpoint "
        f"{MEMORY_MARK} to {config['checkpoints']}; bound {mib(mem['bound'])} MiB, a leak of one state per checkpoint "
        f"would add {mib(mem['leak_of_one_state_per_checkpoint'])} MiB  {flag('memory')}",
        f"  time       median pause {report['pause_s_median'] * 1e3:.1f} ms, "
        f"median save (committed) {report['total_s_median'] * 1e3:.1f} ms",
        "PASSED" if report["ok"] else "FAILED",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoints", type=int, default=200, help="consecutive async checkpoints (default: %(default)s)"
    )
    parser.add_argument(
        "--failure-rate", type=float, default=0.1, help="share of saves failed on purpose (default: %(default)s)"
    )
    parser.add_argument(
        "--keep-last", type=int, default=3, help="retention: committed checkpoints kept (default: %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="which saves fail, where, and the training data (default: %(default)s)"
    )
    parser.add_argument(
        "--width",
        type=int,
        default=512,
        help="model width; the state is about 12 x width^2 bytes (default: %(default)s)",
    )
    parser.add_argument(
        "--workdir", help="where the checkpoint root goes (default: a temporary directory, deleted after)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    parser.add_argument(
        "--verbose", action="store_true", help="show the package's log, including every injected failure"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = SoakConfig(
        checkpoints=args.checkpoints,
        failure_rate=args.failure_rate,
        keep_last=args.keep_last,
        seed=args.seed,
        width=args.width,
    )
    if not args.verbose:  # the injected failures are expected; the report counts them
        logging.getLogger("lightning_shardckpt").setLevel(logging.CRITICAL)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(
        1
    )  # the saver's thread needs a core too: an oversubscribed CPU measures contention, not leaks
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        report = run_soak(config, tempfile.mkdtemp(prefix="soak-", dir=args.workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="shardckpt-soak-") as workdir:
            report = run_soak(config, os.path.join(workdir, "root"))
        report["root"] += " (temporary, deleted)"
    print(json.dumps(report, indent=1, sort_keys=True, default=str) if args.json else render(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
