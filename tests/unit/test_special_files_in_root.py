"""Special files planted in a root never hang a reader, exhaust its memory or lead it out of the root.

A FIFO, a symlink to /dev/zero, a symlink to a file outside the root and a 2 GiB sparse file, each planted as
a checkpoint's commit.json or manifest.json, as `latest`, as an index marker or as a drill lease: listing,
`latest`, following and `shardckpt ls` return within seconds, the planted checkpoint is shown (corrupt, with
why), never loaded, and the good one is chosen. Each test has its own timeout, so a hang fails it.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from lightning_shardckpt import follow_checkpoints, list_checkpoints, resolve_checkpoint
from lightning_shardckpt.engine.commit_index import INDEX_DIR
from lightning_shardckpt.engine.format.names import COMMIT_RECORD, LATEST, MANIFEST, parse_dirname
from lightning_shardckpt.engine.metrics import read_events
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.engine.storage.small_files import SmallFileRefused
from lightning_shardckpt.policies.drills.leases import DrillLeases, lease_name
from tests.helpers.checkpoints import RUN_ID, save_checkpoint

KINDS = ("fifo", "symlink_to_dev_zero", "symlink_outside_root", "sparse_2gib")
# where a file is planted, and whether it makes the newest checkpoint (step 2) unloadable
PLACES = {"commit.json": True, "manifest.json": True, "latest": False, "index_marker": False, "drill_lease": False}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A root with two committed checkpoints of one run (steps 1 and 2), made once and copied per test."""
    root = str(tmp_path_factory.mktemp("template") / "ckpt")
    save_checkpoint(root, step=1)
    save_checkpoint(root, step=2)
    return root


def _dirname(root: str, step: int) -> str:
    return next(name for name in os.listdir(root) if (parsed := parse_dirname(name)) and parsed.step == step)


def _target(root: str, place: str) -> str:
    newest = _dirname(root, 2)
    if place == "commit.json":
        return os.path.join(root, newest, COMMIT_RECORD)
    if place == "manifest.json":
        return os.path.join(root, newest, MANIFEST)
    if place == "latest":
        return os.path.join(root, LATEST)
    if place == "index_marker":
        markers = os.path.join(root, INDEX_DIR, RUN_ID)
        return next(
            os.path.join(markers, name)
            for name in sorted(os.listdir(markers))
            if open(os.path.join(markers, name)).read().strip() == newest
        )
    drills = os.path.join(root, "drills")
    os.makedirs(drills, exist_ok=True)
    path = os.path.join(drills, lease_name(newest, 0))
    with open(path, "w") as handle:  # a lease a live follower on this host would hold, then swapped
        json.dump({"checkpoint": newest, "host": "h", "pid": 1, "expires_at": time.time() + 900}, handle)
    return path


def _plant(path: str, kind: str, outside: str) -> None:
    if kind == "symlink_outside_root":  # the genuine bytes, moved out of the root and linked to
        os.makedirs(outside, exist_ok=True)
        moved = os.path.join(outside, os.path.basename(path))
        shutil.move(path, moved)
        os.symlink(moved, path)
        return
    os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink_to_dev_zero":
        os.symlink("/dev/zero", path)
    else:
        with open(path, "wb") as handle:
            handle.truncate(2 << 30)  # sparse: no disk used, but read whole it is 2 GiB of memory


@pytest.fixture
def planted(template, tmp_path, request):
    kind, place = request.param
    root = str(tmp_path / "ckpt")
    shutil.copytree(template, root, symlinks=True)
    _plant(_target(root, place), kind, str(tmp_path / "outside"))
    return root, place


CASES = [pytest.param((kind, place), id=f"{kind}-as-{place}") for kind in KINDS for place in PLACES]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("planted", CASES, indirect=True)
def test_a_special_file_planted_in_a_root_is_never_read_and_the_good_checkpoint_is_chosen(planted, run_cli):
    root, place = planted
    unloadable = PLACES[place]
    good = _dirname(root, 1) if unloadable else _dirname(root, 2)
    started = time.monotonic()

    listing = list_checkpoints(root)
    assert listing.latest is not None and listing.latest.name == good
    rows = {info.step: info for info in listing.checkpoints}
    if unloadable:
        assert rows[2].state == "corrupt" and place in (rows[2].problem or "")
    else:
        assert rows[2].state == "committed"
    if place == "latest":
        assert listing.latest_pointer is None  # the planted pointer was never read as a name

    assert resolve_checkpoint(root, "latest").name == good
    followed = [info.step for info in follow_checkpoints(root, include_existing=True, timeout_s=0.5, poll_s=0.1)]
    assert followed == ([1] if unloadable else [1, 2])

    code, out, _ = run_cli("ls", root, "--json")
    assert code == 0 and json.loads(out)["latest"] == good

    if place == "drill_lease":  # a drill follower takes the planted lease over as one no follower wrote
        leases = DrillLeases(resolve(root))
        claimed = leases.claim(_dirname(root, 2))
        assert claimed is not None and claimed.generation == 1
        assert leases.malformed == {lease_name(_dirname(root, 2), 0)}
    assert time.monotonic() - started < 15


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
def test_the_one_small_file_read_refuses_a_special_file_naming_it_and_why(tmp_path, kind):
    path = str(tmp_path / "root" / COMMIT_RECORD)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as handle:
        handle.write("{}")
    _plant(path, kind, str(tmp_path / "outside"))
    with pytest.raises(SmallFileRefused) as refused:
        fsio.read_small(resolve(str(tmp_path)).fs, path, 4096)
    why = {"fifo": "not a regular file (a FIFO)", "sparse_2gib": "larger than 4096 bytes"}.get(kind, "a symlink to")
    assert str(refused.value).startswith(f"{path} is {why}")


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", KINDS)
def test_read_events_skips_a_special_file_among_the_events_and_returns_the_others(tmp_path, kind):
    events = tmp_path / "ckpt" / "events"
    events.mkdir(parents=True)
    for name in ("a.json", "b.json"):
        (events / name).write_text(json.dumps({"created_at": 1.0, "step": 1, "name": name}))
    _plant(str(events / "b.json"), kind, str(tmp_path / "outside"))
    assert [event["name"] for event in read_events(str(tmp_path / "ckpt"))] == ["a.json"]
