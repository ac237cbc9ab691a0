"""A file given where a checkpoint root is expected (`ROOT/latest`, a stray file) gets one error from every entry
point: CheckpointNotFound naming the file and the root to pass instead, never NotADirectoryError or a wait.

Where a checkpoint reference is expected (`load_checkpoint(state, PATH)`, `Checkpointer.load(state, PATH)`),
`ROOT/latest` is no stray file but a spelling of the root's latest (engine/root.py), loaded as
`resolve_checkpoint` and the command line resolve it: tests/unit/test_one_reference_interpreter.py.

fabric.load is left out: it needs ranks, and it hands a path that is a file to Fabric's own loading on purpose
(a converted `lit_model.pth`)."""

from __future__ import annotations

import os

import pytest

from lightning_shardckpt import (
    Checkpointer,
    CheckpointNotFound,
    follow_checkpoints,
    list_checkpoints,
    load_checkpoint,
    resolve_checkpoint,
)
from tests.helpers.checkpoints import fresh_state, save_checkpoint

ENTRY_POINTS = {
    "load_checkpoint": lambda path: load_checkpoint(fresh_state(), path),
    "list_checkpoints": lambda path: list_checkpoints(path),
    # timeout_s=None: a follower that waited for the file to become a root would never return
    "follow_checkpoints": lambda path: next(follow_checkpoints(path, timeout_s=None, poll_s=0.1)),
    "resolve_checkpoint": lambda path: resolve_checkpoint(path, "step-1"),
    "Checkpointer.load": lambda path: Checkpointer(os.path.dirname(path)).load(fresh_state(), path),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("root") / "ckpt")
    save_checkpoint(root, step=1)
    with open(os.path.join(root, "notes.txt"), "w") as handle:
        handle.write("a stray file beside the checkpoints\n")
    return root


REFERENCE_TAKING = ("load_checkpoint", "Checkpointer.load")  # a checkpoint reference, where ROOT/latest is one


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("entry_point", "name"),
    [
        (entry_point, name)
        for entry_point in ENTRY_POINTS
        for name in ("latest", "notes.txt")
        if not (name == "latest" and entry_point in REFERENCE_TAKING)
    ],
)
def test_a_file_given_as_a_root_raises_checkpoint_not_found_naming_it_and_the_root(root, entry_point, name):
    path = os.path.join(root, name)
    with pytest.raises(CheckpointNotFound) as raised:
        ENTRY_POINTS[entry_point](path)
    message = str(raised.value)
    assert path in message and "a file, not a checkpoint root or checkpoint directory" in message
    if entry_point != "Checkpointer.load":  # its own wording, which already named the file
        assert f"pass the root that holds it ({root}" in message
