"""Signed checkpoints (issue 39): with signing on, the attack that edits a shard and recomputes every checksum is
refused by load and `shardckpt verify`; with it off it still loads (as before); wrong keys, rotation, `latest`
skipping a tampered newest checkpoint, and the key staying out of everything written."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from lightning_shardckpt import Checkpointer, CheckpointSaver, LoadConfig, SaveConfig, load_checkpoint
from lightning_shardckpt.engine.config import SignConfig, save_config_from
from lightning_shardckpt.engine.format import signing
from lightning_shardckpt.engine.format.names import shard_filename
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.errors import ConfigError
from lightning_shardckpt.ops.verify import SIGNATURE_PROBLEM, verify_checkpoint
from tests.helpers.checkpoints import fresh_state
from tests.helpers.forgery import _replace, forge_tensor_values

FQN = "model.0.weight"
FORGED = 7.0


def make_key(directory: Path, name: str, seed: bytes | None = None) -> tuple[str, str, ed25519.Ed25519PrivateKey]:
    """(private PEM path, public PEM path, key): what docs/howto/signing.md's commands write."""
    key = ed25519.Ed25519PrivateKey.from_private_bytes(seed) if seed else ed25519.Ed25519PrivateKey.generate()
    private = directory / f"{name}.pem"
    public = directory / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return str(private), str(public), key


@pytest.fixture
def keys(tmp_path):
    return make_key(tmp_path, "a"), make_key(tmp_path, "b")


def save(root: str, step: int, sign: SignConfig | None = None, format_version: int = 5) -> str:
    config = SaveConfig(
        async_save=False,
        write_events=False,
        run_id="run-sign",
        sign=sign or SignConfig(),
        format_version=format_version,
    )
    saver = CheckpointSaver(root, config)
    try:
        result = saver.save(fresh_state(seed=step), step=step).result(timeout=60)
    finally:
        saver.close()
    assert result.committed, result.error
    return result.path


def load(root: str, which="latest", **options):
    state = fresh_state(seed=99)
    result = load_checkpoint(state, root, which, config=LoadConfig(**options))
    return result, state


def policy(*public: str) -> dict:
    return {"require_signature": True, "public_keys": list(public)}


@pytest.mark.parametrize("digest", ["blake3", "sha256"])
def test_signed_save_records_a_digest_of_every_file_and_signs_the_exact_manifest_bytes(tmp_path, keys, digest):
    # format v4 (save.format_version: 4): a digest per file; v5's per chunk: tests/distributed/test_signed_v5.py
    (private, public, key), _ = keys
    directory = save(str(tmp_path / "root"), 1, SignConfig(key_path=private, digest=digest), format_version=4)
    record = signing._parse_signature(Path(directory, signing.SIGNATURE).read_bytes(), "sig")
    manifest_bytes = Path(directory, "manifest.json").read_bytes()
    key.public_key().verify(base64.b64decode(record["signature"]), manifest_bytes)  # raises if not
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert record["key_id"] == signing.key_id(raw)
    part = json.loads(Path(directory, "__0_0.part.json").read_bytes())
    manifest = json.loads(manifest_bytes)
    assert manifest[signing.DIGEST_FIELD] == digest
    shard = f"{directory}/__0_0.distcp"
    assert part[signing.FILE_DIGEST] == signing.file_digest(fsio.resolve(directory).fs, shard, digest)[0]
    part_digest = signing.digest_of(Path(directory, "__0_0.part.json").read_bytes(), digest)
    assert manifest["parts"][signing.PART_DIGESTS] == part_digest
    assert load(str(tmp_path / "root"), 1, **policy(public))[0].step == 1


