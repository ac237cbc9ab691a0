"""Warm drill workers: one process that has already imported torch and the engine forks each drill's ranks.

A fresh interpreter importing torch costs ~2 s of CPU, more than restoring a small checkpoint; a drill
that paid it every time measured the interpreter, not the restore, and took that CPU from training.
`WarmPool` starts one pool process (at the drill's low priority, in its own process group, like the drill
ranks were) that imports policies/drills/worker.py once and then, per drill, forks `world_size` ranks.
Each rank forks before any process group exists in the pool (the pool never calls torch.distributed) and
forms a fresh gloo group of its own, so a drill never shares collective state with the previous one.

The pool side (`serve`) speaks one JSON line each way over stdin/stdout: a request names every rank's
argv and log file and the timeout; the reply gives each rank's exit code (None: killed at the deadline).
Destination memory: restoring into freshly allocated tensors costs the kernel a page fault per 4 KiB (0.5 GiB:
~0.2 s here, more than reading and checksumming the same bytes from the page cache), and a real resume pays
it once, when its model is built, not at every restore. The pool keeps one shared, already faulted mapping
(up to `keep_bytes`) and hands each rank its own region of it; a drill that needs more grows it (and pays the
faults, inside its time to resume); one over `keep_bytes` gets none and its ranks allocate as before. Each
rank fills its region with NaN bytes before restoring into it, so no byte of an earlier drill survives into
the checks: a tensor the load did not write is caught by the non-finite check.

The pool waits for its ranks itself (only a parent can reap them), stops the others when one dies, and
dies with its starter (Linux PR_SET_PDEATHSIG), as the ranks die with the pool: a drill is never left
running by a starter that was killed, so a restarted follower cannot race an orphaned drill.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

import lightning_shardckpt

STOP_GRACE_S = 5.0  # after SIGTERM, how long a drill rank gets before SIGKILL
REPLY_GRACE_S = 30.0  # beyond the drill's own timeout, how long the starter waits for the pool's reply
POOL_START_TIMEOUT_S = 300.0  # importing torch on a loaded node at nice +19 can take a while
KEEP_BYTES = 2 * 2**30  # destination memory the pool keeps faulted between drills (all ranks together)
ALIGN = 64  # each tensor's bytes in a region start on this boundary (torch's CPU allocator aligns to 64 too)
# bytes per element by the manifest's dtype name; a dtype not listed: the drill allocates as before
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8}
_ITEMSIZE |= {"int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}

# The pool imports this very package (the directory above it goes first on sys.path: the drill runs the
# code that started it, installed or not). Computed from the package's root, not by counting levels up from
# this file: one level short put lightning_shardckpt/ itself on sys.path, where our lightning/ room shadows
# Lightning ("No module named 'lightning.fabric.strategies'" in every drill of more than one rank).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(lightning_shardckpt.__file__)))
_POOL_BOOTSTRAP = (
    "import sys\n"
    "sys.path.insert(0, sys.argv.pop(1))\n"
    "from lightning_shardckpt.policies.drills.pool import serve\n"
    "sys.exit(serve())\n"
)
# the drill is not part of the training job's world
_JOB_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_JOB_VARIABLES += ("GROUP_RANK", "NODE_RANK")


class PoolFailed(OSError):
    """The pool could not start, or died, or stopped answering; the message says which."""


class WarmPool:
    """The starter's handle on one pool process. Use it from the thread that created it (the pool dies
    with that thread under PR_SET_PDEATHSIG)."""

    def __init__(self, *, threads: int = 1, nice: int = 0, keep_bytes: int = KEEP_BYTES) -> None:
        self.threads, self.nice, self.keep_bytes = threads, nice, keep_bytes
        self._process: subprocess.Popen | None = None
        self.start_s: float | None = None  # seconds the last start took (interpreter + imports)

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def ensure_started(self) -> float:
        """Start the pool unless it runs; the seconds that took (0.0 when it was warm already)."""
        if self.alive:
            return 0.0
        self.close()
        started = time.time()
        threads = str(self.threads)
        env = {
            **{name: value for name, value in os.environ.items() if name not in _JOB_VARIABLES},
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            "PYTHONUNBUFFERED": "1",
            # the drill imports what the caller can (a probe in the user's recipes/ directory, say)
            "PYTHONPATH": os.pathsep.join(entry for entry in sys.path if entry),
        }
        self._process = subprocess.Popen(
            [sys.executable, "-c", _POOL_BOOTSTRAP, _PACKAGE_DIR],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            # its own process group, so a Ctrl-C or a preemption signal of the training job is not the drill's;
            # the same session, so the same scheduler autogroup: with a new session Linux gives the drill a
            # group of its own, weighted like the whole training job, and its nice value means nothing
            # (measured: +23% training time at nice +19 with a new session)
            process_group=0,
        )
        if self.nice:
            # after the start, not in a preexec_fn: that is unsafe in a process with threads (the training job)
            try:
                pid = self._process.pid
                os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0) + self.nice)
            except OSError:  # the process already ended, or the platform refuses: the drill still runs
                pass
        if self._receive(POOL_START_TIMEOUT_S) is None:
            self.close()
            raise PoolFailed(f"the drill worker pool did not start within {POOL_START_TIMEOUT_S:g} s")
        self.start_s = time.time() - started
        return self.start_s

    def run(
        self, ranks: list[tuple[list[str], str]], timeout_s: float, *, destination_bytes: int = 0
    ) -> list[int | None]:
        """Fork one rank per (argv, log path); their exit codes, None for a rank killed at the deadline.
        `destination_bytes`: what one rank restores into (`destination_bytes()`), 0: unknown (it allocates)."""
        self.ensure_started()
        request = {
            "ranks": [{"argv": argv, "log": log} for argv, log in ranks],
            "timeout_s": timeout_s,
            "destination_bytes": destination_bytes if destination_bytes * len(ranks) <= self.keep_bytes else 0,
        }
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        except OSError as err:
            self.close()
            raise PoolFailed(f"the drill worker pool is gone ({err})") from err
        reply = self._receive(timeout_s + STOP_GRACE_S + REPLY_GRACE_S)
        if reply is None:  # dead or hung: its ranks die with it (PR_SET_PDEATHSIG)
            self.close()
            raise PoolFailed("the drill worker pool died or stopped answering during the drill")
        return reply["codes"]

    def close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            process.stdin.close()  # the pool's end of input: it exits
            process.wait(STOP_GRACE_S)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        finally:
            if process.stdout is not None:
                process.stdout.close()

    def _receive(self, timeout_s: float) -> dict[str, Any] | None:
        """The pool's next reply line; None when it died or said nothing within `timeout_s`."""
        process = self._process
        readable, _, _ = select.select([process.stdout], [], [], timeout_s)
        if not readable:
            return None
        line = process.stdout.readline()
        return json.loads(line) if line else None


