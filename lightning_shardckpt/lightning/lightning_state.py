"""Between Lightning's checkpoint dict and the DCP state dict we save.

Tensors go through DCP (sharded model and optimizer states, resharded on load); everything else
Lightning puts in a checkpoint (loops, callbacks, schedulers, hyperparameters, precision and datamodule
state, `on_save_checkpoint` extras) travels as one pickled blob, because its structure is not known
before it is loaded. A plain `dcp.load` can still read the blob: it is a `bytes` object.
"""

from __future__ import annotations

import pickle
from typing import Any

import lightning

from ..engine.format import safe_pickle

MODEL_KEY = "model"
OPTIMIZERS_KEY = "optimizers"
LIGHTNING_KEY = "lightning"  # the pickled rest of Lightning's checkpoint dict


def to_dcp_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Split Lightning's checkpoint dict (not modified) into DCP-saveable parts."""
    rest = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
    return {
        MODEL_KEY: checkpoint["state_dict"],
        OPTIMIZERS_KEY: {str(index): state for index, state in enumerate(checkpoint.get("optimizer_states", []))},
        LIGHTNING_KEY: pickle.dumps(rest, protocol=pickle.HIGHEST_PROTOCOL),
    }


def load_target(model_state: dict[str, Any], optimizer_states: list[dict[str, Any]]) -> dict[str, Any]:
    """A state dict with the structure `to_dcp_state` saved, to be filled in place by a load."""
    return {
        MODEL_KEY: model_state,
        OPTIMIZERS_KEY: {str(index): state for index, state in enumerate(optimizer_states)},
        LIGHTNING_KEY: b"",
    }


def warm_start(
    trainer: Any, *, step: int | None, epoch: int | None, callbacks: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Lightning's checkpoint dict for a checkpoint another door wrote: its loops at the checkpoint's `step` (and
    `epoch`, where it has one), the run's own LR scheduler states (Lightning requires the key), `callbacks`' states
    by state key; the model and optimizers come from the load."""
    checkpoint: dict[str, Any] = {
        "pytorch-lightning_version": lightning.__version__,
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "callbacks": callbacks or {},
    }
    if step is not None:  # every loop, as Lightning's own dict: validate / test / predict restore theirs from it
        checkpoint["loops"] = {
            "fit_loop": _fit_loop_at(trainer, step, epoch or 0),
            "validate_loop": trainer.validate_loop.state_dict(),
            "test_loop": trainer.test_loop.state_dict(),
            "predict_loop": trainer.predict_loop.state_dict(),
        }
    return checkpoint


def _fit_loop_at(trainer: Any, step: int, epoch: int) -> dict[str, Any]:
    """The fit loop's state of this (fresh) Trainer with `step` optimizer steps taken and `epoch` epochs done, at the
    start of an epoch: the writer kept no batch count, the sampler's restored position says where the data is."""
    state = trainer.fit_loop.state_dict()
    for progress in ("ready", "started", "processed", "completed"):
        for counts in ("total", "current"):
            state["epoch_progress"][counts][progress] = epoch
    # global_step reads the optimizer steps (automatic optimization) or the manual loop's step count
    for counts in (
        state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"],
        state["epoch_loop.manual_optimization.optim_step_progress"]["total"],
    ):
        counts["ready"] = counts["completed"] = step
    state["epoch_loop.state_dict"]["_batches_that_stepped"] = step  # the loggers' step
    return state


def lightning_rest(loaded: dict[str, Any], *, trust: bool = False, where: str = "checkpoint") -> dict[str, Any]:
    """The non-tensor part of Lightning's checkpoint dict from a loaded DCP state.

    Unpickled through an allow-list unless `trust`: a checkpoint from elsewhere must not run code on
    load. A blocked class raises UntrustedCheckpoint naming it, the checkpoint and the fix.
    """
    try:
        return safe_pickle.loads(loaded[LIGHTNING_KEY], safe_pickle.LIGHTNING_STATE_GLOBALS, trust=trust)
    except safe_pickle.BlockedGlobal as err:
        raise safe_pickle.untrusted(
            where, f"the Lightning state ({LIGHTNING_KEY!r}: loops, callbacks, hyperparameters)", err.name
        ) from err
