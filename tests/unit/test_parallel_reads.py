"""The load path's parallel range reads: each stored chunk read once per rank however many read items it
feeds, reads in flight bounded by read_threads and buffered bytes by read_ahead_bytes, every byte still
checked, on a real counting filesystem (tests/helpers/counting_fs.py) and on S3 over loopback."""

from __future__ import annotations

import io
import os
import uuid

import fsspec
import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from lightning_shardckpt import (
    CheckpointSaver,
    CorruptCheckpoint,
    LoadConfig,
    SaveConfig,
    load_checkpoint,
    verify_checkpoint,
)
from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format.checksum import block_size_for, checksum
from lightning_shardckpt.engine.format.chunk_index import ChunkIndex
from lightning_shardckpt.engine.format.manifest import files_of
from lightning_shardckpt.engine.format.names import join
from lightning_shardckpt.engine.storage.chunk_reads import HEAD_BYTES, TAIL_BYTES, record_data_offset
from lightning_shardckpt.engine.storage.coalesced_reads import SMALL_CHUNK_BYTES
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.engine.storage.reader import ShardReader
from lightning_shardckpt.engine.storage.writer import save_record
from tests.helpers.checkpoints import SHARD, chunk_of
from tests.helpers.counting_fs import LOGS, counting_url

ROWS, COLUMNS = 64, 32


def counting(latency_s: float = 0.0) -> tuple[dict, str]:
    """Storage options of a fresh counting filesystem, and its log's id."""
    log_id = uuid.uuid4().hex
    return {"log_id": log_id, "latency_s": latency_s}, log_id


def reader_for(directory: str, manifest: dict, options: dict, *, checksums: bool = True, **kwargs) -> ShardReader:
    fs = fsspec.filesystem("counting", **options)
    expected = manifest_format.expected_checksums(manifest) if checksums else None
    return ShardReader(fs, directory, expected_checksums=expected, **kwargs)


def read_items(reader: ShardReader, targets: dict, items: list[ReadItem]) -> None:
    """Run `items` through the reader as DCP would for a rank whose load plan holds them."""
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(targets, metadata, True)
    reader.read_data(LoadPlan(items), planner).wait()


def item(dest: str, storage_offsets: tuple[int, int], lengths: tuple[int, int]) -> ReadItem:
    """A read item taking rows/columns of the stored tensor `w` into the whole of target `dest`."""
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(dest, (0, 0)),
        dest_offsets=torch.Size((0, 0)),
        storage_index=MetadataIndex("w", (0, 0)),
        storage_offsets=torch.Size(storage_offsets),
        lengths=torch.Size(lengths),
    )


