"""The resumable sampler of a Fabric loop: it keeps its own epoch, because Fabric's count restarts on a resume.

Fabric's loader wrapper calls `sampler.set_epoch(n)` with the number of times the loader was iterated in this
process: 0 again after a resume, which would throw the restored position (and epoch) away. This sampler keeps
the epoch its state says, and starts the next epoch itself when an iteration begins after the current one
was fully consumed (`mark_consumed`), or fully dealt when the loop never marks consumption.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning.fabric.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler

from ...training.data import ResumableDistributedSampler, replacing


class FabricResumableSampler(ResumableDistributedSampler):
    """ResumableDistributedSampler for Fabric loops: mark consumption after each optimizer step
    (`loader.sampler.mark_consumed(batches, batch_size)`); epochs advance on their own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dealt_all = False  # the current pass's indices were all handed out

    def set_epoch(self, epoch: int) -> None:
        """Ignored: Fabric passes its iteration count, which restarts at 0 after a resume (see the module docstring)."""

    def __iter__(self) -> Iterator[int]:
        nothing_marked = self.global_position == self.pass_start
        if self.epoch_complete or (self._dealt_all and nothing_marked):
            super().set_epoch(self.epoch + 1)
        self._dealt_all = False
        return self._deal(super().__iter__())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._dealt_all = False

    def _deal(self, indices: Iterator[int]) -> Iterator[int]:
        yield from indices
        self._dealt_all = True


def use_fabric_sampler(dataloader: Any) -> Any:
    """The loader with Fabric's injected DistributedSampler replaced by ours (same arguments, same order at
    position 0); other samplers (custom ones, ours already) are left alone."""
    if not isinstance(dataloader, DataLoader) or type(dataloader.sampler) is not DistributedSampler:
        return dataloader
    return _update_dataloader(dataloader, replacing(dataloader.sampler, FabricResumableSampler))
