"""CPU time a save costs the process, ours (default SaveConfig, async) vs a plain `torch.distributed.checkpoint.save`.

Run from the repository root:

    .venv/bin/python benchmarks/save_cpu.py                      # 512 MiB per rank, 1 and 2 ranks, 3 saves each
    .venv/bin/python benchmarks/save_cpu.py --busy 1             # the same with one core kept busy by another process
    .venv/bin/python benchmarks/save_cpu.py --profile            # + where our CPU goes, by function (1 rank)
    .venv/bin/python benchmarks/save_cpu.py --report a.json b.json c.json   # min / median / max of three runs
    .venv/bin/python benchmarks/save_cpu.py --sign blake3 --ranks 1          # + ours with signing on (issue 39)

Training loses what a background save spends whenever the cores are not idle, so wall time is the wrong
measure: a save that takes longer but burns less CPU hurts training less. Each rank holds one float32
tensor of --size-mib MiB of its own (the "parameter"), a small tensor and a step counter. Per save, on
every rank, from before the call to the commit (ours: `save()` then `result()`, so the background thread
is included; DCP: the synchronous call), we read:
  cpu_s       the process's user+sys CPU seconds (getrusage(RUSAGE_SELF): every thread, the kernel's work
              on the process's behalf such as page-cache copies and fsync, included)
  threads     the CPU seconds of each thread, by Python name (/proc/self/task/*/stat); threads that ended
              inside the window (the overlapped staging copy) are the remainder, "ended threads"
The slowest rank counts. Between saves the parameter changes (`add_`), as training changes it, and the
checkpoint directories are removed. Methods alternate order each round; --warmup rounds are untimed.

--profile (1 rank, after the timed rounds): our save in synchronous mode (the same persist/verify/commit
code the background thread runs, on the caller) under cProfile timed by `time.thread_time`, plus the
staging copy timed alone: CPU seconds by phase (write, checksums, finite flags, read-back verification,
commit, events), not wall time.

--busy N starts N processes that spin for the whole run: the contended case, where every CPU-second a
save spends is one training does not get. The target of issue 30: cpu_s per GiB of ours <= 1.2x DCP's.

--sign DIGEST adds a third method, ours with signing on (`SaveConfig(sign=SignConfig(key_path=..., digest=DIGEST))`:
each file's BLAKE3 or SHA-256 in the write pass, an Ed25519 signature at the commit), in the same rounds; the
target of issue 39: its CPU per GiB <= 1.3x ours unsigned.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import (
    busy_cores,
    checkpoint_workdir,
    environment,
    parse_rank_counts,
    process_cpu,
    run_world,
    thread_cpu,
    thread_deltas,
)

from lightning_shardckpt import CheckpointSaver, SaveConfig, SignConfig

METHODS = ("dcp", "ours")
SIGNED = "signed"
LABELS = {"dcp": "plain dcp.save (sync)", "ours": "ours (default SaveConfig, async)", SIGNED: "ours, signed"}
CPU_VS_DCP_TARGET = 1.2
SIGNED_VS_OURS_TARGET = 1.3
RANK_TIMEOUT_S = 1800
# CPU seconds of a phase of our save: ("own", builtin) sums that builtin's own time (the C work: a syscall,
# a hash, a torch op), ("cum", function) takes a Python function's cumulative time; the rest is what is left
PROFILE_PHASES = (
    ("page-cache copy of the written records (write calls)", "own", "<method 'write' of '_io.BufferedWriter'"),
    ("xxh3 hashing (chunk + block checksums, read-back)", "own", "<method 'update' of 'xxhash.xxh3_64'"),
    ("finite flags (tensor sums)", "own", "<method 'sum' of 'torch._C.TensorBase'"),
    ("reads of the read-back (preadv, or a whole-chunk read before)", "own", ("posix.preadv", "<method 'read' of")),
    ("fsync of the shard file and commit files", "own", "posix.fsync"),
    ("sampled read-back verification (reads and hashing)", "cum", ("verify_reads", "verify_chunks")),
    ("commit (manifest, .metadata, receipts)", "cum", ("__call__",)),
    ("events written", "cum", ("write_event",)),
)
WHOLE_SAVE = ("save",)


@dataclass(frozen=True)
class CpuConfig:
    size_mib: float
    repeats: int
    warmup: int
    threads: int
    profile: bool
    workdir: str
    sign: str | None = None  # the digest of the signed method; None: no signed method
    key_path: str | None = None

    @property
    def methods(self) -> tuple[str, ...]:
        return METHODS + ((SIGNED,) if self.sign else ())


def make_state(rank: int, size_mib: float) -> dict[str, Any]:
    """One large tensor of this rank's own (keyed by rank: every rank writes its own), small items beside it."""
    generator = torch.Generator().manual_seed(rank)
    big = torch.empty(int(size_mib * 2**20 / 4)).uniform_(generator=generator)
    return {"model": {f"rank{rank}.weight": big, f"rank{rank}.bias": torch.zeros(1024)}, "step": 0}


