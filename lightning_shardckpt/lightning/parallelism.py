"""Parallelism dispatch shared by the Trainer's and Fabric's strategies: which class a `parallelism=` builds,
the mesh sizes both use, and the default FSDP2 wrapping of a model that brings no `parallelize_fn`."""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

import torch

from ..errors import ConfigError

PARALLELISMS = ("ddp", "fsdp")


def strategy_class(parallelism: str, *, ddp: type, fsdp: type) -> type:
    """The class `parallelism` names among a door's two strategies; anything else is a ConfigError."""
    if parallelism not in PARALLELISMS:
        raise ConfigError(f"parallelism={parallelism!r} is unknown; use 'ddp' (replicated) or 'fsdp' (FSDP2 sharded)")
    return ddp if parallelism == "ddp" else fsdp


def mesh_sizes(data_parallel: int | str, tensor_parallel: int | str, world_size: int) -> tuple[int, int]:
    """(data_parallel_size, tensor_parallel_size) for `world_size` ranks; "auto" fills what is not given."""
    if data_parallel == "auto" and tensor_parallel == "auto":
        return world_size, 1
    if data_parallel == "auto" or tensor_parallel == "auto":
        given_name, given = (
            ("tensor_parallel_size", tensor_parallel)
            if data_parallel == "auto"
            else ("data_parallel_size", data_parallel)
        )
        if not isinstance(given, int) or given < 1 or world_size % given:
            raise ConfigError(
                f"{given_name}={given!r} does not divide the world size {world_size}; give both data_parallel_size "
                f"and tensor_parallel_size (their product is the world size), or neither (data-parallel over all ranks)"
            )
        other = world_size // given
        return (other, given) if data_parallel == "auto" else (given, other)
    for name, size in (("data_parallel_size", data_parallel), ("tensor_parallel_size", tensor_parallel)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"{name}={size!r} is not a mesh size; give a whole number >= 1, or 'auto'")
    assert isinstance(data_parallel, int) and isinstance(tensor_parallel, int)  # checked just above
    if data_parallel * tensor_parallel != world_size:
        raise ConfigError(
            f"data_parallel_size={data_parallel} × tensor_parallel_size={tensor_parallel} must equal the world size "
            f"{world_size} (devices × num_nodes); set data_parallel_size={max(world_size // tensor_parallel, 1)}"
        )
    return data_parallel, tensor_parallel


class AllRanksDataParallel:
    """Mixin of both doors' FSDP strategies (Lightning's and Fabric's ModelParallelStrategy): their "auto" sizes
    are data_parallel=num_nodes, tensor_parallel=devices, so on one node a model sharded over
    device_mesh["data_parallel"] is neither sharded nor gradient-synced and the replicas silently diverge. Ours:
    data-parallel over every rank unless sizes are given (`mesh_sizes`)."""

    # ModelParallelStrategy's (Lightning's or Fabric's), which this mixin precedes in both doors' classes
    _data_parallel_size: int | Literal["auto"]
    _tensor_parallel_size: int | Literal["auto"]
    num_nodes: int
    num_processes: int

    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = mesh_sizes(
            self._data_parallel_size, self._tensor_parallel_size, self.num_nodes * self.num_processes
        )
        next_in_line: Any = super()  # ModelParallelStrategy's, which mypy cannot name from this mixin
        next_in_line.setup_environment()


def register_in(registry: Any, strategies: tuple[Any, ...]) -> None:
    """Each strategy under its `strategy_name` (with its `description`), once: the Trainer's and Fabric's
    registries are separate, and `lightning_shardckpt.lightning` may be imported more than once."""
    for strategy in strategies:
        if strategy.strategy_name not in registry:
            registry.register(strategy.strategy_name, strategy, description=strategy.description)


def shard_repeated_blocks(module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
    """The default `parallelize_fn`: FSDP2 on each repeated block, one by one, then on the root.

    The repeated blocks are the members of every stack in the tree (`repeated_blocks`): HF's `model.layers`
    (LlamaForCausalLM) and `transformer.h` (GPT-2), LitGPT's `transformer.h`, torchtitan's `layers`. Everything else
    (embeddings, final norm, head) is the root's unit, as in LitGPT's and torchtitan's own wrapping: a weight tied
    between the embedding and the head (GPT-2) is then in one unit, which FSDP2 requires.
    """
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for block in repeated_blocks(module):
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks anywhere in `module`'s tree (`module` included), in the order of `named_modules`.

    They are the members holding parameters of the three torch containers, each read as it is used:
    - a `ModuleList` holds a model's layers, in order: every member (whatever their classes: Jamba alternates two);
    - a `Sequential` runs its members in order: the members of a class it holds two or more of (the blocks of
      `Sequential(embedding, *blocks, norm)`, the two Linears of `Sequential(Linear, ReLU, Linear)`);
    - a `ModuleDict` is keyed: a stack when all its members are of one class (torchtitan's `layers`), otherwise a
      namespace (LitGPT's `transformer = ModuleDict(wte, h=ModuleList(blocks), ln_f)`).
    Everything else is looked into, so the layers under an HF model's backbone (`model.layers`, `transformer.h`)
    are found; a block is not: its own stacks (a mixture's experts) are gathered with it, and units of their own
    would only add collectives.
    """
    blocks = _stacked_members(module)
    found = []
    for child in module.children():
        # a stack of stacks is looked into: fully_shard refuses a container without a forward of its own
        if any(child is block for block in blocks) and not isinstance(child, _NO_FORWARD):
            found.append(child)
        else:
            found.extend(repeated_blocks(child))
    return found


_NO_FORWARD = (torch.nn.ModuleList, torch.nn.ModuleDict)


def _stacked_members(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The members of `module` that are repeated blocks, if it is a container (`repeated_blocks`)."""
    if not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)):
        return []
    members = [child for child in module.children() if any(True for _ in child.parameters())]
    if isinstance(module, torch.nn.ModuleList):
        return members
    classes = Counter(type(member) for member in members)
    if isinstance(module, torch.nn.Sequential):
        return [member for member in members if classes[type(member)] >= 2]
    return members if len(members) >= 2 and len(classes) == 1 else []
