"""Signed checkpoints: who wrote a checkpoint, not only whether its bytes rotted (FORMAT.md §12).

xxh3 checksums catch rot and truncation, but anyone who can write the storage can change a shard and recompute
every checksum. With signing on, cryptographic digests (BLAKE3, or SHA-256) are computed in the same streaming pass
as the xxh3 chunk checksums. Format v4 (save.format_version 4): each shard file's in its part (`file_digest`), each
part's in the manifest's parts table (`part_digests`). Format v5 (FORMAT.md §12.2): each chunk's (and block's) in
its part (`digest`), each part's in its group table (`part_digests`), each table's in the manifest
(`groups.table_digests`), so a rank checks exactly the tables, parts and chunks it reads (chunk_index.py,
storage/reader.py) and never fetches a whole file to check it. The algorithm is in the manifest (`digest_algorithm`),
and the coordinator signs the manifest's exact bytes with Ed25519 into `manifest.sig`, written before the commit
record: one signature over the small manifest covers every byte transitively.

Readers with a signature policy (LoadConfig.require_signature) refuse an unsigned, mis-signed or
digest-mismatched checkpoint with one line naming the file and the key id; `latest` and `last-good` skip it.
A key's acceptance can end (FORMAT.md §12.1): an accepted key may carry a validity window (`not_after_step`,
`not_after`: judged on the signed manifest's `step` and `created_at`), and `revoked_keys` refuses a key at every
step. Both live in the one SignaturePolicy every reader builds (`policy_of`), so every reader refuses alike.
`cryptography` is imported only when a key is used (the optional extra `sign`).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from typing import Any

from ...errors import ConfigError, SignatureRefused
from ..storage import fsio, retry
from ..storage.small_files import SmallFileRefused
from . import bounded_json, groups
from .file_digests import (  # noqa: F401 - this module's readers and writers name the digests through it
    BLAKE3,
    DIGEST_ALGORITHMS,
    DIGEST_CHARS,
    DIGEST_FIELD,
    FILE_DIGEST,
    INSTALL_HINT,
    METADATA_DIGEST,
    NO_DIGEST,
    PART_DIGESTS,
    SHA256,
    digest_of,
    file_digest,
    new_digest,
)
from .names import GROUPS_FORMAT_VERSION, MANIFEST, join, shard_rank

SIGNATURE = "manifest.sig"  # beside manifest.json, written before commit.json
ALGORITHM = "ed25519"
SIGNATURE_MAX_BYTES = 4096
# how an operator makes a signing key, for every message that refuses one (docs/howto/signing.md, step 1)
MAKE_KEY = "make one with `openssl genpkey -algorithm ed25519 -out signing.pem` (docs/howto/signing.md, step 1)"


def key_id(public_raw: bytes) -> str:
    """A key's id: SHA-256 of its 32 raw public bytes, in hex (never the key itself)."""
    return hashlib.sha256(public_raw).hexdigest()


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as err:
        raise ConfigError(f"signing checkpoints needs `cryptography`; {INSTALL_HINT}") from err
    return serialization, ed25519


def _raw_public(public_key: Any) -> bytes:
    serialization, _ = _crypto()
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# --- writing -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signer:
    """Signs bytes: `sign(data) -> (signature, raw public key)`. Holds the private key (or a KMS call) in memory
    only; its repr names the key id, never the key."""

    sign: Callable[[bytes], tuple[bytes, bytes]]
    source: str  # where the key came from, for messages: "key_path /x", "env SHARDCKPT_SIGNING_KEY", "signer m:f"

    def __repr__(self) -> str:
        return f"Signer({self.source})"


def signer_from_private_key(private_key: Any, source: str) -> Signer:
    public_raw = _raw_public(private_key.public_key())
    return Signer(lambda data: (private_key.sign(data), public_raw), source)


