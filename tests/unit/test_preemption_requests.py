"""PreemptionRequests with real signals to this process: the handler only flags, Lightning's handler is taken
back, fit's end restores what was there, and the watchdog ends a process whose fit does not return."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_shardckpt.training.preemption import PreemptionRequests, expired_exit_status

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def requests():
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    made = PreemptionRequests(grace_s=None)
    yield made
    made.close()
    for signum, handler in before.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_only_sets_the_flag_and_the_process_goes_on(requests, signum):
    assert requests.install()
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs at the next bytecode
    assert requests.requested and requests.signum == signum


def test_a_handler_installed_after_ours_is_taken_back_and_never_runs(requests):
    ran = []
    requests.install()
    signal.signal(signal.SIGTERM, lambda *_: ran.append("framework"))  # as Lightning does when fit starts
    requests.take_back()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    assert requests.requested and ran == []


def test_the_end_of_fit_restores_the_handler_found_and_a_leftover_of_ours_acts_as_it(requests):
    calls = []

    def programs_own(signum, frame):
        calls.append(signum)

    signal.signal(signal.SIGUSR1, programs_own)
    requests.install()
    leftover = signal.getsignal(signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)  # during fit: flagged, and the program's own handler still runs
    time.sleep(0.05)
    assert calls == [signal.SIGUSR1]
    requests.close()
    assert signal.getsignal(signal.SIGUSR1) is programs_own
    signal.signal(signal.SIGUSR1, leftover)  # a framework restoring ours after fit (Lightning after an exception)
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05)
    assert calls == [signal.SIGUSR1, signal.SIGUSR1]


@pytest.mark.slow
def test_a_process_whose_fit_does_not_return_exits_after_the_grace_period_with_128_plus_the_signal(tmp_path):
    script = textwrap.dedent(
        """
        import threading
        from lightning_shardckpt.training.preemption import PreemptionRequests
        PreemptionRequests(grace_s=1.0).install()
        print("ready", flush=True)
        threading.Event().wait()  # fit never returns
        """
    )
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"ready"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the watchdog did not end the process")
    assert code == expired_exit_status(signal.SIGTERM) == 143
    assert 1.0 <= time.monotonic() - sent < 10
    assert b"exiting with status 143" in proc.stderr.read()
