"""Warm drill workers: one process that has already imported torch and the engine forks each drill's ranks,
and keeps the last drill's ranks alive for the next one.

A fresh interpreter importing torch costs ~2 s of CPU, more than restoring a small checkpoint; a drill
that paid it every time measured the interpreter, not the restore, and took that CPU from training.
`WarmPool` starts one pool process (at the drill's low priority, in its own process group, like the drill
ranks were) that imports policies/drills/worker.py once and then forks `world_size` ranks. The pool never
calls torch.distributed: each rank forms its gloo group of its own.

Kept ranks (`_KeptRanks`): a forked process starts with no page of its destination tensors mapped (0.5 GiB:
~0.2 s of page faults, more than reading and checksumming the same bytes from the page cache) and with no
process group; a real resume pays both once, when its job starts, not at every restore. So the ranks of a
drill stay alive after it (`worker.DrillRank`): their gloo group and their destination tensors
(`worker.Destination`, reused while the next checkpoint's tensors have the same shapes and dtypes) serve
the next drill, which the pool hands them over a pipe per rank. They are stopped and forked anew when a
drill fails, dies or times out (nothing of a broken group or a half-done load survives), when the world
size or the options that change a rank process (threads, safe globals) differ, and when the destination
no longer fits `keep_bytes` (`drill.keep_memory_gib` for all ranks together; 0: no rank outlives its
drill). A drill over the bound forks ranks that allocate and exit, as before kept ranks.

The pool side (`serve`) speaks one JSON line each way over stdin/stdout: a request names every rank's
argv and log file, the timeout and whether its ranks may be kept; the reply gives each rank's exit code
(0 for a kept rank that finished; None: killed at the deadline), `rank_process` ("kept" | "forked") and
the ranks' pids.

The pool waits for its ranks itself (only a parent can reap them), stops the others when one dies, and
dies with its starter (Linux PR_SET_PDEATHSIG), as the ranks die with the pool: a drill is never left
running by a starter that was killed, so a restarted follower cannot race an orphaned drill.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any

STOP_GRACE_S = 5.0  # after SIGTERM, how long a drill rank gets before SIGKILL
REPLY_GRACE_S = 30.0  # beyond the drill's own timeout, how long the starter waits for the pool's reply
POOL_START_TIMEOUT_S = 300.0  # importing torch on a loaded node at nice +19 can take a while
KEEP_BYTES = 2 * 2**30  # drill.keep_memory_gib's default: destination memory kept ranks hold (all ranks together)
ALIGN = 64  # what one tensor of the destination is counted as, rounded up to (torch's CPU allocator aligns to 64)
# bytes per element by the manifest's dtype name; a dtype not listed: the size is unknown, the ranks are not kept
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8}
_ITEMSIZE |= {"int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}

# The pool imports this very package (the directory above it goes first on sys.path: the drill runs the
# code that started it, installed or not).
_PACKAGE_DIR = str(Path(__file__).resolve().parents[3])  # the directory holding lightning_shardckpt/
# The collector is off while the pool imports (serve() freezes what they made and turns it back on): collecting
# while torch, DCP and DTensor load walks an ever larger heap for nothing, ~0.6 of the ~3 CPU-s a pool start costs.
_POOL_BOOTSTRAP = (
    "import gc\n"
    "gc.disable()\n"
    "import sys\n"
    "sys.path.insert(0, sys.argv.pop(1))\n"
    "from lightning_shardckpt.policies.drills.pool import serve\n"
    "sys.exit(serve(starter=int(sys.argv.pop(1))))\n"
)
# the drill is not part of the training job's world
_JOB_VARIABLES: tuple[str, ...] = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_JOB_VARIABLES += ("GROUP_RANK", "NODE_RANK")


class PoolFailed(OSError):
    """The pool could not start, or died, or stopped answering; the message says which."""


class WarmPool:
    """The starter's handle on one pool process. Use it from the thread that created it (the pool dies
    with that thread under PR_SET_PDEATHSIG)."""

    def __init__(self, *, threads: int = 1, nice: int = 0, keep_bytes: int = KEEP_BYTES) -> None:
        self.threads, self.nice, self.keep_bytes = threads, nice, keep_bytes
        self._process: subprocess.Popen[str] | None = None
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
        command = [sys.executable, "-c", _POOL_BOOTSTRAP, _PACKAGE_DIR, str(os.getpid())]
        # its own process group, so a Ctrl-C or a preemption signal of the training job is not the drill's;
        # the same session, so the same scheduler autogroup: with a new session Linux gives the drill a
        # group of its own, weighted like the whole training job, and its nice value means nothing
        # (measured: +23% training time at nice +19 with a new session)
        if sys.version_info >= (3, 11):
            self._process = subprocess.Popen(
                command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, process_group=0
            )
        else:  # Popen has no process_group before 3.11: the parent moves the child, as a shell does
            self._process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            os.setpgid(self._process.pid, 0)
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
        self,
        ranks: list[tuple[list[str], str]],
        timeout_s: float,
        *,
        destination_bytes: int = 0,
        kept_key: str = "",
    ) -> dict[str, Any]:
        """Run one drill on one rank per (argv, log path): kept ranks when the destination fits `keep_bytes`,
        else forked ones. `destination_bytes`: what one rank restores into (`destination_bytes()`; 0: unknown,
        never kept); `kept_key`: the options that shape a rank process (kept ranks started with another are
        replaced). Returns {"codes": one per rank (None: killed at the deadline), "rank_process", "pids"}."""
        self.ensure_started()
        request = {
            "ranks": [{"argv": argv, "log": log} for argv, log in ranks],
            "timeout_s": timeout_s,
            "keep": 0 < destination_bytes * len(ranks) <= self.keep_bytes,
            "kept_key": kept_key,
        }
        _, stdin, _ = self._pipes()
        try:
            stdin.write(json.dumps(request) + "\n")
            stdin.flush()
        except OSError as err:
            self.close()
            raise PoolFailed(f"the drill worker pool is gone ({err})") from err
        reply = self._receive(timeout_s + STOP_GRACE_S + REPLY_GRACE_S)
        if reply is None:  # dead or hung: its ranks die with it (PR_SET_PDEATHSIG)
            self.close()
            raise PoolFailed("the drill worker pool died or stopped answering during the drill")
        return reply

    def close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            if process.stdin is not None:
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
        _, _, stdout = self._pipes()
        readable, _, _ = select.select([stdout], [], [], timeout_s)
        if not readable:
            return None
        line = stdout.readline()
        reply: dict[str, Any] | None = json.loads(line) if line else None
        return reply

    def _pipes(self) -> tuple[subprocess.Popen[str], IO[str], IO[str]]:
        """The running pool and its two pipes; PoolFailed when there is none (closed, or never started)."""
        process = self._process
        if process is None or process.stdin is None or process.stdout is None:
            raise PoolFailed("the drill worker pool is not running (closed, or never started): start it first")
        return process, process.stdin, process.stdout


def destination_bytes(manifest: dict[str, Any], world_size: int) -> int:
    """Bytes of one drill rank's share of every tensor (dim 0 split as DTensor splits it, rounded up; each
    tensor aligned): what the keep bound is checked against. 0 when a dtype is unknown: the memory a drill would
    keep cannot be bounded, so its ranks are forked and exit after it."""
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


def serve(starter: int) -> int:
    """The pool's main (`starter`: the pid of the process that started it): import the drill worker once, then
    run each request's ranks (kept or forked) and report their codes."""
    die_with_parent(starter)
    from . import worker as drill_worker  # torch, DCP and the engine: paid once here, never by a drill

    drill_worker.warm_imports()
    # What the imports made (torch, DCP, the engine) lives as long as the pool: in the permanent generation, each
    # drill rank's garbage collections skip it and leave its pages shared with the pool instead of copying them
    # (the Python documentation's advice before fork() without exec(); measured on the tests' forkserver, whose
    # ranks spent ~20 % of their CPU in the collector without it). Then the collector runs again (the bootstrap
    # turned it off for the imports).
    gc.freeze()
    gc.enable()

    reply = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies goes down the starter's pipe
    _write(reply, {"ready": True, "pid": os.getpid()})
    kept = _KeptRanks(starter)
    try:
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("keep"):
                _write(reply, kept.run(request))
                continue
            kept.stop()  # keeping is off, or the destination no longer fits: their memory goes back now
            pids = [_fork_rank(drill_worker.main, rank["argv"], rank["log"]) for rank in request["ranks"]]
            codes = _wait_all(pids, time.time() + float(request["timeout_s"]), starter)
            _write(reply, {"codes": codes, "rank_process": "forked", "pids": pids})
    finally:
        kept.stop()
    return 0