def test_a_signed_save_of_one_rank_is_v5_with_a_digest_per_chunk_and_resumes_under_a_policy(tmp_path, keys):
    # one group: an unsigned save of it is v4, a signed one v5, whose parts let a reader check what it reads
    (private, public, _), _ = keys
    root = str(tmp_path / "root")
    directory = save(root, 1, SignConfig(key_path=private, digest="sha256"))
    manifest = json.loads(Path(directory, "manifest.json").read_bytes())
    assert manifest["format_version"] == 5 and "parts" not in manifest
    assert manifest["groups"]["count"] == 1 and len(manifest["groups"]["table_digests"]) == 64
    part = json.loads(Path(directory, "__0_0.part.json").read_bytes())
    assert signing.FILE_DIGEST not in part
    shard = Path(directory, shard_filename(0)).read_bytes()
    # §12.2: the records' digests are stored as one column, 32 bytes per record in record order
    records = [*part["chunks"], *part["objects"]]
    column = base64.b64decode(part["digest_column"], validate=True)
    assert records and len(column) == 32 * len(records) and not any("digest" in chunk for chunk in records)
    for index, chunk in enumerate(records):
        assert column[32 * index : 32 * index + 32].hex() == signing.digest_of(
            shard[chunk["offset"] : chunk["offset"] + chunk["length"]], "sha256"
        )
    result, state = load(root, 1, **policy(public))
    expected = fresh_state(seed=1)
    assert result.step == 1 and torch.equal(state["model"]["0.weight"], expected["model"]["0.weight"])


def test_signing_off_writes_no_digest_and_no_signature(tmp_path):
    directory = save(str(tmp_path / "root"), 1)
    assert not os.path.exists(os.path.join(directory, signing.SIGNATURE))
    assert signing.DIGEST_FIELD not in Path(directory, "manifest.json").read_text()
    assert signing.FILE_DIGEST not in Path(directory, "__0_0.part.json").read_text()


def test_edited_shard_with_every_checksum_recomputed_loads_when_signing_is_off(tmp_path):
    root = str(tmp_path / "root")
    directory = save(root, 1)
    forge_tensor_values(fsio.resolve(root), directory, FQN, FORGED)
    _, state = load(root)
    assert torch.all(state["model"]["0.weight"] == FORGED)  # the attack of issue 39: xxh3 cannot tell
    assert verify_checkpoint(root).ok


def test_edited_shard_with_every_checksum_recomputed_is_refused_by_load_and_verify_when_signed(tmp_path, keys):
    (private, public, _), _ = keys
    root = str(tmp_path / "root")
    directory = save(root, 1, SignConfig(key_path=private))
    forge_tensor_values(fsio.resolve(root), directory, FQN, FORGED)
    with pytest.raises(signing.SignatureRefused, match=r"manifest.json: its signature by key [0-9a-f]{16} does not"):
        load(root, 1, **policy(public))
    report = verify_checkpoint(root, public_keys=[public])
    assert [p["kind"] for p in report.problems] == [SIGNATURE_PROBLEM]
    assert "does not verify" in report.problems[0]["actual"]


def test_shard_bytes_changed_under_a_signed_manifest_are_refused_by_their_digest(tmp_path, keys):
    # the manifest and parts stay as signed; only the shard changes (as an xxh3 collision would leave it): with
    # checksums off, only the signed digest stands between the load and the attacker's bytes
    # format v4: the shard's one digest condemns it; v5's chunk digests: tests/distributed/test_signed_v5.py
    (private, public, _), _ = keys
    root = str(tmp_path / "root")
    directory = save(root, 1, SignConfig(key_path=private), format_version=4)
    shard = os.path.join(directory, shard_filename(0))
    data = bytearray(Path(shard).read_bytes())
    data[-100] ^= 0xFF
    _replace(fsio.resolve(root).fs, shard, bytes(data))
    with pytest.raises(signing.SignatureRefused, match=r"__0_0.distcp: its blake3 digest differs .* key [0-9a-f]{16}"):
        load(root, 1, verify_checksums=False, **policy(public))
    report = verify_checkpoint(root, public_keys=[public])
    assert any(p["kind"] == SIGNATURE_PROBLEM and p["file"] == "__0_0.distcp" for p in report.problems)


