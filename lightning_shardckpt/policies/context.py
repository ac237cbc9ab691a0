"""What a plug-in sees of the run at an event: the `PluginContext` a front door fills in, the `Reporter` it sends
metrics and alerts to, and the `SaverHosting` it may ask for savers. Framework-free; policies/plugin.py is the
contract that uses them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..engine.config import SaveConfig
from ..engine.storage.fsio import Location

if TYPE_CHECKING:
    import torch.distributed as dist

    from ..engine.save.saver import CheckpointSaver, FaultHook


class Reporter:
    """Where plug-ins send what the run's loggers show; the no-op default for runs without loggers."""

    def log_metrics(self, values: dict[str, float]) -> None:
        pass

    def alert(self, title: str, text: str, level: str, wait_s: float) -> None:
        """`level`: INFO, WARN or ERROR. The log line and the event under ROOT/events/ are the alert otherwise."""

    def checkpoints_deleted(self, deleted: list[dict[str, Any]]) -> None:
        """Retention deleted these checkpoints (rank 0, training thread): whatever references them (a W&B
        artifact) says so, so nobody follows a dead reference. Each: checkpoint, step, uri, deleted_at."""


@dataclass
class PluginContext:
    """What plug-ins see of the run at a hook (the front door refreshes it; framework-free)."""

    location: Location | None = None  # the checkpoint root
    storage_options: dict[str, Any] = field(default_factory=dict)  # of the root (drill processes open it too)
    stage: str | None = None  # setup: "fit", "validate", ...
    run_id: str | None = None
    is_global_zero: bool = True
    world_size: int = 1
    saver: CheckpointSaver | None = None  # the saver saves go to now
    host: SaverHosting | None = None  # the front door's savers and its training-thread agreement
    reporter: Reporter = field(default_factory=Reporter)
    all_reduce_max: Callable[[list[float]], list[float]] = lambda values: values  # over the training group
    allow_shared_root: bool = False
    fault_hook: FaultHook | None = None  # tests only: the door's fault injection, passed on to background copies
    resume_event: dict[str, Any] | None = None  # train start after a resume: the resume's event document
    publish: Callable[[dict[str, Any]], None] = lambda event: None  # hand an event document to every plug-in
    request_drill: Callable[[str], None] = lambda path: None  # drill this checkpoint now (a health rule)
    spare: Callable[[int | None], set[str]] = lambda keep_last: set()  # what retention must keep (every plug-in's)


class SaverHosting(Protocol):
    """What plug-ins may ask of the front door's saver host (training/savers.py `SaverHost`)."""

    @property
    def save_config(self) -> SaveConfig: ...

    def saver_for(self, root: str) -> CheckpointSaver: ...

    def existing_saver(self, root: str) -> CheckpointSaver | None: ...

    def replace_saver(self, root: str, saver: CheckpointSaver) -> None: ...

    def checkpoint_group(self) -> dist.ProcessGroup | None: ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...  # noqa: A002 - Lightning's name
