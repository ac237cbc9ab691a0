"""Digests of a signed checkpoint whose manifest lists its files: formats v2 and v3 (FORMAT.md §12).

A v4 checkpoint's files are vouched for through its parts (signing.py). A v2 or v3 manifest lists every file
itself, so the digests sit there: each own file's `files[].digest` (computed in the rank's write pass), and in a
v3 (incremental) manifest each referenced file's `references[].digest`. A referenced file lives in an earlier
checkpoint; its digest is carried from the manifest that wrote it (or, for a reference of a reference, that
referenced it), as the committing writer signed it, so the *referencing* manifest's signature covers the bytes it
borrows: a holder file changed after the fact fails the load of every checkpoint that references it, whatever
the holder's own signature says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ...errors import CommitFailed, SignatureRefused
from .file_digests import DIGEST_FIELD, file_digest
from .names import join
from .references import REFERENCES_FIELD, make

DIGEST = "digest"  # files[] and references[] entries: the file's digest, 64 lowercase hex characters


def add_listed_digests(
    manifest: dict[str, Any], receipts: Iterable[Any], reference_digests: dict[str, str], algorithm: str
) -> None:
    """The coordinator, before signing: each own file's digest from its writer's receipts, each referenced file's
    from `reference_digests` (what the previous commit recorded). A file without one fails the commit: a signed
    manifest that vouched for less than every byte would read as signed all the same."""
    own = {r.relative_path: r.file_digest for r in receipts if not r.reference}
    manifest[DIGEST_FIELD] = algorithm
    for item in manifest["files"]:
        item[DIGEST] = own.get(item["path"])
    for item in manifest.get(REFERENCES_FIELD) or []:
        item[DIGEST] = reference_digests.get(item["path"])
    missing = [item["path"] for item, _ in _listed(manifest) if not item.get(DIGEST)]
    if missing:
        raise CommitFailed(
            f"signed save: no {algorithm} digest for {missing[:3]} (a referenced file's digest comes from the commit "
            "that wrote it in this process); the checkpoint is not committed. A full save (save.incremental=false, "
            "or the next full_every_n) records every digest"
        )


def reference_digests_of(manifest: dict[str, Any], dirname: str) -> dict[str, str]:
    """What a later incremental save may reference in checkpoint `dirname`, by reference path: its own files (as
    `../dirname/file`) and the files it references itself (their paths as they are: a reference never chains)."""
    out = {make(dirname, item["path"]): item[DIGEST] for item in manifest.get("files") or [] if item.get(DIGEST)}
    out.update({item["path"]: item[DIGEST] for item in manifest.get(REFERENCES_FIELD) or [] if item.get(DIGEST)})
    return out


def check_listed_files(
    fs: Any, directory: str, manifest: dict[str, Any], kid: str, only: Callable[[str], bool] | None = None
) -> int:
    """Every own and referenced file of a v2/v3 manifest against its signed digest, read whole; bytes hashed.
    SignatureRefused names the first file that differs (or has no digest) and the key. `only`: the files whose
    path it accepts (a rank checking the files it wrote)."""
    algorithm = manifest[DIGEST_FIELD]
    hashed = 0
    for item, what in _listed(manifest):
        if only is not None and not only(item["path"]):
            continue
        path = join(directory, item["path"])  # a reference '../<dir>/<file>' resolves lexically (FORMAT.md §9)
        expected = item.get(DIGEST)
        if not isinstance(expected, str):
            raise SignatureRefused(
                f"{path}: the manifest signed by key {kid[:16]} records no digest for it; it cannot be vouched for"
            )
        actual, nbytes = file_digest(fs, _normalized(path), algorithm)
        hashed += nbytes
        if actual != expected:
            raise SignatureRefused(
                f"{path}: this {what}'s {algorithm} digest differs from the manifest signed by key {kid[:16]}; the "
                "file was changed"
            )
    return hashed


def _listed(manifest: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """(entry, what it is) of every own file, then every referenced one."""
    own = [(item, "file") for item in manifest.get("files") or []]
    return own + [(item, "referenced file") for item in manifest.get(REFERENCES_FIELD) or []]


def _normalized(path: str) -> str:
    """`ROOT/step-a/../step-b/f` -> `ROOT/step-b/f`: object stores have no `..` (the schema allows one, §9)."""
    head, sep, tail = path.partition("/../")
    if not sep:
        return path
    return head.rsplit("/", 1)[0] + "/" + tail
