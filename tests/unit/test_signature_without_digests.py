"""A `manifest.sig` that verifies over a manifest binding its files by no digest a reader can check (FORMAT.md §12,
"A signature beside a v5 manifest"): refused, and the refusal says why in terms that are true of every format.

A v5 manifest without `groups.table_digests` binds its group tables, and through them its parts and shard files, by
xxh3 only (another tool's, or one written before signed v5, FORMAT.md §12.2); this writer records digests of every
file in every format it signs."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from lightning_shardckpt.engine.format import signing
from lightning_shardckpt.engine.format.names import MANIFEST, checkpoint_dirname
from lightning_shardckpt.errors import SignatureRefused
from tests.helpers.signing_keys import Keys
from tests.unit.test_format_vectors import vectors


def _signed_directory(tmp_path: Path, keys: Keys, manifest_bytes: bytes) -> str:
    """A checkpoint directory holding `manifest_bytes` and the run key's `manifest.sig` over them."""
    directory = tmp_path / checkpoint_dirname(7, "0123456789ab")
    directory.mkdir()
    (directory / MANIFEST).write_bytes(manifest_bytes)
    signer = signing.load_signer(keys.private, None, None)
    (directory / signing.SIGNATURE).write_bytes(signing.signature_bytes(manifest_bytes, signer))
    return str(directory)


def _refusal(tmp_path: Path, manifest: dict) -> str:
    keys = Keys.make(tmp_path)
    data = (json.dumps(manifest, sort_keys=True) + "\n").encode()
    directory = _signed_directory(tmp_path, keys, data)
    policy = signing.accepted_policy([keys.public])
    with pytest.raises(SignatureRefused) as refused:
        policy.check_manifest(fsspec.filesystem("file"), directory, manifest)
    return str(refused.value)


@pytest.mark.parametrize("digest_algorithm", [None, "blake3"])
def test_a_signed_v5_manifest_is_refused_because_its_group_tables_carry_no_digests(tmp_path, digest_algorithm):
    manifest = json.loads(vectors()["v5 manifest"])
    if digest_algorithm:  # a digest algorithm named, with nothing in a v5 manifest that holds digests
        manifest["digest_algorithm"] = digest_algorithm
    message = _refusal(tmp_path, manifest)
    assert "format v5, whose group tables carry no cryptographic digests" in message
    assert "v2/v3 save records none" not in message


def test_a_signed_manifest_without_digests_is_refused_without_claiming_v2_and_v3_record_none(tmp_path):
    manifest = json.loads(vectors()["manifest"])  # v4, signed but with no digest_algorithm
    message = _refusal(tmp_path, manifest)
    assert "records no file digests this reader knows (digest_algorithm=None" in message
    assert "format v2, v3 or v4 records blake3 or sha256 digests of every file" in message
    assert "v2/v3 save records none" not in message
