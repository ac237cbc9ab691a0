"""Refuse before writing (issue 46, item 6): a save configuration whose manifest no reader could load is refused.

The estimate is checked against the manifests the project's own code builds (manifest.build_manifest + to_bytes
over a DCP Metadata and the receipts the ranks would send), at small world sizes; the refusal at a large world is
checked by calling it with the world size and the state's shape (no 16k ranks), and through a real CheckpointSaver
on a 16,384-rank fake process group (one process: torch's `fake` backend), which must write no checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_shardckpt.engine.config import SaveConfig
from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format.bounded_json import MANIFEST_MAX_BYTES
from lightning_shardckpt.engine.format.checksum import block_size_for
from lightning_shardckpt.engine.format.names import shard_filename
from lightning_shardckpt.engine.save.metadata_budget import TensorShape, estimate, refuse_unloadable, writes_every_chunk
from lightning_shardckpt.engine.storage.writer import ChunkReceipt
from lightning_shardckpt.errors import ConfigError
from lightning_shardckpt.training.finished_saves import CallableReporter
from lightning_shardckpt.training.save_loop import SaveLoop
from lightning_shardckpt.training.savers import ControlGroup
from tests.helpers.checkpointer_loop import checkpointer_loop

# a 70B-class decoder layer (benchmarks/scale.py SHAPES): q/o, k/v, up/gate, down, a norm
SHAPES = ((8192, 8192), (1024, 8192), (1024, 8192), (8192, 8192), (28672, 8192), (28672, 8192), (8192, 28672), (8192,))
RECORD_HEADER = 1100  # what a shard record adds to a chunk's bytes (roughly; only the offsets' digits depend on it)


def fsdp_tensors(world: int, count: int) -> list[TensorShape]:
    """FSDP2's layout: every bf16 tensor row-sharded over all ranks (one chunk per rank, empty ones included)."""
    return [TensorShape(_fqn(i), SHAPES[i % len(SHAPES)], 2, world) for i in range(count)]


def _fqn(index: int) -> str:
    return f"model.layers.{index // 8}.w{index % 8}.weight"


