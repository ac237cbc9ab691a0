"""Issue 38: Fabric's default FSDP2 wrapping shards the repeated blocks inside containers. A LitGPT-layout model
(`transformer = ModuleDict(wte, h=ModuleList(blocks), ln_f)`, `lm_head`) could not start under
ShardedFabricStrategy(parallelism="fsdp") without a `parallelize_fn`: `fully_shard` was applied to every direct
child and refuses a ModuleDict ("does not support containers that do not implement forward"). 2 real gloo ranks."""

from __future__ import annotations

import torch
from lightning.fabric import Fabric
from torch.distributed.tensor import DTensor

from lightning_shardckpt import ShardedFabricStrategy
from tests.helpers.fabric_ranks import full_state
from tests.helpers.lightning_run import lightning_env
from tests.helpers.litgpt_shaped import LitGPTShaped
from tests.helpers.spawn import run_ranks, values


def train_save_load(rank: int, world_size: int, root: str) -> dict:
    lightning_env(rank, world_size)
    fabric = Fabric(
        accelerator="cpu", devices=world_size, strategy=ShardedFabricStrategy(parallelism="fsdp", root=root)
    )
    fabric.launch()
    model = fabric.setup_module(LitGPTShaped(seed=3))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    loss = model(torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(rank))).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    fabric.save(root, {"model": model, "optimizer": optimizer, "step": 1})
    saved = full_state(model.module, optimizer.optimizer)
    fresh = fabric.setup_module(LitGPTShaped(seed=4))
    fresh_optimizer = fabric.setup_optimizers(torch.optim.AdamW(fresh.parameters(), lr=0.01))
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    fabric.load("latest", state)
    loaded = full_state(fresh.module, fresh_optimizer.optimizer)
    sharded = {
        name: isinstance(parameter, DTensor) and parameter.to_local().shape != parameter.shape
        for name, parameter in fresh.module.named_parameters()
    }
    fabric.strategy.teardown()
    return {
        "step": state["step"],
        "unequal": sorted(key for key in saved if not torch.equal(saved[key], loaded[key])),
        "blocks_sharded": all(sharded[f"transformer.h.{i}.attn.weight"] for i in (0, 1)),
    }


def test_a_litgpt_layout_model_starts_trains_and_resumes_bit_exact_with_the_default_wrapping(tmp_path):
    for rank in values(run_ranks(train_save_load, 2, str(tmp_path / "ckpt"), timeout_s=180)):
        assert rank == {"step": 1, "unequal": [], "blocks_sharded": True}
