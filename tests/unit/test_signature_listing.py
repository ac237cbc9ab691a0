"""`shardckpt ls ROOT --public-key PEM` and `list_checkpoints(ROOT, public_keys=...)`: each committed checkpoint's
signature state against the given keys (signed by which key, refused and why, unsigned), and the `latest` a resume
with `require_signature` and those keys loads. Real files, real Ed25519 keys, the issue-39 forgery."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from cryptography.hazmat.primitives import serialization

from lightning_shardckpt import LoadConfig, SignatureRefused, list_checkpoints, load_checkpoint, resolve_checkpoint
from lightning_shardckpt.engine.config import SignConfig
from lightning_shardckpt.engine.format import signing
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.checkpoints import fresh_state
from tests.helpers.forgery import forge_tensor_values
from tests.unit.test_signing import FQN, make_key, save


def key_id_of(key) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return signing.key_id(raw)


def signed_root(tmp_path):
    """Step 1 signed by key a, step 2 by key b, step 3 unsigned, step 4 signed by a and then forged."""
    root = str(tmp_path / "ckpt")
    a_private, a_public, a_key = make_key(tmp_path, "a")
    b_private, b_public, b_key = make_key(tmp_path, "b")
    paths = {
        1: save(root, 1, SignConfig(key_path=a_private)),
        2: save(root, 2, SignConfig(key_path=b_private)),
        3: save(root, 3),
        4: save(root, 4, SignConfig(key_path=a_private)),
    }
    forge_tensor_values(fsio.resolve(root), paths[4], FQN, 7.0)
    return root, {"a": (a_public, key_id_of(a_key)), "b": (b_public, key_id_of(b_key))}


def test_listing_with_public_keys_marks_each_signature_and_picks_the_newest_validly_signed_as_latest(tmp_path):
    root, keys = signed_root(tmp_path)
    a_public, a_id = keys["a"]
    listing = list_checkpoints(root, public_keys=[a_public])
    states = {info.step: (info.state, info.signature, info.signed_by) for info in listing.checkpoints}
    assert states == {
        1: ("committed", "signed", a_id),
        2: ("committed", "refused", None),  # signed, but by b: not accepted
        3: ("committed", "unsigned", None),
        4: ("committed", "refused", None),  # a's signature no longer verifies: the manifest was changed
    }
    problems = {info.step: info.signature_problem for info in listing.checkpoints}
    assert "not accepted" in problems[2] and "missing" in problems[3] and "does not verify" in problems[4]
    assert listing.latest.step == 1  # what a resume requiring a's signature loads

    rotated = list_checkpoints(root, public_keys=[a_public, keys["b"][0]])  # a rotation: both keys accepted
    assert {info.step: info.signed_by for info in rotated.checkpoints}[2] == keys["b"][1]
    assert rotated.latest.step == 2

    plain = list_checkpoints(root)  # no keys: nothing checked, the forgery's checksums are consistent
    assert {info.signature for info in plain.checkpoints} == {None} and plain.latest.step == 4


def test_resolve_checkpoint_with_public_keys_picks_what_a_signed_resume_loads_and_names_what_it_passed_over(tmp_path):
    root, keys = signed_root(tmp_path)
    a_public, a_id = keys["a"]
    names = {info.step: info.name for info in list_checkpoints(root).checkpoints}
    picked = resolve_checkpoint(root, "latest", public_keys=[a_public])
    assert (picked.step, picked.signature, picked.signed_by) == (1, "signed", a_id)
    # newest first: the forged step 4, the unsigned step 3, step 2 signed by b (not accepted)
    assert picked.signature_skipped == (names[4], names[3], names[2])

    resumed = load_checkpoint(
        fresh_state(seed=99), root, "latest", config=LoadConfig(require_signature=True, public_keys=[a_public])
    )
    assert (resumed.path, resumed.signature_skipped) == (picked.path, picked.signature_skipped)
    assert resolve_checkpoint(f"{root}/latest", public_keys=[a_public]).step == 1  # every spelling of `latest`

    rotated = resolve_checkpoint(root, "latest", public_keys=[a_public, keys["b"][0]])
    assert (rotated.step, rotated.signed_by, rotated.signature_skipped) == (2, keys["b"][1], (names[4], names[3]))
    assert resolve_checkpoint(root, 1, public_keys=[a_public]).signature_skipped == ()  # named: nothing passed over

    with pytest.raises(SignatureRefused, match=rf"{names[4]}/manifest.json: its signature by key {a_id[:16]}"):
        resolve_checkpoint(root, 4, public_keys=[a_public])  # named, refused: raises as a resume of step 4 does

    plain = resolve_checkpoint(root, "latest")  # no keys: nothing checked, the forged newest as before
    assert (plain.step, plain.signature, plain.signature_skipped) == (4, None, None)


def test_ls_public_key_shows_the_signature_column_and_json_fields(tmp_path, run_cli):
    root, keys = signed_root(tmp_path)
    a_public, a_id = keys["a"]
    code, out, _ = run_cli("ls", root, "--json", "--public-key", a_public)
    assert code == 0
    listing = json.loads(out)
    rows = {row["step"]: row for row in listing["checkpoints"]}
    assert [(rows[s]["signature"], rows[s]["signed_by"]) for s in (1, 2, 3, 4)] == [
        ("signed", a_id),
        ("refused", None),
        ("unsigned", None),
        ("refused", None),
    ]
    assert "does not verify" in rows[4]["signature_problem"] and listing["latest"] == rows[1]["name"]

    code, out, _ = run_cli("ls", root, "--public-key", a_public)
    assert code == 0
    header, *lines = out.splitlines()
    assert "SIGNATURE" in header.split()
    (first,) = [line for line in lines if line.endswith(rows[1]["name"])]
    assert f"signed:{a_id[:16]}" in first.split() and "*" in first.split()
    assert f"{rows[4]['name']}: refused: " in out and f"{rows[2]['name']}: refused: " in out

    code, out, _ = run_cli("ls", root)  # without keys: the table as before
    assert code == 0 and "SIGNATURE" not in out


def test_ls_tiers_public_key_shows_each_copys_signature_and_the_signed_latest(tmp_path, run_cli):
    root, keys = signed_root(tmp_path)
    a_public, a_id = keys["a"]
    durable = tmp_path / "durable"
    shutil.copytree(root, durable)
    first = next(e.name for e in list_checkpoints(root).checkpoints if e.step == 1)
    os.remove(durable / first / signing.SIGNATURE)  # the durable copy of step 1 left unsigned
    code, out, _ = run_cli("ls", root, "--durable", str(durable), "--json", "--public-key", a_public)
    assert code == 0
    listing = json.loads(out)
    rows = {row["step"]: row for row in listing["checkpoints"]}
    assert (rows[1]["fast_signature"], rows[1]["durable_signature"]) == (f"signed:{a_id[:16]}", "unsigned")
    assert rows[4]["fast_signature"] == rows[4]["durable_signature"] == "refused"
    assert listing["latest"]["tier"] == "fast" and listing["latest"]["name"] == first  # the one signed copy

    code, out, _ = run_cli("ls", root, "--durable", str(durable))  # without keys: the newest, no signature columns
    assert code == 0 and "FAST-SIG" not in out and "resumes the fast copy of " + rows[4]["name"] in out


def test_ls_public_key_on_a_node_local_template_says_to_list_a_node_root(tmp_path, run_cli):
    root, keys = signed_root(tmp_path)
    code, _, err = run_cli("ls", str(tmp_path / "node{node_rank}"), "--public-key", keys["a"][0])
    assert code == 2 and "list a node's root on its own" in err
