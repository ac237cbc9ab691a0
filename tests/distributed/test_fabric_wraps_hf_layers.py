"""Issue 48 (Fabric users): Fabric's default FSDP2 wrapping shards the repeated blocks anywhere in the tree, one by
one, then the root. It used to shard each direct child with a forward: LlamaForCausalLM became two units, the
backbone `model` (every decoder layer in it) and `lm_head`, and GPT-2 did not start (its head, tied to the token
embedding of `transformer`, was a second unit: FSDP2 refuses a parameter shared between units).

One spawn of 2 ranks trains a step and saves each model with the Fabric door (HF Llama, HF GPT-2, and LitGPT's
pretrain pattern: `out_dir/step-XXXXXXXX/lit_model.pth` every interval); one spawn of 3 ranks resumes each, as
LitGPT resumes (the newest `step-*/*.pth`). Every tensor of model and optimizer state must come back equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_shardckpt import ShardedFabricStrategy
from tests.helpers.fabric_ranks import full_state
from tests.helpers.hf_tiny import fsdp_units, tiny_gpt2, tiny_llama, token_ids
from tests.helpers.lightning_run import lightning_env
from tests.helpers.litgpt_shaped import LitGPTShaped, tokens
from tests.helpers.spawn import run_ranks, values

pytestmark = pytest.mark.timeout(240)

HF_MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


class StreamingLoaderStandIn:
    """What LitGPT's `train_dataloader` (LitData's StreamingDataLoader) is to `fabric.save`: a stateful object."""

    def __init__(self) -> None:
        self.samples_yielded = 0

    def state_dict(self) -> dict[str, int]:
        return {"samples_yielded": self.samples_yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.samples_yielded = state["samples_yielded"]


def _setup(fabric: Fabric, model: torch.nn.Module) -> tuple[Any, Any]:
    module = fabric.setup_module(model)
    return module, fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=0.01))


def _summary(fabric: Fabric, module: Any, optimizer: Any) -> dict[str, Any]:
    """The FSDP units; the full model and optimizer state (a collective), kept on rank 0 only: the test compares it."""
    state = full_state(module.module, optimizer.optimizer)
    return {"units": fsdp_units(module.module), "state": state if fabric.global_rank == 0 else None}


def _litgpt_pretrain(fabric: Fabric, out_dir: Path) -> dict[str, Any]:
    """LitGPT's pretrain loop (litgpt/pretrain.py `fit`): its state dict, a save to its own path every 2 steps."""
    model, optimizer = _setup(fabric, LitGPTShaped(seed=3))
    train_dataloader = StreamingLoaderStandIn()
    state = {"model": model, "optimizer": optimizer, "train_dataloader": train_dataloader}
    state.update(iter_num=0, step_count=0)
    while state["step_count"] < 4:
        fabric.backward(model(tokens(state["iter_num"] * 10 + fabric.global_rank)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        state["iter_num"] += 1
        state["step_count"] += 1
        train_dataloader.samples_yielded += 4
        if state["step_count"] % 2 == 0:  # litgpt/pretrain.py `save_checkpoint`
            checkpoint_file = out_dir / f"step-{state['step_count']:08d}" / "lit_model.pth"
            checkpoint_file.parent.mkdir(parents=True, exist_ok=True)
            fabric.save(checkpoint_file, state)
            if fabric.global_rank == 0:
                (checkpoint_file.parent / "model_config.yaml").write_text("n_layer: 2\n")
    return _summary(fabric, model, optimizer)


def save_on_2_ranks(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    lightning_env(rank, world_size)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ShardedFabricStrategy(parallelism="fsdp"))
    fabric.launch()
    saved = {}
    for name, build in HF_MODELS.items():
        model, optimizer = _setup(fabric, build(seed=1))
        fabric.backward(model(input_ids=token_ids(rank), labels=token_ids(rank)).loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.save(f"{workdir}/{name}", {"model": model, "optimizer": optimizer, "step": 1})
        saved[name] = _summary(fabric, model, optimizer)
    saved["litgpt"] = _litgpt_pretrain(fabric, Path(workdir) / "litgpt")
    fabric.strategy.teardown()  # waits for the commits
    return saved


def resume_on_3_ranks(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    lightning_env(rank, world_size)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ShardedFabricStrategy(parallelism="fsdp"))
    fabric.launch()
    resumed = {}
    for name, build in HF_MODELS.items():
        model, optimizer = _setup(fabric, build(seed=2))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(f"{workdir}/{name}", state)
        resumed[name] = {**_summary(fabric, model, optimizer), "step": state["step"]}

    out_dir = Path(workdir) / "litgpt"
    model, optimizer = _setup(fabric, LitGPTShaped(seed=4))
    train_dataloader = StreamingLoaderStandIn()
    state = {"model": model, "optimizer": optimizer, "train_dataloader": train_dataloader}
    state.update(iter_num=0, step_count=0)
    # litgpt/pretrain.py: `resume == "auto"` picks the newest step directory's .pth
    resume = max(out_dir.rglob("step-*/*.pth"), key=lambda path: int(path.parent.name.split("-")[1]))
    fabric.load(resume, state)
    resumed["litgpt"] = {
        **_summary(fabric, model, optimizer),
        "resumed_from": resume.parent.name,
        "counters": (state["iter_num"], state["step_count"], train_dataloader.samples_yielded),
    }
    fabric.strategy.teardown()
    return resumed


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hf-layers"))


@pytest.fixture(scope="module")
def saved(workdir: str) -> list[dict[str, Any]]:
    return values(run_ranks(save_on_2_ranks, 2, workdir, timeout_s=120, pg_timeout_s=30))


@pytest.fixture(scope="module")
def resumed(saved: list[dict[str, Any]], workdir: str) -> list[dict[str, Any]]:
    return values(run_ranks(resume_on_3_ranks, 3, workdir, timeout_s=120, pg_timeout_s=30))


def _unequal(expected: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(loaded) == sorted(expected)
    return sorted(key for key in expected if not torch.equal(expected[key], loaded[key]))


def test_fabric_default_wrapping_shards_each_hf_decoder_layer_as_its_own_unit(saved):
    for rank in saved:
        assert rank["llama"]["units"] == ["", "model.layers.0", "model.layers.1"]
        # GPT-2's tied head and token embedding stay together in the root's unit
        assert rank["gpt2"]["units"] == ["", "transformer.h.0", "transformer.h.1"]
        assert rank["litgpt"]["units"] == ["", "transformer.h.0", "transformer.h.1"]


def test_hf_llama_and_gpt2_saved_by_fabric_on_2_ranks_resume_on_3_bit_exact_layer_by_layer(saved, resumed):
    for name, layers in (("llama", "model.layers"), ("gpt2", "transformer.h")):
        for rank in resumed:
            assert rank[name]["units"] == ["", f"{layers}.0", f"{layers}.1"] and rank[name]["step"] == 1
        assert _unequal(saved[0][name]["state"], resumed[0][name]["state"]) == [], name


def test_litgpt_pretrain_save_pattern_resumes_2_to_3_ranks_bit_exact(saved, resumed):
    for rank in resumed:
        assert rank["litgpt"]["resumed_from"] == "step-00000004"
        assert rank["litgpt"]["counters"] == (4, 4, 16)
    assert _unequal(saved[0]["litgpt"]["state"], resumed[0]["litgpt"]["state"]) == []
