"""Ed25519 key pairs as PEM files, as docs/howto/signing.md's commands write them: for tests that sign."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Keys:
    """The run's key pair (PEM files) and another private key, which the readers do not accept."""

    private: str
    public: str
    other_private: str

    @staticmethod
    def make(directory: Path) -> Keys:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519

        paths = []
        for name in ("run", "other"):
            key = ed25519.Ed25519PrivateKey.generate()
            private, public = Path(directory, f"{name}.pem"), Path(directory, f"{name}.pub")
            private.write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
            public.write_bytes(
                key.public_key().public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                )
            )
            paths.append((str(private), str(public)))
        return Keys(private=paths[0][0], public=paths[0][1], other_private=paths[1][0])
