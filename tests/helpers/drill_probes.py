"""Probes for restore-drill tests: functions of a model state dict, imported by drill processes by name."""

from __future__ import annotations

import os
import signal
import time

import torch


def weighted_sum(model_state: dict[str, torch.Tensor]) -> float:
    """A fixed 'batch' through a stand-in model: a deterministic scalar of every weight."""
    total = torch.zeros((), dtype=torch.float64)
    for name in sorted(model_state):
        value = model_state[name]
        if value.is_floating_point():
            weights = torch.linspace(-1.0, 1.0, value.numel(), dtype=torch.float64)
            total += (value.detach().double().flatten() * weights).sum()
    return float(total)


def hangs(model_state: dict[str, torch.Tensor]) -> float:
    time.sleep(3600)
    return 0.0


def dies(model_state: dict[str, torch.Tensor]) -> float:
    os.kill(os.getpid(), signal.SIGKILL)
    return 0.0


def differs_every_call(model_state: dict[str, torch.Tensor]) -> float:
    """A different value in every process: the drill's probe never matches the one saved (a failing drill)."""
    return float(int.from_bytes(os.urandom(4), "little") + 1)


def slow_weighted_sum(model_state: dict[str, torch.Tensor]) -> float:
    """weighted_sum, after DRILL_PROBE_SLEEP_S seconds where that is set (in drill followers, not in training):
    a drill long enough for a test to kill its follower in the middle of it."""
    time.sleep(float(os.environ.get("DRILL_PROBE_SLEEP_S", "0")))
    return weighted_sum(model_state)