def load_private_key(pem: bytes, source: str) -> Any:
    serialization, ed25519 = _crypto()
    # the messages name the source and the key's kind, never its bytes (a key must not reach a log)
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as err:
        if _is_public_key(pem):
            raise ConfigError(
                f"{source} holds a public key; signing needs the private key (the .pem beside it, its .pub goes to "
                f"the readers' public_keys), or {MAKE_KEY}"
            ) from None
        raise ConfigError(f"{source} is not an unencrypted PEM private key ({err}); {MAKE_KEY}") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ConfigError(
            f"{source} holds a {type(key).__name__}; checkpoints are signed with Ed25519 keys only: {MAKE_KEY}"
        )
    return key


def _is_public_key(pem: bytes) -> bool:
    serialization, _ = _crypto()
    try:
        serialization.load_pem_public_key(pem)
    except (ValueError, TypeError):
        return False
    return True


def check_key_source(key_path: str | None, key_env: str | None) -> None:
    """Load SignConfig's private key once, when the options are built: a missing file, a public key or a key that
    is not Ed25519 is a ConfigError before training, where at a commit it only fails that save in the background
    (each commit loads the key again, so a rotated file is picked up). A `signer` callable is checked at its call."""
    if key_path is not None or key_env is not None:
        load_signer(key_path, key_env, None)


def load_signer(key_path: str | None, key_env: str | None, signer: Any) -> Signer:
    """The signer of SignConfig's one key source: a PEM file, an environment variable holding PEM text, or a
    callable (or 'module:function') `f(data) -> (signature, raw public key)` for a KMS."""
    if signer is not None:
        source = signer if isinstance(signer, str) else getattr(signer, "__qualname__", type(signer).__name__)
        function = _callable(signer) if isinstance(signer, str) else signer
        return Signer(_checked_call(function, f"signer {source}"), f"signer {source}")
    if key_path is not None:
        try:
            with open(os.path.expanduser(key_path), "rb") as handle:
                pem = handle.read()
        except OSError as err:
            raise ConfigError(
                f"save.sign.key_path={key_path!r} cannot be read ({err}); give the PEM private key's path, or "
                f"{MAKE_KEY}"
            ) from None
        return signer_from_private_key(
            load_private_key(pem, f"save.sign.key_path={key_path!r}"), f"key_path {key_path}"
        )
    if key_env is not None:
        text = os.environ.get(key_env)
        if not text:
            raise ConfigError(
                f"save.sign.key_env={key_env!r}: the environment variable is not set on this process; export the PEM "
                "private key's text in it (only the coordinator, rank 0, signs)"
            )
        return signer_from_private_key(
            load_private_key(text.encode(), f"environment variable {key_env}"), f"env {key_env}"
        )
    raise ConfigError("signing is on but no key source is set; give save.sign.key_path, key_env or signer")


def _callable(spec: str) -> Callable[[bytes], tuple[bytes, bytes]]:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"save.sign.signer={spec!r} must be 'module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"save.sign.signer={spec!r} cannot be imported: {err}") from None


def _checked_call(function: Callable[..., Any], source: str) -> Callable[[bytes], tuple[bytes, bytes]]:
    def sign(data: bytes) -> tuple[bytes, bytes]:
        answer = function(data)
        if not (isinstance(answer, tuple) and len(answer) == 2 and all(isinstance(x, bytes) for x in answer)):
            raise ConfigError(f"{source} must return (signature bytes, 32 raw public key bytes), not {type(answer)}")
        return answer

    return sign