def test_unsigned_checkpoint_is_refused_naming_the_missing_signature(tmp_path, keys):
    (_, public, _), _ = keys
    root = str(tmp_path / "root")
    save(root, 1)
    with pytest.raises(signing.SignatureRefused, match=r"manifest.sig: missing; the checkpoint is unsigned"):
        load(root, 1, **policy(public))


def test_a_key_not_accepted_is_refused_naming_its_key_id(tmp_path, keys):
    (private_a, _, key_a), (_, public_b, _) = keys
    root = str(tmp_path / "root")
    save(root, 1, SignConfig(key_path=private_a))
    raw = key_a.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    with pytest.raises(
        signing.SignatureRefused, match=f"signed by key {signing.key_id(raw)[:16]}, which is not accepted"
    ):
        load(root, 1, **policy(public_b))


def test_rotation_accepts_checkpoints_of_every_listed_key(tmp_path, keys):
    (private_a, public_a, _), (private_b, public_b, _) = keys
    root = str(tmp_path / "root")
    save(root, 1, SignConfig(key_path=private_a))
    save(root, 2, SignConfig(key_path=private_b))  # the key was rotated between saves
    assert load(root, 1, **policy(public_a, public_b))[0].step == 1
    assert load(root, 2, **policy(public_a, public_b))[0].step == 2
    with pytest.raises(signing.SignatureRefused):
        load(root, 1, **policy(public_b))  # the retired key no longer accepted: its checkpoints are refused


def test_latest_skips_a_tampered_newest_checkpoint_and_resumes_the_newest_validly_signed(tmp_path, keys, caplog):
    (private, public, _), _ = keys
    root = str(tmp_path / "root")
    save(root, 1, SignConfig(key_path=private))
    newest = save(root, 2, SignConfig(key_path=private))
    forge_tensor_values(fsio.resolve(root), newest, FQN, FORGED)
    with caplog.at_level(logging.WARNING, logger="lightning_shardckpt"):
        result, state = load(root, **policy(public))
    assert result.step == 1
    assert not torch.any(state["model"]["0.weight"] == FORGED)
    assert any("skipping" in r.getMessage() and os.path.basename(newest) in r.getMessage() for r in caplog.records)
    assert load(root)[0].step == 2  # without the policy, latest is the (forged) newest, as before


def test_the_key_never_reaches_the_checkpoint_root_or_the_config(tmp_path, keys, monkeypatch):
    (private, _, key), _ = keys
    pem = Path(private).read_text()
    monkeypatch.setenv("TEST_SIGNING_KEY", pem)
    config = save_config_from({"sign": {"key_env": "TEST_SIGNING_KEY"}}, async_save=False, write_events=True)
    root = tmp_path / "root"
    saver = CheckpointSaver(str(root), config)
    saver.save(fresh_state(seed=1), step=1).result(timeout=60)
    saver.close()
    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    secrets = [pem.splitlines()[1].encode(), seed, seed.hex().encode(), base64.b64encode(seed)]
    written = [path for path in root.rglob("*") if path.is_file()]
    assert any(path.name == signing.SIGNATURE for path in written)
    for path in written:
        data = path.read_bytes()
        assert not any(secret in data for secret in secrets), f"{path} holds the private key"
    for text in (repr(config), str(config)):
        assert not any(secret.decode(errors="ignore") in text for secret in secrets[:1] + secrets[2:])


def test_a_callable_signer_signs_like_a_kms(tmp_path, keys):
    (_, public, key), _ = keys
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    root = str(tmp_path / "root")
    save(root, 1, SignConfig(signer=lambda data: (key.sign(data), raw)))
    assert load(root, 1, **policy(public))[0].step == 1


def test_sign_options_are_checked_before_any_save(tmp_path):
    with pytest.raises(ConfigError, match="one key source"):
        SignConfig(key_path="a.pem", key_env="KEY")
    with pytest.raises(ConfigError, match="unknown save.sign option"):
        save_config_from({"sign": {"key_file": "a.pem"}})
    with pytest.raises(ConfigError, match="without public_keys"):
        LoadConfig(require_signature=True)


