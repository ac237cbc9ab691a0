"""Where a Lightning run blocks for an overlapped staging copy: right before the state it copies changes.

With `save.overlap_staging`, a checkpoint copies parameters and optimizer state in the background
while the next batches' forward and backward run (engine/save/staging.py). They change only in the
optimizer step, so the strategy fences there: after the closure (automatic optimization runs the
forward and backward inside `optimizer.step(closure)`), before the update. A step pre-hook covers
`step()` calls that bypass the strategy; a load and a blocking save fence too. `zero_grad` (which
Lightning calls inside the closure) needs no fence: gradients are not part of the saved state.
"""

from __future__ import annotations

from typing import Any


class StagingFence:
    """Mixin of ShardedStrategy (which holds `_savers`); the fence itself is `CheckpointSaver.fence`."""

    _savers: dict[str, Any]

    def _init_staging_fence(self) -> None:
        self._guarded: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook's handle
        self._in_optimizer_step = False  # inside optimizer_step: its closure fences, the pre-hook need not

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Fence overlapped staging copies after the closure, right before the update.

        Under automatic optimization the closure runs the next batch's forward and backward (inside
        `optimizer.step`), so the copy overlaps them; the update comes after. Under manual
        optimization the closure is empty and the fence comes at `opt.step()`.
        """

        def closure_then_fence() -> Any:
            result = closure()
            self.wait_for_staging()
            return result

        self._in_optimizer_step = True
        try:
            return super().optimizer_step(optimizer, closure_then_fence, model, **kwargs)
        finally:
            self._in_optimizer_step = False

    def open_savers(self) -> list:
        """The host's savers whose staging may be in flight (the strategy says which)."""
        raise NotImplementedError(f"{type(self).__name__} must say which savers it holds (open_savers)")

    def wait_for_staging(self) -> float:
        """Block until every requested checkpoint's state is copied; seconds blocked.

        Called before the optimizer step, a load and a blocking save. Code that changes parameters or
        optimizer state outside `optimizer.step()` (e.g. averaging weights in a callback) must call it first.
        """
        return sum(saver.fence() for saver in self.open_savers())

    def _guard_optimizers(self) -> None:
        """A step pre-hook on every optimizer fences `step()` calls that bypass `optimizer_step`.

        Manual optimization through `self.optimizers()` goes through optimizer_step; a raw
        `optimizer.step()` does not. Inside optimizer_step the hook does nothing: the closure fences
        after the forward and backward that automatic optimization runs inside `step()`.
        """
        for optimizer in (
            getattr(opt, "_optimizer", opt) for opt in self.optimizers
        ):  # LightningOptimizer wraps the real one
            if id(optimizer) not in self._guarded:
                self._guarded[id(optimizer)] = optimizer.register_step_pre_hook(self._fence_unless_in_step)

    def _fence_unless_in_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._in_optimizer_step:
            self.wait_for_staging()

    def _remove_optimizer_guards(self) -> None:
        for handle in self._guarded.values():
            handle.remove()
        self._guarded = {}