def signature_bytes(manifest_bytes: bytes, signer: Signer) -> bytes:
    """`manifest.sig`'s bytes for `manifest_bytes`. The signature is checked against the returned public key
    before it is written: a KMS answering with another key's signature fails the save, not a later load."""
    _, ed25519 = _crypto()
    signature, public_raw = signer.sign(manifest_bytes)
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public_raw).verify(signature, manifest_bytes)
    except Exception as err:
        raise ConfigError(f"{signer.source} returned a signature its public key does not verify ({err!r})") from None
    record = {
        "algorithm": ALGORITHM,
        "key_id": key_id(public_raw),
        "signature": base64.b64encode(signature).decode(),
    }
    return (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()


# --- reading -------------------------------------------------------------------------------------------------


WINDOW_OPTIONS = ("path", "not_after_step", "not_after")  # the keys of a windowed `public_keys` entry
KEY_ID_HEX = re.compile(r"[0-9a-fA-F]{16,64}")  # a key id or its prefix as refusals print it (16 characters)


@dataclass(frozen=True)
class AcceptedKey:
    """A `public_keys` entry with a validity window: the key's signatures are accepted on checkpoints up to and
    including step `not_after_step` and created at or before `not_after` (UTC); either bound may be None. Frozen
    and hashable, so LoadConfig stays hashable with it."""

    path: str  # the PEM public key file (or PEM text), as a plain entry
    not_after_step: int | None = None
    not_after: datetime | None = None  # timezone-aware, UTC

    def argument(self) -> str:
        """The command-line spelling (`--public-key`, public_key_argument): what a drill worker is handed."""
        bounds = [f"not_after_step={self.not_after_step}"] if self.not_after_step is not None else []
        bounds += [f"not_after={_iso(self.not_after)}"] if self.not_after is not None else []
        return ",".join([self.path, *bounds])

    def describe(self) -> str:
        bounds = [f"not_after_step={self.not_after_step}"] if self.not_after_step is not None else []
        if self.not_after is not None:
            bounds.append(f"not_after={_iso(self.not_after)}")
        return ", ".join(bounds) or "no window"

    def refuses(self, step: Any, created_at: Any) -> str | None:
        """Why a manifest with this `step` and `created_at` is outside the window; None when it is inside. A value
        the window cannot judge (missing, not a step or a time) is outside: a window is a promise to refuse."""
        if self.not_after_step is not None:
            if not isinstance(step, int) or isinstance(step, bool):
                return f"its step {step!r} is not a step the window can judge"
            if step > self.not_after_step:
                return f"step {step} is after not_after_step={self.not_after_step}"
        if self.not_after is not None:
            try:
                when = _utc(datetime.fromisoformat(created_at))
            except (TypeError, ValueError):
                return f"its created_at {created_at!r} is not a time the window can judge"
            if when > self.not_after:
                return f"created_at {_iso(when)} is after not_after={_iso(self.not_after)}"
        return None


def _utc(when: datetime) -> datetime:
    # a time without a zone is UTC (what the manifests write and what docs/CONFIGURATION.md says)
    return when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when.astimezone(timezone.utc)


def _iso(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


def accepted_key(entry: Mapping[str, Any]) -> AcceptedKey:
    """A windowed `public_keys` entry (`{path: ..., not_after_step: ..., not_after: ...}`), checked: ConfigError
    naming the option and the fix for an unknown key, a missing path, a step that is not a step or a time that is
    not a time."""
    entry = dict(entry)
    unknown = sorted(set(entry) - set(WINDOW_OPTIONS))
    if unknown:
        raise ConfigError(f"public_keys entry {entry!r}: unknown option(s) {unknown}; known: {list(WINDOW_OPTIONS)}")
    path = entry.get("path")
    if not isinstance(path, str | os.PathLike) or not os.fspath(path):
        raise ConfigError(f"public_keys entry {entry!r} has no `path`; give the PEM public key file it bounds")
    step = entry.get("not_after_step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ConfigError(
            f"public_keys entry for {os.fspath(path)!r}: not_after_step={step!r} is not a step; use an integer >= 0 "
            "(the last training step this key may sign), or leave it out"
        )
    return AcceptedKey(os.fspath(path), step, _not_after(entry.get("not_after"), os.fspath(path)))


def public_key_argument(text: str) -> str | AcceptedKey:
    """`--public-key`'s value: a PEM file, or `PEM,not_after_step=N,not_after=TIME` (an AcceptedKey, checked)."""
    path, *bounds = text.split(",")
    if not bounds:
        return text
    entry: dict[str, Any] = {"path": path}
    for bound in bounds:
        name, sep, value = (part.strip() for part in bound.partition("="))
        if not sep or name not in WINDOW_OPTIONS[1:]:
            raise ConfigError(f"{text!r}: {bound!r} is not a window bound; use PEM,not_after_step=N,not_after=TIME")
        entry[name] = int(value) if name == "not_after_step" and value.isdigit() else value
    return accepted_key(entry)


def _not_after(value: Any, path: str) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):  # YAML loaders other than Hydra's parse an unquoted timestamp
        return _utc(value)
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=timezone.utc)
    try:
        return _utc(datetime.fromisoformat(value))
    except (TypeError, ValueError):
        raise ConfigError(
            f"public_keys entry for {path!r}: not_after={value!r} is not a time; use an ISO 8601 time, UTC unless it "
            "names a zone, e.g. '2026-12-01T00:00:00Z' (the last created_at this key may sign)"
        ) from None