def test_a_key_removed_after_the_start_fails_the_commit_naming_the_option(tmp_path):
    # a key missing when the options are built is refused then (the test below); one that vanishes during the
    # run still fails its commit, named: each commit loads the key again
    private, _, _ = make_key(tmp_path, "none")
    config = SaveConfig(async_save=False, write_events=False, sign=SignConfig(key_path=private))
    os.remove(private)
    saver = CheckpointSaver(str(tmp_path / "root"), config)
    result = saver.save(fresh_state(seed=1), step=1).result(timeout=60)
    saver.close()
    assert not result.committed
    assert re.search(r"save.sign.key_path=.*none.pem.* cannot be read", str(result.error))


def _bad_keys(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """key_path -> what the refusal says, for each key a run cannot sign with."""
    _, public, _ = make_key(tmp_path, "writer")
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rsa_path = tmp_path / "rsa.pem"
    rsa_path.write_bytes(
        rsa_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return {
        "missing": (str(tmp_path / "none.pem"), "cannot be read"),
        "public": (public, "holds a public key"),
        "rsa": (str(rsa_path), "holds a RSAPrivateKey; checkpoints are signed with Ed25519 keys only"),
    }


@pytest.mark.parametrize("kind", ["missing", "public", "rsa"])
@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda root, key: SignConfig(key_path=key), id="SignConfig"),
        pytest.param(lambda root, key: save_config_from({"sign": {"key_path": key}}), id="SaveConfig"),
        pytest.param(lambda root, key: Checkpointer(root, save={"sign": {"key_path": key}}), id="Checkpointer"),
    ],
)
def test_a_signing_key_that_cannot_sign_is_refused_when_the_door_is_built(tmp_path, kind, build):
    key_path, problem = _bad_keys(tmp_path)[kind]
    root = tmp_path / "root"
    with pytest.raises(ConfigError) as refused:
        build(str(root), key_path)
    message = str(refused.value)
    assert f"save.sign.key_path={key_path!r} {problem}" in message, message
    assert "openssl genpkey -algorithm ed25519" in message and "docs/howto/signing.md" in message
    assert "PRIVATE KEY" not in message and "PUBLIC KEY" not in message  # never the key's text
    assert not root.exists()  # refused before any save


def test_format_md_signature_vector_verifies_and_is_what_this_code_signs():
    text = Path(__file__).parents[2].joinpath("docs", "FORMAT.md").read_text()
    blocks = dict(re.findall(r"<!-- vector: (signature [a-z ]+) -->\n```[a-z]*\n(.*?)\n```", text, re.S))
    seed = bytes.fromhex(blocks["signature key seed"].strip())
    manifest_bytes = blocks["signature manifest"].encode() + b"\n"
    expected = blocks["signature record"].encode() + b"\n"
    key = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
    signer = signing.signer_from_private_key(key, "vector")
    assert signing.signature_bytes(manifest_bytes, signer) == expected  # Ed25519 is deterministic
    record = signing._parse_signature(expected, "vector")
    key.public_key().verify(base64.b64decode(record["signature"]), manifest_bytes)


def test_a_durable_tier_copy_of_a_signed_checkpoint_is_signed_and_accepted(tmp_path, keys):
    from lightning_shardckpt.engine.tiers.config import TierConfig, TiersConfig
    from lightning_shardckpt.engine.tiers.replicate import Replicator

    (private, public, _), _ = keys
    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    sign = SignConfig(key_path=private)
    name = os.path.basename(save(fast, 1, sign))
    config = TiersConfig(fast=TierConfig(dirpath=fast), durable=TierConfig(dirpath=durable))
    replicator = Replicator(config, fsio.resolve(fast), fsio.resolve(durable), group=None, sign=sign)
    replicator.submit(name)
    assert replicator.close(30)
    copy = json.loads(Path(durable, name, "manifest.json").read_bytes())
    assert "replicated_from" in copy  # its manifest differs from the original's: signed again, not copied
    result, _ = load(durable, 1, **policy(public))
    assert result.step == 1
    assert verify_checkpoint(durable, 1, public_keys=[public]).ok