class _KeptRanks:
    """The last drill's ranks, alive between drills (worker.DrillRank): a request pipe and a reply pipe each.
    Started by the first drill that may keep its ranks, handed every next one whose world size and
    `kept_key` match; stopped after any drill that did not finish cleanly on every rank."""

    def __init__(self, parent: int) -> None:
        self._parent = parent
        self._key: list[Any] | None = None
        self._pids: list[int] = []
        self._requests: list[int] = []  # the pool's write end of each rank's request pipe
        self._replies: list[int] = []  # the pool's read end of each rank's reply pipe

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        key = [len(request["ranks"]), request.get("kept_key", "")]
        if key != self._key or not self._all_alive():
            self.stop()
            self._start(request["ranks"], key)
        try:
            for fd, rank in zip(self._requests, request["ranks"]):
                _write_fd(fd, rank)
        except OSError:  # a rank died since the check above: the drill gets fresh ranks, not a failure
            self.stop()
            self._start(request["ranks"], key)
            for fd, rank in zip(self._requests, request["ranks"]):
                _write_fd(fd, rank)
        pids = list(self._pids)
        codes, all_passed = self._wait(time.time() + float(request["timeout_s"]))
        if not all_passed:
            self.stop()  # a failed, dead or stuck drill: nothing of it is kept
        return {"codes": codes, "rank_process": "kept", "pids": pids}

    def stop(self) -> None:
        """End the kept ranks (their memory and process group go with them); a no-op when there are none."""
        for fd in self._requests:  # end of input: an idle rank leaves its loop by itself
            _close(fd)
        _stop_all(self._pids)
        for fd in self._replies:
            _close(fd)
        self._key, self._pids, self._requests, self._replies = None, [], [], []

    def _start(self, ranks: list[dict[str, Any]], key: list[Any]) -> None:
        from .worker import DrillRank

        pipes = [(os.pipe(), os.pipe()) for _ in ranks]  # (request r, w), (reply r, w) per rank
        every = [fd for pair in pipes for ends in pair for fd in ends]
        for index, rank in enumerate(ranks):
            (request_read, _), (_, reply_write) = pipes[index]
            own = (request_read, reply_write)

            def main(argv: list[str], own: tuple[int, int] = own) -> int:
                for fd in every:  # the pool's ends and the other ranks' pipes: EOF must mean what it says
                    if fd not in own:
                        _close(fd)
                return DrillRank(*own).serve()

            self._pids.append(_fork_rank(main, [], rank["log"]))
        for (request_read, request_write), (reply_read, reply_write) in pipes:
            _close(request_read)
            _close(reply_write)
            self._requests.append(request_write)
            self._replies.append(reply_read)
        self._key = key

    def _all_alive(self) -> bool:
        return bool(self._pids) and all(os.waitpid(pid, os.WNOHANG)[0] == 0 for pid in self._pids)

    def _wait(self, deadline: float) -> tuple[list[int | None], bool]:
        """Each rank's code, as a forked rank's exit code reads: 0 when it reported its drill finished (passed or
        not: rank 0's outcome says which), its exit status when it died without a report, None when the deadline
        passed first; and whether every rank reported a pass. A rank that failed exits after its report, so its
        peers' collectives end as they do when a forked rank exits, and rank 0 still reports."""
        codes: list[int | None] = [None] * len(self._pids)
        passed = [False] * len(self._pids)
        pending = {fd: index for index, fd in enumerate(self._replies)}
        buffers = dict.fromkeys(pending, b"")
        while pending and time.time() < deadline and os.getppid() == self._parent:
            readable, _, _ = select.select(list(pending), [], [], min(0.5, max(0.0, deadline - time.time())))
            for fd in readable:
                chunk = os.read(fd, 4096)
                buffers[fd] += chunk
                if chunk and b"\n" not in buffers[fd]:
                    continue
                index = pending.pop(fd)
                if chunk:
                    codes[index], passed[index] = 0, bool(json.loads(buffers[fd])["ok"])
                else:  # the pipe closed without a report: the rank is gone
                    _, status = os.waitpid(self._pids[index], 0)
                    self._pids[index] = -1  # reaped: never signalled again (its pid may be reused)
                    codes[index] = os.waitstatus_to_exitcode(status)
            if any(code not in (None, 0) for code in codes):
                break  # one dead rank: the others would wait for it until their collective timeout
        return codes, all(passed)


