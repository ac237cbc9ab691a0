"""Shard files written past the page cache (O_DIRECT, engine/storage/direct_file.py): the same bytes as a
buffered write, on a real disk that takes O_DIRECT; buffered where the filesystem refuses it; a full disk
fails the save and keeps what was committed."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem

from lightning_shardckpt import CheckpointSaver, SaveConfig, load_checkpoint
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.engine.storage.direct_file import BUFFER_BYTES, DirectFile, open_direct
from tests.helpers.checkpoints import RUN_ID
from tests.helpers.full_disk import mounted_ext4, run_saves, state
from tests.helpers.quota_fs import QuotaFileSystem

MIB = 2**20


def takes_direct_io(directory: Path) -> bool:
    probe = open_direct(str(directory / ".probe"))
    if probe is None:
        return False
    probe.close()
    os.unlink(directory / ".probe")
    return True


@pytest.fixture
def direct_dir(tmp_path):
    """A directory on a disk that takes O_DIRECT: tmp_path where it does, else a small ext4 loop mount."""
    if takes_direct_io(tmp_path):
        yield tmp_path
        return
    try:
        with mounted_ext4(tmp_path / "ext4", 64) as directory:
            yield directory
    except PermissionError as err:
        pytest.skip(f"no disk here takes O_DIRECT and no ext4 can be mounted ({err})")


def pieces_of(sizes: list[int]) -> list[bytes]:
    generator = torch.Generator().manual_seed(len(sizes))
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).numpy().tobytes() for size in sizes]


def test_a_direct_file_holds_exactly_the_bytes_written_across_buffers_and_flushes(direct_dir):
    path = direct_dir / "shard.bin"
    # odd sizes, one crossing the 8 MiB buffer twice, a flush (the tail block padded, then cut back) mid-stream
    before_flush = pieces_of([1, 4095, 4097, 3 * MIB + 5])
    after_flush = pieces_of([2 * BUFFER_BYTES + 17, 0, 511, 4096])
    handle = fsio.open_shard(LocalFileSystem(), str(path), direct_io=True)
    assert isinstance(handle, DirectFile)
    assert fcntl.fcntl(handle.fileno(), fcntl.F_GETFL) & os.O_DIRECT
    for piece in before_flush:
        assert handle.write(piece) == len(piece)
    handle.flush()
    os.fsync(handle.fileno())
    assert path.read_bytes() == b"".join(before_flush)  # durable so far, at its true size
    for piece in after_flush:
        handle.write(memoryview(piece))
    handle.close()
    handle.close()  # a second close is a no-op, as for any file
    assert path.read_bytes() == b"".join(before_flush + after_flush)
    with pytest.raises(ValueError, match="closed file"):
        handle.write(b"x")


def test_a_checkpoint_written_direct_has_the_same_bytes_as_a_buffered_one_and_loads_in_both_loaders(direct_dir):
    model = {"weight": torch.randn(1536, 1024), "bias": torch.randn(7), "step": torch.tensor(5)}  # 6 MiB
    roots = {}
    for direct_io in (True, False):
        root = direct_dir / f"direct-{direct_io}"
        saver = CheckpointSaver(str(root), SaveConfig(async_save=False, run_id=RUN_ID, direct_io=direct_io))
        assert saver.save({"model": model}, step=5).result(timeout=60).committed
        saver.close()
        roots[direct_io] = root
    (direct_shard,) = roots[True].glob("step-*/__0_0.distcp")
    (buffered_shard,) = roots[False].glob("step-*/__0_0.distcp")
    assert direct_shard.read_bytes() == buffered_shard.read_bytes()

    ours = {"model": {name: torch.zeros_like(value) for name, value in model.items()}}
    load_checkpoint(ours, str(roots[True]))
    plain = {"model": {name: torch.zeros_like(value) for name, value in model.items()}}
    dcp.load(plain, checkpoint_id=str(direct_shard.parent))  # no package code: DCP's own reader
    for name, value in model.items():
        assert torch.equal(ours["model"][name], value) and torch.equal(plain["model"][name], value), name


def test_direct_io_off_and_a_filesystem_that_opens_files_its_own_way_are_written_buffered(direct_dir):
    # (a disk that refuses O_DIRECT, EINVAL at open, is written buffered the same way: tmpfs before Linux 6.6)
    handle = fsio.open_shard(LocalFileSystem(), str(direct_dir / "off.bin"), direct_io=False)
    assert not isinstance(handle, DirectFile)
    handle.close()
    wrapping = QuotaFileSystem(2**30, str(direct_dir))  # a LocalFileSystem whose _open wraps every file
    handle = fsio.open_shard(wrapping, str(direct_dir / "wrapped.bin"), direct_io=True)
    assert not isinstance(handle, DirectFile)
    handle.write(b"through the wrapper")
    handle.close()
    assert (direct_dir / "wrapped.bin").read_bytes() == b"through the wrapper"


@pytest.mark.slow  # a fresh Python process of its own (imports torch) and a loop-mounted disk
def test_saves_filling_a_real_ext4_disk_written_direct_fail_counted_and_keep_what_committed(tmp_path):
    try:
        with mounted_ext4(tmp_path / "ext4", 2) as disk:
            assert takes_direct_io(disk)
            proc = run_saves(str(disk / "root"), {}, [None] * 10)
            assert proc.returncode == 0, proc.stderr[-4000:]
            report = json.loads(proc.stdout.strip().splitlines()[-1])
            outcomes = [save["committed"] for save in report]
            assert outcomes[0] and not all(outcomes), f"expected the 2 MiB disk to fill part way: {report}"
            failed = [save for save in report if not save["committed"]]
            assert all("No space left on device" in save["cause"] for save in failed), failed
            first = {name: torch.zeros_like(value) for name, value in state().items() if torch.is_tensor(value)}
            load_checkpoint(first, str(disk / "root" / "b0"), strict=False)
            for name, value in first.items():
                assert torch.equal(value, state()[name]), name
    except PermissionError as err:
        pytest.skip(f"cannot mount an ext4 disk here ({err}); test_storage_errors covers disk-full buffered")
