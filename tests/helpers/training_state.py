"""Small models with uneven shapes, trained a step, in DDP-style (replicated) or FSDP2 (sharded) form.

Used by distributed tests: every rank builds the same model, and `full_state` gathers a plain,
unsharded copy of model + AdamW state to compare bit-exactly across world sizes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 13, 7, 5: no world size from 2 to 4 divides these evenly, so shards are uneven.
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))


def build(parallelism: str, seed: int, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(seed)
    if parallelism == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randn(8, 13, generator=generator)
        loss = model(batch).pow(2).mean()
        loss.backward()
        if not _is_fsdp(model) and dist.is_initialized():
            for param in model.parameters():  # DDP semantics: average gradients, stay replicated
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
        optimizer.step()
        optimizer.zero_grad()


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def apply_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Flat {name: full tensor} of parameters and optimizer state, gathered on rank 0 (empty elsewhere)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    flat = {f"model.{k}": v.clone() for k, v in model_sd.items()}
    for param_name, state in optim_sd.get("state", {}).items():  # full state lands on rank 0 only
        for key, value in state.items():
            flat[f"optim.{param_name}.{key}"] = torch.as_tensor(value).clone()
    return flat


def _is_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def assert_bit_exact(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(actual), f"keys differ: {sorted(set(expected) ^ set(actual))}"
    for name in expected:
        assert expected[name].dtype == actual[name].dtype, name
        assert torch.equal(expected[name], actual[name]), f"{name} differs after the round trip"
