"""One interpreter of checkpoint references (engine/root.py): every spelling of a checkpoint gives the same
checkpoint, or the same error naming the path, at every entry point that takes one.

The root holds step 2 (drilled: the last known-good) and step 4 (the latest). The spellings: `latest`,
`last-good`, a step (int, "2", "step-2"), an id, a directory name, the root, `ROOT/latest` (the pointer file),
`ROOT/last-good`, a checkpoint directory, and two files that are no checkpoint (a stray file in the root, a file
inside a checkpoint). Fabric's and the Trainer's doors need ranks: tests/distributed/test_one_reference_every_door.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_shardckpt import (
    Checkpointer,
    CheckpointNotFound,
    CheckpointSaver,
    export_checkpoint,
    load_checkpoint,
    read_manifest_summary,
    resolve_checkpoint,
    verify_checkpoint,
)
from lightning_shardckpt.engine.format import drill_records
from lightning_shardckpt.engine.format.names import MANIFEST, parse_dirname
from lightning_shardckpt.engine.root import Root
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.ops.export import ExportOptions
from tests.helpers.checkpoints import dirname_of, fresh_state, save_checkpoint

NOT_FOUND = "not found"  # the expected answer of a spelling that names no checkpoint


class Spelled:
    """The root and its checkpoints' names, for the tables."""

    def __init__(self, root: str, good: dict, newest: dict) -> None:
        self.root, self.good, self.newest = root, good, newest

    def spellings(self) -> dict[str, tuple[str | int, int | str]]:
        """label -> (the spelling, the step it names, or NOT_FOUND)."""
        root, good = self.root, dirname_of(self.good)
        return {
            "latest": ("latest", 4),
            "last-good": ("last-good", 2),
            "int step": (2, 2),
            "step text": ("2", 2),
            "step word": ("step-2", 2),
            "id": (self.good["id"], 2),
            "directory name": (good, 2),
            "root": (root, 4),
            "ROOT/latest": (f"{root}/latest", 4),
            "ROOT/last-good": (f"{root}/last-good", 2),
            "checkpoint directory": (f"{root}/{good}", 2),
            "stray file in the root": (f"{root}/notes.txt", NOT_FOUND),
            "file inside a checkpoint": (f"{root}/{good}/{MANIFEST}", NOT_FOUND),
        }


@pytest.fixture(scope="module")
def spelled(tmp_path_factory) -> Spelled:
    root = str(tmp_path_factory.mktemp("one-interpreter") / "ckpt")
    good = save_checkpoint(root, step=2)
    newest = save_checkpoint(root, step=4)
    record = {"checkpoint": dirname_of(good), "drill_id": drill_records.new_drill_id(), "verdict": drill_records.PASSED}
    drill_records.write_record(fsio.resolve(root), {**record, "cause": None})
    with open(os.path.join(root, "notes.txt"), "w") as handle:
        handle.write("a stray file beside the checkpoints\n")
    return Spelled(root, good, newest)


def step_of(path: str) -> int:
    parsed = parse_dirname(path)
    assert parsed is not None, path
    return parsed.step


def cli_step(run_cli, *argv: str) -> int:
    """The step of the checkpoint a `shardckpt ... --json` command reports; CheckpointNotFound as the library's,
    carrying the command's one-line message (exit 2)."""
    code, out, err = run_cli(*argv, "--json")
    if code == 2:
        raise CheckpointNotFound(err)
    document = json.loads(out)
    return step_of(document.get("a") or document["path"])


def exported(root: str, which: str | int, out_dir) -> int:
    out = os.path.join(out_dir, f"export-{len(os.listdir(out_dir))}.safetensors")
    return step_of(export_checkpoint(root, out, ExportOptions(format="safetensors"), which=which).checkpoint)


# entry points given (root, spelling): a selector is looked up in the root, a path names its own
WITHIN_A_ROOT = {
    "resolve_checkpoint": lambda root, which, **_: resolve_checkpoint(root, which).step,
    "read_manifest_summary": lambda root, which, **_: read_manifest_summary(root, which).step,
    "load_checkpoint": lambda root, which, **_: load_checkpoint(fresh_state(), root, which).step,
    "Checkpointer.load": lambda root, which, **_: Checkpointer(root).load(fresh_state(), which),
    "verify_checkpoint": lambda root, which, **_: verify_checkpoint(root, which).step,
    "export_checkpoint": lambda root, which, out_dir, **_: exported(root, which, out_dir),
    "Root.open": lambda root, which, **_: Root.at(root).open(which)[1].step,
    "shardckpt compare --root": lambda root, which, run_cli, **_: cli_step(
        run_cli, "compare", "--root", root, str(which), "latest"
    ),
}

