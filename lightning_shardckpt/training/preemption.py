"""Preemption requests on this process: SIGTERM / SIGUSR1 set a flag, and a watchdog bounds the exit.

A signal handler runs between two bytecodes of the main thread, possibly in the middle of a collective, so
it must never run one itself (Lightning's SIGTERM handler broadcasts there, and the job hangs when the ranks
are not all in that same broadcast). This handler only records that a signal came; the front door reads
`requested` at the next batch end, where the ranks agree on it in the all-reduce that already runs there,
save once and stop.

A Python signal handler runs only once the main thread is back in the interpreter: a rank blocked in a
collective with a stuck peer never runs it. So the watchdog thread learns of the signal from the C level: the
signal module writes each caught signal's number to the wakeup fd (`signal.set_wakeup_fd`) at once, and the
watchdog reads it there. The watchdog bounds how long that may take: `grace_s` after the first signal, if the front door has not
closed this object (fit has not returned: a rank stuck in a collective, a final save slower than the grace
period), it exits the process with status 128 + the signal's number, the status a shell reports for a
process that signal killed. The last committed checkpoint is kept; a save in flight stays uncommitted.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # scancel / Kubernetes / torchrun; a preemption notice (--signal=USR1@90)
DEFAULT_GRACE_S = 60.0  # SLURM's default --signal lead time; its KillWait (SIGTERM to SIGKILL) is 30 s
POLL_S = 0.25


def expired_exit_status(signum: int) -> int:
    """The exit status after the grace period ran out: what a shell reports for a process `signum` killed."""
    return 128 + int(signum)


class _Handler:
    """Our handler for one signal; remembers the one it replaced. Once its owner is closed (fit returned)
    it acts as that one did, in case a framework restores it after fit (Lightning restores the handlers
    it found, ours among them)."""

    def __init__(self, owner: PreemptionRequests, signum: int, previous: Any) -> None:
        self.owner, self.signum, self.previous = owner, signum, previous

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.owner.closed:
            self.owner.record(signum)
        elif self.previous in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)  # the default action (terminate), as before fit
            os.kill(os.getpid(), signum)
            return
        if callable(self.previous):  # a handler the program had before fit still runs
            self.previous(signum, frame)


class PreemptionRequests:
    """Flag-only handlers for SIGTERM and SIGUSR1 while installed, and the exit watchdog."""

    def __init__(self, grace_s: float | None = DEFAULT_GRACE_S) -> None:
        self.grace_s = grace_s  # None: no watchdog
        self.requested_at: float | None = None  # monotonic time of the first signal
        self.signum: int | None = None
        self.closed = True
        self._handlers: dict[int, _Handler] = {}
        self._done = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._wakeup: tuple[socket.socket, socket.socket] | None = None  # (read, write): signal numbers, C level

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def record(self, signum: int) -> None:
        """The handler's whole work: no lock, no I/O, no collective."""
        if self.requested_at is None:
            self.signum, self.requested_at = signum, time.monotonic()

    def install(self) -> bool:
        """Handle SIGTERM and SIGUSR1 from now on (main thread only); start the watchdog. False off the main
        thread, where Python allows no signal handler: signals then act as they did."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("save_on_preemption: fit runs off the main thread, where no signal handler can be set")
            return False
        self.requested_at, self.signum, self.closed = None, None, False
        for signum in SIGNALS:
            previous = signal.getsignal(signum)
            if isinstance(previous, _Handler):  # left behind by an earlier fit: what it replaced
                previous = previous.previous
            self._handlers[signum] = _Handler(self, signum, previous)
            signal.signal(signum, self._handlers[signum])
        if self.grace_s is not None:
            self._done.clear()
            self._wakeup = _wakeup_pair()
            self._watchdog = threading.Thread(target=self._watch, name="shardckpt-preemption-watchdog", daemon=True)
            self._watchdog.start()
        return True

    def take_back(self) -> None:
        """Ours again, wherever a framework put its own handler since `install` (Lightning does, for SIGTERM,
        when fit starts): its handler runs a collective, so it must not be the one that runs."""
        for signum, handler in self._handlers.items():
            if signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)

    def close(self) -> None:
        """Fit returned: stop the watchdog and put back the handlers found at `install`."""
        if self.closed:
            return
        self.closed = True
        self._done.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=2 * POLL_S)
        self._watchdog = None
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._handlers.items():
                signal.signal(signum, handler.previous if handler.previous is not None else signal.SIG_DFL)
            if self._wakeup is not None:
                signal.set_wakeup_fd(-1)
        if self._wakeup is not None:
            for end in self._wakeup:
                end.close()
            self._wakeup = None

    def _watch(self) -> None:
        grace_s = self.grace_s
        assert grace_s is not None  # the watchdog thread starts only with a grace (install)
        noticed, wakeup = False, self._wakeup
        while not self._done.is_set():
            if wakeup is None:
                self._done.wait(POLL_S)
            else:
                try:
                    ready = select.select([wakeup[0]], [], [], POLL_S)[0]
                    caught = wakeup[0].recv(64) if ready else b""  # each caught signal's number, a byte each
                except (OSError, ValueError):  # closed under us: fit returned
                    return
                for signum in caught:
                    if signum in SIGNALS:
                        self.record(signum)
            started = self.requested_at
            if started is None:
                continue
            if not noticed:  # logged here, not in the handler: a handler must not take the logging lock
                noticed = True
                log.warning(
                    "%s received: the ranks agree at the next batch end, save once and stop; this process exits "
                    "within preemption_grace_s=%.0f s",
                    signal.Signals(self.signum or signal.SIGTERM).name,
                    self.grace_s,
                )
            if time.monotonic() - started > grace_s and not self._done.is_set():
                self._expire()

    def _expire(self) -> None:
        signum = self.signum or signal.SIGTERM
        status = expired_exit_status(signum)
        log.error(
            "preemption: fit has not returned %.0f s after %s (a rank stuck in a collective, or a final save slower "
            "than that); exiting with status %d. The last committed checkpoint is kept, a save in flight stays "
            "uncommitted; if the final save needs longer, raise preemption_grace_s (below the scheduler's kill time)",
            self.grace_s,
            signal.Signals(signum).name,
            status,
        )
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not keep the process alive
                pass
        os._exit(status)


def _wakeup_pair() -> tuple[socket.socket, socket.socket] | None:
    """A socket pair whose write end is the process's signal wakeup fd; None where another part of the program
    (an asyncio loop in the main thread) holds it: the watchdog then sees a signal only once the handler ran."""
    read, write = socket.socketpair()
    read.setblocking(False)
    write.setblocking(False)
    previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)
        read.close()
        write.close()
        log.info("the signal wakeup fd is in use; the preemption watchdog counts from when the handler runs")
        return None
    return read, write
