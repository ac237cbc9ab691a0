"""Run a function on N real gloo ranks (separate processes) and report every rank's failure.

Ranks are forked from a forkserver that has already imported torch and the package, so a spawn costs
well under a second instead of re-importing torch in every rank. The function must be importable
(module level); its return value must be picklable.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import runpy
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

_PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "lightning.pytorch",
    "lightning_shardckpt",
    "s3fs",
    "tests.helpers.forkserver_gc_freeze",  # last: freezes what the imports above created
]  # s3fs: absent is fine (ImportError is ignored)
_context = None


def _ctx():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


@dataclass
class RankOutcome:
    rank: int
    ok: bool
    value: Any = None
    error: str | None = None  # formatted traceback
    exitcode: int | None = None


class DistributedFailure(AssertionError):
    pass


_PORTS_PER_WORKER = 1500
_FIRST_PORT = 20000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = (int(field) for field in handle.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as sock:  # no SO_REUSEADDR: a port still in TIME_WAIT counts as taken
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port for a test's rendezvous that nothing else takes between this call and rank 0's bind.

    A port the kernel picks (bind to 0) comes from its ephemeral range, where every outgoing connection of
    every test (an S3 client, another group's TCPStore client) also gets its local port: one of them took
    such a port before rank 0 listened on it (CI: EADDRINUSE, and the other ranks timed out). So ports come
    from below that range, where only an explicit bind lands, in a slice of their own per xdist worker, each
    handed out once per process and checked free."""
    low, _ = _ephemeral_range()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    slices = max(1, (low - _FIRST_PORT) // _PORTS_PER_WORKER)
    if low - _FIRST_PORT < _PORTS_PER_WORKER:  # an unusual range: no room below it, so the kernel picks
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    first = _FIRST_PORT + (int(worker) if worker.isdigit() else 0) % slices * _PORTS_PER_WORKER
    # a random start: two suites on one host (a clean-clone run beside a worktree's) rarely pick alike
    start = int.from_bytes(os.urandom(2), "little") % _PORTS_PER_WORKER
    for offset in range(_PORTS_PER_WORKER):
        port = first + (start + offset) % _PORTS_PER_WORKER
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise OSError(f"no free port in {first}..{first + _PORTS_PER_WORKER - 1} (ports below the ephemeral range {low})")


def launched_rank_env(
    rank: int, world: int, port: int, *, node: int = 0, local_world: int | None = None, **extra: str
) -> dict[str, str]:
    """The environment torchrun (or SLURM through Lightning) gives global rank `rank` of `world`, on node `node` of
    `local_world` ranks each (default: one node of all `world`): a test that starts each rank process itself sees
    each one's exit status and output (Lightning launches nothing). `extra` is laid over the defaults (a test's
    own W&B mode, storage variables), never over the rank's placement."""
    local_world = world if local_world is None else local_world
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    env.update(extra)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank - node * local_world),
        LOCAL_WORLD_SIZE=str(local_world),
        NODE_RANK=str(node),
        GROUP_RANK=str(node),
    )
    return env


def _rank_main(fn, rank, world_size, port, args, queue, pg_timeout_s):
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args)
        # plain pickle bytes: torch's queue reducers pass tensors as shared-memory fds, which vanish
        # when the rank exits before the parent reads them
        queue.put(RankOutcome(rank, True, value=pickle.dumps(value)))
    except BaseException:  # report everything, including assertion errors, with the traceback
        queue.put(RankOutcome(rank, False, error=traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    pg_timeout_s: float = 60.0,
    allow_failures: bool = False,
) -> list[RankOutcome]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return outcomes in rank order.

    Raises DistributedFailure naming every failing rank with its traceback unless `allow_failures`
    (then outcomes of ranks that died without reporting carry their exit code).
    """
    ctx = _ctx()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, args, queue, pg_timeout_s), daemon=False)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, RankOutcome] = {}
    import queue as queue_module
    import time

    deadline = time.monotonic() + timeout_s
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            outcome = queue.get(timeout=0.2)
            outcomes[outcome.rank] = outcome
        except queue_module.Empty:
            if all(not p.is_alive() for p in procs):
                # drain what is left, then stop waiting for ranks that died silently
                try:
                    while True:
                        outcome = queue.get(timeout=0.5)
                        outcomes[outcome.rank] = outcome
                except queue_module.Empty:
                    break
    for proc in procs:
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    for rank, proc in enumerate(procs):
        if rank not in outcomes:
            reason = (
                "timed out"
                if proc.exitcode in (-9, None) and time.monotonic() >= deadline
                else "died without reporting"
            )
            outcomes[rank] = RankOutcome(
                rank, False, error=f"rank {rank} {reason} (exit code {proc.exitcode})", exitcode=proc.exitcode
            )
        else:
            outcomes[rank].exitcode = proc.exitcode
            if outcomes[rank].ok:
                outcomes[rank].value = pickle.loads(outcomes[rank].value)
    result = [outcomes[rank] for rank in range(world_size)]
    failed = [o for o in result if not o.ok]
    if failed and not allow_failures:
        report = "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in failed)
        raise DistributedFailure(f"{len(failed)} of {world_size} ranks failed:\n{report}")
    return result


def _python_main(argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In the forked child: what `python ARGV` (`-m module args` or `script.py args`) with `env` in `cwd` runs,
    its output appended to `log`."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # append: a node's ranks share one log
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python script.py` puts it first
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        # a fresh interpreter runs its atexit handlers on the way out; the forkserver's child ends in os._exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


class ForkedMain:
    """`subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=log, stderr=log)` as far as a test of
    rank processes uses it (pid, poll, wait, kill, returncode), for a process forked from the forkserver: torch,
    Lightning and the package are already imported (a fresh interpreter spends ~4.5 CPU-s importing them, the
    forked one nothing); the module or script runs from the top as `__main__`, with the environment, working
    directory and output given (appended to `log`). Exit statuses read as Popen's: the status of `sys.exit`,
    1 for an exception, -N for death by signal N. What it does not reproduce: the interpreter's finalization
    (the forked child ends in os._exit after the atexit handlers), so a test of how a process exits, or of what
    happens when it starts, runs a fresh interpreter instead."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | os.PathLike, log: str | os.PathLike):
        self.args = [sys.executable, *argv]
        self._process = _ctx().Process(target=_python_main, args=(list(argv), dict(env), str(cwd), str(log)))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


def fork_launched_ranks(
    argv: list[str], world: int, cwd: str | os.PathLike, logs: list[Path], **env: str
) -> list[ForkedMain]:
    """`torchrun --nproc-per-node {world} ARGV` on one node without torchrun: each rank forked from the forkserver
    (ForkedMain) with the environment torchrun gives it (launched_rank_env, `env` laid over it), its output appended
    to `logs[rank]` (one path for every rank: one log, as torchrun's). For a test of what a script's ranks do; a
    test of how a process starts or exits, or of a launcher (Lightning's, Fabric's, torchrun), starts fresh
    interpreters. Wait for them with `wait_for_ranks`."""
    port = free_port()
    return [ForkedMain(argv, launched_rank_env(rank, world, port, **env), cwd, logs[rank]) for rank in range(world)]


def wait_for_ranks(ranks: list[ForkedMain], timeout_s: float) -> list[int | None]:
    """Each rank's exit status within `timeout_s` overall; None for a rank still running then, which is killed (a
    hung rank must not outlive its test)."""
    deadline, codes = time.monotonic() + timeout_s, []
    for rank in ranks:
        try:
            codes.append(rank.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    return codes


def values(outcomes: list[RankOutcome]) -> list[Any]:
    return [o.value for o in outcomes]
