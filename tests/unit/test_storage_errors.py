"""A storage error while a tensor record is written fails that checkpoint, and nothing else.

The bug these tests pin: a `torch._C.PyTorchFileWriter` abandoned after a failed write stayed
referenced by the kept error's traceback and threw from its C++ destructor at the next garbage
collection or at exit: SIGABRT, exit 134, after `on_error="log"` had promised that training goes on.
Each save runs in a process of its own (tests/helpers/full_disk.py) so the exit status is the verdict.
Disk-full is real: a small tmpfs (root only; skipped otherwise) and, everywhere, a size-limited
fsspec filesystem (tests/helpers/quota_fs.py) that refuses bytes once its budget is spent.
"""

from __future__ import annotations

import gc
import json
import os
import traceback

import pytest

from lightning_shardckpt.engine.config import SaveConfig
from lightning_shardckpt.engine.save.saver import CheckpointSaver
from tests.helpers import quota_fs
from tests.helpers.checkpoints import dirnames_at_step
from tests.helpers.full_disk import mounted_tmpfs, run_saves, state

SIGABRT_EXIT = 134


def _report(proc) -> list[dict]:
    assert proc.returncode == 0, (
        f"the saving process exited {proc.returncode}"
        + (" (SIGABRT)" if proc.returncode in (SIGABRT_EXIT, -6) else "")
        + f"\n--- stdout ---\n{proc.stdout[-2000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs: the 270 KiB state fits three times, with its own small files, never four."""
    try:
        with mounted_tmpfs(tmp_path / "tmpfs", "1m") as directory:
            yield directory
    except PermissionError as err:
        pytest.skip(f"cannot mount a tmpfs here ({err}); the quota:// tests cover disk-full without it")


def shard_bytes(tmp_path) -> int:
    """Size of the shard file the helper's state makes (measured on an unlimited save)."""
    root = tmp_path / "measure"
    saver = CheckpointSaver(str(root), SaveConfig(async_save=False))
    assert saver.save(state(), step=1).result().committed
    saver.close()
    (shard,) = root.glob("step-*/__0_0.distcp")
    return shard.stat().st_size


@pytest.mark.slow  # a fresh Python process of its own (imports torch): ~4 s, more under load
def test_saves_filling_a_real_tmpfs_fail_counted_and_the_process_exits_0(small_tmpfs):
    # four saves into one 1 MiB root: the first ones commit, one runs out of space mid-record
    proc = run_saves(str(small_tmpfs / "root"), {}, [None, None, None, None])
    report = _report(proc)
    outcomes = [save["committed"] for save in report]
    assert outcomes[0] and not all(outcomes), f"expected the disk to fill up part way: {report}"
    failed = [save for save in report if not save["committed"]]
    assert all("No space left on device" in save["cause"] for save in failed), failed
    assert all(save["counters"]["failed"] == 1 for save in failed)


@pytest.mark.slow  # a fresh Python process of its own (imports torch): ~4 s, more under load
def test_a_save_running_out_of_quota_at_any_byte_of_its_records_fails_and_the_process_exits_0(tmp_path):
    """Budgets that end the disk in the first record, mid-tensor, and in the last bytes (the zip's end records)."""
    full = shard_bytes(tmp_path)
    budgets = [0, 1, 700, 5_000, full // 2, full - 600, full - 200, full - 64, full - 22, full - 1]
    proc = run_saves(quota_fs.quota_url(tmp_path / "quota"), {}, budgets)
    report = _report(proc)
    assert [save["committed"] for save in report] == [False] * len(budgets), report
    assert all("No space left on device" in save["cause"] for save in report), report
    assert all(save["counters"] == {"attempted": 1, "committed": 0, "failed": 1, "skipped": 0} for save in report)


@pytest.mark.slow  # a fresh Python process of its own (imports torch): ~4 s, more under load
def test_a_background_save_running_out_of_quota_fails_and_the_process_exits_0(tmp_path):
    full = shard_bytes(tmp_path)
    proc = run_saves(quota_fs.quota_url(tmp_path / "quota"), {}, [700, full - 200, 10 * full], async_save=True)
    report = _report(proc)
    assert [save["committed"] for save in report] == [False, False, True], report


def test_a_failed_save_keeps_its_error_without_the_frames_local_variables(tmp_path):
    """The kept error must not keep the failed save's objects (record writers, staged state) alive."""
    options = quota_fs.quota_options(tmp_path / "quota", 5_000)
    saver = CheckpointSaver(
        quota_fs.quota_url(tmp_path / "quota"), SaveConfig(async_save=False, storage_options=options)
    )
    result = saver.save(state(), step=1).result()
    saver.close()
    assert not result.committed and "No space left on device" in str(result.error)
    gc.collect()
    leaked = []
    for err in _chain(result.error):
        for frame, _ in traceback.walk_tb(err.__traceback__):
            if frame.f_locals:
                leaked.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name} holds {sorted(frame.f_locals)}")
    assert not leaked, "\n".join(leaked)
    assert "".join(traceback.format_exception(result.error)).count("OSError") >= 1  # still printable


def _chain(err: BaseException) -> list[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    out, pending, seen = [], [err], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        out.append(current)
        pending.extend((current.__cause__, current.__context__))
        if isinstance(current, CheckpointException):
            pending.extend(failure[0] for failure in current.failures.values())
    return out


def test_quota_filesystem_refuses_bytes_past_its_budget_and_frees_room_on_delete(tmp_path):
    """The test filesystem itself: a real limit, counted on disk, released by deletion."""
    fs = quota_fs.QuotaFileSystem(budget_bytes=1000, quota_root=str(tmp_path))
    with fs.open(str(tmp_path / "a"), "wb") as handle:
        handle.write(b"x" * 600)
    with pytest.raises(OSError) as raised:
        with fs.open(str(tmp_path / "b"), "wb") as handle:
            handle.write(b"y" * 600)
    assert raised.value.errno == 28
    assert quota_fs.used_bytes(str(tmp_path)) == 1000  # what fit was kept, as on a real disk
    fs.rm(str(tmp_path / "b"))
    with fs.open(str(tmp_path / "c"), "wb") as handle:
        handle.write(b"z" * 400)
    assert quota_fs.used_bytes(str(tmp_path)) == 1000


# --- a failed attempt's directory is removed once every rank saw it fail (issue 9.3) ---


def test_a_transient_disk_full_does_not_leave_a_partial_directory_that_fails_every_later_save(tmp_path):
    """A disk with room for two checkpoints: one fills up (someone else's file), then frees again.

    Left behind, the failed attempt's partial shard takes the room the next save needs: every later
    save failed with ENOSPC too. Removed by the coordinator, the next save commits.
    """
    full = shard_bytes(tmp_path)
    disk = tmp_path / "disk"
    options = quota_fs.quota_options(disk, int(2.3 * full))
    saver = CheckpointSaver(quota_fs.quota_url(disk / "root"), SaveConfig(async_save=False, storage_options=options))
    assert saver.save(state(), step=1).result().committed
    ballast = disk / "someone-elses-file"
    ballast.write_bytes(b"\0" * int(0.9 * full))  # the disk is nearly full for a while
    failed = saver.save(state(), step=2).result()
    ballast.unlink()
    later = saver.save(state(), step=3).result()  # the room for a second checkpoint is free again
    saver.close()

    assert not failed.committed and "No space left on device" in str(failed.error)
    assert later.committed, later.error  # the symptom: with the partial directory left, this one failed too
    assert failed.cleanup == "removed" and not dirnames_at_step(os.listdir(disk / "root"), 2)
    assert saver.counters.notes() == {"failed_dirs_removed": 1}


def test_a_failed_attempt_is_kept_for_inspection_with_keep_failed_attempts(tmp_path):
    options = quota_fs.quota_options(tmp_path / "disk", 5_000)
    config = SaveConfig(async_save=False, storage_options=options, keep_failed_attempts=True)
    saver = CheckpointSaver(quota_fs.quota_url(tmp_path / "disk"), config)
    result = saver.save(state(), step=1).result()
    saver.close()
    assert not result.committed and result.cleanup is None and saver.counters.notes() == {}
    assert len(dirnames_at_step(os.listdir(tmp_path / "disk"), 1)) == 1


def test_on_s3_a_failed_attempt_is_removed_and_the_committed_one_stays(s3_server, s3_root):
    from lightning_shardckpt.engine.catalog import list_checkpoints
    from lightning_shardckpt.engine.storage.fsio import resolve
    from tests.helpers.faults import FailOnce

    saver = CheckpointSaver(
        s3_root.url, SaveConfig(storage_options=s3_root.storage_options), fault_hook=FailOnce("after_write")
    )
    failed = saver.save(state(), step=1).result(timeout=60)  # its shard object was uploaded, then the rank failed
    committed = saver.save(state(), step=2).result(timeout=60)
    saver.close()
    assert not failed.committed and failed.cleanup == "removed" and committed.committed
    attempt = failed.path.rstrip("/").rsplit("/", 1)[-1]
    assert not s3_server.fs.find(f"{s3_root.bucket}/{s3_root.prefix}/{attempt}")
    assert [(e.step, e.state) for e in list_checkpoints(resolve(s3_root.url, s3_root.storage_options))] == [
        (2, "committed")
    ]