def test_export_compare_and_drill_with_a_public_key_refuse_a_forged_checkpoint_in_one_line(tmp_path, keys, run_cli):
    (private, public, _), _ = keys
    root = str(tmp_path / "root")
    good = save(root, 1, SignConfig(key_path=private))
    forged = save(root, 2, SignConfig(key_path=private))
    forge_tensor_values(fsio.resolve(root), forged, FQN, FORGED)
    refusals = {
        "export": run_cli("export", forged, str(tmp_path / "out.safetensors"), "--public-key", public),
        "compare": run_cli("compare", good, forged, "--public-key", public),
        "drill": run_cli("drill", forged, "--public-key", public),
    }
    for command, (code, out, err) in refusals.items():
        assert code == 2, (command, out, err)
        lines = [line for line in err.splitlines() if "manifest.json: its signature by key" in line]
        assert len(lines) == 1, (command, err)
        assert not os.path.exists(tmp_path / "out.safetensors")
    code, _, err = run_cli("export", good, str(tmp_path / "good.safetensors"), "--public-key", public)
    assert code == 0, err


def test_a_copier_that_signs_again_accepts_its_own_key_and_the_runs_public_keys_and_no_other(tmp_path, keys):
    """Issue 47 item 1: what the tier replicator accepts before it signs a copy (signing.policy_of_signer)."""
    (old_private, old_public, _), (own_private, _, _) = keys
    stranger_private, _, _ = make_key(tmp_path, "stranger")
    signed = {
        name: save(str(tmp_path / name), 1, SignConfig(key_path=key))
        for name, key in (("old", old_private), ("own", own_private), ("stranger", stranger_private))
    }
    own_signer = signing.load_signer(own_private, None, None)

    def accepts(policy: signing.SignaturePolicy, name: str) -> bool:
        directory = signed[name]
        manifest = json.loads(Path(directory, "manifest.json").read_bytes())
        try:
            policy.check_manifest(fsio.resolve(directory).fs, directory, manifest)
        except signing.SignatureRefused:
            return False
        return True

    rotated = signing.policy_of_signer(own_signer, [old_public])
    assert [accepts(rotated, name) for name in ("old", "own", "stranger")] == [True, True, False]
    own_only = signing.policy_of_signer(own_signer)
    assert [accepts(own_only, name) for name in ("old", "own", "stranger")] == [False, True, False]


@pytest.mark.parametrize("format_version", [2, 4])
def test_each_rank_checks_only_the_files_it_wrote_against_the_signed_digests(tmp_path, keys, format_version):
    """signing.check_rank_files, each replicating rank's check of what it uploads: rank 0 wrote everything here."""
    (private, _, _), _ = keys
    root = str(tmp_path / "root")
    config = SaveConfig(async_save=False, write_events=False, format_version=format_version)
    saver = CheckpointSaver(root, save_config_from(config, sign=SignConfig(key_path=private)))
    try:
        directory = saver.save(fresh_state(seed=1), step=1).result(timeout=60).path
    finally:
        saver.close()
    fs = fsio.resolve(root).fs
    manifest = json.loads(Path(directory, "manifest.json").read_bytes())
    assert manifest["format_version"] == format_version
    assert signing.check_rank_files(fs, directory, manifest, 0, "k" * 16) > 0
    assert signing.check_rank_files(fs, directory, manifest, 1, "k" * 16) == 0  # rank 1 wrote nothing
    shard = os.path.join(directory, shard_filename(0))
    data = bytearray(Path(shard).read_bytes())
    data[len(data) // 2] ^= 0xFF
    _replace(fs, shard, bytes(data))
    with pytest.raises(signing.SignatureRefused, match="digest differs"):
        signing.check_rank_files(fs, directory, manifest, 0, "k" * 16)
    assert signing.check_rank_files(fs, directory, manifest, 1, "k" * 16) == 0
