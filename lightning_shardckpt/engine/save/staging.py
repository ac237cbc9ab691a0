"""Host copies of a rank's state, allocated once and refilled in place at every checkpoint.

The training loop pauses only for this copy. A copy into memory that was used before runs at memory
bandwidth (12–14 GiB/s here); into freshly allocated memory it measured 4–50x slower, so buffers live
as long as the state keeps its layout. On CUDA the buffers are pinned and filled by non-blocking
copies on a side stream; `wait_until_ready` (called by the background thread) syncs on an event.

Overlapped staging (`stage(state, defer=...)`): the tensors `defer(fqn)` names (parameters and
optimizer state, which change only in the optimizer step) are copied by a `DeferredCopy` while the
next batch's forward and backward run; everything else (buffers that change in forward, counters,
pickled state) is copied before `stage` returns. The training thread calls `DeferredCopy.fence`
before the deferred state may change.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._state_dict_utils import _create_cpu_state_dict
from torch.distributed.tensor import DTensor

from ...errors import ShardCkptError
from ..tree import iter_tensors

log = logging.getLogger(__name__)


def layout_signature(state: Any, prefix: str = "") -> tuple:
    """Keys, types, shapes and dtypes: buffers are reused while this stays the same."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if isinstance(state, DTensor) else state
        return ((prefix, type(state).__name__, tuple(local.shape), local.dtype),)
    if isinstance(state, dict):
        return tuple(item for key in state for item in layout_signature(state[key], f"{prefix}.{key}"))
    if isinstance(state, (list, tuple)):
        return ((prefix, type(state).__name__, len(state)),) + tuple(
            item for index, value in enumerate(state) for item in layout_signature(value, f"{prefix}.{index}")
        )
    return ((prefix, "object"),)


def _has_cuda_tensors(state: Any) -> bool:
    return any(tensor.device.type == "cuda" for tensor in iter_tensors(state))


class StagingFailed(ShardCkptError):
    """Copying the state into staging memory failed (a value that cannot be copied, or the background part
    of an overlapped copy): that checkpoint cannot commit."""


Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (live source, staging buffer), local tensors


class DeferredCopy:
    """The large part of one staging copy (parameters, optimizer state), running while training goes on.

    CPU: one background thread copies tensor by tensor; torch's copy releases the GIL, so the next
    forward and backward run meanwhile. CUDA: non-blocking copies on the staging side stream into
    pinned buffers, already queued by `StagingBuffers.stage`; an event marks their end.
    """

    def __init__(self, pairs: Pairs, event: Any = None) -> None:
        self.nbytes = sum(target.nbytes for _, target in pairs)
        self.seconds = 0.0  # how long the background copy ran (CPU)
        self.error: BaseException | None = None
        self._event = event
        self._done = threading.Event()
        if event is not None:
            self._done.set()  # the GPU orders the rest: fence and wait use the event
        else:
            self._pairs = pairs
            threading.Thread(target=self._copy, name="shardckpt-staging", daemon=True).start()

    def _copy(self) -> None:
        started = time.perf_counter()
        try:
            with torch.no_grad():  # grad mode is per thread: the buffers must not join the autograd graph
                for source, target in self._pairs:
                    target.copy_(source)
        except BaseException as err:  # kept for the save, which then fails; training is not interrupted
            self.error = err
            log.error("the background staging copy failed: %s", err)
        finally:
            self._pairs = []  # no reference to live training memory once copied
            self.seconds = time.perf_counter() - started
            self._done.set()

    def fence(self) -> float:
        """On the training thread, before the deferred state may change; returns the seconds it blocked.

        CUDA: the training stream waits for the copy's event, the CPU does not block.
        """
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            return 0.0
        started = time.perf_counter()
        self._done.wait()
        return time.perf_counter() - started

    def done(self) -> bool:
        return self._done.is_set() if self._event is None else self._event.query()

    def wait(self) -> None:
        """On the writing thread: block until the bytes are in host memory; raise if the copy failed."""
        if self._event is not None:
            self._event.synchronize()
        self._done.wait()
        if self.error is not None:
            raise StagingFailed(
                f"the overlapped staging copy failed: {type(self.error).__name__}: {self.error}"
            ) from self.error


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes are stored: a DTensor's local shard, detached from autograd."""
    return (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).detach()


def _fill(
    state: Any,
    buffers: Any,
    prefix: str,
    defer: Callable[[str], bool],
    now: Pairs,
    later: Pairs,
    skip: frozenset[str] = frozenset(),
) -> Any:
    """The staged tree: `buffers`' tensors in `state`'s containers, copies split into `now` and `later`.

    `prefix` is the flattened key DCP gives the item ("model.net.0.weight", "optimizers.0.state....").
    Non-tensor leaves are immutable or deep-copied here, so later changes never reach the snapshot.
    """
    if isinstance(state, torch.Tensor):
        if prefix in skip:  # incremental save, unchanged: the writer references it, never reads it (no copy)
            return state
        (later if defer(prefix) else now).append((_local(state), _local(buffers)))
        return buffers
    if isinstance(state, dict):
        return {
            key: _fill(value, buffers[key], f"{prefix}.{key}" if prefix else str(key), defer, now, later, skip)
            for key, value in state.items()
        }
    if isinstance(state, (list, tuple)):
        items = [
            _fill(value, buffers[index], f"{prefix}.{index}" if prefix else str(index), defer, now, later, skip)
            for index, value in enumerate(state)
        ]
        return tuple(items) if isinstance(state, tuple) else items
    if state is None or isinstance(state, (int, float, str, bytes)):
        return state
    return copy.deepcopy(state)


