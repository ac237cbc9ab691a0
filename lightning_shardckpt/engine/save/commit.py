"""The commit protocol, coordinator side: completeness check, DCP metadata, manifest, `latest`.

Runs inside DCP's `finish` on the coordinator after every rank's receipts arrived. Raising here fails
the save on every rank (DCP broadcasts the coordinator's outcome), so all ranks agree on the result.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from ...errors import CommitFailed
from .. import catalog, commit_index
from ..format import manifest as manifest_format
from ..format import signing
from ..format.checksum import checksum
from ..format.listed_digests import add_listed_digests
from ..format.names import COMMIT_RECORD, DCP_METADATA, LATEST, MANIFEST, join
from ..format.safe_pickle import DCP_METADATA_FIELD
from ..storage import fsio, retry
from ..storage.fsio import Location
from ..storage.writer import ChunkReceipt, FaultHook, storage_info_of

log = logging.getLogger(__name__)


@dataclass
class CheckpointTarget:
    """Everything the coordinator needs to commit one checkpoint directory."""

    root: Location
    dirname: str
    checkpoint_id: str
    step: int
    verify_mode: str
    node_local: bool = False  # other nodes' files are not visible here (SaveConfig.node_local)
    manifest_fields: dict[str, Any] = field(default_factory=dict)  # epoch, samples_consumed, topology, identity, extra
    sign: Any = None  # SaveConfig.sign when signing is on: the coordinator loads the key at the commit, nobody else
    # other roots of this run whose commits the new one's seq and parent continue (tiers' degraded mode: the fast tier)
    lineage_from: tuple[Location, ...] = ()

    def signer(self) -> signing.Signer | None:
        if self.sign is None or not self.sign.enabled:
            return None
        return signing.load_signer(self.sign.key_path, self.sign.key_env, self.sign.signer)

    @property
    def path(self) -> str:
        return join(self.root.path, self.dirname)


def check_completeness(
    planned: list[list[MetadataIndex]], results: list[list[WriteResult]], verify_mode: str
) -> tuple[dict[MetadataIndex, ChunkReceipt], list[str]]:
    """Every planned chunk written exactly once, chunks tiling each file, verification done.

    Returns the receipts by chunk and the list of problems (empty when the checkpoint may commit).
    """
    problems: list[str] = []
    if len(planned) != len(results):
        problems.append(f"{len(results)} ranks reported, {len(planned)} were planned")
    receipts: dict[MetadataIndex, ChunkReceipt] = {}
    written: Counter[MetadataIndex] = Counter()
    for rank, (keys, rank_results) in enumerate(zip(planned, results)):
        counts = Counter(result.index for result in rank_results)
        written.update(counts)
        missing = set(keys) - set(counts)
        unplanned = set(counts) - set(keys)
        if missing:
            problems.append(f"rank {rank} did not report {len(missing)} planned chunk(s), e.g. {_sample(missing)}")
        if unplanned:
            problems.append(f"rank {rank} reported {len(unplanned)} unplanned chunk(s), e.g. {_sample(unplanned)}")
        by_file: dict[str, list[ChunkReceipt]] = {}
        for result in rank_results:
            receipt = result.storage_data
            if not isinstance(receipt, ChunkReceipt):
                problems.append(f"rank {rank} sent no receipt for {result.index.fqn}")
                continue
            receipts[result.index] = receipt
            if receipt.reference:  # incremental: held by an earlier checkpoint (checked by check_stored_sizes)
                continue
            by_file.setdefault(receipt.relative_path, []).append(receipt)
        for path, chunks in by_file.items():
            problems.extend(_tiling_problems(path, chunks))
            if verify_mode != "off" and not any(chunk.verified for chunk in chunks):
                problems.append(f"{path}: no chunk was read back although verify.mode={verify_mode!r}")
    twice = [key for key, count in written.items() if count > 1]
    if twice:
        problems.append(f"{len(twice)} chunk(s) written more than once, e.g. {_sample(twice)}")
    return receipts, problems


def rank_write_stats(results: list[list[WriteResult]]) -> list[dict[str, Any]]:
    """Per rank that wrote a file: its bytes, write time and GB/s, as its receipts report them.

    The coordinator is the one place that sees every rank's numbers, so a slow rank (a bad disk, a
    throttled node) shows up in its event without an extra collective.
    """
    stats = []
    for rank, rank_results in enumerate(results):
        receipts = [
            result.storage_data
            for result in rank_results
            if isinstance(result.storage_data, ChunkReceipt) and not result.storage_data.reference
        ]
        if not receipts or receipts[0].write_s is None:
            continue
        nbytes, seconds = receipts[0].file_bytes, receipts[0].write_s
        stats.append(
            {
                "rank": rank,
                "bytes": nbytes,
                "write_s": seconds,
                "write_gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            }
        )
    return stats


def check_stored_sizes(
    root: Location, directory: str, receipts: dict[MetadataIndex, ChunkReceipt], missing_ok: bool = False
) -> list[str]:
    """Each file on storage has exactly the size its writer reported (catches truncated uploads), and each
    file an incremental checkpoint references still holds its chunks (retention never deletes it under us).
    A file whose writer's read-back saw its stored size is checked from the receipt (no request: on S3 that was
    one HEAD per rank, one after another); the others are asked. `missing_ok` (node-local tier): a file this node
    cannot see is skipped, referenced ones too."""
    problems = []
    sizes = {receipt.relative_path: receipt.file_bytes for receipt in receipts.values() if not receipt.reference}
    seen = {
        receipt.relative_path: receipt.stored_bytes
        for receipt in receipts.values()
        if not receipt.reference and receipt.stored_bytes is not None
    }
    reach: dict[str, int] = {}
    for receipt in receipts.values():
        if receipt.reference:
            reach[receipt.relative_path] = max(reach.get(receipt.relative_path, 0), receipt.offset + receipt.length)
    for relative, end in sorted(reach.items()):
        path = join(directory, relative)
        try:
            actual = retry.call("size", partial(root.fs.size, path), target=path)
        except FileNotFoundError:
            if missing_ok:
                continue
            actual = None
        if actual is None or actual < end:
            problems.append(f"{relative}: referenced file has {actual} bytes on storage, its chunks reach {end}")
    for relative, expected in sorted(sizes.items()):
        try:
            path = join(directory, relative)
            actual = (
                seen[relative] if relative in seen else retry.call("size", partial(root.fs.size, path), target=path)
            )
        except FileNotFoundError:
            if missing_ok:
                continue
            actual = None
        if actual != expected:
            problems.append(f"{relative}: {actual} bytes on storage, {expected} written")
    return problems


class Committer:
    """Callable handed to ShardWriter: commits one checkpoint or raises CommitFailed."""

    def __init__(
        self,
        target: CheckpointTarget,
        fault_hook: FaultHook | None = None,
        reference_digests: dict[str, str] | None = None,
    ) -> None:
        self.target = target
        self.reference_digests = reference_digests or {}  # signed incremental saves (SaveMeta.reference_digests)
        self._fault = fault_hook or (lambda point: None)
        self.manifest: dict[str, Any] | None = None
        self.seconds = 0.0
        self.ranks: list[dict[str, Any]] = []  # per rank: bytes, write_s, write_gbps (from the receipts)

    def __call__(
        self, metadata: Metadata, results: list[list[WriteResult]], planned: list[list[MetadataIndex]]
    ) -> None:
        started = time.perf_counter()
        try:
            self._commit(metadata, results, planned)
        finally:
            self.seconds = time.perf_counter() - started

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]], planned: list[list[MetadataIndex]]) -> None:
        target, fs = self.target, self.target.root.fs
        receipts, problems = check_completeness(planned, results, target.verify_mode)
        if not problems:
            problems = check_stored_sizes(target.root, target.path, receipts, missing_ok=target.node_local)
        if problems:
            raise CommitFailed(f"step {target.step} ({target.dirname}) did not commit: " + "; ".join(problems))
        self.ranks = rank_write_stats(results)

        # DCP's own metadata, with DCP's own storage records: what a plain `dcp.load` reads.
        metadata.storage_data = {index: storage_info_of(receipt) for index, receipt in receipts.items()}
        self._fault("before_metadata")
        metadata_bytes = pickle.dumps(metadata)
        fsio.write_new_file(fs, join(target.path, DCP_METADATA), metadata_bytes)

        parent, seq = lineage(target.root, target.manifest_fields.get("run_id"), target.lineage_from)
        verification = _verification_summary(target.verify_mode, receipts)
        manifest = manifest_format.build_manifest(
            checkpoint_id=target.checkpoint_id,
            parent=parent,
            seq=seq,
            step=target.step,
            metadata=metadata,
            receipts=receipts,
            verification=verification,
            **target.manifest_fields,
        )
        # v2: readers check .metadata's bytes against this before they unpickle it (safe_pickle.py)
        manifest[DCP_METADATA_FIELD] = {"checksum": checksum(metadata_bytes), "bytes": len(metadata_bytes)}
        if target.sign is not None:
            add_listed_digests(manifest, receipts.values(), self.reference_digests, target.sign.digest)

        def committed() -> None:
            self.manifest = manifest

        publish_target(target, manifest, self._fault, committed)
        log.info(
            "committed %s (%d files, %d bytes)",
            target.path,
            len(manifest["files"]),
            manifest_format.total_bytes(manifest),
        )


def publish_target(
    target: CheckpointTarget, manifest: dict[str, Any], fault: FaultHook, committed: Callable[[], None]
) -> None:
    """`publish` as both committers (this one and parts_commit's) run it: their fault points around the
    manifest, `committed` called the moment the manifest exists (before the after_manifest fault, so a
    committer that crashes there still knows it committed), and a directory another writer committed
    first refused as CommitFailed."""

    def after_manifest() -> None:
        committed()
        fault("after_manifest")

    try:
        publish(
            target.root.fs,
            target.root.path,
            target.dirname,
            manifest,
            before_manifest=lambda: fault("before_manifest"),
            after_manifest=after_manifest,
            signer=target.signer(),
        )
    except FileExistsError as err:
        raise CommitFailed(
            f"step {target.step}: {target.dirname} already has a manifest; another writer committed this "
            "directory. Two runs may share this root: give each run its own dirpath"
        ) from err


def publish(
    fs: Any,
    root_path: str,
    dirname: str,
    manifest: dict[str, Any],
    *,
    before_manifest: Callable[[], None] | None = None,
    after_manifest: Callable[[], None] | None = None,
    signer: signing.Signer | None = None,
) -> None:
    """The commit point of `root_path/dirname`, whose data files and `.metadata` are all written.

    The commit record first (whenever a manifest exists, so does its record, which listing reads; a
    record alone commits nothing), then the manifest by create-if-absent — its existence is the commit —
    then the `latest` hint, which readers confirm against the manifests. Raises FileExistsError when
    the directory has a manifest already (another writer committed it), before anything is written:
    rewriting the commit record of a committed checkpoint would make its manifest read as edited.
    """
    directory = join(root_path, dirname)
    manifest_path = join(directory, MANIFEST)
    if retry.call("exists", lambda: fs.exists(manifest_path), target=manifest_path):
        raise FileExistsError(f"{manifest_path} exists: {dirname} is already committed")
    manifest_bytes = manifest_format.to_bytes(manifest)
    if signer is not None:
        # before the commit record and the manifest: a committed checkpoint is never half-signed
        fsio.write_new_file(fs, join(directory, signing.SIGNATURE), signing.signature_bytes(manifest_bytes, signer))
    fsio.write_new_file(
        fs,
        join(directory, COMMIT_RECORD),
        manifest_format.to_bytes(manifest_format.build_commit_record(manifest, manifest_bytes)),
    )
    # the run's commit index names this directory before its manifest exists: `latest` finds it without a listing
    commit_index.write_marker(fs, root_path, manifest, dirname)
    if before_manifest is not None:
        before_manifest()
    fsio.create_if_absent(fs, manifest_path, manifest_bytes)  # a writer racing past the check above still loses here
    if after_manifest is not None:
        after_manifest()
    try:
        # not fsynced: `latest` is a hint readers confirm against the manifests (a stale, empty or missing one
        # falls back to them, FORMAT.md §4); the commit is the manifest, made durable above
        fsio.backend_for(fs).replace_hint(join(root_path, LATEST), (dirname + "\n").encode())
    except Exception:  # committed all the same: readers go by the manifests
        log.warning(
            "committed %s but could not update %s; readers fall back to the manifests", directory, LATEST, exc_info=True
        )


def lineage(root: Location, run_id: str | None, also: tuple[Location, ...] = ()) -> tuple[str | None, int]:
    """(parent, seq) of the next commit of `run_id`: its newest committed checkpoint and that one's seq + 1.

    From the run's commit index (commit_index.py: the pointer, checked against the markers, never the pointer
    alone, which a crash between a manifest and its update leaves one behind), else from a listing of commit
    records. `also`: other roots the run commits to (tiers' degraded mode saves on the durable tier while the
    fast tier holds newer commits of the run than the durable tier does); the newest commit over all of them is
    the parent, so `seq` stays strictly monotonic per run across tiers. Runs on the coordinator's background
    thread.
    """
    previous = _newest_of_run(root, run_id)
    for other in also if run_id is not None else ():
        assert run_id is not None  # the loop runs only with a run id
        try:
            theirs = catalog.newest_commit_of_run(other, run_id)
        except Exception:  # noqa: BLE001 - a failing fast tier (why degraded mode began): its last commits are lost
            log.warning("cannot read %s for the run's commit order; seq continues %s's", other.url, root.url)
            continue
        if theirs is not None and (previous is None or (theirs.seq or 0) > (previous.seq or 0)):
            previous = theirs
    if previous is None:
        return None, 1
    return previous.checkpoint_id, (previous.seq or 0) + 1


def _newest_of_run(root: Location, run_id: str | None) -> catalog.CheckpointEntry | None:
    if run_id is not None:
        return catalog.newest_commit_of_run(root, run_id)
    return catalog.newest_committed(catalog.list_checkpoints(root))  # no run id (older writers): list the root


def _verification_summary(mode: str, receipts: dict[MetadataIndex, ChunkReceipt]) -> dict[str, Any]:
    own = [r for r in receipts.values() if not r.reference]  # incremental: references were verified when written
    verified = [r for r in own if r.verified]
    return {
        "mode": mode,
        "chunks_total": len(own),
        "bytes_total": sum(r.length for r in own),
        "chunks_verified": len(verified),
        # a large chunk is sampled by block in "sample" mode: the bytes actually read back
        "bytes_verified": sum(r.length if r.verified_bytes is None else r.verified_bytes for r in verified),
    }


def _tiling_problems(path: str, chunks: list[ChunkReceipt]) -> list[str]:
    chunks = sorted(chunks, key=lambda c: c.offset)
    sizes = {chunk.file_bytes for chunk in chunks}
    if len(sizes) != 1:
        return [f"{path}: receipts disagree on the file size ({sorted(sizes)})"]
    position = 0
    for chunk in chunks:
        if chunk.offset != position:
            return [f"{path}: bytes {position}..{chunk.offset} are not covered by any chunk"]
        position += chunk.length
    if position != chunks[0].file_bytes:
        return [f"{path}: chunks cover {position} bytes, the file has {chunks[0].file_bytes}"]
    return []


def _sample(keys: Any) -> str:
    names = sorted({getattr(key, "fqn", str(key)) for key in keys})
    return ", ".join(names[:3]) + (" …" if len(names) > 3 else "")