def test_two_row_shards_from_one_stored_chunk_are_filled_from_a_single_read_of_it(committed_checkpoint):
    weights = torch.randn(ROWS, COLUMNS)
    _, directory, manifest = committed_checkpoint(state={"w": weights})
    options, log_id = counting()
    reader = reader_for(directory, manifest, options)
    targets = {"top": torch.zeros(ROWS // 2, COLUMNS), "bottom": torch.zeros(ROWS // 2, COLUMNS)}

    read_items(
        reader,
        targets,
        [item("top", (0, 0), (ROWS // 2, COLUMNS)), item("bottom", (ROWS // 2, 0), (ROWS // 2, COLUMNS))],
    )

    assert torch.equal(targets["top"], weights[: ROWS // 2]) and torch.equal(targets["bottom"], weights[ROWS // 2 :])
    chunk = chunk_of(manifest, "w")
    parts = sorted(
        LOGS[log_id].bytes_read(os.path.join(directory, SHARD), chunk["offset"], chunk["offset"] + chunk["length"])
    )
    assert sum(stop - start for start, stop in parts) == chunk["length"]  # every byte of the chunk, once
    assert all(previous[1] <= following[0] for previous, following in zip(parts, parts[1:]))
    assert (reader.chunks_read, reader.bytes_read) == (1, chunk["length"])


def test_two_column_slices_of_one_stored_chunk_are_cut_from_a_single_buffered_read(committed_checkpoint):
    weights = torch.randn(ROWS, COLUMNS)
    _, directory, manifest = committed_checkpoint(state={"w": weights})
    options, log_id = counting()
    reader = reader_for(directory, manifest, options)
    targets = {"left": torch.zeros(ROWS, COLUMNS // 2), "right": torch.zeros(ROWS, COLUMNS // 2)}

    read_items(
        reader,
        targets,
        [item("left", (0, 0), (ROWS, COLUMNS // 2)), item("right", (0, COLUMNS // 2), (ROWS, COLUMNS // 2))],
    )

    assert torch.equal(targets["left"], weights[:, : COLUMNS // 2]) and torch.equal(
        targets["right"], weights[:, COLUMNS // 2 :]
    )
    chunk = chunk_of(manifest, "w")
    parts = LOGS[log_id].bytes_read(os.path.join(directory, SHARD), chunk["offset"], chunk["offset"] + chunk["length"])
    assert sum(stop - start for start, stop in parts) == chunk["length"]
    assert reader.chunks_read == 1


def test_with_checksums_off_only_the_rows_a_rank_needs_and_the_record_headers_are_read(committed_checkpoint):
    weights = torch.randn(4096, COLUMNS)  # 512 KiB: the headers read (a few KiB) are small beside it
    _, directory, manifest = committed_checkpoint(state={"w": weights})
    options, _ = counting()
    reader = reader_for(directory, manifest, options, checksums=False)
    targets = {"top": torch.zeros(1024, COLUMNS)}

    read_items(reader, targets, [item("top", (0, 0), (1024, COLUMNS))])

    assert torch.equal(targets["top"], weights[:1024])
    needed = 1024 * COLUMNS * 4
    assert needed <= reader.bytes_read < needed + 16 * 1024
    assert reader.bytes_read < chunk_of(manifest, "w")["length"] // 2


def many_tensors(count: int = 12, rows: int = 128) -> dict:
    generator = torch.Generator().manual_seed(7)
    return {f"layer{i:02d}": torch.randn(rows, COLUMNS, generator=generator) for i in range(count)}


def zeros_like(state: dict) -> dict:
    return {key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else None for key, value in state.items()}


def test_range_reads_overlap_but_never_exceed_read_threads(committed_checkpoint):
    # chunks past SMALL_CHUNK_BYTES: each is its own request (smaller neighbours share one, the test below)
    state = many_tensors(count=6, rows=SMALL_CHUNK_BYTES // (4 * COLUMNS) + 1)
    root, _, _ = committed_checkpoint(state=state)
    options, log_id = counting(latency_s=0.05)
    target = zeros_like(state)

    result = load_checkpoint(target, counting_url(root), config=LoadConfig(storage_options=options, read_threads=3))

    assert all(torch.equal(target[key], state[key]) for key in state)
    assert 2 <= LOGS[log_id].peak_running <= 3
    assert result.chunks_read == len(state)


def test_neighbouring_small_chunks_of_a_shard_file_are_read_in_one_request_and_each_checked(committed_checkpoint):
    # an FSDP2 resume's pattern: one small chunk per tensor, neighbours in the file; one request per chunk made ~1,000
    # requests per rank to one object for a 1,000-tensor model (issue 46)
    state = many_tensors(count=40)
    root, _, _ = committed_checkpoint(state=state)
    options, log_id = counting()
    target = zeros_like(state)

    result = load_checkpoint(target, counting_url(root), config=LoadConfig(storage_options=options, read_threads=3))

    assert all(torch.equal(target[key], state[key]) for key in state)
    shard_reads = [read for read in LOGS[log_id].reads if read[0].endswith(".distcp")]
    assert len(shard_reads) == 1, shard_reads
    assert result.chunks_read == len(state)


def test_read_ahead_bytes_holds_buffered_chunks_to_one_at_a_time(committed_checkpoint):
    # objects are always read into a buffer: with a budget smaller than one, they are read one by one
    state = {f"note{i}": list(range(200 + i)) for i in range(8)}
    root, _, _ = committed_checkpoint(state=state)
    options, log_id = counting(latency_s=0.02)
    target = {key: None for key in state}

    load_checkpoint(
        target, counting_url(root), config=LoadConfig(storage_options=options, read_threads=4, read_ahead_bytes=1)
    )

    assert target == state
    assert LOGS[log_id].peak_running == 1


@pytest.mark.parametrize("where", ["record header", "tensor bytes"])
def test_a_flipped_byte_in_one_of_many_chunks_read_in_parallel_is_named(committed_checkpoint, where):
    state = many_tensors()
    root, directory, manifest = committed_checkpoint(state=state)
    chunk = chunk_of(manifest, "layer05")
    path = os.path.join(directory, SHARD)
    data = bytearray(open(path, "rb").read())
    data[chunk["offset"] + (10 if where == "record header" else chunk["length"] // 2)] ^= 0x01
    open(path, "wb").write(bytes(data))

    with pytest.raises(CorruptCheckpoint) as caught:
        load_checkpoint(zeros_like(state), root, config=LoadConfig(read_threads=4))
    assert (caught.value.problems[0]["file"], caught.value.problems[0]["tensor"]) == (SHARD, "layer05")


def test_read_settings_that_cannot_work_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="read_threads=0"):
        LoadConfig(read_threads=0)
    with pytest.raises(ValueError, match="read_ahead_bytes=0"):
        LoadConfig(read_ahead_bytes=0)


def test_on_s3_every_chunk_is_read_once_with_range_gets_in_parallel_and_a_flipped_byte_is_named(s3_root):
    state = many_tensors()
    saver = CheckpointSaver(
        s3_root.url, SaveConfig(async_save=False, write_events=False, storage_options=s3_root.storage_options)
    )
    try:
        saved = saver.save(state, step=1).result(timeout=120)
    finally:
        saver.close()
    assert saved.committed, saved.error
    config = LoadConfig(storage_options=s3_root.storage_options, read_threads=4)
    target = zeros_like(state)

    result = load_checkpoint(target, s3_root.url, config=config)

    assert all(torch.equal(target[key], state[key]) for key in state)
    shards = [f for f in files_of(saved.manifest) if f["kind"] == "shard"]
    assert result.bytes_read == sum(f["bytes"] for f in shards)  # every chunk once, nothing twice
    location = resolve(s3_root.url, s3_root.storage_options)
    chunk = ChunkIndex(location.fs, join(location.path, os.path.basename(saved.path)), saved.manifest).tensor_chunks(
        "layer05"
    )[0]
    fs = fsspec.filesystem("s3", **s3_root.storage_options)
    shard = f"{s3_root.bucket}/{s3_root.prefix}/{os.path.basename(saved.path)}/{chunk['file']}"
    data = bytearray(fs.cat_file(shard))
    data[chunk["offset"] + chunk["length"] // 2] ^= 0x01
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(CorruptCheckpoint) as caught:
        load_checkpoint(zeros_like(state), s3_root.url, config=config)
    assert (caught.value.problems[0]["file"], caught.value.problems[0]["tensor"]) == (chunk["file"], "layer05")


def test_a_record_is_located_from_its_head_and_tail_alone_and_another_layout_is_declined():
    tensor = torch.randn(4096, COLUMNS)
    ours = io.BytesIO()
    save_record(tensor, ours)
    data = ours.getvalue()
    tail_start = len(data) - TAIL_BYTES
    start = record_data_offset(
        bytearray(data[:HEAD_BYTES]), bytearray(data[tail_start:]), tail_start, len(data), tensor.nbytes
    )
    assert start is not None and data[start : start + tensor.nbytes] == tensor.numpy().tobytes()

    # torch.save of a view writes its whole storage: the storage is not the chunk's bytes, so it is declined
    view = io.BytesIO()
    torch.save(tensor[::2], view)
    other = view.getvalue()
    tail_start = len(other) - TAIL_BYTES
    assert (
        record_data_offset(
            bytearray(other[:HEAD_BYTES]), bytearray(other[tail_start:]), tail_start, len(other), tensor[::2].nbytes
        )
        is None
    )


# --- block checksums: a rank that needs part of a large chunk reads and checks only the blocks holding it ---
BIG_ROWS, BIG_COLUMNS = 8192, 256  # 8 MiB of float32: blocks of 1 MiB (block_size_for), 9 of them with the record


def big_chunk(committed_checkpoint) -> tuple[torch.Tensor, str, str, dict, dict]:
    weights = torch.randn(BIG_ROWS, BIG_COLUMNS)
    root, directory, manifest = committed_checkpoint(state={"w": weights})
    return weights, root, directory, manifest, chunk_of(manifest, "w")


def test_a_large_chunk_records_one_checksum_per_block_of_its_bytes_and_a_small_one_none(tmp_path, committed_checkpoint):
    _, _, directory, manifest, chunk = big_chunk(committed_checkpoint)
    blocks = chunk["blocks"]
    assert blocks["size"] == block_size_for(BIG_ROWS * BIG_COLUMNS * 4) == 2**20
    with open(os.path.join(directory, SHARD), "rb") as handle:
        handle.seek(chunk["offset"])
        data = handle.read(chunk["length"])
    assert blocks["checksums"] == [checksum(data[i : i + blocks["size"]]) for i in range(0, len(data), blocks["size"])]
    small = committed_checkpoint(tmp_path / "small", state={"w": torch.randn(ROWS, COLUMNS)}).manifest
    assert "blocks" not in chunk_of(small, "w")


def test_a_rank_that_needs_half_of_a_large_chunk_reads_and_checks_only_the_blocks_holding_it(committed_checkpoint):
    weights, _, directory, manifest, chunk = big_chunk(committed_checkpoint)
    options, _ = counting()
    reader = reader_for(directory, manifest, options, expected_blocks=manifest_format.expected_blocks(manifest))
    half = BIG_ROWS // 2
    targets = {"bottom": torch.zeros(half, BIG_COLUMNS)}

    read_items(
        reader,
        targets,
        [
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex("bottom", (0, 0)),
                dest_offsets=torch.Size((0, 0)),
                storage_index=MetadataIndex("w", (0, 0)),
                storage_offsets=torch.Size((half, 0)),
                lengths=torch.Size((half, BIG_COLUMNS)),
            )
        ],
    )

    assert torch.equal(targets["bottom"], weights[half:])
    # the bottom half's 4 MiB and the block holding the record's head (the tail's block is the half's last)
    assert reader.bytes_read <= half * BIG_COLUMNS * 4 + 2 * chunk["blocks"]["size"] + 2 * HEAD_BYTES
    assert reader.bytes_read < 0.7 * chunk["length"]


@pytest.mark.parametrize("half", ["needed", "not needed"])
def test_a_flipped_byte_is_named_by_block_where_it_is_read_and_full_verify_finds_it_anywhere(
    committed_checkpoint, half
):
    weights, root, directory, manifest, chunk = big_chunk(committed_checkpoint)
    path = os.path.join(directory, SHARD)
    data = bytearray(open(path, "rb").read())
    data[chunk["offset"] + chunk["length"] // (4 if half == "not needed" else 2) + 4096] ^= 0x01  # inside the data
    open(path, "wb").write(bytes(data))
    options, _ = counting()
    reader = reader_for(directory, manifest, options, expected_blocks=manifest_format.expected_blocks(manifest))
    bottom = BIG_ROWS // 2
    item_bottom = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("bottom", (0, 0)),
        dest_offsets=torch.Size((0, 0)),
        storage_index=MetadataIndex("w", (0, 0)),
        storage_offsets=torch.Size((bottom, 0)),
        lengths=torch.Size((bottom, BIG_COLUMNS)),
    )
    targets = {"bottom": torch.zeros(bottom, BIG_COLUMNS)}

    if half == "needed":
        with pytest.raises(CorruptCheckpoint, match="block 4") as caught:
            read_items(reader, targets, [item_bottom])
        assert (caught.value.problems[0]["file"], caught.value.problems[0]["tensor"]) == (SHARD, "w")
    else:  # a rank never reads a block it does not need: the damage is another rank's to find, or verify's
        read_items(reader, targets, [item_bottom])
        assert torch.equal(targets["bottom"], weights[bottom:])
    report = verify_checkpoint(directory)
    assert not report.ok and report.problems[0]["tensor"] == "w"


def test_one_large_chunk_is_read_by_several_threads_block_by_block_and_lands_bit_exact(committed_checkpoint):
    weights, root, _, _, chunk = big_chunk(committed_checkpoint)  # one chunk, 9 blocks
    options, log_id = counting(latency_s=0.05)
    target = {"w": torch.zeros_like(weights)}

    result = load_checkpoint(target, counting_url(root), config=LoadConfig(storage_options=options, read_threads=3))

    assert torch.equal(target["w"], weights)
    assert result.chunks_read == 1
    assert 2 <= LOGS[log_id].peak_running <= 3 + 1  # the blocks' readers, plus the chunk's own head/tail read


def test_a_flipped_byte_in_the_last_block_of_a_chunk_read_in_parallel_is_named_by_its_block(committed_checkpoint):
    _, root, directory, _, chunk = big_chunk(committed_checkpoint)
    path = os.path.join(directory, SHARD)
    data = bytearray(open(path, "rb").read())
    data[chunk["offset"] + chunk["length"] - TAIL_BYTES - 8] ^= 0x01  # inside the data, in the last block
    open(path, "wb").write(bytes(data))
    last_block = (chunk["length"] - TAIL_BYTES - 8) // chunk["blocks"]["size"]

    with pytest.raises(CorruptCheckpoint, match=f"block {last_block}") as caught:
        load_checkpoint({"w": torch.zeros(BIG_ROWS, BIG_COLUMNS)}, root, config=LoadConfig(read_threads=4))
    assert (caught.value.problems[0]["file"], caught.value.problems[0]["tensor"]) == (SHARD, "w")