def public_key_specs(public_keys: Any) -> tuple[Any, ...]:
    """`public_keys` as every reader takes it: a tuple of PEM files (or PEM texts), and AcceptedKey for an entry
    with a validity window (a mapping). The one place a single key (`public_keys="/keys/ckpt.pub"`, a Path, one
    PEM text, one mapping) becomes a one-tuple: iterated as it is, a string would be a key file per character.
    None or empty: no keys."""
    if public_keys is None:
        return ()
    if isinstance(public_keys, str | bytes | os.PathLike | Mapping | AcceptedKey):
        public_keys = (public_keys,)
    return tuple(_spec(spec) for spec in public_keys)


def _spec(spec: Any) -> Any:
    if isinstance(spec, str | bytes | AcceptedKey):
        return spec
    if isinstance(spec, Mapping):
        return accepted_key(spec)
    return os.fspath(spec)


def revoked_key_ids(revoked_keys: Any) -> frozenset[str]:
    """The key ids (or id prefixes, 16 to 64 hex characters: what refusals print) `revoked_keys` names: each
    entry a key id, or a PEM public key file (or text) whose id is taken. ConfigError naming an entry that is
    neither. A prefix revokes every key whose id starts with it: revoking too much refuses, never accepts."""
    revoked = set()
    for entry in public_key_specs(revoked_keys):
        if isinstance(entry, AcceptedKey):
            raise ConfigError(f"revoked_keys entry {entry!r}: give a key id or a PEM public key file, not a window")
        text = entry.decode(errors="replace") if isinstance(entry, bytes) else entry
        if KEY_ID_HEX.fullmatch(text.strip()):
            revoked.add(text.strip().lower())
        elif text.lstrip().startswith("-----BEGIN") or os.path.exists(os.path.expanduser(text)):
            revoked.update(_load_keys((entry,), "revoked_keys entry"))
        else:
            raise ConfigError(
                f"revoked_keys entry {text!r} is neither a key id (16 to 64 hex characters, as a refusal prints it) "
                "nor a readable PEM public key file"
            )
    return frozenset(revoked)


def load_public_keys(specs: Any) -> dict[str, Any]:
    """Accepted keys by key id, from PEM public key files (or PEM text): one, or several for a key rotation."""
    return _load_keys([spec.path if isinstance(spec, AcceptedKey) else spec for spec in public_key_specs(specs)])


def _load_keys(specs: Any, label: str = "public key") -> dict[str, Any]:
    serialization, ed25519 = _crypto()
    keys = {}
    for spec in specs:
        if isinstance(spec, bytes | str) and str(spec).lstrip().startswith("-----BEGIN"):
            pem, where = (spec if isinstance(spec, bytes) else spec.encode()), "a PEM text"
        else:
            where = str(spec)
            try:
                with open(os.path.expanduser(where), "rb") as handle:
                    pem = handle.read()
            except OSError as err:
                raise ConfigError(f"{label} {where!r} cannot be read ({err}); give a PEM public key file") from None
        try:
            key = serialization.load_pem_public_key(pem)
        except ValueError as err:
            raise ConfigError(f"{label} {where!r} is not a PEM public key ({err})") from None
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise ConfigError(f"{label} {where!r} is a {type(key).__name__}; only Ed25519 keys verify checkpoints")
        keys[key_id(_raw_public(key))] = key
    return keys