def real_manifest_bytes(world: int, tensors: list[TensorShape], references: bool = False) -> int:
    """The v2 manifest the Committer would write for this state (`references`: the v3 manifest of an incremental
    save where nothing changed, every chunk a reference): DCP's Metadata and the ranks' receipts, built and
    serialised by the project's own code."""
    holder = "../step-000000010-0123456789ab/" if references else ""
    state, receipts, file_end = {}, {}, [0] * world
    for tensor in tensors:
        rows = -(-tensor.shape[0] // world)
        row_bytes = tensor.itemsize * (tensor.shape[1] if len(tensor.shape) > 1 else 1)
        chunks = []
        for rank in range(world):
            start = min(rank * rows, tensor.shape[0])
            count = min(tensor.shape[0], start + rows) - start
            chunk = ChunkStorageMetadata(
                offsets=torch.Size([start] + [0] * (len(tensor.shape) - 1)),
                sizes=torch.Size([count, *tensor.shape[1:]]),
            )
            chunks.append(chunk)
            length = count * row_bytes + RECORD_HEADER
            block = block_size_for(count * row_bytes)
            blocks = (block, tuple(f"{n:016x}" for n in range(-(-length // block)))) if block else None
            receipts[MetadataIndex(tensor.fqn, chunk.offsets)] = ChunkReceipt(
                relative_path=holder + shard_filename(rank),
                offset=file_end[rank],
                length=length,
                checksum="0123456789abcdef",
                file_bytes=10**9,
                verified=True,
                finite=True,
                blocks=blocks,
                reference=references,
            )
            file_end[rank] += length
        properties = TensorProperties(dtype=torch.bfloat16)
        state[tensor.fqn] = TensorStorageMetadata(properties=properties, size=torch.Size(tensor.shape), chunks=chunks)
    metadata = Metadata(state_dict_metadata=state)
    metadata.storage_data = {
        index: _StorageInfo(relative_path=r.relative_path, offset=r.offset, length=r.length)
        for index, r in receipts.items()
    }
    manifest = manifest_format.build_manifest(
        metadata=metadata,
        receipts=receipts,
        checkpoint_id="0123456789ab",
        parent=None,
        seq=1,
        step=1,
        topology={"world_size": world, "parallelism": "fsdp"},
        verification={"mode": "sample"},
    )
    return len(manifest_format.to_bytes(manifest))


@pytest.mark.parametrize("references", [False, True], ids=["v2", "v3-references"])
@pytest.mark.parametrize(("world", "count"), [(1, 200), (8, 200), (256, 16), (2048, 4)])
def test_manifest_estimate_is_within_ten_percent_of_the_manifest_the_committer_builds(world, count, references):
    tensors = fsdp_tensors(world, count)
    real = real_manifest_bytes(world, tensors, references)
    estimated = estimate(world, tensors, references).manifest_bytes
    assert abs(estimated - real) <= 0.1 * real, (world, count, real, estimated)


def test_format_v2_at_16384_ranks_is_refused_naming_format_version_and_the_numbers() -> None:
    with pytest.raises(ConfigError) as refused:
        refuse_unloadable(SaveConfig(format_version=2), 16_384, fsdp_tensors(16_384, 1_000))
    message = str(refused.value)
    assert "save.format_version=2" in message
    assert "set save.format_version=5" in message
    assert "16,384 ranks x 1,000 tensors is 16,384,000 chunks" in message
    assert "GiB" in message and "never load" in message
    assert "incremental" not in message


def test_incremental_on_format_v2_at_16384_ranks_is_refused_naming_incremental_and_format_version_5() -> None:
    with pytest.raises(ConfigError) as refused:
        refuse_unloadable(SaveConfig(incremental=True, format_version=2), 16_384, fsdp_tensors(16_384, 1_000))
    message = str(refused.value)
    assert "save.incremental=true" in message and "save.format_version=2" in message
    assert "set save.format_version=5" in message  # v5 keeps incremental's references in the parts (§10.6)


def test_incremental_on_v5_at_16384_ranks_is_not_refused_its_references_live_in_the_parts() -> None:
    assert not writes_every_chunk(SaveConfig(incremental=True))
    refuse_unloadable(SaveConfig(incremental=True), 16_384, fsdp_tensors(16_384, 1_000))


def test_format_v2_refusal_starts_where_the_manifest_passes_the_readers_bound() -> None:
    """The world size at which format v2 is refused, for a 1,000-tensor FSDP state: a manifest just under the bound
    is written, one over it refused."""
    fits = [
        w
        for w in (1_024, 2_048, 4_096, 8_192)
        if estimate(w, fsdp_tensors(w, 1_000)).manifest_bytes <= MANIFEST_MAX_BYTES
    ]
    assert fits == [1_024, 2_048, 4_096]
    refuse_unloadable(SaveConfig(format_version=2), 4_096, fsdp_tensors(4_096, 1_000))
    with pytest.raises(ConfigError):
        refuse_unloadable(SaveConfig(format_version=2), 8_192, fsdp_tensors(8_192, 1_000))


def test_realistic_small_runs_are_not_refused() -> None:
    for config in (SaveConfig(format_version=2), SaveConfig(incremental=True), SaveConfig()):
        refuse_unloadable(config, 64, fsdp_tensors(64, 1_000))
        refuse_unloadable(config, 8, fsdp_tensors(8, 10_000))


def test_flat_formats_are_never_refused_for_their_chunk_count() -> None:
    for version in (4, 5):
        refuse_unloadable(SaveConfig(format_version=version), 131_072, fsdp_tensors(131_072, 1_000))


FAKE_WORLD_SAVE = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from lightning_shardckpt.engine.config import SaveConfig
    from lightning_shardckpt.engine.save.saver import CheckpointSaver
    from lightning_shardckpt.errors import ConfigError

    root, world = sys.argv[1], 16384
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,))
    local = torch.zeros(1, 8192, dtype=torch.bfloat16)
    state = {
        f"w{i}": DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([16384, 8192]),
                                    stride=(8192, 1))
        for i in range(400)
    }
    saver = CheckpointSaver(root, SaveConfig(format_version=2, async_save=False), group=dist.group.WORLD)
    try:
        saver.save(state, step=1)
    except ConfigError as err:
        print(err)
        sys.exit(3)
    sys.exit(0)
    """
)


@pytest.mark.slow
def test_saver_refuses_an_unloadable_v2_save_at_16384_ranks_before_writing_a_checkpoint(tmp_path) -> None:
    """A real CheckpointSaver on a 16,384-rank fake process group (one process): the first save raises ConfigError
    on the training thread, and the root holds nothing but the owner marker the saver's construction claims."""
    root = tmp_path / "root"
    done = subprocess.run(
        [sys.executable, "-c", FAKE_WORLD_SAVE, str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "set save.format_version=5" in done.stdout
    assert "16,384 ranks x 400 tensors is 6,553,600 chunks" in done.stdout
    assert "rerun with save.run_id=" in done.stdout
    assert sorted(os.listdir(root)) == [".owner.json"]  # no checkpoint directory, no events, no `latest`


def save_loop_of(root: str, world_size: int, **save: Any) -> SaveLoop:
    """A door's save loop as the Checkpointer builds one, at `world_size` (a number only: nothing here is collective
    before the storage check, which a refused configuration never reaches)."""
    return checkpointer_loop(
        root,
        SaveConfig(**save),
        agreement=ControlGroup(60.0),
        reporter=CallableReporter(None, lambda: 0),
        world_size=world_size,
    )


def test_format_v2_past_the_world_size_whose_per_rank_entries_alone_pass_the_bound_is_refused_at_set_up(tmp_path):
    """The world-size-only check: before any state exists, a v2 manifest's per-rank entries alone outgrow the bound
    past ~9.76 M ranks; the door's set-up refuses it before the root is even created."""
    root = tmp_path / "root"
    with pytest.raises(ConfigError) as refused:
        save_loop_of(str(root), 10_000_000, format_version=2).setup("fit")
    assert "10,000,000 ranks x 0 tensors" in str(refused.value)
    assert "set save.format_version=5" in str(refused.value)
    assert not root.exists()
    save_loop_of(str(root), 10_000_000).setup("fit")  # v5: flat in ranks, no per-chunk entries
    assert root.exists()