def destination_bytes(manifest: dict[str, Any], world_size: int) -> int:
    """Bytes of one drill rank's share of every tensor (dim 0 split as DTensor splits it, rounded up; each
    tensor aligned); 0 when a dtype is unknown (the rank then allocates its tensors itself)."""
    total = 0
    for tensor in manifest["tensors"]:
        itemsize = _ITEMSIZE.get(str(tensor["dtype"]).removeprefix("torch."))
        if itemsize is None:
            return 0
        shape = list(tensor["shape"])
        if shape and shape[0] > 0:
            shape[0] = -(-shape[0] // world_size)
        elements = 1
        for size in shape:
            elements *= size
        total += -(-elements * itemsize // ALIGN) * ALIGN
    return total


# --- the pool process ---------------------------------------------------------------------------


def serve() -> int:
    """The pool's main: import the drill worker once, then fork each request's ranks and report their codes."""
    _die_with_parent()
    parent = os.getppid()
    from . import worker as drill_worker  # torch, DCP and the engine: paid once here, never by a drill

    drill_worker.warm_imports()

    reply = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies goes down the starter's pipe
    _write(reply, {"ready": True, "pid": os.getpid()})
    memory = _Destinations()
    for line in sys.stdin:
        request = json.loads(line)
        each = int(request.get("destination_bytes") or 0)
        regions = memory.regions(each, len(request["ranks"]))
        pids = [
            _fork_rank(drill_worker.main, rank["argv"], rank["log"], region)
            for rank, region in zip(request["ranks"], regions)
        ]
        del regions  # the pool's views: the mapping stays for the next drill, the ranks hold their own
        _write(reply, {"codes": _wait_all(pids, time.time() + float(request["timeout_s"]), parent)})
    return 0


class _Destinations:
    """The pool's destination memory: one shared anonymous mapping, faulted in once, a region per rank.
    Shared, not private: a forked rank writing into a private mapping would copy every page (a fault each)."""

    def __init__(self) -> None:
        self._mapping: mmap.mmap | None = None

    def regions(self, each: int, ranks: int) -> list[memoryview | None]:
        if each <= 0:
            return [None] * ranks
        needed = each * ranks
        if self._mapping is None or len(self._mapping) < needed:
            if self._mapping is not None:
                self._mapping.close()
            self._mapping = mmap.mmap(-1, needed, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
            _touch(self._mapping)
        view = memoryview(self._mapping)
        return [view[rank * each : (rank + 1) * each] for rank in range(ranks)]


def _touch(mapping: mmap.mmap) -> None:
    """Fault every page in now, one write per page (a drill rank then writes into resident memory)."""
    import torch

    pages = torch.frombuffer(mapping, dtype=torch.uint8)
    pages[:: mmap.PAGESIZE] = 0


def _write(stream: Any, message: dict[str, Any]) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def _fork_rank(main: Any, argv: list[str], log_path: str, destination: memoryview | None = None) -> int:
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the rank: never returns into the pool's loop
        os.setpgid(0, 0)  # its own group: the pool stops a rank and whatever it started with one killpg
        _die_with_parent()
        output = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(output, 1)
        os.dup2(output, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the pool's requests are not the rank's input
        sys.stdout = sys.stderr
        code = main(argv, destination=destination)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait_all(pids: list[int], deadline: float, parent: int) -> list[int | None]:
    """Exit codes (negative: killed by that signal); None for a rank killed at the deadline. One dead rank
    takes the others down: they would wait for it until their collective timeout."""
    codes: list[int | None] = [None] * len(pids)
    while time.time() < deadline and any(code is None for code in codes):
        for index, pid in enumerate(pids):
            if codes[index] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[index] = os.waitstatus_to_exitcode(status)
        if any(code not in (None, 0) for code in codes) or os.getppid() != parent:
            break
        time.sleep(0.02)
    running = [pid for pid, code in zip(pids, codes) if code is None]
    for pid in running:
        _signal_group(pid, signal.SIGTERM)
    grace_ends = time.time() + STOP_GRACE_S
    while running and time.time() < grace_ends:
        running = [pid for pid in running if os.waitpid(pid, os.WNOHANG)[0] == 0]
        time.sleep(0.02)
    for pid in running:
        _signal_group(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return codes


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that started it exits. Elsewhere the pool notices a
    dead starter at the end of its input and its ranks at their collective timeout."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