def accepted_policy(public_keys: Any, revoked_keys: Any = ()) -> SignaturePolicy:
    """The policy of `public_keys` (plain entries, and AcceptedKey windows) less `revoked_keys`: what every
    reader with keys builds (policy_of, the replicator's policy_of_signer, the CLI's --public-key)."""
    specs = public_key_specs(public_keys)
    windows: dict[str, tuple[AcceptedKey, ...]] = {}
    for spec in specs:
        if isinstance(spec, AcceptedKey) and (spec.not_after_step is not None or spec.not_after is not None):
            # a key listed twice is bound by every window given for it: the tighter one holds
            for kid in _load_keys([spec.path]):
                windows[kid] = windows.get(kid, ()) + (spec,)
    return SignaturePolicy(load_public_keys(specs), windows, revoked_key_ids(revoked_keys))


@dataclass(frozen=True)
class SignaturePolicy:
    """What a reader accepts: checkpoints whose manifest one of `keys` signed, and whose files match its digests."""

    keys: dict[str, Any]  # key id -> Ed25519PublicKey
    windows: dict[str, tuple[AcceptedKey, ...]] = field(default_factory=dict)  # key id -> its validity window(s)
    revoked: frozenset[str] = frozenset()  # key ids (or prefixes) refused whatever they signed; beats `keys`

    def revocation_of(self, kid: str) -> str | None:
        """The `revoked_keys` entry that revokes key `kid`, or None."""
        return next((entry for entry in sorted(self.revoked) if kid.startswith(entry)), None)

    def check_manifest(self, fs: Any, directory: str, manifest: dict[str, Any]) -> str:
        """The accepting key's id; SignatureRefused naming the file and key otherwise. Reads manifest.json's
        bytes again (small): the signature covers the bytes, not their parse."""
        sig_path, manifest_path = join(directory, SIGNATURE), join(directory, MANIFEST)
        accepted = ", ".join(k[:16] for k in sorted(self.keys)) or "none"
        try:
            raw = _read_small(fs, sig_path, bounded_json.SMALL_MAX_BYTES)
        except FileNotFoundError:
            raise SignatureRefused(
                f"{sig_path}: missing; the checkpoint is unsigned and this reader requires a signature "
                f"(accepted key ids {accepted})"
            ) from None
        record = _parse_signature(raw, sig_path)
        kid = record["key_id"]
        revoked = self.revocation_of(kid)
        if revoked is not None:  # before the key lookup: a revoked key is refused even where it is still listed
            raise SignatureRefused(
                f"{sig_path}: signed by key {kid[:16]}, which is revoked (revoked_keys: {revoked[:16]}); its "
                "checkpoints are refused at every step: resume one signed by a key still trusted, or take the key "
                "out of revoked_keys if it was revoked by mistake"
            )
        key = self.keys.get(kid)
        if key is None:
            raise SignatureRefused(
                f"{sig_path}: signed by key {kid[:16]}, which is not accepted (accepted: {accepted})"
            )
        data = _read_small(fs, manifest_path, bounded_json.MANIFEST_MAX_BYTES)
        try:
            key.verify(base64.b64decode(record["signature"], validate=True), data)
        except Exception:
            raise SignatureRefused(
                f"{manifest_path}: its signature by key {kid[:16]} does not verify; the manifest was changed after "
                "it was signed"
            ) from None
        self._check_window(manifest_path, kid, data)
        if manifest.get(DIGEST_FIELD) not in DIGEST_ALGORITHMS or (
            _group_tables(manifest) and not groups.is_signed(manifest)
        ):
            raise SignatureRefused(f"{manifest_path}: signed by key {kid[:16]} but {_unverifiable(manifest)}")
        return kid

    def _check_window(self, manifest_path: str, kid: str, data: bytes) -> None:
        """Key `kid`'s windows against the step and created_at of the manifest bytes it signed (verified just
        now): judged on the signed bytes, never on a parse a caller holds, which could be another version."""
        windows = self.windows.get(kid, ())
        if not windows:
            return
        try:
            signed = json.loads(data)
        except ValueError:
            signed = {}
        signed = signed if isinstance(signed, dict) else {}
        for window in windows:
            why = window.refuses(signed.get("step"), signed.get("created_at"))
            if why is not None:
                raise SignatureRefused(
                    f"{manifest_path}: signed by key {kid[:16]} outside its validity window ({why}; public key "
                    f"{_where(window.path)}, {window.describe()}): the key was retired; resume a checkpoint within "
                    "its window (latest passes over this one), or widen that public_keys entry's window if the key "
                    "still signs"
                )

    def check_files(self, fs: Any, directory: str, manifest: dict[str, Any], ranks: list[int], kid: str) -> int:
        """Each of `ranks`' part and shard file against the signed digests, read whole; returns bytes hashed.
        Signed v5: through their group tables, each shard file by its chunks' digests (_check_grouped)."""
        from .names import shard_filename
        from .parts import PART_MAX_BYTES, part_filename

        if groups.is_grouped(manifest):
            return _check_grouped(fs, directory, manifest, ranks, kid)
        table = manifest["parts"]
        algorithm = manifest[DIGEST_FIELD]
        hashed = 0
        for rank in ranks:
            expected = table[PART_DIGESTS][rank * DIGEST_CHARS : (rank + 1) * DIGEST_CHARS]
            part_path = join(directory, part_filename(rank))
            data = _read_small(fs, part_path, PART_MAX_BYTES)
            hashed += len(data)
            if digest_of(data, algorithm) != expected:
                raise SignatureRefused(
                    f"{part_path}: its {algorithm} digest differs from the manifest signed by key {kid[:16]}; the file "
                    "was changed"
                )
            part = json.loads(data)
            shard_path = join(directory, shard_filename(rank))
            actual, nbytes = file_digest(fs, shard_path, algorithm)
            hashed += nbytes
            if actual != part.get(FILE_DIGEST):
                raise SignatureRefused(
                    f"{shard_path}: its {algorithm} digest differs from the part signed (through the manifest) by key "
                    f"{kid[:16]}; the file was changed"
                )
        return hashed

    def check_every_file(self, fs: Any, directory: str, manifest: dict[str, Any], kid: str) -> int:
        """Every file of the checkpoint against the signed digests, read whole; bytes hashed. `.metadata` by its
        digest when the manifest records one; v5: every group table, part and shard file (each by its chunks'
        digests); v4: each writing rank's part and shard; v2/v3: every listed and every referenced file
        (listed_digests.py)."""
        hashed = _check_metadata(fs, directory, manifest, kid)
        if groups.is_grouped(manifest):
            return hashed + _check_grouped(fs, directory, manifest, None, kid)
        if "parts" in manifest:
            return hashed + self.check_files(fs, directory, manifest, _writing_ranks(manifest), kid)
        from .listed_digests import check_listed_files  # that module builds on this one's names

        return hashed + check_listed_files(fs, directory, manifest, kid)


