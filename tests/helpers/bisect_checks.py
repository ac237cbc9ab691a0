"""User checks for `shardckpt bisect --bad module:function` (importable, as a user's own would be)."""

from __future__ import annotations

from lightning_shardckpt.ops.checks import CheckpointHandle, CheckResult

WATCHED = "model.head.weight"
LIMIT = 100.0  # the head's largest |weight| above this: the run has blown up


def head_blew_up(handle: CheckpointHandle) -> CheckResult:
    """Reads one tensor of the checkpoint, as a user check would."""
    largest = float(handle.tensor(WATCHED).abs().max())
    return CheckResult(largest > LIMIT, f"max |{WATCHED}| = {largest:.3g}", [{"fqn": WATCHED, "files": []}])


def returns_a_string(handle: CheckpointHandle) -> str:
    return "not a verdict"


def crashes(handle: CheckpointHandle) -> CheckResult:
    """A user check with a bug: it raises instead of returning a verdict."""
    raise ValueError("this check has a bug")
