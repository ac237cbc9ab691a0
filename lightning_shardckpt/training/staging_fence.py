"""Where a Lightning run blocks for an overlapped staging copy: right before the state it copies changes.

With `save.overlap_staging`, a checkpoint copies parameters and optimizer state in the background
while the next batches' forward and backward run (engine/save/staging.py). They change only in the
optimizer step, so the strategy fences there: after the closure (automatic optimization runs the
forward and backward inside `optimizer.step(closure)`), before the update. A step pre-hook covers
`step()` calls that bypass the strategy; a load and a blocking save fence too. `zero_grad` (which
Lightning calls inside the closure) needs no fence: gradients are not part of the saved state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

if TYPE_CHECKING:  # savers.py imports the engine; the fence needs only its type
    from .savers import SaverHost


class _WithOptimizers(Protocol):
    """What the strategy this mixin precedes (Lightning's Strategy) has and the mixin uses."""

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]: ...


class StagingFence:
    """Mixin of ShardedStrategy, whose savers are its `host` (training/savers.py SaverHost): the fence itself is
    `SaverHost.fence`, the step pre-hooks `SaverHost.guard`."""

    host: SaverHost

    def _init_staging_fence(self) -> None:
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
            next_in_line: Any = super()  # Lightning's Strategy.optimizer_step, which mypy cannot name from this mixin
            return next_in_line.optimizer_step(optimizer, closure_then_fence, model, **kwargs)
        finally:
            self._in_optimizer_step = False

    def wait_for_staging(self) -> float:
        """Block until every requested checkpoint's state is copied; seconds blocked.

        Called before the optimizer step, a load and a blocking save. Code that changes parameters or
        optimizer state outside `optimizer.step()` (e.g. averaging weights in a callback) must call it first.
        """
        return self.host.fence()

    def _guard_optimizers(self) -> None:
        """A step pre-hook on every optimizer fences `step()` calls that bypass `optimizer_step`.

        Manual optimization through `self.optimizers()` goes through optimizer_step; a raw
        `optimizer.step()` does not. Inside optimizer_step the hook does nothing: the closure fences
        after the forward and backward that automatic optimization runs inside `step()`.
        """
        # LightningOptimizer wraps the real one
        strategy = cast(_WithOptimizers, self)  # the mixin of a Strategy, whose `optimizers` it reads
        optimizers = [getattr(optimizer, "_optimizer", optimizer) for optimizer in strategy.optimizers]
        self.host.guard(optimizers, unless=lambda: self._in_optimizer_step)
