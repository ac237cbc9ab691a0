"""A signed export: `shardckpt export ... --sign-key-path PEM` signs what it wrote in OpenSSF model-signing's format.

A checkpoint's signature (engine/format/signing.py) covers our format; once exported, the tensors leave it, and a
consumer of a safetensors file checks it with the supply-chain tool models are checked with: OpenSSF
`model-signing` (https://github.com/sigstore/model-transparency). Its *key* method signs offline: a Sigstore bundle
(DSSE envelope over an in-toto statement listing every file's SHA-256) with a local private key, no network, no
transparency log. `model_signing verify key OUT --signature OUT.sig --public_key PUB` checks it, offline too.

model-signing 1.1.1's key method takes ECDSA keys only (NIST P-256, P-384, P-521), not the Ed25519 keys that
sign checkpoints: the export key is its own key (a release key, often not the training job's). The bundle goes
beside OUT (`OUT.sig`), never inside a sharded OUT, whose every file it lists. Optional: the `sign` extra brings
`model-signing` (and `pyopenssl`, which it imports but does not declare).
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError

SIGNATURE_SUFFIX = ".sig"  # OUT + this: the model-signing bundle
CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what model-signing 1.1.1's elliptic-key signer accepts
INSTALL_HINT = "install the optional extra: pip install 'lightning_shardckpt[sign]' (model-signing, pyopenssl)"
MAKE_KEY_HINT = (
    'make one with: python -c "from cryptography.hazmat.primitives.asymmetric import ec; from '
    "cryptography.hazmat.primitives import serialization as s; k = ec.generate_private_key(ec.SECP256R1()); "
    "open('export.pem', 'wb').write(k.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption()))\""
)


def signature_path(out: str) -> str:
    return out.rstrip("/") + SIGNATURE_SUFFIX


def check_export_key(key_path: str) -> None:
    """Before anything is exported: the key is readable, an ECDSA key on a curve model-signing takes, and
    model-signing is installed. A wrong key fails here, not after minutes of export with an unsigned artifact left."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        with open(os.path.expanduser(key_path), "rb") as handle:
            key = serialization.load_pem_private_key(handle.read(), password=None)
    except OSError as err:
        raise ConfigError(f"--sign-key-path {key_path!r} cannot be read ({err}); give a PEM private key") from None
    except (ValueError, TypeError) as err:
        raise ConfigError(
            f"--sign-key-path {key_path!r} is not an unencrypted PEM private key ({err}); {MAKE_KEY_HINT}"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in CURVES:
        kind = key.curve.name if isinstance(key, ec.EllipticCurvePrivateKey) else type(key).__name__
        raise ConfigError(
            f"--sign-key-path {key_path!r} holds a {kind} key; OpenSSF model-signing signs exports with ECDSA keys on "
            f"{', '.join(CURVES)} only (checkpoints' Ed25519 keys do not fit); {MAKE_KEY_HINT}"
        )
    _model_signing()


def refuse_remote(target: Any, out: str) -> None:
    """model-signing reads the files it signs from a local path."""
    protocols = target.fs.protocol if isinstance(target.fs.protocol, tuple) else (target.fs.protocol,)
    if "file" not in protocols:
        raise ConfigError(
            f"--sign-key-path signs a local OUT; {out} is on {protocols[0]}: export to a local path, then copy OUT and "
            "OUT.sig"
        )


def sign_export(out_path: str, key_path: str) -> str:
    """Sign the exported file or shard directory at `out_path` (local) into `OUT.sig`; the bundle's path."""
    model_signing = _model_signing()
    bundle = signature_path(out_path)
    if os.path.lexists(bundle):
        os.remove(bundle)  # the bundle of the export just replaced (an existing OUT.sig was refused before without it)
    model_signing.signing.Config().use_elliptic_key_signer(private_key=os.path.expanduser(key_path)).sign(
        out_path, bundle
    )
    return bundle


def refuse_existing_signature(out_path: str, replace: bool) -> None:
    """An `OUT.sig` without --replace: refused as an existing OUT is."""
    bundle = signature_path(out_path)
    if os.path.lexists(bundle) and not replace:
        raise ConfigError(f"{bundle} exists (a signature of an earlier export); pass --replace to replace both")


def _model_signing() -> Any:
    try:
        import model_signing
    except ImportError as err:
        raise ConfigError(f"--sign-key-path needs OpenSSF model-signing ({err}); {INSTALL_HINT}") from None
    return model_signing