# entry points given the path alone (a path spelling names its own root)
A_PATH_ALONE = {
    "resolve_checkpoint": lambda path, **_: resolve_checkpoint(path).step,
    "read_manifest_summary": lambda path, **_: read_manifest_summary(path).step,
    "load_checkpoint": lambda path, **_: load_checkpoint(fresh_state(), path).step,
    "Checkpointer.load (another root)": lambda path, elsewhere, **_: Checkpointer(elsewhere).load(fresh_state(), path),
    "verify_checkpoint": lambda path, **_: verify_checkpoint(path).step,
    "export_checkpoint": lambda path, out_dir, **_: exported(path, "latest", out_dir),
    "shardckpt inspect": lambda path, run_cli, **_: cli_step(run_cli, "inspect", path),
    "shardckpt verify": lambda path, run_cli, **_: cli_step(run_cli, "verify", path),
}

SELECTOR_LABELS = ["latest", "last-good", "int step", "step text", "step word", "id", "directory name"]
PATH_LABELS = [
    "root",
    "ROOT/latest",
    "ROOT/last-good",
    "checkpoint directory",
    "stray file in the root",
    "file inside a checkpoint",
]


def answer(door, **kwargs) -> int | str:
    try:
        return door(**kwargs)
    except CheckpointNotFound as err:
        return f"{NOT_FOUND}: {err}"


def check(answered: int | str, expected: int | str, spelling: str | int) -> None:
    if expected == NOT_FOUND:
        assert isinstance(answered, str) and answered.startswith(NOT_FOUND), answered
        assert str(spelling) in answered, answered  # the error names the path it was given
    else:
        assert answered == expected


@pytest.mark.parametrize("label", SELECTOR_LABELS + PATH_LABELS)
@pytest.mark.parametrize("door", list(WITHIN_A_ROOT))
def test_every_spelling_within_a_root_names_the_same_checkpoint_at_every_entry_point(
    spelled, door, label, tmp_path, run_cli
):
    spelling, expected = spelled.spellings()[label]
    answered = answer(WITHIN_A_ROOT[door], root=spelled.root, which=spelling, out_dir=tmp_path, run_cli=run_cli)
    check(answered, expected, spelling)


@pytest.mark.parametrize("label", PATH_LABELS)
@pytest.mark.parametrize("door", list(A_PATH_ALONE))
def test_every_path_spelling_alone_names_the_same_checkpoint_at_every_entry_point(
    spelled, door, label, tmp_path, run_cli
):
    spelling, expected = spelled.spellings()[label]
    kwargs = {"path": spelling, "out_dir": tmp_path, "run_cli": run_cli, "elsewhere": str(tmp_path / "other")}
    check(answer(A_PATH_ALONE[door], **kwargs), expected, spelling)


def _saved(backend, steps: tuple[int, ...]) -> list[str]:
    """Commit a small checkpoint at each step under the backend's root; their directory names."""
    saver = CheckpointSaver(backend.url, backend.save_config(async_save=False, write_events=False, run_id="one-root"))
    try:
        results = [saver.save({"model": {"w": torch.full((4,), float(step))}}, step=step).result(60) for step in steps]
    finally:
        saver.close()
    return [dirname_of(result.manifest) for result in results]


def test_root_lists_picks_opens_and_follows_the_same_way_on_local_disk_and_s3(backend):
    first, second = _saved(backend, (1, 2))
    root = Root.at(backend.url, backend.storage_options)
    assert [entry.name for entry in root.list() if entry.committed] == [first, second]
    assert root.pick().name == second and root.pick(1).name == first and root.pick("step-1").name == first
    pointer = f"{backend.url}/latest"  # the pointer file, on either storage: the root's latest
    assert root.open(pointer, storage_options=backend.storage_options)[1].name == second
    target = {"model": {"w": torch.zeros(4)}}
    assert load_checkpoint(target, pointer, config=backend.load_config()).step == 2
    assert torch.equal(target["model"]["w"], torch.full((4,), 2.0))
    settled: set[str] = set()
    assert [entry.name for entry in root.follow(settled)] == [first, second]  # commit order
    assert root.follow(settled) == []  # nothing new: nothing read again
