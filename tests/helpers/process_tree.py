"""Which processes hold a file open under a directory (read from /proc), and a wait until none does.

A process killed with SIGKILL is reaped by its parent at once, while what it started dies after it (Linux
PR_SET_PDEATHSIG: each child is signalled as its parent exits, one generation at a time). A test that then looks at
what those children write must first wait for them, or a grandchild's last write can land after the look. Asking
who holds files open there, rather than who descends from the killed process, also catches a child forked a moment
before the kill.
"""

from __future__ import annotations

import os
import time


def processes_holding(directory: str) -> dict[int, list[str]]:
    """pid -> the paths under `directory` it has open now (its stdout redirected there counts)."""
    prefix = os.path.realpath(directory).rstrip("/") + "/"
    holding: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
            targets = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in fds]
        except OSError:  # ended meanwhile (or not ours to read)
            continue
        inside = [target for target in targets if target.startswith(prefix)]
        if inside:
            holding[int(entry)] = inside
    return holding


def wait_until_none_holds(directory: str, timeout_s: float) -> None:
    """Return once no process has a file under `directory` open; AssertionError naming them after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (holding := processes_holding(directory)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not holding, f"still open under {directory} {timeout_s:.0f} s after its writer was killed: {holding}"
