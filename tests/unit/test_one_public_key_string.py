"""`public_keys="/keys/ckpt.pub"`: one key given as one string (or a Path) is one key at every entry point, never a
key file per character; each verifies the signed checkpoint with it."""

from __future__ import annotations

import pathlib

import pytest

from lightning_shardckpt import Checkpointer, LoadConfig, list_checkpoints, load_checkpoint, resolve_checkpoint
from lightning_shardckpt.engine.config import SignConfig
from tests.helpers.checkpoints import fresh_state
from tests.unit.test_signature_listing import key_id_of
from tests.unit.test_signing import make_key, save


def _checkpointer_load(root: str, key) -> int:
    with Checkpointer(root, require_signature=True, public_keys=key) as checkpointer:
        return checkpointer.load(fresh_state(seed=99))


ENTRY_POINTS = {
    "load_checkpoint": lambda root, key: (
        load_checkpoint(fresh_state(seed=99), root, config=LoadConfig(require_signature=True, public_keys=key)).step
    ),
    "Checkpointer.load": _checkpointer_load,
    "resolve_checkpoint": lambda root, key: resolve_checkpoint(root, public_keys=key).signed_by,
    "list_checkpoints": lambda root, key: list_checkpoints(root, public_keys=key).latest.signed_by,
}


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """A root whose one checkpoint (step 1) is signed, and the public key file that verifies it."""
    directory = tmp_path_factory.mktemp("signed")
    private, public, key = make_key(directory, "a")
    root = str(directory / "ckpt")
    save(root, 1, SignConfig(key_path=private))
    return root, public, key_id_of(key)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("as_path", [False, True], ids=["str", "Path"])
@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_one_public_key_given_as_one_string_verifies_a_signed_checkpoint_at_every_entry_point(
    signed, entry_point, as_path
):
    root, public, key_id = signed
    answer = ENTRY_POINTS[entry_point](root, pathlib.Path(public) if as_path else public)
    assert answer == (1 if entry_point in ("load_checkpoint", "Checkpointer.load") else key_id)


def test_the_config_keeps_one_key_as_a_one_tuple_and_several_as_given():
    assert LoadConfig(public_keys="/keys/a.pub").public_keys == ("/keys/a.pub",)
    assert LoadConfig(public_keys=pathlib.Path("/keys/a.pub")).public_keys == ("/keys/a.pub",)
    assert LoadConfig(public_keys=["/keys/a.pub", "/keys/b.pub"]).public_keys == ("/keys/a.pub", "/keys/b.pub")
