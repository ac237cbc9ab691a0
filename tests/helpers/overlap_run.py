"""Lightning runs whose every checkpoint is compared with the state captured at its request.

A strategy subclass's `save_to_saver` keeps a clone of what the request saw (model, optimizers,
the pickled Lightning state with loops, callbacks, RNG and data position); the background copy is held
for a while, so the next batches' forward, backward and (fenced) optimizer step run while it is pending.
After fit, each committed checkpoint is loaded and compared with its clone.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_shardckpt import ShardedCheckpoint, ShardedDDPStrategy, ShardedFSDPStrategy, load_checkpoint
from lightning_shardckpt.lightning import lightning_state
from tests.helpers.held_staging import held_staging_copy
from tests.helpers.lightning_run import lightning_env

HOLD_S = 0.3  # how long each background copy is held: longer than a step of these tiny models


def bn_net() -> torch.nn.Sequential:
    torch.manual_seed(11)
    # BatchNorm: running statistics and num_batches_tracked change in every forward; Dropout draws from the RNG
    return torch.nn.Sequential(
        torch.nn.Linear(13, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 5)
    )


class BNModule(pl.LightningModule):
    """Automatic optimization (AdamW): one optimizer, stepped every `accumulate_grad_batches` batches."""

    def __init__(self, parallelism: str) -> None:
        super().__init__()
        self.parallelism = parallelism
        self.net = bn_net()

    def configure_model(self) -> None:
        if self.parallelism != "fsdp":
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for index in (0, 3):
            fully_shard(self.net[index], mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def loss(self, batch: Any) -> torch.Tensor:
        (inputs,) = batch
        return self.net(inputs).pow(2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class ManualTwoOptimizers(BNModule):
    """Manual optimization with two optimizers: one stepped through Lightning, one through the raw torch optimizer."""

    def __init__(self, parallelism: str) -> None:
        super().__init__(parallelism)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        first, second = self.optimizers()
        self.manual_backward(self.loss(batch))
        first.step()  # LightningOptimizer -> strategy.optimizer_step: fenced after its (empty) closure
        second.optimizer.step()  # bypasses the strategy: the step pre-hook fences
        first.zero_grad()
        second.zero_grad()

    def configure_optimizers(self) -> Any:
        head = list(self.net[3].parameters())
        body = [p for p in self.parameters() if all(p is not h for h in head)]
        return [torch.optim.AdamW(body, lr=0.05), torch.optim.SGD(head, lr=0.1, momentum=0.9)]


def data() -> DataLoader:
    inputs = torch.randn(64, 13, generator=torch.Generator().manual_seed(5))
    return DataLoader(TensorDataset(inputs), batch_size=4)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(item) for item in value)
    return value


def _empty_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, float("nan")) if value.is_floating_point() else torch.zeros_like(value)
    if isinstance(value, dict):
        return {key: _empty_like(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_empty_like(item) for item in value)
    return b"" if isinstance(value, bytes) else value


class _CapturesRequests:
    """Mixin for a ShardedStrategy: clones the state each save request saw; collects its savers' records."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.captured: dict[int, dict[str, Any]] = {}
        self.records: list = []
        self._listening: set[int] = set()

    def save_to_saver(self, saver: Any, checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        self.captured[int(checkpoint["global_step"])] = _clone(lightning_state.to_dcp_state(checkpoint))
        if id(saver) not in self._listening:
            self._listening.add(id(saver))
            saver.add_listener(self.records.append)
        return super().save_to_saver(saver, checkpoint, *args, **kwargs)


class CapturingDDPStrategy(_CapturesRequests, ShardedDDPStrategy):
    pass


class CapturingFSDPStrategy(_CapturesRequests, ShardedFSDPStrategy):
    pass


CAPTURING = {"ddp": CapturingDDPStrategy, "fsdp": CapturingFSDPStrategy}


def differences(expected: Any, loaded: Any, rank: int, key: str = "") -> list[str]:
    """Keys whose loaded value differs from the request's. Plain tensors are rank 0's (RankZeroSavePlanner):
    only rank 0 compares them; every rank compares its own DTensor shards."""
    if isinstance(expected, dict):
        return [d for name in expected for d in differences(expected[name], loaded[name], rank, f"{key}.{name}")]
    if isinstance(expected, DTensor):
        return [] if torch.equal(expected.to_local(), loaded.to_local()) else [key]
    if isinstance(expected, torch.Tensor):
        return [] if rank != 0 or torch.equal(expected, loaded) else [key]
    if isinstance(expected, bytes):
        return [] if rank != 0 or expected == loaded else [key]
    return []


def overlap_fits_on_rank(rank: int, world_size: int, workdir: str, parallelism: str) -> dict[str, Any]:
    """Two fits: automatic optimization with accumulate_grad_batches=2, manual with two optimizers."""
    lightning_env(rank, world_size)
    torch.manual_seed(100 + rank)
    out: dict[str, Any] = {}
    for name, module_type, accumulate in (
        ("auto_accumulate", BNModule, 2),
        ("manual_two_optimizers", ManualTwoOptimizers, 1),
    ):
        root = f"{workdir}/{name}"
        strategy = CAPTURING[parallelism]()
        captured, records = strategy.captured, strategy.records
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            num_nodes=1,
            strategy=strategy,
            max_steps=6,
            accumulate_grad_batches=accumulate,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[
                ShardedCheckpoint(root, every_n_train_steps=2, log_artifact=False, save={"overlap_staging": True})
            ],
        )
        with held_staging_copy(delay_s=HOLD_S):
            trainer.fit(module_type(parallelism), train_dataloaders=data())
        mismatched: dict[int, list[str]] = {}
        for step, expected in sorted(captured.items()):
            loaded = _empty_like(expected)
            load_checkpoint(loaded, root, step)
            mismatched[step] = differences(expected, loaded, rank)
        out[name] = {
            "steps": sorted(captured),
            "mismatched": mismatched,
            "deferred_copies": [r.overlap_copy_s for r in records],
            "waits": [r.overlap_wait_s for r in records],
            "stages": [
                r.stage_s for r in records
            ],  # the request's own copy (pause_s also holds a wait for a free slot)
            "outcomes": [r.outcome for r in records],
        }
    return out
