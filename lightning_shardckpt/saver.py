"""Write one checkpoint through DCP and our storage writer, and commit it (or fail cleanly)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from . import fsio, topology
from .collectives import broadcast_from_coordinator, new_checkpoint_group, rank_and_world
from .commit import CheckpointTarget, Committer
from .config import SaveConfig
from .errors import CommitFailed, ShardCkptError
from .layout import checkpoint_dirname, join, new_checkpoint_id
from .storage import FaultHook, ShardWriter

log = logging.getLogger(__name__)


@dataclass
class SaveResult:
    """The outcome of one save on this rank."""

    step: int
    checkpoint_id: str
    path: str
    committed: bool
    error: BaseException | None = None
    manifest: dict[str, Any] | None = None  # on the coordinator only
    bytes_rank: int = 0
    timings: dict[str, float] = field(default_factory=dict)


class CheckpointSaver:
    """Saves state dicts as committed, verified checkpoints under one root.

    Construct it on every rank at the same point (it creates the checkpoint process group).
    """

    def __init__(self, dirpath: str, config: SaveConfig | None = None, *, fault_hook: FaultHook | None = None) -> None:
        self.config = config or SaveConfig()
        self.root = fsio.resolve(dirpath, self.config.storage_options)
        fsio.makedirs(self.root.fs, self.root.path)
        self.group = new_checkpoint_group(self.config.collective_timeout_s)
        self._fault_hook = fault_hook

    def save(
        self,
        state_dict: dict[str, Any],
        step: int,
        *,
        epoch: int | None = None,
        samples_consumed: int | None = None,
        identity: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> SaveResult:
        """Write and commit `state_dict` as the checkpoint of `step`; never raises on a failed commit.

        A failed save leaves an uncommitted directory and the previous checkpoint as latest; the
        result carries the error.
        """
        started = time.perf_counter()
        # collective "checkpoint-id": all ranks must write into the same fresh directory
        checkpoint_id = broadcast_from_coordinator("checkpoint-id", new_checkpoint_id(), self.group)
        target = CheckpointTarget(
            root=self.root,
            dirname=checkpoint_dirname(step, checkpoint_id),
            checkpoint_id=checkpoint_id,
            step=step,
            verify_mode=self.config.verify.mode,
            manifest_fields={
                "epoch": epoch,
                "samples_consumed": samples_consumed,
                "topology": topology.describe(state_dict, self.group, self.config.parallelism),
                "identity": identity,
                "extra": extra,
            },
        )
        committer = Committer(target, self._fault_hook)
        writer = ShardWriter(
            self.root.fs, target.path, verify=self.config.verify, commit=committer, fault_hook=self._fault_hook
        )
        result = SaveResult(step=step, checkpoint_id=checkpoint_id, path=join(self.root.url, target.dirname), committed=False)
        try:
            dcp.save(state_dict, storage_writer=writer, process_group=self.group, planner=DefaultSavePlanner())
            result.committed = True
            result.manifest = committer.manifest
        except (CheckpointException, ShardCkptError, OSError, RuntimeError) as err:
            result.error = CommitFailed(f"step {step} did not commit ({target.dirname}): {_root_cause(err)}")
            result.error.__cause__ = err
            log.error("rank %d: %s", rank_and_world(self.group)[0], result.error)
        result.bytes_rank = writer.last_write_stats.get("bytes", 0)
        result.timings["total_s"] = time.perf_counter() - started
        return result


def _root_cause(err: BaseException) -> str:
    """DCP wraps per-rank failures; name the first rank's own error."""
    if isinstance(err, CheckpointException):
        failures = err.failures
        if failures:
            rank = sorted(failures)[0]
            cause = failures[rank][0]  # DCP stores (exception, traceback) per failed rank
            return f"rank {rank}: {type(cause).__name__}: {cause}"
    return f"{type(err).__name__}: {err}"
