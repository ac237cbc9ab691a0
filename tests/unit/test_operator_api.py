"""The public operator API (`from lightning_shardckpt import list_checkpoints, ...`): list, resolve, inspect and
follow a root's checkpoints on local disk and on the loopback S3 server, picking what a resume picks (issue 38,
item 6). The script that uses it from outside the tests is run by tests/e2e/test_follow_checkpoints_recipe.py."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import datetime

import pytest

from lightning_shardckpt import (
    CheckpointInfo,
    CheckpointListing,
    CheckpointNotFound,
    CheckpointSaver,
    ConfigError,
    ManifestSummary,
    follow_checkpoints,
    list_checkpoints,
    read_manifest_summary,
    resolve_checkpoint,
)
from lightning_shardckpt.engine.format import drill_records
from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format.names import COMMIT_RECORD, MANIFEST, checkpoint_dirname, join
from tests.helpers import counting_fs
from tests.helpers.backends import LOCAL, Backend
from tests.helpers.checkpoints import RUN_ID, dirname_of, fresh_state


def save(backend: Backend, step: int) -> dict:
    """Commit one small checkpoint under the backend's root, as a training run does; its manifest."""
    saver = CheckpointSaver(backend.url, backend.save_config(async_save=False, write_events=False, run_id=RUN_ID))
    try:
        result = saver.save(fresh_state(seed=step), step=step).result(timeout=60)
    finally:
        saver.close()
    assert result.committed, result.error
    return result.manifest


def plant(backend: Backend, name: str, files: dict[str, bytes]) -> None:
    """Files under ROOT/name, written the way a crashed writer or a person leaves them."""
    location = backend.location()
    location.backend.makedirs(join(location.path, name))
    for file, data in files.items():
        location.fs.pipe_file(join(location.path, name, file), data)


def drill(backend: Backend, name: str, verdict: str) -> None:
    record = {"checkpoint": name, "drill_id": drill_records.new_drill_id(), "verdict": verdict, "cause": None}
    drill_records.write_record(backend.location(), record)


def test_list_checkpoints_shows_every_state_its_trust_and_the_two_checkpoints_a_resume_picks(backend):
    manifests = {step: save(backend, step) for step in (1, 2, 3)}
    names = {step: dirname_of(manifest) for step, manifest in manifests.items()}
    drill(backend, names[2], drill_records.PASSED)
    drill(backend, names[3], drill_records.FAILED)
    plant(backend, checkpoint_dirname(9, "deadbeefcafe"), {"__0_0.distcp": b"half a shard"})  # a crashed save
    plant(backend, checkpoint_dirname(8, "0123456789ab"), {MANIFEST: b"{}", COMMIT_RECORD: b"{not json"})

    listing = list_checkpoints(backend.url, storage_options=backend.storage_options)

    assert isinstance(listing, CheckpointListing) and all(isinstance(c, CheckpointInfo) for c in listing.checkpoints)
    by_step = {info.step: info for info in listing.checkpoints}
    assert [info.step for info in listing.checkpoints] == [1, 2, 3, 8, 9]
    assert {step: info.state for step, info in by_step.items()} == {
        1: "committed",
        2: "committed",
        3: "committed",
        8: "corrupt",
        9: "uncommitted",
    }
    assert {step: info.trust for step, info in by_step.items()} == {
        1: "committed",
        2: "drilled",
        3: "drill-failed",
        8: None,
        9: None,
    }
    assert listing.latest.name == names[3] and listing.latest_step() == 3 and listing.latest_pointer == names[3]
    assert listing.last_good.name == names[2]
    assert listing.all_steps() == [1, 2, 3] and [info.step for info in listing.committed] == [1, 2, 3]
    three = by_step[3]
    assert three.path == f"{backend.url}/{names[3]}" and three.root == backend.url
    assert three.checkpoint_id == manifests[3]["id"] and three.parent == manifests[2]["id"] and three.seq == 3
    assert (
        three.bytes == sum(item["bytes"] for item in manifest_format.files_of(manifests[3]))
        and three.bytes_referenced == 0
    )
    assert isinstance(three.committed_at, datetime) and three.committed_at.tzinfo is not None
    assert three.run_id == RUN_ID and three.age_s is not None and three.age_s >= 0 and three.problem is None
    assert "commit record" in by_step[8].problem and by_step[8].committed_at is None
    assert by_step[9].bytes == len(b"half a shard")


