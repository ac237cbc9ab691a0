"""Lightning's checkpoint paths under ShardedStrategy: `ckpt_path="last"`, and the paths Lightning saves to.

- `ckpt_path="last"`: Lightning resolves it before any hook of ours runs, from ModelCheckpoint's `last*.ckpt`
  files (or OnExceptionCheckpoint's); with ShardedCheckpoint alone it finds none, warns and starts fresh.
  The strategy's launcher is the one place that sees `ckpt_path` first: with ShardedCheckpoint and no
  source of Lightning's own, "last" becomes "latest" (the callback's root's newest commit, resolved in
  `ShardedStrategy.load_checkpoint`). With `ModelCheckpoint(save_last=...)` beside ShardedCheckpoint,
  "last" keeps Lightning's meaning (its `last.ckpt`); without ShardedCheckpoint, Lightning's as well.
- A fork (a resume into another dirpath): Lightning keys a callback's state by its `state_key`, which
  names ShardedCheckpoint's dirpath, so the source's state (data position, RNG) would not be handed over.
- A path Lightning saves to (`trainer.save_checkpoint(path)`, ModelCheckpoint's `last.ckpt` and top-k
  paths) becomes a checkpoint root. Lightning overwrites such a file; the root keeps its newest checkpoint
  only, the older ones deleted once the new one committed (an interrupted save leaves the previous one).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any, cast

from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies.launchers.launcher import _Launcher

from ...engine.storage.fsio import Location
from ...policies import retention

log = logging.getLogger(__name__)

LATEST_REFERENCE = "latest"  # the newest committed checkpoint of ShardedCheckpoint's root, resolved at the load


def with_last_resolved(launcher: _Launcher | None) -> _Launcher:
    """The strategy's launcher, passing `ckpt_path="last"` on as ShardedCheckpoint spells it.

    Lightning's launcher keeps its class (Lightning checks it with isinstance); only this instance's
    `launch` changes. Without one (processes started by torchrun or SLURM under ModelParallelStrategy),
    one that runs the Trainer's function in this process, as Lightning does without a launcher.
    """
    if launcher is None:
        return InProcessLauncher()
    cast(Any, launcher).launch = _ResolvingLast(launcher)  # this instance's method only: its class stays Lightning's
    return launcher


def lightning_spelling(function: Callable, args: tuple, kwargs: dict[str, Any], trainer: Any) -> tuple[tuple, dict]:
    """`function`'s arguments (Trainer._fit_impl, _validate_impl, ...) with ckpt_path "last" as "latest"
    where Lightning has no `last` of its own to find."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):  # not a Trainer entry point we know: as given
        return args, kwargs
    if bound.arguments.get("ckpt_path") == "last" and _only_ours_saves_last(trainer):
        bound.arguments["ckpt_path"] = LATEST_REFERENCE
        log.debug("ckpt_path='last': the newest committed checkpoint of ShardedCheckpoint's root")
    return bound.args, bound.kwargs


def _only_ours_saves_last(trainer: Any) -> bool:
    """A checkpoint callback of ours (a `Checkpoint` Lightning does not know), and none whose files Lightning's
    "last" looks for (ModelCheckpoint(save_last=...), OnExceptionCheckpoint: its _CheckpointConnector)."""
    callbacks = getattr(trainer, "callbacks", [])
    lightnings = (ModelCheckpoint, OnExceptionCheckpoint)
    ours = any(isinstance(callback, Checkpoint) and not isinstance(callback, lightnings) for callback in callbacks)
    return ours and not any(
        isinstance(callback, OnExceptionCheckpoint) or (isinstance(callback, ModelCheckpoint) and callback.save_last)
        for callback in callbacks
    )


class _ResolvingLast:
    """A launcher's `launch` with Lightning's "last" resolved first (picklable: spawn launchers pickle it)."""

    def __init__(self, launcher: _Launcher) -> None:
        self.launcher = launcher

    def __call__(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        args, kwargs = lightning_spelling(function, args, kwargs, trainer)
        return type(self.launcher).launch(self.launcher, function, *args, trainer=trainer, **kwargs)


class InProcessLauncher(_Launcher):
    """Runs the Trainer's function in this process (the ranks were started outside Lightning)."""

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        args, kwargs = lightning_spelling(function, args, kwargs, trainer)
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        pass  # started outside Lightning: whoever started the processes signals them


def keep_only_newest(location: Location, run_id: str | None, just_committed: str) -> None:
    """After a commit to a path Lightning overwrites: delete the run's older checkpoints in that root.
    Rank 0; a failure is logged, never raised (the new checkpoint committed; the next save retries)."""
    try:
        retention.apply(location, 1, None, run_id=run_id, just_committed=just_committed, keep_last_drilled=0)
    except Exception:  # noqa: BLE001 - the save committed; a leftover older checkpoint is only space
        log.warning("could not delete the older checkpoints of %s; the next save retries", location.url, exc_info=True)


def callback_state_key(dirpath: str | None) -> str:
    """ShardedCheckpoint's `state_key`: Lightning files a callback's state in the checkpoint dict under it."""
    return f"ShardedCheckpoint{{'dirpath': {dirpath!r}}}"


def forked_callback_state(checkpoint: dict[str, Any], state_key: str) -> dict[str, Any] | None:
    """ShardedCheckpoint's state in `checkpoint` saved under another dirpath's key, when there is none under
    `state_key` (a fork into a new root) and exactly one other: None otherwise (Lightning loads its own)."""
    states = checkpoint.get("callbacks") or {}
    if state_key in states:
        return None
    prefix = state_key.split("{", 1)[0] + "{"
    others = [state for key, state in states.items() if isinstance(key, str) and key.startswith(prefix)]
    return others[0] if len(others) == 1 else None
