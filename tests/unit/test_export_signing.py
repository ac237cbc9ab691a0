"""`shardckpt export --sign-key-path`: the export of a signed checkpoint stays signed, in OpenSSF model-signing's
format, and `model_signing verify key` (its own command line, with no network) accepts it and refuses a changed
file; a key model-signing cannot use is refused before anything is written; without the option nothing more is
written (as before)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from lightning_shardckpt.engine.config import SignConfig
from tests.unit.test_signing import make_key, save

# looked up, not imported: every pytest worker collects this module, only one runs it (the import is ~0.4 CPU-s)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("model_signing") is None, reason="model_signing is not installed"
)
MODEL_SIGNING = str(Path(sys.executable).with_name("model_signing"))  # the venv's console script


def export_key(directory: Path) -> tuple[str, str]:
    """(private, public) PEM paths of an ECDSA P-256 key, as docs/howto/signing.md makes it."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / "release.pem", directory / "release.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return str(private), str(public)


def model_signing_verify(out: str, public: str) -> subprocess.CompletedProcess:
    command = [MODEL_SIGNING, "verify", "key", out, "--signature", out + ".sig", "--public_key", public]
    if _can_unshare_network():
        command = ["unshare", "-n", *command]  # no network at all: the key method must not need it
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _can_unshare_network() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "shards"])
def test_signed_export_verifies_with_model_signing_offline_and_a_changed_file_does_not(tmp_path, run_cli, sharded):
    private, public, _ = make_key(tmp_path, "writer")
    release, release_pub = export_key(tmp_path)
    checkpoint = save(str(tmp_path / "root"), 1, SignConfig(key_path=private))
    out = str(tmp_path / ("shards" if sharded else "model.safetensors"))
    shards = ["--max-shard-size", "2KiB"] if sharded else []
    code, stdout, err = run_cli("export", checkpoint, str(tmp_path / "unsigned"), *shards)
    assert code == 0 and not os.path.exists(tmp_path / "unsigned.sig") and "signed:" not in stdout, err  # as before
    code, stdout, err = run_cli("export", checkpoint, out, *shards, "--public-key", public, "--sign-key-path", release)
    assert code == 0, err
    assert f"signed: {out}.sig" in stdout
    verified = model_signing_verify(out, release_pub)
    assert verified.returncode == 0 and "Verification succeeded" in verified.stdout, (verified.stdout, verified.stderr)

    changed = sorted(Path(out).glob("*.safetensors"))[0] if sharded else Path(out)
    os.chmod(changed, 0o644)
    with open(changed, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0x01]))
    refused = model_signing_verify(out, release_pub)
    assert "Verification failed" in refused.stdout + refused.stderr, (refused.stdout, refused.stderr)


def test_an_ed25519_key_is_refused_before_anything_is_exported(tmp_path, run_cli):
    private, _, _ = make_key(tmp_path, "writer")
    checkpoint = save(str(tmp_path / "root"), 1, SignConfig(key_path=private))
    out = tmp_path / "model.safetensors"
    code, _, err = run_cli("export", checkpoint, str(out), "--sign-key-path", private)
    assert code == 2, err
    assert "holds a Ed25519PrivateKey key; OpenSSF model-signing signs exports with ECDSA keys" in err
    assert not out.exists() and not Path(f"{out}.sig").exists()