SIGNED, UNSIGNED, REFUSED = "signed", "unsigned", "refused"  # a checkpoint's signature state under a policy


def signature_state(
    policy: SignaturePolicy, fs: Any, directory: str, manifest: dict[str, Any]
) -> tuple[str, str | None, str | None]:
    """(state, accepting key id, why not accepted) of a checkpoint's manifest under `policy`: `signed` (by that key),
    `unsigned` (no manifest.sig) or `refused` (signed by no accepted key, changed after signing, no digests). The
    manifest and its signature only: `shardckpt verify --public-key` reads the files against the signed digests."""
    try:
        return SIGNED, policy.check_manifest(fs, directory, manifest), None
    except SignatureRefused as err:
        signature_path = join(directory, SIGNATURE)
        present = retry.call("exists", lambda: fs.exists(signature_path), target=signature_path)
        return (REFUSED if present else UNSIGNED), None, str(err)


def require_signed(fs: Any, directory: str, manifest: dict[str, Any], public_keys: Any, revoked_keys: Any = ()) -> str:
    """A whole checkpoint against `public_keys` (PEM files, windows) less `revoked_keys`: its signature, then every
    part and shard file against the signed digests (read whole). The accepting key's id; SignatureRefused naming the file and key otherwise.
    For tools that read everything (export, compare, drill) before they start."""
    policy = accepted_policy(public_keys, revoked_keys)
    kid = policy.check_manifest(fs, directory, manifest)
    policy.check_every_file(fs, directory, manifest, kid)
    return kid


