"""The row-sharded model the many-rank tests save and load: twelve [rows, 8] tensors, each split over the world along
its rows as FSDP2 shards (torch.chunk: even and uneven splits, and fewer rows than ranks), plus a replicated step.
Every value is known from its index alone, so a rank of any world checks what it loaded against the whole tensor."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

ROWS = [96, 70, 33, 5]  # rows of each [rows, 8] tensor: even and uneven splits, and fewer rows than ranks
COLUMNS = 8
TENSORS = 12


def global_tensor(index: int) -> torch.Tensor:
    """The whole tensor `layer{index:02d}.weight`, as every world saves it."""
    rows = ROWS[index % len(ROWS)]
    return torch.arange(rows * COLUMNS, dtype=torch.float32).reshape(rows, COLUMNS) * (index + 1) + 0.5


def shard_rows(full: torch.Tensor, mesh: DeviceMesh, world_size: int, rank: int) -> DTensor:
    """Rank `rank`'s Shard(0) piece of `full` (torch.chunk's split, as FSDP2 shards: the last ranks may get none)."""
    pieces = list(torch.chunk(full, world_size, dim=0))
    local = pieces[rank] if rank < len(pieces) else full[:0]
    return DTensor.from_local(local.clone(), mesh, [Shard(0)], shape=full.shape, stride=full.stride())


def row_sharded_state(rank: int, world_size: int, *, zeros: bool, note: str) -> dict:
    """This rank's state: the saved values (step 7, `note`), or zeros of the same layout for a load to fill."""
    mesh = init_device_mesh("cpu", (world_size,))
    state: dict = {"model": {}, "progress": {"global_step": 0 if zeros else 7, "note": "" if zeros else note}}
    for index in range(TENSORS):
        sharded = shard_rows(global_tensor(index), mesh, world_size, rank)
        state["model"][f"layer{index:02d}.weight"] = torch.zeros_like(sharded) if zeros else sharded
    state["model"]["step"] = torch.tensor(0 if zeros else 7)  # replicated, written once by rank 0
    return state


def loaded_exactly(state: dict) -> bool:
    """Whether every sharded tensor of a loaded state equals its whole tensor. full_tensor() is a collective: every rank
    gathers every tensor in the same order, so the comparison never stops at the first mismatch (a rank that stopped
    would leave the others waiting in their next gather)."""
    matches = [
        torch.equal(value.full_tensor(), global_tensor(int(name[5:7])))
        for name, value in state["model"].items()
        if isinstance(value, DTensor)
    ]
    return all(matches)