def rank_main(rank: int, world_size: int, config: CpuConfig) -> dict[str, Any]:
    torch.set_num_threads(config.threads)
    state = make_state(rank, config.size_mib)
    saver = CheckpointSaver(os.path.join(config.workdir, f"ours-{world_size}"), SaveConfig())
    group = saver.group  # DCP saves on the same dedicated gloo group
    signed = None
    if config.sign:
        sign = SignConfig(key_path=config.key_path, digest=config.sign)
        signed = CheckpointSaver(
            os.path.join(config.workdir, f"signed-{world_size}"), SaveConfig(sign=sign), group=group
        )
    rounds = []
    step = 0
    for round_index in range(config.warmup + config.repeats):
        order = config.methods if round_index % 2 == 0 else config.methods[::-1]
        measured = {}
        for method in order:
            step += 1
            state["model"][f"rank{rank}.weight"].add_(1e-3)  # training changed it
            state["step"] = step
            directory = os.path.join(config.workdir, f"dcp-{world_size}-{step}")
            dist.barrier()
            threads_before = thread_cpu()
            cpu_before, wall_before = process_cpu(), time.perf_counter()
            if method == "dcp":
                dcp.save(state, checkpoint_id=directory, process_group=group)
                path = directory
            else:
                result = (signed if method == SIGNED else saver).save(state, step=step).result()
                if not result.committed:
                    raise RuntimeError(f"our save of step {step} did not commit: {result.error}")
                path = result.path
            cpu_s, wall_s = process_cpu() - cpu_before, time.perf_counter() - wall_before
            threads = thread_deltas(threads_before, thread_cpu(), cpu_s)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            measured[method] = {"cpu_s": cpu_s, "wall_s": wall_s, "threads": threads}
        rounds.append({"round": round_index, "warmup": round_index < config.warmup, "methods": measured})
    result: dict[str, Any] = {"rounds": rounds, "bytes": state["model"][f"rank{rank}.weight"].nbytes + 4096}
    if config.profile and world_size == 1:
        result["profile"] = profile_ours(state, config, group)
    saver.close()
    if signed is not None:
        signed.close()
    return result


def profile_ours(state: dict[str, Any], config: CpuConfig, group: Any) -> dict[str, Any]:
    """CPU seconds by phase of one save (median of three): staging copy alone, then a synchronous save profiled."""
    from lightning_shardckpt.engine.save.staging import StagingBuffers

    slot = StagingBuffers()
    slot.stage(state)  # allocate and touch once, as a running saver's slot is
    staging = []
    for _ in range(3):
        started = time.thread_time()
        slot.stage(state)
        staging.append(time.thread_time() - started)
    staged = slot.stage(state)
    saver = CheckpointSaver(os.path.join(config.workdir, "profile"), SaveConfig(async_save=False), group=group)
    phases: dict[str, list[float]] = {name: [] for name, _, _ in PROFILE_PHASES}
    phases["whole save call"] = []
    listing = ""
    for index in range(3):
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        result = saver.save(staged, step=100 + index).result()
        profiler.disable()
        shutil.rmtree(result.path, ignore_errors=True)
        stats = pstats.Stats(profiler)
        for name, kind, match in PROFILE_PHASES:
            phases[name].append(_own(stats, match) if kind == "own" else _cumulative(stats, match))
        phases["whole save call"].append(_cumulative(stats, WHOLE_SAVE, "saver.py"))
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
        listing = text.getvalue()
    saver.close()
    out = {"staging copy (training thread or staging thread)": statistics.median(staging)}
    out.update({name: statistics.median(values) for name, values in phases.items()})
    return {"phases_cpu_s": out, "top_functions_by_own_cpu": listing}


