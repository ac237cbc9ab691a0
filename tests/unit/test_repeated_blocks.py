"""Which modules Fabric's default FSDP2 wrapping shards one by one (lightning/parallelism.py `repeated_blocks`); the
wrapping itself, on real ranks, is tests/distributed/test_fabric_wraps_hf_layers.py."""

from __future__ import annotations

import torch
from torch.nn import Embedding, LayerNorm, Linear, ModuleDict, ModuleList, ReLU, Sequential

from lightning_shardckpt.lightning.parallelism import repeated_blocks
from tests.helpers.hf_tiny import tiny_gpt2, tiny_llama
from tests.helpers.litgpt_shaped import LitGPTShaped


def _names(module: torch.nn.Module) -> list[str]:
    blocks = repeated_blocks(module)
    return [name for name, child in module.named_modules() if any(child is block for block in blocks)]


class MixtureBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = ModuleList([Linear(4, 4), Linear(4, 4)])


def test_the_layers_under_a_backbone_are_repeated_blocks_and_nothing_else_is():
    assert _names(tiny_llama(seed=0)) == ["model.layers.0", "model.layers.1"]
    assert _names(tiny_gpt2(seed=0)) == ["transformer.h.0", "transformer.h.1"]
    assert _names(LitGPTShaped(seed=0)) == ["transformer.h.0", "transformer.h.1"]


def test_each_container_is_read_as_it_is_used():
    # a ModuleList holds layers, of whatever classes; a ModuleDict of mixed members is a namespace
    assert _names(ModuleDict({"h": ModuleList([Linear(4, 4), LayerNorm(4)]), "norm": LayerNorm(4)})) == ["h.0", "h.1"]
    # a ModuleDict of one class is a stack (torchtitan's layers)
    assert _names(ModuleDict({"0": Linear(4, 4), "1": Linear(4, 4)})) == ["0", "1"]
    # a Sequential: the members of a class it holds more than one of; parameterless ones are never blocks
    assert _names(Sequential(Linear(4, 4), ReLU(), Linear(4, 4))) == ["0", "2"]
    blocks = [Sequential(Linear(4, 4)) for _ in range(2)]
    assert _names(Sequential(Embedding(8, 4), *blocks, LayerNorm(4))) == ["1", "2"]


def test_a_stack_of_stacks_is_looked_into_and_a_block_is_not():
    # fully_shard refuses a ModuleList: the inner lists' members are the blocks
    assert _names(ModuleList([ModuleList([Linear(4, 4), Linear(4, 4)]), ModuleList([Linear(4, 4)])])) == [
        "0.0",
        "0.1",
        "1.0",
    ]
    # a mixture's experts are gathered with their block
    assert _names(ModuleDict({"layers": ModuleList([MixtureBlock(), MixtureBlock()])})) == ["layers.0", "layers.1"]