def _group_tables(manifest: dict[str, Any]) -> bool:
    """Format v5 or later: the per-rank columns are in group tables, which no signature of this format covers."""
    version = manifest.get("format_version")
    return isinstance(version, int) and version >= GROUPS_FORMAT_VERSION


def _check_grouped(fs: Any, directory: str, manifest: dict[str, Any], ranks: list[int] | None, kid: str) -> int:
    """Signed v5 (FORMAT.md §12.2): the group tables of `ranks` (None: every rank) against the manifest's
    `table_digests`, their parts against the tables' `part_digests`, each shard file against its part's chunk
    digests, read whole; bytes hashed. SignatureRefused naming the file and the key otherwise."""
    from .chunk_digests import referenced_chunk_problem, shard_chunk_problem
    from .chunk_index import read_parts
    from .names import shard_filename

    algorithm = manifest[DIGEST_FIELD]
    tables = groups.GroupTables(fs, directory, manifest, signed_by=kid)
    merged = {**manifest, "parts": tables.parts_table(ranks)}
    writers = [r for r in (_writing_ranks(merged) if ranks is None else ranks) if _wrote(merged, r)]
    hashed = sum(merged["parts"]["part_bytes"][r] for r in writers)
    digests = tables.part_digests(writers)
    parts = read_parts(fs, directory, merged, writers, signed_by=kid, part_digests=digests)
    for rank, part in sorted(parts.items()):
        shard_path = join(directory, shard_filename(rank))
        problem, nbytes = shard_chunk_problem(fs, shard_path, part, algorithm)
        hashed += nbytes
        if problem is not None:
            raise SignatureRefused(
                f"{shard_path}: its {algorithm} digest differs from its part's (signed through its group table and the "
                f"manifest by key {kid[:16]}) at its chunk {problem}; the file was changed"
            )
        # incremental (FORMAT.md §10.6): each referenced chunk against the digest this part copied when it was written
        holder, problem, nbytes = referenced_chunk_problem(fs, directory, part, algorithm)
        hashed += nbytes
        if problem is not None:
            raise SignatureRefused(
                f"{holder}: its {algorithm} digest differs from the part of rank {rank} that references it (signed "
                f"through its group table and the manifest by key {kid[:16]}) at its chunk {problem}; the file was "
                "changed"
            )
    return hashed


def _wrote(manifest: dict[str, Any], rank: int) -> bool:
    table = manifest["parts"]
    return 0 <= rank < table["count"] and table["file_bytes"][rank] is not None


def _check_metadata(fs: Any, directory: str, manifest: dict[str, Any], kid: str) -> int:
    """`.metadata` against its digest in the signed manifest's `dcp_metadata` record, when it records one (a
    signed save of format v4 or v5 does; earlier ones bound it by xxh3 only, FORMAT.md §12); bytes hashed."""
    from .names import DCP_METADATA, DCP_METADATA_FIELD

    record = manifest.get(DCP_METADATA_FIELD)
    if not isinstance(record, dict) or METADATA_DIGEST not in record:
        return 0
    path = join(directory, DCP_METADATA)
    actual, nbytes = file_digest(fs, path, manifest[DIGEST_FIELD])
    if actual != record[METADATA_DIGEST]:
        raise SignatureRefused(
            f"{path}: its {manifest[DIGEST_FIELD]} digest differs from the manifest signed by key {kid[:16]}; the "
            "file was changed"
        )
    return nbytes


def _unverifiable(manifest: dict[str, Any]) -> str:
    """Why a signed manifest binds its files by no digest a reader can check (FORMAT.md §12, "Signed format v5")."""
    version = manifest.get("format_version")
    if _group_tables(manifest):
        # v5: the per-rank columns are in the group tables, which carry no digests (FORMAT.md §10.5): the signature
        # would vouch for them, and so for every part and shard, by xxh3 only, which anyone can recompute
        return (
            f"is format v{version}, whose group tables carry no cryptographic digests (no "
            f"{groups.GROUPS_FIELD}.{groups.TABLE_DIGESTS}, or no {DIGEST_FIELD}): the signature binds its parts and "
            "shard files by xxh3 only, so it vouches for nothing a person could not change. A signed save of this "
            "writer records both (FORMAT.md §12.2): the file was written or edited by another tool; resume a "
            "checkpoint this writer signed"
        )
    return (
        f"records no file digests this reader knows ({DIGEST_FIELD}={manifest.get(DIGEST_FIELD)!r}; a signed save of "
        f"format v2, v3 or v4 records blake3 or sha256 digests of every file): the manifest was signed without "
        "them by another tool; resume a checkpoint this writer signed"
    )