def _own(stats: pstats.Stats, builtin: str | tuple[str, ...]) -> float:
    """Own CPU seconds of the builtins whose name starts with `builtin` (e.g. "<method 'write' of ...")."""
    return sum(
        own
        for (_, _, function), (_, _, own, _, _) in stats.stats.items()  # type: ignore[attr-defined]
        if function.startswith(builtin)
    )


def _cumulative(stats: pstats.Stats, functions: tuple[str, ...], in_file: str = "lightning_shardckpt") -> float:
    """Cumulative CPU seconds of our Python functions named in `functions` (the largest: recursion counts once)."""
    return max(
        (
            cumulative
            for (path, _, function), (_, _, _, cumulative, _) in stats.stats.items()  # type: ignore[attr-defined]
            if function in functions and in_file in path
        ),
        default=0.0,
    )


# --- the report ---


def summarize(world_size: int, per_rank: list[dict[str, Any]] | str) -> dict[str, Any]:
    if isinstance(per_rank, str):
        return {"ranks": world_size, "error": per_rank}
    gib = per_rank[0]["bytes"] / 2**30
    methods: dict[str, Any] = {}
    for method in per_rank[0]["rounds"][0]["methods"]:
        cpu, wall, threads = [], [], []
        for rounds in zip(*(r["rounds"] for r in per_rank)):
            if rounds[0]["warmup"]:
                continue
            slowest = max(rounds, key=lambda r: r["methods"][method]["cpu_s"])["methods"][method]
            cpu.append(slowest["cpu_s"])
            wall.append(max(r["methods"][method]["wall_s"] for r in rounds))
            threads.append(slowest["threads"])
        methods[method] = {
            "cpu_s": cpu,
            "wall_s": wall,
            "median_cpu_s_per_gib": statistics.median(cpu) / gib,
            "median_wall_s": statistics.median(wall),
            "threads_of_median_save": threads[sorted(range(len(cpu)), key=cpu.__getitem__)[len(cpu) // 2]],
        }
    ratio = methods["ours"]["median_cpu_s_per_gib"] / methods["dcp"]["median_cpu_s_per_gib"]
    summary = {"ranks": world_size, "gib_per_rank": gib, "methods": methods, "cpu_ratio_vs_dcp": ratio}
    if SIGNED in methods:
        summary["cpu_ratio_signed_vs_ours"] = (
            methods[SIGNED]["median_cpu_s_per_gib"] / methods["ours"]["median_cpu_s_per_gib"]
        )
    if "profile" in per_rank[0]:
        summary["profile"] = per_rank[0]["profile"]
    return summary


def format_table(summaries: list[dict[str, Any]], busy: int) -> str:
    lines = [f"busy processes beside the ranks: {busy}"]
    header = f"{'ranks':>5}  {'method':<34}  {'CPU s/GiB':>9}  {'wall s':>7}  CPU seconds by thread (median save)"
    lines += [header, "-" * len(header)]
    for summary in summaries:
        if "error" in summary:
            lines.append(f"{summary['ranks']:>5}  failed: {summary['error']}")
            continue
        for method in summary["methods"]:
            entry = summary["methods"][method]
            threads = ", ".join(f"{name} {seconds:.2f}" for name, seconds in entry["threads_of_median_save"].items())
            lines.append(
                f"{summary['ranks']:>5}  {LABELS[method]:<34}  {entry['median_cpu_s_per_gib']:>9.3f}"
                f"  {entry['median_wall_s']:>7.2f}  {threads}"
            )
        ratio = summary["cpu_ratio_vs_dcp"]
        verdict = "met" if ratio <= CPU_VS_DCP_TARGET else "MISSED"
        lines.append(f"       target: ours CPU per GiB <= {CPU_VS_DCP_TARGET}x DCP's: {verdict} ({ratio:.2f}x)")
        if "cpu_ratio_signed_vs_ours" in summary:
            signed = summary["cpu_ratio_signed_vs_ours"]
            verdict = "met" if signed <= SIGNED_VS_OURS_TARGET else "MISSED"
            lines.append(
                f"       target: signed CPU per GiB <= {SIGNED_VS_OURS_TARGET}x ours unsigned: {verdict} ({signed:.2f}x)"
            )
        if "profile" in summary:
            lines.append(
                "       ours, CPU s by phase (one save, median of 3; read-back and commit include their reads, hashes, fsyncs):"
            )
            lines += [f"         {name:<58} {s:.3f}" for name, s in summary["profile"]["phases_cpu_s"].items()]
    return "\n".join(lines)


def rereport(paths: list[str]) -> str:
    """Several saved runs: a markdown table, each cell min / median / max over the runs."""
    runs = []
    for path in paths:
        with open(path) as handle:
            runs.append(json.load(handle))
    lines = [
        "| busy | ranks | method | CPU s per GiB | wall s | ours / DCP CPU | signed / ours CPU |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(values: list[float], digits: int) -> str:
        values = sorted(values)
        return " / ".join(f"{v:.{digits}f}" for v in (values[0], statistics.median(values), values[-1]))

    keys = sorted({(run["busy"], s["ranks"]) for run in runs for s in run["results"] if "error" not in s})
    for busy, ranks in keys:
        summaries = [s for run in runs if run["busy"] == busy for s in run["results"] if s["ranks"] == ranks]
        summaries = [s for s in summaries if "error" not in s]
        for method in [m for m in LABELS if all(m in s["methods"] for s in summaries)]:
            ratio = cell([s["cpu_ratio_vs_dcp"] for s in summaries], 2) + "x" if method == "ours" else ""
            signed = cell([s["cpu_ratio_signed_vs_ours"] for s in summaries], 2) + "x" if method == SIGNED else ""
            lines.append(
                f"| {busy} | {ranks} | {LABELS[method]} | "
                f"{cell([s['methods'][method]['median_cpu_s_per_gib'] for s in summaries], 3)} | "
                f"{cell([s['methods'][method]['median_wall_s'] for s in summaries], 2)} | {ratio} | {signed} |"
            )
    return "\n".join(lines)


def write_signing_key(workdir: str) -> str:
    """A fresh Ed25519 key for the signed method (its PEM file, which rank 0 reads at each commit)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    path = os.path.join(workdir, "signing.pem")
    pem = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
        handle.write(pem)
    return path


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) >= 3 and sys.argv[1] == "--report":
        print(rereport(sys.argv[2:]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=512.0, help="the large tensor each rank saves, MiB")
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    parser.add_argument("--repeats", type=int, default=3, help="timed saves per method; the median is reported")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on a core for the whole run")
    parser.add_argument("--profile", action="store_true", help="CPU by phase of ours (with 1 rank)")
    parser.add_argument(
        "--sign", choices=("blake3", "sha256"), default=None, help="also time ours with signing on, this file digest"
    )
    parser.add_argument("--workdir", default=None, help="where checkpoints are written (default: a fresh temp dir)")
    parser.add_argument("--out", default="benchmarks/results/save_cpu.json", help="the JSON report")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"environment": environment(), "busy": args.busy, "results": []}
    with busy_cores(args.busy), checkpoint_workdir(args.workdir, prefix="shardckpt-savecpu-") as workdir:
        key_path = write_signing_key(workdir) if args.sign else None
        config = CpuConfig(
            args.size_mib, args.repeats, args.warmup, args.threads, args.profile, workdir, args.sign, key_path
        )
        report["config"] = asdict(config)
        for world_size in parse_rank_counts(args.ranks):
            print(f"running {world_size} rank(s), {args.size_mib:.0f} MiB each ...", flush=True)
            report["results"].append(summarize(world_size, run_world(world_size, rank_main, config, RANK_TIMEOUT_S)))
    report["load_average_at_end"] = os.getloadavg()
    table = format_table(report["results"], args.busy)
    report["table"] = table.splitlines()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=2)
    print(table)
    for summary in report["results"]:
        if "profile" in summary:
            print(summary["profile"]["top_functions_by_own_cpu"])
    print(
        f"load average at start {report['environment']['load_average_at_start']}, at end {report['load_average_at_end']}"
    )
    print(f"wrote {args.out}")
    return 1 if any("error" in s for s in report["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
