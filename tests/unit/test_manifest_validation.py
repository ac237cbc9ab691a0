"""Manifests and commit records are validated by type and value; one bad directory never breaks a tool (issue 9, item 8)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil

import pytest

from lightning_shardckpt import load_checkpoint
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format import manifest_schema
from lightning_shardckpt.engine.format.names import COMMIT_RECORD, MANIFEST, checkpoint_dirname
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.errors import CheckpointNotFound, CorruptCheckpoint
from lightning_shardckpt.ops import gc
from tests.helpers.checkpoints import dirname_of, fresh_state, save_checkpoint


def assert_no_tool_crashes(run_cli, root: str, bad_name: str) -> None:
    """ls, timeline and gc list the bad directory and go on; inspect/verify of it exit 2 with one line."""
    code, out, err = run_cli("ls", root, "--json")
    assert code == 0, err
    rows = {row["name"]: row for row in json.loads(out)["checkpoints"]}
    assert rows[bad_name]["state"] == "corrupt" and rows[bad_name]["problem"] and not rows[bad_name]["latest"]
    assert run_cli("ls", root)[0] == 0
    code, out, err = run_cli("timeline", root, "--json")
    assert code == 0, err
    assert {row["name"]: row["state"] for row in json.loads(out)["checkpoints"]}[bad_name] == "corrupt"
    assert run_cli("gc", root)[0] == 0
    assert run_cli("verify", root)[0] == 0  # the root's latest is a sound checkpoint
    for command in ("inspect", "verify"):
        code, out, err = run_cli(command, os.path.join(root, bad_name))
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("keep_record", [True, False], ids=["v2-with-record", "without-record-like-v1"])
def test_a_checkpoint_copied_under_a_larger_step_is_corrupt_and_never_latest(tmp_path, run_cli, keep_record):
    root = str(tmp_path / "run")
    old = save_checkpoint(root, step=100)
    new = save_checkpoint(root, step=200)
    copied = checkpoint_dirname(900, old["id"])
    shutil.copytree(os.path.join(root, dirname_of(old)), os.path.join(root, copied))
    if not keep_record:
        os.remove(os.path.join(root, copied, COMMIT_RECORD))
    location = resolve(root)
    entries = {e.name: e for e in catalog.list_checkpoints(location)}
    assert entries[copied].state == catalog.CORRUPT
    assert "step 100 does not match the directory name's step 900" in entries[copied].problem
    latest = catalog.find(location, "latest")
    assert latest.name == dirname_of(new), "the copy must not be latest"
    target = fresh_state(seed=0)
    assert load_checkpoint(target, root, "latest").step == 200
    with pytest.raises(CheckpointNotFound, match="corrupt"):
        catalog.find(location, 900)
    assert_no_tool_crashes(run_cli, root, copied)


V2, V4 = 2, 4
MUTATIONS = {  # name: (edit, what the refusal names, the format whose rule it is)
    "created_at without timezone": (lambda m: m.update(created_at="2026-12-02T14:42:26.274"), "created_at", V4),
    "created_at not a time": (lambda m: m.update(created_at="yesterday"), "created_at", V4),
    "step a string": (lambda m: m.update(step=str(m["step"])), "step", V4),
    "id of another checkpoint": (lambda m: m.update(id="0123456789ab"), "id", V4),
    "identity a list": (lambda m: m.update(identity=[]), "identity", V4),
    "seq zero": (lambda m: m.update(seq=0), "seq", V4),
    "an unknown checksum algorithm": (
        lambda m: m.update(checksum_algorithm="sha256"),
        "checksum_algorithm 'sha256' is not one this reader checks",
        V4,
    ),
    # format v2: the manifest lists every file and chunk
    "files not a list": (lambda m: m.update(files={"path": "__0_0.distcp"}), "files is not a list", V2),
    "file path escapes": (lambda m: m["files"][0].update(path="../../etc/passwd"), "relative path", V2),
    "file path absolute": (lambda m: m["files"][0].update(path="/etc/passwd"), "relative path", V2),
    "negative size": (lambda m: m["files"][0].update(bytes=-1), "bytes", V2),
    "bad checksum": (lambda m: m["files"][0].update(checksum="XYZ"), "checksum", V2),
    "chunk in an unlisted file": (
        lambda m: m["tensors"][0]["chunks"][0].update(file="__9_0.distcp"),
        "not listed in files",
        V2,
    ),
    "chunk length negative": (lambda m: m["tensors"][0]["chunks"][0].update(length=-5), "length", V2),
    "object checksum not hex": (lambda m: m["objects"][0].update(checksum=17), "checksum", V2),
    "block checksums that do not tile the chunk": (
        lambda m: m["tensors"][0]["chunks"][0].update(blocks={"size": 1024, "checksums": ["0123456789abcdef"]}),
        "blocks has 1 checksum",
        V2,
    ),
    "block size zero": (
        lambda m: m["tensors"][0]["chunks"][0].update(blocks={"size": 0, "checksums": []}),
        "blocks is",
        V2,
    ),
    # format v4: the parts table and each tensor's layout
    "parts table of another world size": (lambda m: m["parts"].update(count=2), "not a list of 2 entries", V4),
    "part size negative": (lambda m: m["parts"]["part_bytes"].__setitem__(0, -1), "is not two sizes", V4),
    "shard checksum not hex": (
        lambda m: m["parts"].update(file_checksums="XYZ" + m["parts"]["file_checksums"][3:]),
        "16-hex",
        V4,
    ),
    "checksums of another world size": (
        lambda m: m["parts"].update(part_checksums=m["parts"]["part_checksums"] * 2),
        "not a string of 1 x 16 characters",
        V4,
    ),
    "parts table not an object": (lambda m: m.update(parts=[]), "parts is not an object", V4),
    "a chunk on a rank of another save": (
        lambda m: m["tensors"][0]["layout"].update(rank=1),
        "layout.rank is 1, but 1 ranks wrote the checkpoint",
        V4,
    ),
    "a split of a dimension the tensor lacks": (
        lambda m: m["tensors"][0]["layout"].update(split=[[5, 2, 0]]),
        "cuts dimension 5",
        V4,
    ),
    "a split into no pieces": (lambda m: m["tensors"][0]["layout"].update(split=[[0, 0, 0]]), "pieces >= 1", V4),
    "an object of no part": (lambda m: m["objects"][0].update(rank=3), "rank is 3, not a rank of the save", V4),
    "a tensor listed twice": (lambda m: m["tensors"].append(copy.deepcopy(m["tensors"][0])), "listed twice", V4),
    # a v4/v5 manifest lists the files its parts reference (incremental on parts, FORMAT.md §10.6): never empty
    "empty references in a v4 manifest": (lambda m: m.update(references=[]), "references is not a non-empty list", V4),
    "listed chunks that overlap": (
        lambda m: m["tensors"][0].update(layout={"chunks": [[[0], [7], 0], [[0], [7], 0]]}),  # model.0.bias, [7]
        "overlap",
        V4,
    ),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_manifest_values_are_validated_and_name_the_field(tmp_path, name):
    root = str(tmp_path / "run")
    mutate, expected, version = MUTATIONS[name]
    saved = save_checkpoint(root, step=3, format_version=version)
    where = os.path.join(root, dirname_of(saved))
    with open(os.path.join(where, MANIFEST), "rb") as handle:
        manifest = json.load(handle)  # as committed (save_checkpoint returns the v2 shape of a v4 one)
    bad = copy.deepcopy(manifest)
    mutate(bad)
    manifest_format.parse(manifest_format.to_bytes(manifest), where)  # the original is sound
    with pytest.raises(CorruptCheckpoint, match=expected) as err:
        manifest_format.parse(manifest_format.to_bytes(bad), where)
    assert where in str(err.value)


def test_a_manifest_edited_after_commit_is_corrupt_and_latest_falls_back(tmp_path, run_cli):
    root = str(tmp_path / "run")
    old = save_checkpoint(root, step=1)
    new = save_checkpoint(root, step=2)
    path = os.path.join(root, dirname_of(new), MANIFEST)
    edited = dict(new, epoch=99)  # still a valid manifest on its own, but not the one committed
    os.chmod(path, 0o644)
    with open(path, "wb") as handle:
        handle.write(manifest_format.to_bytes(edited))
    location = resolve(root)
    assert catalog.find(location, "latest").name == dirname_of(old)
    with pytest.raises(CorruptCheckpoint, match="does not match its commit record"):
        catalog.find(location, 2)
    code, _, err = run_cli("inspect", os.path.join(root, dirname_of(new)))
    assert code == 2 and "commit record" in err


def test_a_stray_file_named_like_a_checkpoint_breaks_no_tool(tmp_path, run_cli):
    root = str(tmp_path / "run")
    good = save_checkpoint(root, step=3)
    stray = checkpoint_dirname(999, "abcdef012345")
    with open(os.path.join(root, stray), "w") as handle:
        handle.write("not a checkpoint\n")
    location = resolve(root)
    entries = {e.name: e for e in catalog.list_checkpoints(location)}
    assert entries[stray].state == catalog.CORRUPT and "named like a checkpoint" in entries[stray].problem
    assert catalog.find(location, "latest").name == dirname_of(good)
    assert load_checkpoint(fresh_state(seed=0), root, "latest").step == 3
    assert [item.action for item in gc.plan(location, 0) if item.name == stray] == ["keep"]
    assert_no_tool_crashes(run_cli, root, stray)
    assert os.path.isfile(os.path.join(root, stray)), "nothing deletes it"


@pytest.mark.parametrize("damage", ["garbage", "not-an-object", "wrong-step"])
def test_a_bad_commit_record_makes_only_that_checkpoint_corrupt(tmp_path, run_cli, damage):
    root = str(tmp_path / "run")
    old = save_checkpoint(root, step=1)
    new = save_checkpoint(root, step=2)
    path = os.path.join(root, dirname_of(new), COMMIT_RECORD)
    with open(path) as handle:
        record = json.load(handle)
    text = {"garbage": "{not json", "not-an-object": "[1, 2]", "wrong-step": json.dumps({**record, "step": 7})}[damage]
    os.chmod(path, 0o644)
    with open(path, "w") as handle:
        handle.write(text)
    location = resolve(root)
    states = {e.step: e.state for e in catalog.list_checkpoints(location)}
    assert states == {1: "committed", 2: "corrupt"}
    assert catalog.find(location, "latest").name == dirname_of(old)
    assert_no_tool_crashes(run_cli, root, dirname_of(new))


def _drop_every_chunk(tensor: dict) -> None:
    tensor["chunks"] = []


def _halve_the_chunk(tensor: dict) -> None:
    tensor["chunks"][0]["sizes"][0] //= 2  # rows 32..63 are in no chunk


def _list_the_chunk_twice(tensor: dict) -> None:
    tensor["chunks"].append(copy.deepcopy(tensor["chunks"][0]))


UNTILED = {  # a manifest the commit record vouches for, whose chunks do not tile tensor "model.w"
    "the only chunk dropped": (_drop_every_chunk, r"model\.w.*\[0:64, 0:64\] is in no chunk"),
    "a chunk covering half the rows": (_halve_the_chunk, r"model\.w.*\[32:64, 0:64\] is in no chunk"),
    "a chunk listed twice": (_list_the_chunk_twice, r"model\.w.*chunks\[0\] and chunks\[1\] overlap at \[0:64, 0:64\]"),
}


@pytest.mark.parametrize("name", sorted(UNTILED))
def test_chunks_that_do_not_tile_a_tensor_make_verify_export_and_compare_refuse_it_naming_the_tensor(
    tmp_path, run_cli, committed_checkpoint, name
):
    import torch

    from lightning_shardckpt.ops.export import ExportOptions, export_checkpoint
    from tests.helpers.forgery import forge_manifest

    edit, expected = UNTILED[name]
    state = {"model": {"w": torch.zeros(64, 64)}, "progress": {"n": 1}}
    # format v2, whose manifest lists the chunks (v4's parts: test_a_part_missing_a_chunk_its_layout_names_...)
    root, directory, _ = committed_checkpoint(state=state, format_version=2)

    def untile(manifest: dict) -> None:
        edit(next(t for t in manifest["tensors"] if t["fqn"] == "model.w"))

    forge_manifest(directory, untile)
    code, out, err = run_cli("verify", directory)
    assert code == 2 and re.search(expected, err), (code, out, err)
    out_file = tmp_path / "export.pt"
    with pytest.raises(CorruptCheckpoint, match=expected):
        export_checkpoint(directory, str(out_file), ExportOptions(format="torch"))
    assert not out_file.exists()
    with pytest.raises(CorruptCheckpoint, match=expected):
        load_checkpoint({"model": {"w": torch.ones(64, 64)}, "progress": {"n": 0}}, directory)
    code, _, err = run_cli("compare", directory, directory)
    assert code == 2 and re.search(expected, err), err


def test_chunks_of_a_sharded_tensor_that_tile_it_exactly_are_sound():
    where = "/ckpt"
    tensor = {"fqn": "w", "shape": [4, 6], "dtype": "torch.float32"}
    quarters = [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]
    chunks = [{"offsets": list(o), "sizes": list(s)} for o, s in quarters]
    assert manifest_schema.tiling_problems(tensor["shape"], chunks) == []
    chunks[3]["offsets"] = [2, 2]
    assert manifest_schema.tiling_problems(tensor["shape"], chunks) == [
        "chunks[2] and chunks[3] overlap at [2:4, 2:3]",
        "[2:4, 5:6] is in no chunk",
    ], where


# --- one pick for `ls`, `latest`, load and verify (issue 37, item 11) ---


def _tamper_newest_manifest(directory: str, how: str) -> None:
    if how == "edited-after-commit":  # the commit record's checksum no longer matches
        path = os.path.join(directory, MANIFEST)
        manifest = json.load(open(path))
        os.chmod(path, 0o644)
        with open(path, "wb") as handle:
            handle.write(manifest_format.to_bytes(dict(manifest, epoch=99)))
    else:  # "bad-schema": forged with a record that vouches for it, but a table entry breaks the schema
        from tests.helpers.forgery import forge_manifest

        forge_manifest(directory, lambda manifest: manifest["tensors"][0].update(fqn=7))


@pytest.mark.parametrize("how", ["edited-after-commit", "bad-schema"])
def test_ls_stars_the_checkpoint_latest_resumes_when_the_newest_manifest_fails_validation(tmp_path, run_cli, how):
    root = str(tmp_path / "run")
    old = save_checkpoint(root, step=1)
    new = save_checkpoint(root, step=2)
    _tamper_newest_manifest(os.path.join(root, dirname_of(new)), how)
    assert catalog.find(resolve(root), "latest").name == dirname_of(old)
    assert load_checkpoint(fresh_state(seed=0), root, "latest").step == 1
    code, out, _ = run_cli("verify", root)
    assert code == 0 and dirname_of(old) in out  # the root's latest, as load picks it
    code, out, err = run_cli("ls", root, "--json")
    assert code == 0, err
    listing = json.loads(out)
    rows = {row["step"]: row for row in listing["checkpoints"]}
    assert listing["latest"] == dirname_of(old) and rows[1]["latest"] and not rows[2]["latest"]
    assert rows[2]["state"] == "corrupt" and rows[2]["problem"]
    table = {line.split()[0]: line for line in run_cli("ls", root)[1].splitlines()[1:] if line[:1].isdigit()}
    assert " * " in table["1"] and " * " not in table["2"] and "corrupt" in table["2"]


def _edit_commit_record(directory: str, **changes) -> None:
    path = os.path.join(directory, COMMIT_RECORD)
    record = json.load(open(path))
    record.update(changes)  # manifest_checksum untouched: it still matches the manifest
    os.chmod(path, 0o644)
    with open(path, "wb") as handle:
        handle.write(manifest_format.to_bytes(record))


def test_an_older_checkpoint_whose_record_claims_a_later_seq_is_corrupt_and_never_latest(tmp_path, run_cli):
    root = str(tmp_path / "run")
    old = save_checkpoint(root, step=1)
    new = save_checkpoint(root, step=2)
    _edit_commit_record(os.path.join(root, dirname_of(old)), seq=1000)
    location = resolve(root)
    assert catalog.find(location, "latest").name == dirname_of(new)
    assert load_checkpoint(fresh_state(seed=0), root, "latest").step == 2
    rows = {row["step"]: row for row in json.loads(run_cli("ls", root, "--json")[1])["checkpoints"]}
    assert rows[2]["latest"] and not rows[1]["latest"]
    assert rows[1]["state"] == "corrupt" and "seq" in rows[1]["problem"]
    with pytest.raises(CorruptCheckpoint, match=r"commit record says seq=1000.*manifest says seq=1"):
        catalog.find(location, 1)


RECORD_EDITS = {
    "seq": {"seq": 7},
    "run_id": {"run_id": "someone-else"},
    "parent": {"parent": "0123456789ab"},
    "created_at": {"created_at": "2031-01-01T00:00:00.000+00:00"},
    "bytes_total": {"bytes_total": 1},
}


@pytest.mark.parametrize("field", sorted(RECORD_EDITS))
def test_a_commit_record_that_disagrees_with_its_manifest_makes_every_reader_call_it_corrupt(tmp_path, run_cli, field):
    root = str(tmp_path / "run")
    save_checkpoint(root, step=1)
    edited = save_checkpoint(root, step=2)
    _edit_commit_record(os.path.join(root, dirname_of(edited)), **RECORD_EDITS[field])
    location = resolve(root)
    with pytest.raises(CorruptCheckpoint, match=f"commit record says {field}="):
        catalog.find(location, 2)
    rows = {row["step"]: row for row in json.loads(run_cli("timeline", root, "--json")[1])["checkpoints"]}
    # the timeline reads manifests without their tables: the fields that order a root are checked, sizes are not
    assert rows[2]["state"] == ("corrupt" if field in manifest_format.RECORD_FIELDS else "committed")
    code, _, err = run_cli("inspect", os.path.join(root, dirname_of(edited)))
    assert code == 2 and field in err


def test_a_part_missing_a_chunk_its_layout_names_makes_verify_export_and_load_refuse_it_naming_the_tensor(
    tmp_path, run_cli, committed_checkpoint
):
    # format v4: the layout says rank 0 wrote model.w; a part that lacks it, rewritten with every checksum that
    # vouches for it (part, manifest, commit record), is refused by every reader, naming the tensor
    import torch

    from lightning_shardckpt.ops.export import ExportOptions, export_checkpoint
    from tests.helpers.forgery import forge_part

    state = {"model": {"w": torch.zeros(64, 64)}, "progress": {"n": 1}}
    root, directory, _ = committed_checkpoint(state=state)
    forge_part(directory, 0, lambda part: part["chunks"].__setitem__(0, {**part["chunks"][0], "fqn": "model.v"}))
    code, out, err = run_cli("verify", directory)
    assert code == 1 and "model.w" in out and "layout" in out, (code, out, err)
    out_file = tmp_path / "export.pt"
    with pytest.raises(CorruptCheckpoint, match=r"no chunk of 'model\.w'"):
        export_checkpoint(directory, str(out_file), ExportOptions(format="torch"))
    assert not out_file.exists()
    with pytest.raises(CorruptCheckpoint, match=r"no chunk of 'model\.w'"):
        load_checkpoint({"model": {"w": torch.ones(64, 64)}, "progress": {"n": 0}}, directory)


def test_a_part_that_names_another_file_than_its_ranks_shard_is_refused_by_load_and_verify(
    tmp_path, run_cli, committed_checkpoint
):
    # format v4: rank 0's part sends readers to a copy of its shard under another name (same bytes, every
    # checksum that vouches for the part rewritten): the part must name __0_0.distcp, as the manifest's table does
    import torch

    from tests.helpers.forgery import forge_part

    state = {"model": {"w": torch.zeros(64, 64)}, "progress": {"n": 1}}
    root, directory, _ = committed_checkpoint(state=state)
    shutil.copy(os.path.join(directory, "__0_0.distcp"), os.path.join(directory, "elsewhere.distcp"))
    forge_part(directory, 0, lambda part: part.update(file="elsewhere.distcp"))
    with pytest.raises(CorruptCheckpoint, match=r"file is 'elsewhere\.distcp', the manifest says '__0_0\.distcp'"):
        load_checkpoint({"model": {"w": torch.ones(64, 64)}, "progress": {"n": 0}}, directory)
    code, out, err = run_cli("verify", directory)
    assert code == 1 and "elsewhere.distcp" in out, (code, out, err)
