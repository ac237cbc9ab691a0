"""Refuse before writing: a save whose checkpoint no reader could load is refused before anything of it is written.

Saves that take DCP's collective path — `format_version=2` (full v2, incremental v3) and signed incremental saves on
`format_version=4` (metadata_budget.writes_every_chunk) — record every chunk
of every tensor in the manifest (docs/FORMAT.md §5), and the readers parse a manifest only up to
`bounded_json.MANIFEST_MAX_BYTES` (1 GiB): above it the checkpoint is written, committed and never loadable. With
FSDP every tensor is a chunk per rank, so the manifest grows with ranks x tensors: 16,384 ranks x 1,000 tensors is
16.4 M chunks, ~3.5 GB of manifest (and a ~1.3 GB `.metadata` every rank unpickles). The flat formats (v4/v5) list
ranks and tensors, never chunks (an incremental save's references are in the parts), and are not limited here.

What a save will write is known on the training thread before anything is: the world size and, from the state
dict, each tensor's global shape, element size and the number of chunks its placements cut it into. From those
`estimate` computes the manifest's size with the formula below; `refuse_unloadable` raises ConfigError naming the
option that fixes it and the numbers. Every door calls it before its first training step, before anything is
written to the root (training/preflight.py `refuse_unloadable_saves`: at set-up with the world size alone, at a
resume and at train start with the state); the saver calls it again before each such save stages or writes
anything, the backstop for state the start did not see (optimizer state made by the first step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor, Shard

from ...errors import ConfigError
from ..config import SaveConfig
from ..format.bounded_json import MANIFEST_MAX_BYTES
from ..format.checksum import block_size_for
from ..format.names import GROUPS_FORMAT_VERSION, PARTS_FORMAT_VERSION

# The v2/v3 manifest's size (manifest.to_bytes: JSON, indent 1, sorted keys), in bytes:
#   HEADER + FILE x world + sum over tensors of (TENSOR + len(fqn) + SHAPE_DIM x ndim
#       + chunks x (CHUNK + DIM x ndim + [a blocked chunk] BLOCKED + DIGEST x blocks + [v3] REFERENCE))
# A chunk entry holds its file, offset, length, checksum and a line per offset and size; a chunk of 4 MiB and more
# (checksum.block_size_for) adds its block digests, up to 64; an incremental save's reference names its file as
# `../<checkpoint directory>/<file>` (REFERENCE more; counted for every chunk: the largest manifest the run writes,
# where nothing changed). Calibrated on the manifests manifest.build_manifest and
# to_bytes produce for FSDP2-shaped states (tests/unit/test_metadata_budget.py builds them at 1 to 2,048 ranks and
# checks the estimate within 10 %): 214 bytes per 2-D chunk at 16,384 ranks, 2,031 per 64-block 2-D chunk.
HEADER, FILE, TENSOR, SHAPE_DIM = 1_500, 110, 130, 10
CHUNK, DIM, BLOCKED, DIGEST, REFERENCE = 170, 22, 89, 27, 31
# DCP's `.metadata` (a pickle), only reported: ~87 bytes per chunk at 16,384 ranks, more per tensor at a few ranks
DCP_METADATA_PER_CHUNK, DCP_METADATA_PER_TENSOR = 90, 130


@dataclass(frozen=True)
class TensorShape:
    """What a save writes of one tensor, as far as its metadata goes."""

    fqn: str
    shape: tuple[int, ...]  # global
    itemsize: int
    chunks: int  # pieces the tensor is saved in, over all ranks (a DTensor: one per shard, empty ones included)


@dataclass(frozen=True)
class MetadataSize:
    """The metadata a collective-path save of a state would write."""

    chunks: int
    manifest_bytes: int
    dcp_metadata_bytes: int


def writes_every_chunk(config: SaveConfig) -> bool:
    """Whether saves under `config` take DCP's collective path, whose manifest lists every chunk (v2, v3): a
    format_version before v4, or a signed incremental save on v4 (a signed v4 part digests its whole shard file, so
    a chunk referenced in another file would have no digest; v5 digests each chunk: FORMAT.md §12.2). Incremental
    saves on v5 (and unsigned on v4) reference unchanged chunks from the parts (§10.6)."""
    if config.format_version < PARTS_FORMAT_VERSION:
        return True
    return config.incremental and config.sign.enabled and config.format_version < GROUPS_FORMAT_VERSION


def tensors_of(state_dict: dict[str, Any]) -> list[TensorShape]:
    """The tensors of a state dict as the save flattens them (DCP's flattening); other values write no chunk."""
    flat, _ = flatten_state_dict(state_dict)
    shapes = []
    for fqn, value in flat.items():
        if isinstance(value, DTensor):
            cuts = [value.device_mesh.size(dim) for dim, p in enumerate(value.placements) if isinstance(p, Shard)]
            chunks = math.prod(cuts)
        elif isinstance(value, ShardedTensor):
            chunks = len(value.metadata().shards_metadata)
        elif isinstance(value, torch.Tensor):
            chunks = 1  # a plain tensor is written once (rank 0's copy, or one balanced replica)
        else:
            continue
        shapes.append(TensorShape(fqn, tuple(value.shape), value.element_size(), chunks))
    return shapes


def estimate(world: int, tensors: list[TensorShape], references: bool = False) -> MetadataSize:
    """The manifest and `.metadata` a collective-path save of `tensors` by `world` ranks writes (the formula above);
    `references`: every chunk a reference into an earlier checkpoint (an incremental save of an unchanged state)."""
    manifest = HEADER + FILE * world
    chunks = 0
    for tensor in tensors:
        count = max(1, tensor.chunks)
        chunk_bytes = math.prod(tensor.shape) * tensor.itemsize // count
        block = block_size_for(chunk_bytes)
        blocks = BLOCKED + DIGEST * math.ceil(chunk_bytes / block) if block else 0
        ndim = len(tensor.shape)
        per_chunk = CHUNK + DIM * ndim + blocks + (REFERENCE if references else 0)
        manifest += TENSOR + len(tensor.fqn) + SHAPE_DIM * ndim + count * per_chunk
        chunks += count
    dcp_metadata = DCP_METADATA_PER_CHUNK * chunks + DCP_METADATA_PER_TENSOR * len(tensors)
    return MetadataSize(chunks, manifest, dcp_metadata)


def refuse_unloadable(config: SaveConfig, world: int, tensors: list[TensorShape]) -> None:
    """ConfigError when saves under `config` of `tensors` by `world` ranks would write a manifest over the bound every
    reader parses: a checkpoint that commits and never loads. Names the option that fixes it and the numbers."""
    if not writes_every_chunk(config):
        return
    size = estimate(world, tensors, references=config.incremental)
    if size.manifest_bytes <= MANIFEST_MAX_BYTES:
        return
    why = []
    if config.incremental:
        why.append("save.incremental=true (its references are per chunk)")
    why.append(f"save.format_version={config.format_version}" + (" and signing" if config.sign.enabled else ""))
    # v5 keeps a manifest flat in ranks, incremental and signed included (references live in the parts: §10.6)
    older = "" if config.incremental and config.sign.enabled else "; 4 for readers older than v5"
    fixes = [f"save.format_version=5 (per-rank parts: a manifest flat in ranks{older})"]
    raise ConfigError(
        f"{' with '.join(why)} writes every chunk in the manifest: {world:,} ranks x {len(tensors):,} tensors is "
        f"{size.chunks:,} chunks, a manifest of ~{_gib(size.manifest_bytes)} (and a ~{_gib(size.dcp_metadata_bytes)} "
        f"DCP .metadata every rank unpickles), over the {_gib(MANIFEST_MAX_BYTES)} a reader loads: the checkpoint "
        f"would commit and never load. Refused before writing; set {' and '.join(fixes)}"
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