def _write_fd(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _write(stream: Any, message: dict[str, Any]) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def _fork_rank(main: Any, argv: list[str], log_path: str) -> int:
    from .worker import log_to

    sys.stderr.flush()
    pool = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the rank: never returns into the pool's loop
        os.setpgid(0, 0)  # its own group: the pool stops a rank and whatever it started with one killpg
        die_with_parent(pool)
        log_to(log_path)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the pool's requests are not the rank's input
        sys.stdout = sys.stderr
        code = main(argv)
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
    _stop_all([pid for pid, code in zip(pids, codes) if code is None])
    return codes


def _stop_all(pids: list[int]) -> None:
    """SIGTERM each rank's process group, SIGKILL what is left after STOP_GRACE_S, reap them all. A pid below 0
    was reaped already."""
    running = [pid for pid in pids if pid > 0]
    for pid in running:
        _signal_group(pid, signal.SIGTERM)
    grace_ends = time.time() + STOP_GRACE_S
    while running and time.time() < grace_ends:
        running = [pid for pid in running if _not_exited(pid)]
        if running:
            time.sleep(0.02)
    for pid in running:
        _signal_group(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _not_exited(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == 0
    except ChildProcessError:
        return False


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the thread that started it exits; at once when `parent` (the pid that
    forked or started it) is no longer its parent. PR_SET_PDEATHSIG only sees a death after the call: a pool
    killed between forking a rank and the rank's call here (its starter killed mid-drill, the signal passed on
    one generation at a time) left the rank running its whole drill as an orphan, writing into a scratch
    directory no living process owns. Elsewhere the pool notices a dead starter at the end of its input and
    its ranks at their collective timeout."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the call above (the rank was re-parented)
        os.kill(os.getpid(), signal.SIGKILL)
