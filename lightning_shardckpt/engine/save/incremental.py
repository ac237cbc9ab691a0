"""Change detection for incremental saves: which tensors are unchanged since the last save.

A tensor is unchanged when it is the same storage (data pointer and storage identity), the same
shape/stride/dtype, and torch's in-place version counter has not moved since the last save. Every
in-place op (`add_`, `copy_`, an optimizer step, `zero_`) bumps `_version`; re-assigning a parameter
gives a new storage. For a DTensor (FSDP2), an in-place op bumps the DTensor's own counter, not its
`_local_tensor`'s, so both are keyed.

Not detected: writes that bypass autograd's version counter, i.e. through `.data` (`p.data.copy_(x)`,
`p.data[...] = x`) or through another framework's view of the same memory (numpy, DLPack, a CUDA
kernel writing raw pointers). Use `full_every_n` (or a full save) after such writes.
"""

from __future__ import annotations

from typing import Any

import torch

Key = tuple


def _signature(tensor: torch.Tensor) -> Key:
    local = tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
    storage = local.untyped_storage()
    return (
        tensor._version,
        local._version,
        storage.data_ptr(),
        storage.nbytes(),
        local.storage_offset(),
        tuple(local.shape),
        tuple(local.stride()),
        local.dtype,
        local.device,
    )


def signatures(
    state: Any, prefix: str = "", out: dict[str, Key] | None = None, held: list | None = None
) -> dict[str, Key]:
    """Flattened key (as DCP and staging name it) -> change signature, for every tensor in `state`.

    `held` collects each tensor's storage: holding it keeps its memory from being reused (see ChangeTracker).
    """
    out = {} if out is None else out
    if isinstance(state, torch.Tensor):
        out[prefix] = _signature(state)
        if held is not None:
            local = state._local_tensor if hasattr(state, "_local_tensor") else state
            held.append(local.untyped_storage())
    elif isinstance(state, dict):
        for key, value in state.items():
            signatures(value, f"{prefix}.{key}" if prefix else str(key), out, held)
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            signatures(value, f"{prefix}.{index}" if prefix else str(index), out, held)
    return out


class ChangeTracker:
    """Remembers the signatures of the last save; says which tensors have not changed since.

    `plan(state)` is called on the training thread at each save request, before anything is staged.
    It returns the keys that may be referenced (empty: a full save) and remembers this save's
    signatures. The first save, a save after `reset()` and every `full_every_n`-th save are full.

    The storages of the last save's tensors are held until the next save: a tensor the state dict
    builds afresh each time (an RNG state, a copy) could otherwise be allocated at the address of the
    previous one, with the same shape and a version of 0, and pass for unchanged. Held, no new tensor
    can have that address. For parameters and optimizer state this costs nothing (they are alive
    anyway); for a state dict made of copies (e.g. offloaded full state dicts) it holds one extra copy,
    and incremental detects nothing there: leave it off for such strategies.
    """

    # why plan() returned a full save (None: it did not): what the saver logs, so incrementality is never lost silently
    NEW_SAVER = (
        "this saver has written no checkpoint yet: a new saver (a restarted job) cannot prove a tensor unchanged since "
        "a checkpoint it did not write, so its first save is full and the chain continues from it (FORMAT.md §9)"
    )
    AFTER_FAILURE = "the previous save did not commit (or the run resumed): nothing it wrote can be referenced"
    EVERY_N = "save.full_every_n={n}: every {n}-th save is full, so references reach back at most {m} saves"

    def __init__(self, full_every_n: int) -> None:
        self.full_every_n = full_every_n
        self.full_because: str | None = None
        self._reset = False  # reset() since the last plan: a failure, not a new saver
        self._last: dict[str, Key] | None = None
        self._held: list = []
        self._since_full = 0  # incremental saves since the last full one
        self._before_plan: tuple | None = None  # what the last plan() replaced, until undo() or the next plan()

    def reset(self) -> None:
        """The next save is full (the last save failed, or the run resumed)."""
        self._last = None
        self._held = []
        self._reset = True

    def plan(self, state: Any) -> frozenset[str]:
        held: list = []
        now = signatures(state, held=held)
        self._before_plan = (self._last, self._held, self._since_full, self._reset)
        last, self._last = self._last, now
        self._held = held  # the previous save's storages are released only now, after the comparison
        reset, self._reset = self._reset, False
        if last is None or self._since_full + 1 >= self.full_every_n:
            if last is None:
                self.full_because = self.AFTER_FAILURE if reset else self.NEW_SAVER
            else:
                self.full_because = self.EVERY_N.format(n=self.full_every_n, m=self.full_every_n - 1)
            self._since_full = 0
            return frozenset()
        self.full_because = None
        self._since_full += 1
        return frozenset(key for key, signature in now.items() if last.get(key) == signature)

    def undo(self) -> None:
        """Forget the last plan(): its save never happened (staging it failed), so the save before stays
        "the last save". Kept, that plan would have the next save reference tensors that changed since the
        last checkpoint written, which holds their older values."""
        if self._before_plan is not None:
            self._last, self._held, self._since_full, self._reset = self._before_plan
            self._before_plan = None