@pytest.mark.parametrize("how", ["edited-manifest", "record-claims-a-later-seq"])
def test_the_listings_latest_is_the_checkpoint_a_resume_loads_not_the_newest_record(backend, how):
    old, new = dirname_of(save(backend, 1)), dirname_of(save(backend, 2))
    location = backend.location()
    if how == "edited-manifest":  # the newest one's manifest no longer matches its commit record
        path = join(location.path, new, MANIFEST)
        location.fs.pipe_file(path, location.fs.cat_file(path).replace(b'"epoch"', b'"epoch" '))
        expected, corrupt = old, new
    else:  # the older one's record says it committed last
        path = join(location.path, old, COMMIT_RECORD)
        location.fs.pipe_file(path, json.dumps({**json.loads(location.fs.cat_file(path)), "seq": 1000}).encode())
        expected, corrupt = new, old
    listing = list_checkpoints(backend.url, storage_options=backend.storage_options)
    assert listing.latest.name == expected
    assert resolve_checkpoint(backend.url, storage_options=backend.storage_options).name == expected
    assert {info.name: info.state for info in listing.checkpoints}[corrupt] == "corrupt"


def test_resolve_checkpoint_takes_every_spelling_of_a_reference(backend):
    first, second = save(backend, 1), save(backend, 2)
    one, two = dirname_of(first), dirname_of(second)
    drill(backend, one, drill_records.PASSED)
    options = backend.storage_options

    for which in ("latest", 2, "2", "step-2", second["id"], two):
        info = resolve_checkpoint(backend.url, which, storage_options=options)
        assert info.name == two and info.committed and info.trust == "committed", which
    good = resolve_checkpoint(backend.url, "last-good", storage_options=options)
    assert good.name == one and good.trust == "drilled"
    # paths name their own root: a checkpoint directory, ROOT/latest, or a path given as `which`
    assert resolve_checkpoint(f"{backend.url}/{one}", storage_options=options).name == one
    assert resolve_checkpoint(f"{backend.url}/latest", storage_options=options).name == two
    assert resolve_checkpoint("elsewhere", f"{backend.url}/{one}", storage_options=options).name == one


