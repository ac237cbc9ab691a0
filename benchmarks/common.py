"""What benchmarks/pause.py and benchmarks/save_load.py share: the sharded state, the spawned gloo ranks, the report helpers.

Not a script of its own: the benchmarks run as scripts from the repository root
(`.venv/bin/python benchmarks/pause.py`), so their folder is sys.path[0] and `import common` finds this file,
in the parent and in every spawned rank (spawn hands the parent's sys.path to its children).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import resource
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Shard

COLUMNS = 1024  # float32 elements per row: a 4 KiB row
ERROR_CHARS = 500  # errors are cut to this length in the table and the JSON
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # the unit of /proc/<pid>/task/<tid>/stat's CPU times
RESULT_WAIT_S = 60  # how long the parent waits for rank 0's gathered results once the ranks have exited


# --- the state ---


def tensor_rows(tensors: int, world_size: int, size_gib: float, *, per_rank: bool) -> list[int]:
    """Global rows of each [rows, COLUMNS] float32 tensor: sizes 1x..8x, rows a multiple of N (even shards).

    `size_gib` is what every rank holds when `per_rank`, else the whole state's size over all N ranks.
    """
    weights = [1 + (5 * i) % 8 for i in range(tensors)]
    rows = size_gib * 2**30 / (COLUMNS * 4)
    if per_rank:
        return [max(1, round(rows * w / sum(weights))) * world_size for w in weights]
    return [max(1, round(rows * w / sum(weights) / world_size)) * world_size for w in weights]


def make_state(rows: list[int], mesh: Any, rank: int, world_size: int, *, zeros: bool = False) -> dict[str, DTensor]:
    """This rank's 1/N of every [rows, COLUMNS] tensor as a Shard(0) DTensor: random values (seeded by rank), or zeros.

    Every byte is written here, so no timed method pays for first-touching the memory.
    """
    generator = torch.Generator().manual_seed(rank)
    state = {}
    for index, global_rows in enumerate(rows):
        shape = (global_rows // world_size, COLUMNS)
        local = torch.zeros(shape) if zeros else torch.empty(shape).uniform_(generator=generator)
        state[f"layer{index:02d}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], shape=torch.Size((global_rows, COLUMNS)), stride=(COLUMNS, 1)
        )
    return state


# --- CPU time ---


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every live thread of this process, keyed 'name (tid)'."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as handle:
                comm = handle.read().strip()
        except OSError:  # ended while listed
            continue
        name = names.get(int(tid), f"native {comm}")
        out[f"{name} ({tid})"] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return out


def thread_deltas(before: dict[str, float], after: dict[str, float], total: float) -> dict[str, float]:
    """Per thread name (tids merged), CPU seconds spent between the snapshots; the rest as 'ended threads'."""
    deltas: dict[str, float] = {}
    for key, seconds in after.items():
        name = key.rsplit(" (", 1)[0]
        deltas[name] = deltas.get(name, 0.0) + seconds - before.get(key, 0.0)
    deltas["ended threads"] = max(0.0, total - sum(deltas.values()))
    return {name: round(seconds, 3) for name, seconds in deltas.items() if seconds >= 0.005}


# --- the ranks ---


def run_world(
    world_size: int, rank_body: Callable[[int, int, Any], Any], config: Any, timeout_s: float
) -> list[Any] | str:
    """Spawn `world_size` gloo CPU ranks, each running `rank_body(rank, world_size, config)`; every rank's result.

    The results come back gathered on rank 0, in rank order. If a rank crashes, the reason (a string)
    comes back instead, so that the caller can show every method of this rank count as failed.
    `rank_body` must be a module-level function (spawn pickles it by name); `timeout_s` bounds every
    collective of the process group.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    try:
        mp.start_processes(
            _rank_main,
            args=(world_size, port, rank_body, config, timeout_s, queue),
            nprocs=world_size,
            start_method="spawn",
        )
        return queue.get(timeout=RESULT_WAIT_S)
    except Exception as err:
        return error_text(err)


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    rank_body: Callable[[int, int, Any], Any],
    config: Any,
    timeout_s: float,
    queue: Any,
) -> None:
    """One spawned rank: join the gloo group, run `rank_body`, gather every rank's result onto rank 0's queue."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = rank_body(rank, world_size, config)
        # collective "gather-samples": rank 0 reports every rank's samples
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, result)
        if rank == 0:
            queue.put(gathered)
    finally:
        dist.destroy_process_group()


# --- the report ---


def error_text(err: BaseException) -> str:
    """An exception as "Type: message", cut to ERROR_CHARS."""
    return f"{type(err).__name__}: {err}"[:ERROR_CHARS]


def ratio_or_none(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing (or the denominator is 0)."""
    return numerator / denominator if numerator is not None and denominator else None


def phase_medians(phases: list[list[dict[str, float]]], names: tuple[str, ...]) -> dict[str, float]:
    """Per phase in `names`: the slowest rank's time in each save (phases[save][rank][name]), median over saves."""
    if not phases:
        return {}
    return {name: statistics.median(max(rank[name] for rank in save) for save in phases) for name in names}


def environment() -> dict[str, Any]:
    """The machine and software the numbers come from, and when the run started."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def add_shared_arguments(
    parser: argparse.ArgumentParser, *, size_help: str, repeats_help: str, warmup_help: str
) -> None:
    """The options both benchmarks start with, with the same defaults: --size-gib, --ranks, --repeats, --warmup.

    The help texts are the caller's: what --size-gib measures (per rank or in all) and what a round is differ.
    """
    parser.add_argument("--size-gib", type=float, default=1.0, help=size_help)
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts, e.g. 1,2")
    parser.add_argument("--repeats", type=int, default=3, help=repeats_help)
    parser.add_argument("--warmup", type=int, default=1, help=warmup_help)


def parse_rank_counts(text: str) -> list[int]:
    """--ranks "1,2" as [1, 2]."""
    return [int(part) for part in text.split(",") if part.strip()]


def _spin() -> None:
    while True:
        pass


@contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """`count` processes spinning on a core each while the block runs: the contended case, where every
    CPU-second a background save spends is one the training loop does not get."""
    spinners = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(count)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()


@contextmanager
def checkpoint_workdir(requested: str | None, *, prefix: str) -> Iterator[str]:
    """Where the checkpoints go: --workdir (made absolute; created, kept), or a fresh temp dir deleted on exit."""
    own_workdir = requested is None
    workdir = tempfile.mkdtemp(prefix=prefix) if own_workdir else os.path.abspath(requested)
    os.makedirs(workdir, exist_ok=True)
    try:
        yield workdir
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
