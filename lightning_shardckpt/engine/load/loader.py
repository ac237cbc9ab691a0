"""Find a committed checkpoint, check it fits the state being loaded, and load it through DCP.

DCP plans the load for the current topology (resharding 4 ranks to 3 is DCP's job); our reader checks
every chunk it reads against the manifest's checksums.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ...errors import CheckpointDeleted, CorruptCheckpoint, IncompatibleCheckpoint, ShardCkptError
from .. import catalog
from ..collectives import broadcast_from_coordinator, gather_to_coordinator, rank_and_world
from ..config import LoadConfig
from ..format import groups, signing
from ..format import manifest as manifest_format
from ..format.chunk_index import ChunkIndex
from ..format.names import MANIFEST, join, parse_dirname
from ..format.safe_pickle import DCP_METADATA_FIELD
from ..root import open_reference, parse_reference, root_of
from ..storage import fsio
from ..storage.fsio import Location
from ..storage.reader import ShardReader, SignedReads
from .resume_plan import plan_resume
from .shared_reads import SharedChunks, read_shared, shared_items

log = logging.getLogger(__name__)


@dataclass
class LoadResult:
    path: str
    checkpoint_id: str
    step: int
    manifest: dict[str, Any]
    seconds: float
    bytes_read: int
    metadata_s: float = 0.0  # this rank: reading, checking and unpickling .metadata
    read_s: float = 0.0  # this rank: first range read to last chunk read and checksummed (placing overlaps it)
    place_s: float = 0.0  # this rank: the loading thread copying chunks into the state (mostly inside read_s)
    chunks_read: int = 0  # this rank: stored chunks read, each once however many read items it feeds
    source: str | None = None  # which copy was read, in a resume line's words ("fast tier"); set by the resume
    parts_read: int = 0  # this rank, format v4: the parts it read to plan its share (metadata_s includes them)
    # with a signature policy, `latest`/`last-good`: the newer checkpoints passed over because the policy refused
    # them (names; empty when none was); None without a policy (nothing is counted then)
    signature_skipped: tuple[str, ...] | None = None


def load_checkpoint(
    state_dict: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]],
    dirpath: str,
    which: str | int = "latest",
    *,
    config: LoadConfig | None = None,
    strict: bool = True,
    process_group: Any = None,
) -> LoadResult:
    """Load a committed checkpoint into `state_dict` in place, on whatever world size runs now.

    `dirpath` is a checkpoint root (then `which` picks `latest`, a step, an id or a directory name) or
    one checkpoint directory. Uncommitted directories are never candidates. `state_dict` may also be a
    function of the picked checkpoint's manifest returning the state to load into: a caller that reads
    several layouts (the Checkpointer opening a Trainer's checkpoint) shapes it once it knows which.
    """
    config = config or LoadConfig()
    started = time.perf_counter()
    try:
        result = _load_once(state_dict, dirpath, which, config, strict, process_group)
    except CheckpointDeleted as err:
        # another job's retention removed what `latest` picked: what is latest now is a fair answer
        if which != "latest" or parse_dirname(str(dirpath)) is not None:
            raise
        log.warning("%s; resolving `latest` again", err)
        result = _load_once(state_dict, dirpath, which, config, strict, process_group)
    result.seconds = time.perf_counter() - started
    log.info("loaded %s (step %d) in %.2fs", result.path, result.step, result.seconds)
    return result


def _load_once(
    state_dict: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]],
    dirpath: str,
    which: str | int,
    config: LoadConfig,
    strict: bool,
    process_group: Any,
) -> LoadResult:
    # collective "pick-checkpoint": rank 0 lists and decides, so every rank loads the same directory
    is_coordinator = rank_and_world(process_group)[0] == 0
    picked = broadcast_from_coordinator(
        "pick-checkpoint", _pick(dirpath, which, config) if is_coordinator else None, process_group
    )
    if isinstance(picked, ShardCkptError):
        raise picked
    root, entry = _in_own_view(picked[0], picked[1], dirpath, which, config)
    manifest = entry.committed_manifest
    if callable(state_dict):  # every rank alike: the manifest is rank 0's, broadcast
        state_dict = state_dict(manifest)
    check_compatible(state_dict, manifest, entry.path, strict=strict)
    # rank 0's pick, broadcast: every rank knows what it passed over
    skipped = tuple(entry.extra.get(catalog.SIGNATURE_SKIPPED) or ()) if config.require_signature else None
    if manifest_format.is_parts_format(manifest):
        result = _load_from_parts(state_dict, root, entry, config, strict, process_group)
        result.signature_skipped = skipped
        return result
    expected = manifest_format.expected_checksums(manifest) if config.verify_checksums else None
    reader = ShardReader(
        root.fs,
        entry.path,
        expected_checksums=expected,
        expected_blocks=manifest_format.expected_blocks(manifest) if config.verify_checksums else None,
        expected_metadata=manifest.get(DCP_METADATA_FIELD),  # v1 manifests have none: no byte check
        trust=config.trust_checkpoint,
        read_threads=config.read_threads,
        read_ahead_bytes=config.read_ahead_bytes,
    )
    try:
        dcp.load(
            state_dict,
            storage_reader=reader,
            process_group=process_group,
            planner=DefaultLoadPlanner(allow_partial_load=not strict),
        )
    except CheckpointException as err:
        # every rank got the same failure (DCP gathers them); rank 0 looks whether the checkpoint is still
        # there, so all ranks raise alike. Retention deletes the manifest first: no manifest, deleted.
        gone = broadcast_from_coordinator(
            "checkpoint-gone", _gone(root, entry) if is_coordinator else None, process_group
        )
        if gone:
            raise CheckpointDeleted(
                f"{entry.path} was deleted while it was being loaded (retention of another job writing into "
                f"{root.url}?); nothing is corrupt. Load another checkpoint: shardckpt ls {root.url}"
            ) from err
        raise _unwrap(err, entry.path) from err
    return _result(root, entry, reader, metadata_s=reader.metadata_s, signature_skipped=skipped)


def _load_from_parts(
    state_dict: dict[str, Any],
    root: Location,
    entry: catalog.CheckpointEntry,
    config: LoadConfig,
    strict: bool,
    process_group: Any,
) -> LoadResult:
    """Format v4: each rank plans from the parts it needs and loads its share on its own (DCP without its
    collectives: no rank sends its plan anywhere); what every rank needs (objects, small replicated tensors) the
    coordinator reads once and broadcasts (shared_reads.py), so no file is read by every rank; one verdict
    collective makes every rank fail alike."""
    plan = reader = None
    failure: BaseException | None = None
    manifest = entry.committed_manifest
    # signed v5 under a policy: each rank checks what it reads (its group tables, parts, chunks) by the digests
    # the signature binds, as it reads them (FORMAT.md §12.2); signed v4: each file it reads from, hashed whole
    signed_v5 = config.require_signature and groups.is_signed(manifest)
    kid = index = None
    try:
        # rank 0's pick checked the signature (else it is checked here): the key that vouches for every read
        kid = _signed_by(root, entry, config) if signed_v5 else None
    except Exception as err:
        failure = err
    shared, index = _shared_chunks(root, entry, state_dict, kid, failure, process_group)
    try:
        if isinstance(shared, BaseException):  # the coordinator's read failed: every rank reports its error
            raise shared
        plan = plan_resume(root.fs, entry.path, manifest, state_dict, signed_by=kid, shared=shared, index=index)
        if config.require_signature and not signed_v5:
            _check_signed_files(root, entry, plan, config)
        checked = config.verify_checksums or signed_v5  # under a policy the bytes read are always hashed
        reader = ShardReader(
            root.fs,
            entry.path,
            expected_checksums=plan.expected_checksums if checked else None,
            expected_blocks=plan.expected_blocks if checked else None,
            trust=config.trust_checkpoint,
            read_threads=config.read_threads,
            read_ahead_bytes=config.read_ahead_bytes,
            metadata=plan.metadata,
            signed=(
                SignedReads(manifest[signing.DIGEST_FIELD], kid, plan.expected_digests, plan.file_bytes)
                if kid is not None and plan.expected_digests is not None
                else None
            ),
            in_memory=shared.shards(),
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(
                state_dict,
                storage_reader=reader,
                planner=DefaultLoadPlanner(allow_partial_load=not strict),
                no_dist=True,  # this rank's share only: its plan is complete without the others'
            )
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        failure = failure or (_unwrap(err, entry.path) if isinstance(err, CheckpointException) else err)
    verdict = _agree_on_failure(failure, root, entry, process_group)
    if verdict is not None:
        raise verdict from failure
    assert plan is not None and reader is not None
    return _result(root, entry, reader, metadata_s=plan.seconds, parts_read=plan.parts_read)


def _shared_chunks(
    root: Location,
    entry: catalog.CheckpointEntry,
    state_dict: dict[str, Any],
    kid: str | None,
    failure: BaseException | None,
    group: Any,
) -> tuple[SharedChunks | BaseException, ChunkIndex | None]:
    """What every rank reads alike (its target's objects and small replicated tensors), read by the coordinator
    alone and broadcast: rank 0's group table, part and shard file would otherwise take one request from every
    rank. Its error, when the read failed, instead (every rank then reports it). On the coordinator also the
    ChunkIndex the read used: its plan does not read those parts again. Every rank calls it, whatever failed."""
    index = None
    value: SharedChunks | BaseException | None = None
    rank, world = rank_and_world(group)
    if world == 1:  # no other rank to share with: the reader reads it all itself, as it always did
        return (failure if failure is not None else SharedChunks()), None
    if rank == 0:
        try:
            if failure is not None:
                raise failure
            index = ChunkIndex(root.fs, entry.path, entry.committed_manifest, kid)
            flat, _ = flatten_state_dict(state_dict)
            value = read_shared(index, shared_items(entry.committed_manifest, set(flat)))
        except Exception as err:
            value = _portable(err, entry.path)
    # collective "shared-chunks": on the load's group (the caller's thread owns it, as every load collective)
    shared = broadcast_from_coordinator("shared-chunks", value, group)
    if failure is not None:
        return failure, index
    return shared, index


def _result(
    root: Location,
    entry: catalog.CheckpointEntry,
    reader: ShardReader,
    *,
    metadata_s: float,
    parts_read: int = 0,
    signature_skipped: tuple[str, ...] | None = None,
) -> LoadResult:
    """What this rank loaded, from the reader's counters; both formats alike but for how the metadata was read
    (`.metadata` by the reader, v4 parts by the plan) and what only one of them counts."""
    return LoadResult(
        join(root.url, entry.name),
        entry.checkpoint_id,
        entry.step,
        entry.committed_manifest,
        0.0,
        reader.bytes_read,
        metadata_s=metadata_s,
        read_s=reader.read_s,
        place_s=reader.place_s,
        chunks_read=reader.chunks_read,
        parts_read=parts_read,
        signature_skipped=signature_skipped,
    )


def _signed_by(root: Location, entry: catalog.CheckpointEntry, config: LoadConfig) -> str:
    """The id of the key whose signature over the manifest rank 0's pick accepted (or, without one, this rank's
    own check of it): nothing else in the directory is trusted before it."""
    policy = signing.policy_of(config.require_signature, config.public_keys, config.revoked_keys)
    assert policy is not None
    signed_by: str | None = entry.extra.get(catalog.SIGNED_BY)
    return signed_by or policy.check_manifest(root.fs, entry.path, entry.committed_manifest)


def _check_signed_files(root: Location, entry: catalog.CheckpointEntry, plan: Any, config: LoadConfig) -> None:
    """Signed v4: this rank's parts and shard files against the digests rank 0's pick found signed: the signature
    covers the manifest, the manifest each part's digest, each part its shard's. Read whole once more to hash them
    (a v4 part holds one digest per file, which only the whole file can be checked against; v5 parts hold one
    per chunk, checked as each chunk is read)."""
    policy = signing.policy_of(config.require_signature, config.public_keys, config.revoked_keys)
    assert policy is not None
    manifest = entry.committed_manifest
    kid = _signed_by(root, entry, config)
    ranks = sorted(
        {rank for info in plan.metadata.storage_data.values() if (rank := _rank_of(info.relative_path)) is not None}
    )
    policy.check_files(root.fs, entry.path, manifest, ranks, kid)


def _rank_of(relative_path: str) -> int | None:
    name = relative_path.rsplit("/", 1)[-1]
    if name.startswith("__") and name.endswith("_0.distcp"):
        return int(name[2 : -len("_0.distcp")])
    return None


def _agree_on_failure(
    failure: BaseException | None, root: Location, entry: catalog.CheckpointEntry, group: Any
) -> BaseException | None:
    """Every rank's outcome to rank 0, which decides: the first failing rank's error, or CheckpointDeleted when
    the checkpoint went meanwhile (its manifest is gone: another job's retention); None when all loaded."""
    # collective "load-failures": rank 0 gets each rank's error (None for a rank that loaded)
    failures = gather_to_coordinator(
        "load-failures", None if failure is None else _portable(failure, entry.path), group
    )
    verdict = None
    if failures is not None:
        first = next((failed for failed in failures if failed is not None), None)
        if first is not None:
            verdict = first
            if _gone(root, entry):
                verdict = CheckpointDeleted(
                    f"{entry.path} was deleted while it was being loaded (retention of another job writing into "
                    f"{root.url}?); nothing is corrupt. Load another checkpoint: shardckpt ls {root.url}"
                )
    # collective "load-verdict": every rank raises the same error, or none
    agreed: BaseException | None = broadcast_from_coordinator("load-verdict", verdict, group)
    return agreed


def _portable(err: BaseException, path: str) -> BaseException:
    """`err` as it can travel to rank 0 (pickled); an error that cannot, as a CorruptCheckpoint naming it."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return CorruptCheckpoint(f"loading {path} failed: {type(err).__name__}: {err}")


def _in_own_view(
    root: Location, entry: catalog.CheckpointEntry, dirpath: str, which: str | int, config: LoadConfig
) -> tuple[Location, catalog.CheckpointEntry]:
    """Rank 0's pick, read where this rank was told to look: node-local roots (`{node_rank}` tiers, a checkpoint
    assembled from peer copies in every node root) hold the same checkpoint under each node's own path, which
    the other nodes cannot read. Ranks given rank 0's path (the usual case) keep it."""
    reference = parse_reference(which)
    path = reference.text if reference.is_path else str(dirpath)  # a path in `which` names its own root
    own = root_of(fsio.resolve(path, config.storage_options))  # a checkpoint directory's or ROOT/latest's: ROOT
    if own.same_place(root):
        return root, entry
    return own, dataclasses.replace(entry, path=join(own.path, entry.name))


def _gone(root: Location, entry: catalog.CheckpointEntry) -> bool:
    try:
        return not root.fs.exists(join(entry.path, MANIFEST))
    except OSError:  # cannot tell: report the original failure
        return False


def _pick(
    dirpath: str, which: str | int, config: LoadConfig
) -> tuple[Location, catalog.CheckpointEntry] | ShardCkptError:
    try:
        policy = signing.policy_of(config.require_signature, config.public_keys, config.revoked_keys)
        location, entry = open_reference(which, dirpath, config.storage_options, policy=policy)
        if policy is not None and not manifest_format.is_parts_format(entry.committed_manifest):
            # v2/v3 (an incremental run's): no parts to split the check by rank, so rank 0 hashes every own and
            # referenced file once, before any rank reads; its verdict travels with the pick (v4: each rank its own)
            policy.check_every_file(location.fs, entry.path, entry.committed_manifest, entry.extra[catalog.SIGNED_BY])
        return location, entry
    except ShardCkptError as err:  # sent to every rank, raised everywhere
        return err


def check_compatible(state_dict: dict[str, Any], manifest: dict[str, Any], where: str, *, strict: bool) -> None:
    """Raise IncompatibleCheckpoint with a readable diff when keys or shapes do not match."""
    flat, _ = flatten_state_dict(state_dict)
    saved_shapes = {t["fqn"]: t["shape"] for t in manifest["tensors"]}
    saved_objects = {o["fqn"] for o in manifest["objects"]}
    missing, reshaped = [], []
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            if key not in saved_shapes:
                missing.append(key)
            elif list(value.shape) != saved_shapes[key]:
                reshaped.append(f"{key}: checkpoint {saved_shapes[key]}, here {list(value.shape)}")
        elif key not in saved_objects and key not in saved_shapes:
            missing.append(key)
    if reshaped or (missing and strict):
        lines = [f"{where} does not fit the state being loaded:"]
        if missing:
            lines.append(f"  not in the checkpoint ({len(missing)}): " + ", ".join(sorted(missing)[:20]))
        if reshaped:
            lines.append(f"  shape differs ({len(reshaped)}): " + "; ".join(sorted(reshaped)[:20]))
        unused = sorted((set(saved_shapes) | saved_objects) - set(flat))
        if unused:
            lines.append(f"  only in the checkpoint ({len(unused)}): " + ", ".join(unused[:20]))
        lines.append(
            "Load it into a model with the saved layout"
            + (", or pass strict=False to skip missing keys" if not reshaped else "")
        )
        raise IncompatibleCheckpoint("\n".join(lines))


def _unwrap(err: CheckpointException, path: str) -> BaseException:
    """Surface our own error from the first failing rank (a CorruptCheckpoint names file and tensor)."""
    for rank in sorted(err.failures):
        cause = err.failures[rank][0]
        if isinstance(cause, ShardCkptError):
            return cause
    rank = sorted(err.failures)[0]
    return CorruptCheckpoint(f"loading {path} failed on rank {rank}: {err.failures[rank][0]}")