@pytest.mark.parametrize("backend", [LOCAL], indirect=True)
def test_resolve_and_list_name_the_root_and_the_fix_when_nothing_matches(backend, tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(CheckpointNotFound, match=f"{missing} does not exist; check the path"):
        list_checkpoints(missing)
    with pytest.raises(CheckpointNotFound, match=f"{missing} does not exist"):
        resolve_checkpoint(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFound, match="no committed checkpoint 'latest' in .*empty"):
        resolve_checkpoint(str(tmp_path / "empty"))
    name = dirname_of(save(backend, 5))
    with pytest.raises(CheckpointNotFound, match="no drilled checkpoint in .*shardckpt drill"):
        resolve_checkpoint(backend.url, "last-good")
    with pytest.raises(CheckpointNotFound, match=r"no committed checkpoint 7 in .*committed here: \['step-0+5-"):
        resolve_checkpoint(backend.url, 7)
    directory = f"{backend.url}/{name}"
    for call in (lambda: list_checkpoints(directory), lambda: resolve_checkpoint(directory, 5)):
        with pytest.raises(
            ConfigError, match=f"is a checkpoint directory, not a root; give the root .*: {backend.url}$"
        ):
            call()
    empty = list_checkpoints(str(tmp_path / "empty"))
    assert empty.checkpoints == () and empty.latest is None and empty.last_good is None and empty.latest_step() is None


def test_read_manifest_summary_gives_position_topology_counts_and_identity(backend):
    first, second = save(backend, 1), save(backend, 2)
    summary = read_manifest_summary(backend.url, storage_options=backend.storage_options)
    assert isinstance(summary, ManifestSummary)
    assert (summary.step, summary.checkpoint_id, summary.parent) == (2, second["id"], first["id"])
    assert summary.path == f"{backend.url}/{dirname_of(second)}" and summary.run_id == RUN_ID
    assert summary.tensor_count == len(second["tensors"]) and summary.object_count == len(second["objects"])
    assert summary.file_count == len(manifest_format.files_of(second)) == 2  # the shard and its part (format v4)
    assert summary.bytes == manifest_format.total_bytes(second) and summary.bytes_referenced == 0
    assert summary.topology["world_size"] == 1 and summary.verification == second["verification"]
    assert summary.identity == second["identity"] and set(summary.identity) == {
        "config",
        "data",
        "model",
        "code",
        "run",
    }
    assert summary.created_at == datetime.fromisoformat(second["created_at"])
    older = read_manifest_summary(backend.url, 1, storage_options=backend.storage_options)
    assert older.checkpoint_id == first["id"]


def copy_checkpoint(source: Backend, name: str, target: Backend, skip: tuple[str, ...] = ()) -> None:
    """Copy a committed checkpoint's files into another root (without `skip`): a save seen half-way."""
    src, dst = source.location(), target.location()
    dst.backend.makedirs(join(dst.path, name))
    for path in src.fs.ls(join(src.path, name), detail=False):
        file = path.rstrip("/").rsplit("/", 1)[-1]
        if file not in skip:
            dst.fs.pipe_file(join(dst.path, name, file), src.fs.cat_file(path))


def test_follow_checkpoints_yields_each_new_commit_in_commit_order_and_nothing_uncommitted_or_corrupt(
    backend, tmp_path
):
    save(backend, 1)  # committed before the follower starts: not new
    options = backend.storage_options
    # 3 s without a commit ends the loop: the commits below take well under that, on S3 and a loaded machine too
    follower = follow_checkpoints(backend.url, timeout_s=3.0, poll_s=0.05, storage_options=options)

    plant(backend, checkpoint_dirname(60, "0123456789ab"), {MANIFEST: b"{}", COMMIT_RECORD: b"{not json"})
    elsewhere = Backend(backend.name, f"{backend.url}-elsewhere", options)
    in_flight = dirname_of(save(elsewhere, 50))
    copy_checkpoint(elsewhere, in_flight, backend, skip=(MANIFEST,))  # files and record, no manifest yet
    steps = [save(backend, step)["step"] for step in (2, 3)]
    assert [next(follower).step for _ in steps] == [2, 3]  # both landed between two looks: commit order

    def commit_later() -> None:
        time.sleep(0.3)
        copy_checkpoint(elsewhere, in_flight, backend)  # its manifest lands: now it is committed
        save(backend, 4)

    thread = threading.Thread(target=commit_later)
    thread.start()
    assert [next(follower).step for _ in range(2)] == [50, 4]
    thread.join()
    assert list(follower) == []  # 3 s without a commit: the loop ends


def test_follow_checkpoints_waits_for_a_root_that_does_not_exist_yet_and_checks_its_options_at_once(tmp_path):
    root = tmp_path / "later"
    with pytest.raises(ConfigError, match="poll_s=0 "):
        follow_checkpoints(str(root), poll_s=0)  # raised by the call, not by the first next()
    with pytest.raises(ConfigError, match="is a checkpoint directory, not a root"):
        follow_checkpoints(str(root / checkpoint_dirname(3, "0123456789ab")))
    follower = follow_checkpoints(str(root), timeout_s=30, poll_s=0.05)
    thread = threading.Thread(target=lambda: save(Backend(LOCAL, str(root)), 7))
    thread.start()
    assert next(follower).step == 7
    thread.join()
    started = time.monotonic()
    assert list(follow_checkpoints(str(root), timeout_s=0.2, poll_s=0.05)) == []
    assert time.monotonic() - started >= 0.2


def test_each_look_of_a_follower_reads_only_directories_it_has_not_seen(tmp_path):
    """Polling a root of many checkpoints costs one listing, not a read per checkpoint (object stores bill both)."""
    root = str(tmp_path / "root")
    for step in range(1, 6):
        save(Backend(LOCAL, root), step)
    log_id = f"follow-{uuid.uuid4().hex}"
    url = counting_fs.counting_url(root)
    follower = follow_checkpoints(url, timeout_s=5, poll_s=0.05, storage_options={"log_id": log_id})
    log = counting_fs.LOGS[log_id]
    del log.reads[:]  # what the looks read from here on
    new = dirname_of(save(Backend(LOCAL, root), 6))
    assert next(follower).name == new
    assert {path.rsplit("/", 2)[-2] for path, _, _ in log.reads if "/step-" in path} == {new}


def test_follow_never_yields_a_checkpoint_whose_manifest_was_edited_after_commit_and_ends_where_ls_stars(tmp_path):
    """Issue 47 item 9: the follower and the listing apply one validity rule (the manifest is the committed one)."""
    from tests.helpers.forgery import replace_file

    root = Backend(LOCAL, str(tmp_path / "root"))
    older, newer = (dirname_of(save(root, step)) for step in (1, 2))
    path = tmp_path / "root" / newer / MANIFEST
    data = path.read_bytes()
    at = data.index(b'"created_at": "') + len(b'"created_at": "') + 3  # the year's last digit: still valid JSON
    edited = data[:at] + (b"8" if data[at : at + 1] != b"8" else b"7") + data[at + 1 :]
    json.loads(edited)
    replace_file(str(path), edited)

    yielded = [info.name for info in follow_checkpoints(root.url, include_existing=True, timeout_s=0.3, poll_s=0.05)]
    listing = list_checkpoints(root.url)
    assert yielded == [older]
    assert {info.name: info.state for info in listing.checkpoints}[newer] == "corrupt"
    assert listing.latest is not None and listing.latest.name == yielded[-1]