def _uncopyable(state: Any, prefix: str = "") -> tuple[str, Any] | None:
    """The first non-tensor value `_fill` (or the buffer allocation) cannot deep-copy: (flattened key, value)."""
    if isinstance(state, torch.Tensor) or state is None or isinstance(state, (int, float, str, bytes)):
        return None
    if isinstance(state, (dict, list, tuple)):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        for key, value in items:
            found = _uncopyable(value, f"{prefix}.{key}" if prefix else str(key))
            if found is not None:
                return found
        return None
    try:
        copy.deepcopy(state)
    except Exception:
        return prefix, state
    return None


def _staging_failed(state_dict: dict[str, Any], err: Exception) -> StagingFailed:
    """The error `stage` raises: names the value that could not be copied, when one is the cause, and the fix."""
    found = _uncopyable(state_dict)
    if found is None:
        return StagingFailed(
            f"copying the state into staging memory failed: {type(err).__name__}: {err}. Nothing was saved; "
            "fix the cause and save again"
        )
    key, value = found
    return StagingFailed(
        f"cannot copy {key!r} ({type(value).__name__}) into the checkpoint: {type(err).__name__}: {err}. "
        "Nothing was saved. Keep only tensors, containers and values copy.deepcopy can copy in the state dict "
        "(drop that value or store something copyable in its place), then save again"
    )


def _nothing(fqn: str) -> bool:
    return False


class StagingBuffers:
    """One reusable host copy of a state dict (one checkpoint's worth of staging memory)."""

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self._signature: tuple | None = None
        self._event: Any = None
        self._stream: Any = None
        self.allocations = 0  # how often buffers were (re)allocated: stays 1 while the layout is stable
        self.nbytes = 0
        self.deferred: DeferredCopy | None = None  # the overlapped part of the last stage(), until waited for

    def stage(
        self, state_dict: dict[str, Any], defer: Callable[[str], bool] | None = None, skip: frozenset[str] = frozenset()
    ) -> dict[str, Any]:
        """Copy `state_dict` into the buffers; return a state dict that owns no training memory.

        Tensors are copied into the reused buffers; containers are rebuilt and other objects deep-copied,
        so changes the training loop makes after this returns never reach the checkpoint. Tensors whose
        flattened key `defer` accepts are copied in the background instead (`self.deferred`): until its
        `fence()` returned, the caller must not change them. Tensors named in `skip` (unchanged since an
        incremental save's base) are not copied: the staged tree holds the live tensor, which the writer
        never reads (it writes a reference).

        Raises StagingFailed (naming the value, when one cannot be copied) if the copy fails; nothing was
        deferred then.
        """
        try:
            return self._stage(state_dict, defer, skip)
        except StagingFailed:
            raise
        except Exception as err:
            raise _staging_failed(state_dict, err) from err

    def _stage(self, state_dict: dict[str, Any], defer: Callable[[str], bool] | None, skip: frozenset[str]) -> Any:
        signature = layout_signature(state_dict)
        on_cuda = _has_cuda_tensors(state_dict)
        if signature != self._signature:
            self._allocate(state_dict, signature, pin=on_cuda)
        now: Pairs = []
        later: Pairs = []
        staged = _fill(state_dict, self._buffers, "", defer or _nothing, now, later, skip)
        if not on_cuda:
            with torch.no_grad():
                for source, target in now:
                    target.copy_(source)
            self.deferred = DeferredCopy(later) if later else None
            return staged
        # CUDA: copy on a side stream that first waits for the work that produced the state.
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream), torch.no_grad():
            for source, target in now:
                target.copy_(source, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
            for source, target in later:  # queued behind the small copies, which the next forward waits for
                target.copy_(source, non_blocking=True)
            later_event = torch.cuda.Event()
            later_event.record(self._stream)
        # the training stream must not overwrite what is copied now before the copy read it; the GPU
        # orders it, the CPU does not block. The deferred part is ordered at its fence.
        torch.cuda.current_stream().wait_event(self._event)
        self.deferred = DeferredCopy(later, event=later_event) if later else None
        return staged

    def allocate_like(self, state_dict: dict[str, Any]) -> None:
        """Allocate buffers for `state_dict`'s layout and touch every page (no values are kept)."""
        signature = layout_signature(state_dict)
        if signature == self._signature:
            return
        self._allocate(state_dict, signature, pin=_has_cuda_tensors(state_dict))
        for tensor in iter_tensors(self._buffers):
            (
                tensor.to_local() if isinstance(tensor, DTensor) else tensor
            ).zero_()  # first touch, off the training thread

    def wait_until_ready(self) -> None:
        """Block until every copy of the last stage() has landed (device-to-host and overlapped ones).

        Raises StagingFailed when the overlapped copy failed.
        """
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            deferred.wait()

    def _allocate(self, state_dict: dict[str, Any], signature: tuple, *, pin: bool) -> None:
        self._buffers = _create_cpu_state_dict(state_dict, pin_memory=pin, share_memory=False)
        self._signature = signature
        self.allocations += 1
        self.nbytes = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in iter_tensors(self._buffers))
        kind = ("pinned " if pin else "") + "host"
        log.info("allocated %.1f MiB of %s staging memory", self.nbytes / 2**20, kind)
