"""Plain values with non-string keys, or keys holding a '.', come back exactly through the Trainer and Fabric
(issue 37, item 8; the Checkpointer's own case is in tests/unit/test_checkpointer.py), on 2 gloo ranks.

The Trainer keeps `on_save_checkpoint` extras, Fabric the state's plain values, in one pickled section beside the
tensors: `{0: 11, 1: 22}` and `{"lr.decay": 0.1, "lr": {"decay": 0.2}}` are saved as they are and loaded as they
were, keys and all, with `strict` loads on either side.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric import Fabric

from lightning_shardckpt import ShardedCheckpoint, ShardedFabricStrategy
from tests.helpers.fabric_ranks import TrainerShaped
from tests.helpers.lightning_run import TinyData, TinyModule, ddp_trainer, lightning_env
from tests.helpers.spawn import run_ranks, values

EXTRAS = {
    "counts": {0: 11, 1: 22},
    "cfg": {"lr.decay": 0.1, "lr": {"decay": 0.2}},
    "by_layer": {(0, 1): [1, 2], True: None},
}


class ModuleWithExtras(TinyModule):
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint.update(EXTRAS)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.extra_loaded = {key: checkpoint.get(key) for key in EXTRAS}


def _fit(root: str, world_size: int, max_steps: int, ckpt_path: Any) -> ModuleWithExtras:
    trainer = ddp_trainer(world_size, max_steps, [ShardedCheckpoint(root, every_n_train_steps=2, log_artifact=False)])
    module = ModuleWithExtras()
    trainer.fit(module, datamodule=TinyData(), ckpt_path=ckpt_path)
    return module


def plain_values_on_rank(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    lightning_env(rank, world_size)
    _fit(f"{workdir}/trainer", world_size, 2, None)
    trainer_loaded = _fit(f"{workdir}/trainer", world_size, 3, "latest").extra_loaded

    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ShardedFabricStrategy(parallelism="ddp"))
    fabric.launch()
    model = fabric.setup_module(TrainerShaped(seed=1))
    fabric.save(f"{workdir}/fabric", {"model": model, "step": 1, **EXTRAS})
    fabric.strategy.wait()
    state = {"model": model, "step": 0, "counts": {0: -1, 1: -1}, "cfg": {}, "by_layer": {}}
    fabric.load(f"{workdir}/fabric", state, strict=True)
    fabric.strategy.teardown()
    return {"trainer": trainer_loaded, "fabric": {key: state[key] for key in EXTRAS}}


def test_plain_values_with_non_string_or_dotted_keys_round_trip_through_the_trainer_and_fabric(tmp_path):
    for result in values(run_ranks(plain_values_on_rank, 2, str(tmp_path), timeout_s=300)):
        assert result["trainer"] == EXTRAS
        assert result["fabric"] == EXTRAS
