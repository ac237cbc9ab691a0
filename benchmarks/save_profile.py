"""Where a save's CPU goes, per save and per thread: ours (default SaveConfig, overlapped staging) vs the floor.

Run from the repository root:

    .venv/bin/python benchmarks/save_profile.py                          # CPU s per save by thread, ours and the floor
    .venv/bin/py-spy record --threads --rate 250 --format raw -o /tmp/save_profile.txt -- \\
        .venv/bin/python benchmarks/save_profile.py --methods ours --saves 12
    .venv/bin/python benchmarks/save_profile.py --fold /tmp/save_profile.txt --saves 12   # CPU by thread and phase

One process (no process group: a 1-rank run's collectives are no-ops), the state of pause_inloop.py's issue case:
an MLP of --params-mib MiB of float32 parameters and AdamW's two moments (3x that saved). Per save the state
changes in place (as an optimizer step changes it), then the method saves it and the caller waits until the
save is complete (ours: `fence()` then `result()`, so every thread's share of one save counts):
  floor   pause_inloop.py's floor: one long-lived thread copies the state into reused buffers and `write()`s
          one file (then an fsync), nothing else
  ours    CheckpointSaver with the default SaveConfig, overlapped staging (every tensor deferred), as
          pause_inloop.py's ours_overlap (shard files written with O_DIRECT where the disk takes it)
  ours_buffered  the same with `direct_io=False`: shard files written through the page cache, as before
          issue 36's direct writes (`--methods floor,ours,ours_buffered` compares them in one run)

Printed per method: the process's CPU seconds per save (user + sys, the kernel's page-cache copy and fsync
included) and each thread's. Under py-spy (`--threads`, without `--native`: with it, py-spy 0.4 here also
sampled threads waiting on a lock), `--fold` turns the raw profile into CPU seconds per save by thread and phase
(sample count / rate / saves, warm-up saves included): the staging copy, checksums, the finite flags, write()
into the page cache, fsync, read-back, the part and commit, events, DCP's planning, Python bookkeeping.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import statistics
import sys
import tempfile
from collections import defaultdict
from typing import Any

import pause_inloop
import torch
from common import process_cpu, thread_cpu, thread_deltas
from pause_inloop import Floor
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine.format import checksum as checksum_format

METHODS = ("floor", "ours", "ours_buffered")


def _line(module: Any, text: str) -> str:
    """`file.py:N)` as py-spy names the line of `module` holding `text` (a phase inside one Python function)."""
    path = inspect.getsourcefile(module)
    with open(path) as handle:
        number = next(n for n, line in enumerate(handle, 1) if text in line)
    return f"{os.path.basename(path)}:{number})"


# (phase, substrings of a stack's frames): the first phase with a frame containing one of them wins, so the
# specific ones (a hash inside a write, a sum inside the finite check) come before the general ones. Without
# --native, a C call shows as the Python line that made it: lines tell the hash from the write in one loop
PHASES = (
    ("finite flags (is_finite)", ("is_finite",)),
    ("read-back verification", ("verify_reads", "_read_back_checksum")),
    ("xxh3 checksums", ("ChunkHasher.update", _line(checksum_format, "self._hasher.update(piece)"))),
    ("fsync", ("fsync", "sync_local_file", _line(pause_inloop, "os.fsync("))),
    (
        "staging copy",
        ("DeferredCopy._copy", "StagingBuffers._stage", _line(pause_inloop, "target.copy_(source)")),
    ),
    ("write() into the page cache", (_line(checksum_format, "self._raw.write(piece)"), "Floor._run")),
    ("part, summaries and commit", ("_summarize", "PartsCommitter", "parts_commit", "commit_index", "manifest")),
    ("events and records", ("write_event", "_finish", "metrics.py")),
    ("planning (DCP planner, layout)", ("create_local_plan", "set_up_planner", "save_layout", "describe")),
    ("tensor records (torch serialization)", ("save_record", "serialization.py")),
)

SAVE_THREADS = ("shardckpt-", "floor-writer")  # every sample of these threads is a save's
SAVE_FRAME = "run.<locals>.save"  # the caller's samples inside a save (the rest is start-up and teardown)
OTHER = "other (Python bookkeeping, thread start, waits)"


def build_state(params_mib: float, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = int((params_mib * 2**20 / 4 / layers) ** 0.5)
    torch.manual_seed(0)
    module = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    module(torch.randn(4, width)).pow(2).mean().backward()
    optimizer.step()  # AdamW's moments exist: the state has its final layout
    return module, optimizer


def tensors_of(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach() for p in module.parameters()]
    for state in optimizer.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return tensors


def run(method: str, saves: int, warmup: int, params_mib: float, layers: int, workdir: str) -> dict[str, Any]:
    module, optimizer = build_state(params_mib, layers)
    tensors = tensors_of(module, optimizer)
    directory = os.path.join(workdir, method)
    os.makedirs(directory)
    if method == "floor":
        floor = Floor(tensors)

        def save(index: int) -> None:
            floor.save(tensors, os.path.join(directory, f"floor-{index}.bin"))
            floor.fence()
            floor.wait()

        close = floor.close
    else:
        saver = CheckpointSaver(directory, SaveConfig(overlap_staging=True, direct_io=method == "ours"))
        saver.guard(optimizer)

        def save(index: int) -> None:
            state = {"model": get_model_state_dict(module), "optim": get_optimizer_state_dict(module, optimizer)}
            pending = saver.save(state, step=index, defer=lambda fqn: True)
            saver.fence()
            result = pending.result()
            if not result.committed:
                raise RuntimeError(f"ours: the save of step {index} did not commit: {result.error}")

        close = saver.close
    cpu, threads = [], []
    try:
        for index in range(1, warmup + saves + 1):
            with torch.no_grad():
                for tensor in tensors:
                    tensor.add_(1e-3)  # the state changes between saves, as training changes it
            before_threads, before = thread_cpu(), process_cpu()
            save(index)
            spent = process_cpu() - before
            if index > warmup:
                cpu.append(spent)
                threads.append(thread_deltas(before_threads, thread_cpu(), spent))
            for name in os.listdir(directory):  # keep the disk's share per save alike: nothing accumulates
                path = os.path.join(directory, name)
                if name.startswith(("floor-", "step-")):
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    finally:
        close()
    names = sorted({name for entry in threads for name in entry})
    return {
        "method": method,
        "state_mib": sum(t.nbytes for t in tensors) / 2**20,
        "cpu_s": statistics.median(cpu),
        "cpu_s_range": (min(cpu), max(cpu)),
        "threads": {name: statistics.median(entry.get(name, 0.0) for entry in threads) for name in names},
    }


def fold(path: str, saves: int, rate: int) -> str:
    """A py-spy raw profile (`--threads --format raw`) as CPU seconds per save, by thread and phase."""
    by_thread: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    with open(path) as handle:
        for line in handle:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            # "thread (tid): name" or "thread (tid)" then the thread's name as the first frame
            thread = frames[0].split(": ", 1)[1] if ": " in frames[0] else frames[0]
            if not thread.startswith(SAVE_THREADS) and not any(SAVE_FRAME in frame for frame in frames):
                continue  # the caller outside a save: imports, building the state, exit
            phase = next((name for name, keys in PHASES if any(k in f for f in frames for k in keys)), OTHER)
            by_thread[_thread_family(thread)][phase] += int(count)
    lines = [f"CPU seconds per save by thread and phase ({path}, {saves} saves, {rate} samples/s):"]
    total = 0.0
    for thread, phases in sorted(by_thread.items(), key=lambda item: -sum(item[1].values())):
        seconds = sum(phases.values()) / rate / saves
        total += seconds
        lines.append(f"  {thread}: {seconds:.3f}")
        for phase, count in sorted(phases.items(), key=lambda item: -item[1]):
            lines.append(f"      {phase:<48} {count / rate / saves:.3f}")
    lines.append(f"  all threads: {total:.3f}")
    return "\n".join(lines)


def _thread_family(name: str) -> str:
    """Threads of one role under one name (py-spy shows each thread's own id)."""
    return name.split(" (")[0].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-mib", type=float, default=170.0, help="float32 parameters, MiB (saved: 3x)")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers of the MLP")
    parser.add_argument("--saves", type=int, default=8, help="timed saves per method")
    parser.add_argument("--warmup", type=int, default=2, help="untimed saves first (staging allocation, page cache)")
    parser.add_argument("--methods", default="floor,ours", help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--workdir", default=None, help="where the saves go (default: a fresh temp dir)")
    parser.add_argument("--fold", default=None, help="a py-spy raw profile of this script: print it by phase")
    parser.add_argument("--rate", type=int, default=250, help="--fold: the profile's samples per second")
    args = parser.parse_args(argv)
    if args.fold:
        print(fold(args.fold, args.saves + args.warmup, args.rate))
        return 0
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or set(methods) - set(METHODS):
        parser.error(f"--methods: choose from {','.join(METHODS)}")
    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="save_profile-", dir=args.workdir)
    try:
        results = [run(m, args.saves, args.warmup, args.params_mib, args.layers, workdir) for m in methods]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    floor_cpu = next((r["cpu_s"] for r in results if r["method"] == "floor"), None)
    for result in results:
        low, high = result["cpu_s_range"]
        ratio = f", {result['cpu_s'] / floor_cpu:.2f}x the floor's" if floor_cpu else ""
        print(
            f"{result['method']}: {result['state_mib']:.0f} MiB, CPU {result['cpu_s']:.3f} s per save "
            f"(median of {args.saves}; {low:.3f}-{high:.3f}){ratio}"
        )
        for name, seconds in sorted(result["threads"].items(), key=lambda item: -item[1]):
            print(f"    {name:<40} {seconds:.3f}")
    print(f"load average at end {os.getloadavg()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
