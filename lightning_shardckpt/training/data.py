"""Exact data position across world-size changes: one global order per epoch, and per-rank RNG state.

The rules (docs/FORMAT.md and docs/howto/resize.md refer here):

- **Order.** Epoch `e` has ONE global order of the dataset: `torch.randperm(n)` seeded with `seed + e`
  (`range(n)` without shuffle), the permutation torch's DistributedSampler uses.
- **Position.** `global_position` counts samples of that order consumed *by training steps* of all
  ranks together: `order[:global_position]` is exactly what the model has been trained on this epoch.
- **Assignment.** A pass starts at `pass_start` (the position when iteration begins) and deals
  `order[pass_start:]` round-robin: rank r gets remaining[r], remaining[r + N], ... Once every rank has
  consumed k samples of its stream, the union consumed is exactly `remaining[:k * N]`, a prefix, so the
  position is `pass_start + k * N`. A run resumed on M ranks deals `order[position:]` among M ranks: its
  first samples are exactly the next unseen ones, whatever N was.
- **Remainder.** DDP needs every rank to take the same number of steps, so with R samples remaining:
  drop_last=False: every rank yields ceil(R / N); ranks r >= R % N end with one *padding* sample (a
  repeat of the pass's first samples). Padding never counts in the position (it stops at the pass's end),
  and `num_padded` tells the rank it holds one, e.g. to mask it from a metric.
  drop_last=True: every rank yields R // N; the last R % N samples of the order are not seen this epoch
  (`dropped`). A resumed run on M ranks may drop a different tail (always < M samples).
- **Length.** `len(sampler)` is a whole epoch's per-rank length on the current world size, also for a
  pass resumed mid-epoch, which yields only the rest (`num_samples`): Lightning sizes the epoch by it and
  counts the resumed epoch's batches from where the position stands (`restore_position`).
- **Consumption.** The position moves only through `mark_consumed`, `load_state_dict` and
  `set_epoch(<another epoch>)`, never because the loader fetched indices: a DataLoader prefetches ahead of
  training, and a batch fetched but not trained on must be seen again after a resume.
- **RNG on a rank-count change.** Rank r restores saved rank r's state when it exists; a rank beyond the
  saved world size gets a state derived deterministically from saved rank 0's state and r
  (`rng_state_for_rank`). States of saved ranks >= M are not used.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler

from ..engine.collectives import all_gather_objects
from ..engine.format.checksum import checksum
from ..errors import IncompatibleCheckpoint

log = logging.getLogger(__name__)

SAMPLER_STATE_VERSION = 1


class ResumableDistributedSampler(DistributedSampler[int]):
    """A DistributedSampler whose position in the epoch survives a checkpoint and a world-size change.

    With `global_position == 0` it yields exactly what torch's DistributedSampler yields. Being a
    DistributedSampler, a loader that already uses it is left alone by Lightning's sampler injection.

    Drive it from the training loop: call `mark_consumed(batches, batch_size)` when `batches` more
    batches per rank have been applied by an optimizer step (with gradient accumulation: at the step,
    for all micro-batches since the previous step), then `state_dict()` at checkpoint time.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.dataset_length = len(dataset)
        self.global_position = 0
        # the current pass (_begin_pass sets them): where it started, what each rank consumed, what it keeps
        self._pass_start, self._consumed_per_rank, self._pass_kept = 0, 0, 0
        self._begin_pass()

    # --- the DistributedSampler surface ---
    def __iter__(self) -> Iterator[int]:
        # a pass deals what is unseen *now*: a loaded state or an earlier pass's consumption counts
        self._begin_pass()
        return iter(self.rank_indices())

    def __len__(self) -> int:
        # the whole epoch's per-rank length on this world size, also for a pass resumed mid-epoch (which
        # yields only `num_samples`): Lightning sizes the epoch by it, and restore_position
        # (sampler_injection.py) starts the epoch's batch count where the resumed pass stands
        return self.epoch_num_samples

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` at position 0; the current epoch again keeps its position (a resume)."""
        # the same epoch leaves the pass alone: Lightning calls set_epoch after a resumed iterator exists
        if epoch != self.epoch:
            self.epoch = epoch
            self.global_position = 0
            self._begin_pass()

    # --- position ---
    def mark_consumed(self, batches: int, batch_size: int) -> None:
        """Record that every rank trained on `batches` more batches of `batch_size` from this pass.

        Call it on every rank with the same numbers (ranks step in lockstep), when an optimizer step has
        applied them: micro-batches of an unfinished accumulation are not consumed (their gradients
        die with the process), so they are seen again after a resume. A last, shorter batch counts as
        `batch_size`: the count stops at the end of the rank's stream.
        """
        if batches < 0 or batch_size < 1:
            raise ValueError(
                f"mark_consumed(batches={batches}, batch_size={batch_size}): use batches >= 0 and batch_size >= 1"
            )
        self._consumed_per_rank = min(self._consumed_per_rank + batches * batch_size, self.num_samples)
        # the consumed union is the prefix remaining[:k * N]; padding lies past `_pass_kept`, never counted
        self.global_position = self._pass_start + min(self._consumed_per_rank * self.num_replicas, self._pass_kept)

    @property
    def pass_start(self) -> int:
        return self._pass_start

    @property
    def epoch_complete(self) -> bool:
        """Every rank has consumed its whole stream of the current pass (nothing of this epoch is left)."""
        return self._consumed_per_rank >= self.num_samples

    @property
    def num_padded(self) -> int:
        """Padding samples (0 or 1) at the end of this rank's stream in the current pass."""
        if self.drop_last:
            return 0
        remaining = self.dataset_length - self._pass_start
        return 1 if remaining % self.num_replicas and self.rank >= remaining % self.num_replicas else 0

    @property
    def dropped(self) -> list[int]:
        """Dataset indices this pass does not deal to any rank (drop_last=True only)."""
        order = self.epoch_order()
        return order[self._pass_start + self._pass_kept :] if self.drop_last else []

    def epoch_order(self) -> list[int]:
        """The global order of the current epoch: the same on every rank, for any world size."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.dataset_length, generator=generator).tolist()
        return list(range(self.dataset_length))

    def rank_indices(self, rank: int | None = None) -> list[int]:
        """What `rank` (default: this rank) yields in the current pass, padding included."""
        rank = self.rank if rank is None else rank
        remaining = self.epoch_order()[self._pass_start :]
        if not remaining:
            return []
        stream = []
        for j in range(rank, self.num_samples * self.num_replicas, self.num_replicas):
            stream.append(remaining[j] if j < len(remaining) else remaining[(j - len(remaining)) % len(remaining)])
        return stream

    # --- checkpoint state ---
    def state_dict(self) -> dict[str, Any]:
        """The same on every rank after the same `mark_consumed` calls; save it once per checkpoint."""
        return {
            "version": SAMPLER_STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "global_position": self.global_position,
            "epoch_complete": self.epoch_complete,
            "dataset_length": self.dataset_length,
            "num_replicas": self.num_replicas,  # informational: the position does not depend on it
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` left off, on this sampler's world size; call before iterating.

        A state whose epoch was complete loads as the start of the next epoch, so an iterator created
        before the trainer's `set_epoch` (DataLoader workers prefetch on `iter()`) deals the right epoch.
        """
        if state.get("dataset_length") != self.dataset_length:
            raise IncompatibleCheckpoint(
                f"the sampler state was saved for a dataset of {state.get('dataset_length')} samples, this one has "
                f"{self.dataset_length}: its position means nothing here; resume with the saved dataset, or start "
                "the epoch over by not loading the sampler state"
            )
        for option in ("seed", "shuffle"):
            if state[option] != getattr(self, option):
                # the epoch in progress was ordered with the saved value: keep it, or samples repeat and go missing
                log.warning(
                    "sampler %s=%r differs from the checkpoint's %r; using the checkpoint's for an exact resume",
                    option,
                    getattr(self, option),
                    state[option],
                )
                setattr(self, option, state[option])
        if state.get("drop_last", self.drop_last) != self.drop_last:
            log.warning(
                "sampler drop_last=%r differs from the checkpoint's %r; keeping %r",
                self.drop_last,
                state["drop_last"],
                self.drop_last,
            )
        position = int(state["global_position"])
        if not 0 <= position <= self.dataset_length:
            raise IncompatibleCheckpoint(f"sampler global_position={position} is outside [0, {self.dataset_length}]")
        if state.get("epoch_complete"):
            self.epoch, self.global_position = int(state["epoch"]) + 1, 0
        else:
            self.epoch, self.global_position = int(state["epoch"]), position
        self._begin_pass()

    # --- internals ---
    @property
    def epoch_num_samples(self) -> int:
        """What each rank yields in a whole epoch (a pass from position 0) on this world size."""
        if self.drop_last:
            return self.dataset_length // self.num_replicas
        return math.ceil(self.dataset_length / self.num_replicas)

    def _begin_pass(self) -> None:
        self._pass_start = self.global_position
        self._consumed_per_rank = 0
        remaining = self.dataset_length - self._pass_start
        if self.drop_last:
            self.num_samples = remaining // self.num_replicas
            self._pass_kept = self.num_samples * self.num_replicas
        else:
            self.num_samples = math.ceil(remaining / self.num_replicas)
            self._pass_kept = remaining
        self.total_size = self.num_samples * self.num_replicas


def replacing(
    plain: DistributedSampler[Any], kind: type[ResumableDistributedSampler] = ResumableDistributedSampler
) -> ResumableDistributedSampler:
    """A resumable sampler (`kind`) with the arguments of an injected DistributedSampler: same order at position 0."""
    return kind(
        plain.dataset,
        num_replicas=plain.num_replicas,
        rank=plain.rank,
        shuffle=plain.shuffle,
        seed=plain.seed,
        drop_last=plain.drop_last,
    )


def samples_consumed(sampler: ResumableDistributedSampler) -> int:
    """Samples trained on since the first epoch began (recorded in every manifest: `shardckpt timeline`)."""
    return sampler.epoch * sampler.dataset_length + sampler.global_position


# --- RNG state, per rank ---
def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch CPU and CUDA generator states, as plain picklable values.

    Only dicts, lists, tuples, ints, floats and bytes: it survives `torch.load(weights_only=True)`, and
    DCP stores a list of them as one object.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": None,
        "torch": bytes(torch.get_rng_state().numpy().tobytes()),
        "cuda": None,
        "cuda_seed": None,
        "derived_from": None,
    }
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(cached))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [bytes(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's generators from `state` (from `capture_rng_state` or `rng_state_for_rank`)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np = _numpy()
    if np is not None and state.get("numpy") is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if torch.cuda.is_available():
        if state.get("cuda"):
            # a host with fewer devices restores the first ones; extra devices keep their own state
            for device, saved in enumerate(state["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(torch.frombuffer(bytearray(saved), dtype=torch.uint8), device)
        elif state.get("cuda_seed") is not None:
            torch.cuda.manual_seed_all(state["cuda_seed"])


def gather_rng_states(group: Any = None) -> list[dict[str, Any]]:
    """Collective "rng-states": every rank's `capture_rng_state()`, in rank order, on every rank.

    Save the list as one object: every rank then holds identical bytes, and a resumed run of any size
    finds every saved rank's state in it.
    """
    return all_gather_objects("rng-states", capture_rng_state(), group)


def rng_state_for_rank(saved: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """The state `rank` restores from the saved ranks' states (the rule in the module docstring)."""
    if not saved:
        raise IncompatibleCheckpoint("the checkpoint holds no RNG states; resume without restoring RNG")
    if rank < len(saved):
        return saved[rank]
    # derived, not copied: two ranks with one state would draw identical dropout masks / augmentations
    seed = int(checksum(saved[0]["torch"] + f"/rank{rank}".encode()), 16)
    state: dict[str, Any] = {
        "python": random.Random(seed).getstate(),
        "numpy": None,
        "torch": bytes(torch.Generator().manual_seed(seed).get_state().numpy().tobytes()),
        "cuda": None,
        "cuda_seed": seed,
        "derived_from": 0,
    }
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.RandomState(seed & 0xFFFFFFFF).get_state()
        state["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(cached))
    return state


def _numpy() -> ModuleType | None:
    try:
        import numpy
    except ImportError:  # numpy is optional: without it there is no numpy state to keep
        return None
    return numpy
