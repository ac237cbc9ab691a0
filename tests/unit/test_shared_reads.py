"""The coordinator's read of what every rank needs (engine/load/shared_reads.py): the records of the target's
objects and small replicated tensors, their bytes in one range read per run of neighbours, never a file outside
the checkpoint directory. (Across real ranks: tests/distributed/test_scale_ranks.py, no file read by every rank.)"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, CorruptCheckpoint, SaveConfig
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format.chunk_index import ChunkIndex
from lightning_shardckpt.engine.load.shared_reads import read_shared, shared_items
from lightning_shardckpt.engine.storage.chunk_reads import InMemoryShard
from lightning_shardckpt.engine.storage.fsio import resolve
from tests.helpers import counting_fs


def _saved(root: str) -> catalog.CheckpointEntry:
    state = {
        "step": torch.tensor(7),
        "norm": torch.ones(16),
        "big": torch.zeros(512, 1024),  # 2 MiB: over SHARED_TENSOR_MAX_BYTES, each rank reads its own
        "progress": {"epoch": 3},
        "note": "hello",
    }
    saver = CheckpointSaver(root, SaveConfig(async_save=False, write_events=False))
    result = saver.save(state, step=1).result(timeout=60)
    saver.close()
    assert result.committed, result.error
    [entry] = catalog.list_checkpoints(resolve(root))
    return entry


def test_the_shared_items_are_read_in_one_request_per_run_and_served_from_memory(tmp_path):
    entry = _saved(str(tmp_path / "ckpt"))
    fqns = shared_items(entry.manifest, {"step", "norm", "big", "progress.epoch", "note", "absent"})
    assert sorted(fqns) == ["norm", "note", "progress.epoch", "step"]
    # a budget for the shared tensors: the smallest first (step's 8 bytes), the rest read by each rank
    assert sorted(shared_items(entry.manifest, {"step", "norm", "note"}, tensors_max_bytes=8)) == ["note", "step"]
    log_id = uuid.uuid4().hex
    location = resolve(counting_fs.counting_url(tmp_path / "ckpt"), {"log_id": log_id})
    directory = location.fs._strip_protocol(entry.path)
    shared = read_shared(ChunkIndex(location.fs, directory, entry.manifest), fqns)

    shard_reads = [read for read in counting_fs.LOGS[log_id].reads if read[0].endswith(".distcp")]
    assert len(shard_reads) == 1  # four neighbouring records, one range read
    [memory] = shared.shards().values()
    assert isinstance(memory, InMemoryShard)
    for record in shared.records.values():
        assert memory.covers(record["offset"], record["length"])
        view = memoryview(bytearray(record["length"]))
        assert memory.read_into(record["offset"], view) == record["length"]


def test_the_coordinators_shared_read_never_opens_a_shard_that_leads_out_of_the_directory(tmp_path):
    entry = _saved(str(tmp_path / "ckpt"))
    shard = os.path.join(entry.path, "__0_0.distcp")
    outside = tmp_path / "elsewhere.distcp"
    os.replace(shard, outside)
    os.symlink(outside, shard)
    location = resolve(str(tmp_path / "ckpt"))
    with pytest.raises(CorruptCheckpoint, match="outside the checkpoint directory"):
        read_shared(ChunkIndex(location.fs, entry.path, entry.manifest), ["note"])