def _writing_ranks(manifest: dict[str, Any]) -> list[int]:
    return [rank for rank, size in enumerate(manifest["parts"]["file_bytes"]) if size is not None]


def _parse_signature(raw: bytes, where: str) -> dict[str, Any]:
    try:
        if len(raw) > SIGNATURE_MAX_BYTES:
            raise ValueError(f"{len(raw)} bytes")
        record = json.loads(raw)
        if record.get("algorithm") != ALGORITHM or not isinstance(record.get("key_id"), str):
            raise ValueError(f"algorithm {record.get('algorithm')!r}")
        if not isinstance(record.get("signature"), str):
            raise ValueError("no signature")
    except (ValueError, AttributeError) as err:
        raise SignatureRefused(f"{where}: not a signature record this reader knows ({err})") from None
    return record


def policy_of_signer(signer: Signer, public_keys: Any = (), revoked_keys: Any = ()) -> SignaturePolicy:
    """What a writer that signs what it copies (the tier replicator) accepts as the copy's source: checkpoints
    signed by its own key, or by one of `public_keys` (PEM files or text, windows: the run's accepted keys, a
    rotation), never by one of `revoked_keys` (its own included). A KMS signer is asked its public key by signing
    a fixed probe once."""
    _, ed25519 = _crypto()
    public_raw = signer.sign(_PUBLIC_KEY_PROBE)[1]
    policy = accepted_policy(public_keys, revoked_keys)
    policy.keys.setdefault(key_id(public_raw), ed25519.Ed25519PublicKey.from_public_bytes(public_raw))
    return policy


_PUBLIC_KEY_PROBE = b"lightning_shardckpt: which public key signs here"  # never a manifest: not JSON


def check_rank_files(fs: Any, directory: str, manifest: dict[str, Any], rank: int, kid: str) -> int:
    """The files rank `rank` wrote, against the digests of `manifest`, whose signature by key `kid` was checked
    already (SignaturePolicy.check_manifest, where the keys are): v4, its part and shard file; v2, its listed
    files (rank 0 also those no rank's name marks, as it copies them). Comparing digests needs no key, so each
    rank of a copier checks what it reads itself. Bytes hashed; SignatureRefused naming the file and key."""
    if groups.is_grouped(manifest):
        return _check_grouped(fs, directory, manifest, [rank], kid)
    if "parts" in manifest:
        ranks = [rank] if rank in _writing_ranks(manifest) else []
        return SignaturePolicy({}).check_files(fs, directory, manifest, ranks, kid)
    from .listed_digests import check_listed_files  # that module builds on this one's names

    def written_by(path: str) -> bool:
        owner = shard_rank(path)
        return owner == rank or (owner is None and rank == 0)

    return check_listed_files(fs, directory, manifest, kid, only=written_by)


def policy_of(require_signature: bool, public_keys: Any, revoked_keys: Any = ()) -> SignaturePolicy | None:
    """The reader's policy from LoadConfig's fields; None when it requires no signature."""
    if not require_signature:
        return None
    return accepted_policy(public_keys, revoked_keys)


def _where(path: str) -> str:
    return "(a PEM text)" if path.lstrip().startswith("-----BEGIN") else repr(path)


def _read_small(fs: Any, path: str, max_bytes: int) -> bytes:
    """A signed file's bytes, or SignatureRefused naming it when it is a FIFO, a link or over `max_bytes`: what a
    signature covers is a regular file of the checkpoint, never something a reader could hang on."""
    try:
        return fsio.read_small(fs, path, max_bytes)
    except SmallFileRefused as err:
        raise SignatureRefused(f"{err}; a signed checkpoint's files are regular files") from None
