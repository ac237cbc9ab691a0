"""What the state being saved runs on: world size, device type, mesh shape (manifest `topology`)."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor

from ..collectives import rank_and_world
from ..tree import iter_tensors


def describe(state_dict: dict[str, Any], group: Any, parallelism: str) -> dict[str, Any]:
    _, world = rank_and_world(group)
    device_type, mesh_shape = "cpu", None
    for tensor in iter_tensors(state_dict):
        if isinstance(tensor, DTensor):
            device_type, mesh_shape = tensor.device_mesh.device_type, list(tensor.device_mesh.shape)
            break
        device_type = tensor.device.type
    return {"world_size": world, "device_type": device_type, "parallelism": parallelism, "mesh_shape": mesh_shape}
