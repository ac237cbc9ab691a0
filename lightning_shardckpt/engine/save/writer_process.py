"""The write of a checkpoint in a long-lived writer process per rank (SaveConfig.writer="process").

With the writer thread, the training process's GIL is held by the write's Python (DCP planning,
pickling, checksums, the commit protocol) while forward/backward run beside it. Here the training
process only stages into shared-memory buffers (StagingBuffers(shared=True), allocated once and
refilled every save) and hands the staged tree to its writer process over a pipe: tensors travel as
handles to the same shared memory, not as bytes. The writer process runs the same persist_checkpoint
(our ShardWriter + verify + commit) and sends the SaveResult back, so results, events, plug-ins and
errors behave as with the thread.

The commit protocol runs collectives: the writer processes form a gloo group of their own, through a
TCPStore that rank 0's training process serves (as DCP's process-based async executor does, but with
the store held by the parent: no port race, and a writer that dies cannot take the store with it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from ...errors import CommitFailed
from ..collectives import broadcast_from_coordinator, rank_and_world
from ..config import SaveConfig
from ..storage import fsio
from ..storage.fsio import Location
from ..storage.writer import FaultHook
from ..tree import iter_tensors
from .persist import SaveMeta, SaveResult, persist_checkpoint

log = logging.getLogger(__name__)

READY = "ready"
STORE_PREFIX = "shardckpt-writer/"  # the writer group's keys in the rendezvous store


class InThreadWriter:
    """persist_checkpoint on the calling (background) thread: writer="thread"."""

    def __init__(self, root: Location, group: Any, config: SaveConfig, fault_hook: FaultHook | None) -> None:
        self.root, self.group, self.config, self.fault_hook = root, group, config, fault_hook

    def persist(self, state: dict[str, Any], step: int, meta: SaveMeta) -> SaveResult:
        return persist_checkpoint(self.root, self.group, self.config, state, step, meta, self.fault_hook)

    def close(self, timeout: float) -> None:
        return None


class WriterProcess:
    """One rank's writer process; constructed on every rank at the same point (it rendezvouses over `group`)."""

    def __init__(self, dirpath: str, config: SaveConfig, group: Any, fault_hook: FaultHook | None = None) -> None:
        """`fault_hook` (tests) must be picklable: it runs in the writer process."""
        rank, world = rank_and_world(group)
        self.rank = rank
        # per staging slot, the shared-memory tensors the writer process holds (in order), keyed by the id of the
        # slot's first tensor (held here, so the id stays unique); bounded: a layout change allocates anew
        self._shared: dict[int, list[torch.Tensor]] = {}
        self._shared_limit = 2 * config.max_in_flight
        # torchrun sets MASTER_ADDR (rank 0's host); single-node runs without it reach rank 0 on loopback
        host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
        self._store = None
        if rank == 0:
            self._store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False)
        port = broadcast_from_coordinator("writer-process-store", self._store.port if self._store else None, group)
        context = mp.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(
            target=_serve,
            args=(child, dirpath, config, rank, world, host, port, fault_hook),
            name=f"shardckpt-writer-{rank}",
            daemon=True,
        )
        with _main_module_hidden():
            self._process.start()
        child.close()
        reply = self._receive("starting")
        if reply != READY:
            raise CommitFailed(f"rank {rank}: the checkpoint writer process did not start: {reply}") from (
                reply if isinstance(reply, BaseException) else None
            )

    def persist(self, state: dict[str, Any], step: int, meta: SaveMeta) -> SaveResult:
        """Send the staged tree (shared-memory tensors) to the writer process; its SaveResult."""
        if any(isinstance(t, DTensor) for t in iter_tensors(state)):
            raise CommitFailed(
                f"step {step}: writer='process' saves plain tensors only; this state holds DTensors (FSDP/TP). "
                "Set save.writer='thread'"
            )
        identical = meta.identical
        # a callable does not cross the pipe: the keys it accepts do
        keys = None if identical is None else frozenset(k for k in flatten_state_dict(state)[0] if identical(k))
        portable = SaveMeta(meta.epoch, meta.samples_consumed, meta.identity, meta.extra, None, meta.references)
        tensors: list[torch.Tensor] = []
        tree = _by_reference(state, tensors)
        # the staging slot refills the same tensors every save: they cross the pipe (one fd handshake with the
        # parent's resource-sharer thread each, GIL held) only when the slot was (re)allocated
        key = id(tensors[0]) if tensors else 0
        held = self._shared.get(key)
        if held is None or len(held) != len(tensors) or any(a is not b for a, b in zip(tensors, held)):
            if held is None and len(self._shared) >= self._shared_limit:
                oldest = next(iter(self._shared))
                del self._shared[oldest]
                self._connection.send(("forget", oldest))
            self._connection.send(("tensors", key, tensors))
            self._shared[key] = tensors
        self._connection.send(("save", key, tree, step, portable, keys))
        reply = self._receive(f"writing step {step}")
        if isinstance(reply, SaveResult):
            return reply
        raise CommitFailed(f"step {step}: the checkpoint writer process failed: {reply}")

    def _receive(self, doing: str) -> Any:
        try:
            return self._connection.recv()  # blocks in C, GIL released: the training thread runs
        except (EOFError, OSError) as err:
            self._process.join(5)
            raise CommitFailed(
                f"rank {self.rank}: the checkpoint writer process exited while {doing} "
                f"(exit code {self._process.exitcode}); the next save starts no new one: set save.writer='thread' "
                "or restart the run"
            ) from err

    def close(self, timeout: float) -> None:
        """Stop the writer process (after the saver's in-flight saves finished)."""
        if self._process.is_alive():
            try:
                self._connection.send(None)
            except OSError:
                pass
            self._process.join(timeout)
            if self._process.is_alive():
                log.error(
                    "rank %d: the checkpoint writer process did not stop within %.0fs; killed", self.rank, timeout
                )
                self._process.kill()
                self._process.join(5)
        self._connection.close()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a spawned process without it re-running the training script.

    Spawn imports the parent's __main__ in the child (as __mp_main__); a training script without an
    `if __name__ == "__main__":` guard would train again in the writer. The writer needs nothing from
    __main__ (its target and arguments live in this package), so the child is told of none.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _serve(
    connection: Any,
    dirpath: str,
    config: SaveConfig,
    rank: int,
    world: int,
    host: str,
    port: int,
    fault_hook: FaultHook | None,
) -> None:
    """The writer process: join the writer group, then persist every staged tree it is sent, in order."""
    shared: dict[int, list[torch.Tensor]] = {}  # per staging slot (WriterProcess._shared)
    torch.set_num_threads(1)  # the write is I/O and checksums; never compete with training for intra-op threads
    try:
        store = dist.PrefixStore(STORE_PREFIX, dist.TCPStore(host, port, world, is_master=False))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=config.collective_timeout_s)
        )
        root = fsio.resolve(dirpath, config.storage_options)
        group = dist.group.WORLD
        connection.send(READY)
    except BaseException as err:
        connection.send(_portable_error(err))
        return
    try:
        while True:
            try:
                request = connection.recv()
            except EOFError:  # the training process is gone
                return
            if request is None:
                return
            if request[0] == "tensors":
                shared[request[1]] = request[2]
                continue
            if request[0] == "forget":
                shared.pop(request[1], None)
                continue
            _, key, tree, step, meta, identical_keys = request
            state = _resolve(tree, shared[key])
            meta.identical = None if identical_keys is None else identical_keys.__contains__
            try:
                result = persist_checkpoint(root, group, config, state, step, meta, fault_hook)
            except BaseException as err:  # persist never raises on a failed commit: this is a bug, reported
                result = SaveResult(step=step, checkpoint_id=None, path=None, committed=False, error=err)
            del state
            if result.error is not None:
                result.error = _portable_error(result.error)
            connection.send(result)
    finally:
        dist.destroy_process_group()


def _portable_error(err: BaseException) -> BaseException:
    """`err` as the parent can unpickle it: the same type when it round-trips, else CommitFailed with its text."""
    import pickle

    err.__traceback__ = None
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return CommitFailed(f"{type(err).__name__}: {err}")


class _TensorRef:
    """Stands for the `index`-th shared tensor the writer process holds."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (_TensorRef, (self.index,))


def _by_reference(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """`tree` with every tensor replaced by a _TensorRef into `tensors` (appended in order)."""
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return _TensorRef(len(tensors) - 1)
    if isinstance(tree, dict):
        return {key: _by_reference(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_by_reference(value, tensors) for value in tree]
        return tuple(items) if isinstance(tree, tuple) else items
    return tree


def _resolve(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of _by_reference, in the writer process."""
    if isinstance(tree, _TensorRef):
        return tensors[tree.index]
    if isinstance(tree, dict):
        return {key: _resolve(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_resolve(value, tensors) for value in tree]
        return tuple(items) if isinstance(tree, tuple) else items
    return tree
