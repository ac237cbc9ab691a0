"""Peer replication of the fast tier: each rank's committed files also land in its peers' node-local roots.

One background thread per rank takes fast-tier commits in commit order. For each copy:

1. collective "peer-pick": the coordinator picks the newest commit waiting (one that fell behind skips to
   the newest, counted as `peer_replication_skipped`) and broadcasts its manifest and commit record bytes;
2. for each peer round k (rank r sends to r + k*jump, receives from r - k*jump), every rank streams the files
   it wrote (rank 0: also `.metadata`) to its peer, which checks every range against the manifest as the
   bytes arrive and renames a file into place only when it is whole and good (peer_transfer.py). Format v5
   first sends each group's table from its leader (collective "peer-tables"): the parts that follow are checked
   against the table that lists them, read on the receiving node (groups stay inside one node: save/node_groups.py);
3. collective "peer-receipts": every rank's outcome and the files it received; then the first rank of each
   node root whose directory now holds every file of the checkpoint commits it there (commit record, then
   the manifest, create-if-absent): a peer copy counts only when complete and verified. Each receiving
   rank records what it holds in `ROOT/peers/<checkpoint>/from-rank-<r>.json` (which checkpoint, which
   rank's files, from where), which `shardckpt ls` and the resume read.

With 3 or more nodes and one copy each, no root but the coordinator's holds a checkpoint whole, so its only
committed manifest is node 0's. Every other root's first rank keeps the commit documents step 1 broadcast
(manifest, commit record, signature: the original bytes) beside its records, in `ROOT/peers/<checkpoint>/`
(`keep_documents`): never a commit there, but what lets a resume that lost node 0 find the checkpoint on the
survivors and assemble it from their files (peer_restore.py).

Like the durable replicator, it owns a gloo group of its own: one thread's collectives per group.
A failed copy (a damaged or short file) is not retried: the next commit is copied whole. A collective that
fails (a dead rank) stops peer replication for the rest of the run; every later commit is then reported as a
failed copy with its lag, so the health rule still fires.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import CorruptCheckpoint
from .. import metrics
from ..collectives import all_gather_objects, broadcast_from_coordinator, rank_and_world
from ..format import bounded_json, groups, signing
from ..format import manifest as manifest_format
from ..format import references as refs
from ..format.manifest import files_with_metadata, transfer_order
from ..format.names import (
    COMMIT_RECORD,
    DCP_METADATA,
    MANIFEST,
    checkpoint_dirname_parts,
    join,
    parse_dirname,
    shard_rank,
)
from ..metrics import RunCounters
from ..save import node_groups
from ..storage import fsio
from ..storage.fsio import Location
from . import referenced_files, root_identity
from .backlog import Backlog
from .config import PeersConfig
from .peer_transfer import Incoming, Outgoing, exchange
from .verified_copy import expected_ranges, file_size, listed_size

log = logging.getLogger(__name__)

PEERS_DIR = "peers"  # ROOT/peers/<checkpoint>/from-rank-<r>.json: the peer copies this root holds
PEER_REPLICATED = "peer_replicated"
PEER_REPLICATION_FAILED = "peer_replication_failed"
PEER_REPLICATION_SKIPPED = "peer_replication_skipped"
PEER_REPLICATION_LAG = "peer_replication_lag_checkpoints"  # commits not yet complete on a peer
PEER_BYTES_SENT = "peer_bytes_sent"

_STOP = object()


def files_of_rank(manifest: dict[str, Any], rank: int) -> list[str]:
    """The files `rank` wrote for the checkpoint (the coordinator also wrote `.metadata`, when there is one),
    a part before its shard file (transfer_order)."""
    mine = [path for path in files_with_metadata(manifest) if shard_rank(path) == rank]
    if rank == 0 and DCP_METADATA in files_with_metadata(manifest):
        mine.append(DCP_METADATA)
    return sorted(mine, key=transfer_order)


def all_files(manifest: dict[str, Any]) -> dict[str, int]:
    """Every data file of the checkpoint and its committed size (`.metadata` included when written); a v5
    manifest once groups.expanded read its tables."""
    return files_with_metadata(manifest)


def _ranges(manifest: dict[str, Any], relative: str, root: Location, directory: str) -> Any:
    """What an incoming file is checked against; for a v4 shard, looked up once its part (sent first) landed here."""
    if manifest_format.is_parts_format(manifest):
        return lambda: expected_ranges(manifest, relative, [(root.fs, directory)])
    return expected_ranges(manifest, relative)


def _referenced_ranges(root: Location, directory: str, manifest: dict[str, Any], src: int, reference: str) -> Any:
    """What a referenced file `src` sends is checked against: the records of its part, which lands here first (the
    same exchange), looked up when the file starts arriving."""
    return lambda: referenced_files.of_ranks(root.fs, directory, manifest, [src])[reference][1]


def record_path(root: Location, name: str, from_rank: int) -> str:
    return join(root.path, PEERS_DIR, name, f"from-rank-{from_rank}.json")


def documents_dir(root: Location, name: str) -> str:
    """Where a root holding part of checkpoint `name` keeps its commit documents (`keep_documents`): the manifest
    and commit record under their own names, and the signature when signed (signing reads them as in a checkpoint)."""
    return join(root.path, PEERS_DIR, name)


def keep_documents(
    root: Location, name: str, manifest_bytes: bytes, record_bytes: bytes, signature: bytes | None
) -> None:
    """Keep the commit documents of `name` in `root`, which holds only part of it: a resume whose coordinator's node
    is lost learns the checkpoint from them. Manifest last: a reader takes the documents only once it is there."""
    directory = documents_dir(root, name)
    root.fs.makedirs(directory, exist_ok=True)
    if signature is not None:
        fsio.replace_small_file(root.fs, join(directory, signing.SIGNATURE), signature)
    fsio.replace_small_file(root.fs, join(directory, COMMIT_RECORD), record_bytes)
    fsio.replace_small_file(root.fs, join(directory, MANIFEST), manifest_bytes)


class PeerReplicator:
    """Construct on every rank at the same point (after the group exists); `submit` on every rank alike."""

    def __init__(self, config: PeersConfig, fast: Location, *, group: Any) -> None:
        self.config = config
        self.fast = fast
        self.group = group
        self.rank, self.world_size = rank_and_world(group)
        self.counters = RunCounters()
        self.bytes_sent = 0  # this rank's bytes sent to peers (the network cost of peer copies)
        self.broken: BaseException | None = None
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # coordinator: each copy's event
        self._queue: queue.Queue[Any] = queue.Queue()
        self._backlog = Backlog()
        self._roots: list[str] = all_gather_objects("peer-roots", fast.url, group)  # each rank's node root
        # each rank's storage: the lowest rank whose root is the same directory, whatever its name (a symlink)
        self._storage = root_identity.storage_of(fast, self._roots, self.rank, group, PEERS_DIR)
        for alias, owner in root_identity.aliases(self._roots, self._storage) if self.rank == 0 else []:
            log.warning(
                "node root %s is the same storage as %s (a file written under one appears under the other: a "
                "symlink, a bind mount or one shared disk); peer copies between them are skipped, as they would be "
                "no second copy. Give each node a root on its own disk",
                alias,
                owner,
            )
        same = [r for r in range(self.world_size) if any(self._storage[p] == self._storage[r] for p in self._peers(r))]
        if same and self.rank == 0:
            log.warning(
                "peer copies of rank(s) %s land on their own node (jump=%d); set tiers.fast.peers.jump to the ranks "
                "per node so a lost node loses no file",
                same[:8],
                config.jump,
            )
        self._unreadable: set[int] = set()  # ranks whose own group table was unreadable in the copy under way
        self._thread = threading.Thread(target=self._work, name="shardckpt-peer-replicator", daemon=True)
        self._thread.start()

    def _peers(self, rank: int) -> list[int]:
        return self.config.peers_of(rank, self.world_size)

    # --- the caller's side ---
    def submit(self, dirname: str) -> None:
        self._backlog.add()
        if self.broken is not None:  # no thread copies it any more: the health rule still sees the lag grow
            self._stopped_event(dirname)
            return
        self._queue.put(dirname)

    def flush(self, timeout: float) -> bool:
        return self._backlog.wait_empty(time.monotonic() + timeout, lambda: self.broken is not None)

    def close(self, timeout: float) -> bool:
        flushed = self.flush(timeout)
        self._queue.put(_STOP)
        self._thread.join(max(1.0, timeout))
        return flushed

    @property
    def lag(self) -> int:
        """Commits not yet copied to peers (or skipped): what `peer_replication_lag_checkpoints` reports."""
        return self._backlog.pending

    @property
    def stopped(self) -> bool:
        return not self._thread.is_alive()

    @property
    def on_coordinators_storage(self) -> bool:
        """Whether this rank's node root is the coordinator's (node 0's) storage, under its name or another."""
        return self._storage[self.rank] == self._storage[0]

    def snapshot(self) -> dict[str, int]:
        return {**self.counters.notes(), PEER_REPLICATION_LAG: self.lag, PEER_BYTES_SENT: self.bytes_sent}

    # --- the thread ---
    def _work(self) -> None:
        try:
            while True:
                pending = [self._queue.get()]
                while True:  # what else waits: copy the newest only
                    try:
                        pending.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                saw_stop = _STOP in pending
                names = [item for item in pending if item is not _STOP]
                decision = None
                if self.rank == 0:  # the coordinator's view decides for all: what to copy, how many, whether to stop
                    decision = (self._decide(names[-1]) if names else None, len(names), saw_stop)
                picked, count, stop = broadcast_from_coordinator("peer-pick", decision, self.group)
                names = self._take(names, count)
                if saw_stop and not stop:
                    self._queue.put(_STOP)  # this rank saw close before the coordinator did: stop next round
                if picked is not None:
                    for _ in names[:-1]:
                        self.counters.note(PEER_REPLICATION_SKIPPED)
                    self._copy(*picked)
                self._backlog.done(len(names))
                if stop:
                    return
        except BaseException as err:  # a collective failed (a rank died): the group is unusable now
            self.broken = err
            self.counters.note(PEER_REPLICATION_FAILED)
            log.error("rank %d: peer replication stopped: %s; checkpoints stay on this node only", self.rank, err)
            self._backlog.wake()

    def _take(self, names: list[str], count: int) -> list[str]:
        """Exactly the coordinator's `count` submissions (a rank may see a commit's notice a little later)."""
        while len(names) < count:
            item = self._queue.get()
            if item is _STOP:
                self._queue.put(_STOP)
                raise RuntimeError(f"rank {self.rank}: stopped while the coordinator copies a checkpoint it never saw")
            names.append(item)
        for item in names[count:]:
            self._queue.put(item)  # seen here before the coordinator: the next round takes it
        return names[:count]

    def _decide(self, name: str) -> tuple[str, dict[str, Any], bytes, bytes, list[str], bytes | None, list[str]] | None:
        """Coordinator: the checkpoint to copy, its manifest and commit record, what its own root still holds (the
        other roots follow its retention), its signature (signed checkpoints: the node copy stays signed), and which
        of what it holds retention retired (an incremental chain's earlier checkpoints: their manifests went, their
        referenced files stay: FORMAT.md §10.6)."""
        directory = join(self.fast.path, name)
        try:
            manifest_bytes = fsio.read_small(self.fast.fs, join(directory, MANIFEST), bounded_json.MANIFEST_MAX_BYTES)
            record_bytes = fsio.read_small(self.fast.fs, join(directory, COMMIT_RECORD), bounded_json.SMALL_MAX_BYTES)
            kept = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in self.fast.fs.ls(self.fast.path, detail=False)]
            signature_path = join(directory, signing.SIGNATURE)
            signature = (
                fsio.read_small(self.fast.fs, signature_path, bounded_json.SMALL_MAX_BYTES)
                if self.fast.fs.exists(signature_path)
                else None
            )
        except Exception as err:  # noqa: BLE001 - retention deleted it meanwhile: nothing to copy
            log.warning("cannot read the manifest of %s (%s); not copying it to peers", name, err)
            return None
        manifest = bounded_json.loads(manifest_bytes, bounded_json.MANIFEST_MAX_BYTES)
        retired = [
            other
            for other in kept
            if parse_dirname(other) is not None and self.fast.fs.exists(join(self.fast.path, other, refs.RETIRED))
        ]
        return name, manifest, manifest_bytes, record_bytes, kept, signature, retired

    def _copy(
        self,
        name: str,
        manifest: dict[str, Any],
        manifest_bytes: bytes,
        record_bytes: bytes,
        kept: list[str],
        signature: bytes | None = None,
        retired: list[str] | tuple[str, ...] = (),
    ) -> None:
        started = time.perf_counter()
        directory = join(self.fast.path, name)
        problems: list[str] = []
        own, landed = self._copy_tables(directory, manifest, problems)
        references, held = self._references(directory, manifest, own, problems)
        sent = 0
        for k in range(1, self.config.factor):
            dst = (self.rank + k * self.config.jump) % self.world_size
            src = (self.rank - k * self.config.jump) % self.world_size
            # a peer on this node's own root adds no failure domain (a world shrunk to one node, or the same
            # directory under another name): nothing to send
            send = self._storage[dst] != self._storage[self.rank] and self._table_reaches(
                manifest, k, self.rank, landed
            )
            receive = self._storage[src] != self._storage[self.rank]
            if receive and not self._table_reaches(manifest, k, src, landed):
                problems.append(
                    f"rank {self.rank}: rank {src}'s files were not sent: the group table listing them is unreadable "
                    "on its node or did not reach this one, so they could not be checked as they arrive "
                    f"(tiers.fast.peers.jump={self.config.jump} should be the ranks per node)"
                )
                receive = False
            # v5: the sender's rows from its group table, which phase one just copied here
            theirs = groups.for_ranks(self.fast.fs, directory, manifest, [src]) if receive else manifest
            outgoing = []
            if send and own is not None:
                outgoing = [
                    Outgoing(self.fast.fs, join(directory, rel), listed_size(own, rel))
                    for rel in files_of_rank(own, self.rank)
                ]
                # incremental: then the earlier files its part references that the peer lacks (its own, on this node)
                outgoing += (
                    []
                    if not outgoing
                    else [
                        Outgoing(self.fast.fs, join(directory, ref), size)
                        for ref, (size, _) in sorted(references.items())
                        if ref not in held[dst][1][k]
                    ]
                )
            incoming = [
                Incoming(
                    self.fast.fs,
                    join(directory, rel),
                    listed_size(theirs, rel),
                    _ranges(theirs, rel, self.fast, directory),
                )
                for rel in (files_of_rank(theirs, src) if receive else [])
            ]
            if incoming and held:
                incoming += [
                    Incoming(
                        self.fast.fs,
                        join(directory, ref),
                        size,
                        _referenced_ranges(self.fast, directory, theirs, src, ref),
                    )
                    for ref, size in sorted(held[src][0].items())
                    if ref not in held[self.rank][1][k]
                ]
            if not outgoing and not incoming:
                continue
            result = exchange(outgoing, dst, incoming, src, self.group)
            sent += sum(item.size for item in outgoing)
            problems.extend(f"rank {self.rank}: {p}" for p in result.problems)
            if receive and not result.problems:
                self._record(name, theirs, src)
        receipts = all_gather_objects("peer-receipts", problems, self.group)
        complete = self._commit_node_copy(name, manifest, manifest_bytes, record_bytes, signature)
        nodes = [n for n in all_gather_objects("peer-complete", complete, self.group) if n]
        failed = [p for rank_problems in receipts for p in rank_problems]
        self.counters.note(PEER_REPLICATION_FAILED if failed else PEER_REPLICATED)
        self.bytes_sent += sent
        self._follow_owner_retention(kept, checkpoint_dirname_parts(name).step, retired)
        self._gc()
        if failed:
            log.warning("copying %s to peer nodes failed: %s", name, "; ".join(failed[:3]))
        self._event(
            name, manifest, not failed, "; ".join(failed[:3]), sorted(set(nodes)), time.perf_counter() - started
        )

    def _copy_tables(
        self, directory: str, manifest: dict[str, Any], problems: list[str]
    ) -> tuple[dict[str, Any] | None, set[tuple[int, int]]]:
        """Format v5, phase one: on each root, the rank holding a group's table there (its group's lowest rank on it)
        sends it to its peers whose root the save did not write it on, before any part (a received part is checked
        against the table that lists it, read on the receiving node). Collective "peer-tables": every
        rank learns which (round, sender) tables landed and which ranks could read their own rows, so that both ends
        of every later transfer agree on what travels. Returns this rank's view of its own files (None: its group
        table is unreadable here, it sends nothing) and what landed. v1-v4: the manifest lists every part."""
        if not groups.is_grouped(manifest):
            return manifest, set()
        own: dict[str, Any] | None = None
        try:  # this rank's files as its group table lists them: on this node, where the save wrote it
            own = groups.for_ranks(self.fast.fs, directory, manifest, [self.rank])
        except (CorruptCheckpoint, OSError) as err:
            problems.append(f"rank {self.rank}: its own group table is unreadable, its files stay unsent: {err}")
        tables = {entry["path"]: entry for entry in groups.table_files(manifest)}
        landed: list[tuple[int, int]] = []
        for k in range(1, self.config.factor):
            dst = (self.rank + k * self.config.jump) % self.world_size
            src = (self.rank - k * self.config.jump) % self.world_size
            mine, theirs = self._table_held_by(manifest, self.rank), self._table_held_by(manifest, src)
            # no copy where the save wrote one already (every root its group spans: save/node_groups.py)
            send = (
                mine is not None
                and self._storage[dst] != self._storage[self.rank]
                and not self._written_on(manifest, self.rank, dst)
            )
            receive = (
                theirs is not None
                and self._storage[src] != self._storage[self.rank]
                and not self._written_on(manifest, src, self.rank)
            )
            outgoing = [Outgoing(self.fast.fs, join(directory, mine), tables[mine]["bytes"])] if send and mine else []
            incoming = (
                [
                    Incoming(
                        self.fast.fs,
                        join(directory, theirs),
                        tables[theirs]["bytes"],
                        [(0, tables[theirs]["bytes"], tables[theirs]["checksum"], None)],
                    )
                ]
                if receive and theirs
                else []
            )
            if not outgoing and not incoming:
                continue
            result = exchange(outgoing, dst if outgoing else None, incoming, src if incoming else None, self.group)
            problems.extend(f"rank {self.rank}: {p}" for p in result.problems)
            if incoming and not result.problems:
                landed.append((k, src))
        heard = all_gather_objects("peer-tables", (landed, own is not None), self.group)
        self._unreadable = {rank for rank, (_, readable) in enumerate(heard) if not readable}
        return own, {item for items, _ in heard for item in items}

    def _references(
        self, directory: str, manifest: dict[str, Any], own: dict[str, Any] | None, problems: list[str]
    ) -> tuple[dict[str, tuple[int, list]], list[Any]]:
        """Incremental on parts (FORMAT.md §10.6): a peer copy is readable on its node only with the earlier files
        its parts reference (engine/tiers/referenced_files.py). Collective "peer-references": every rank tells the
        sizes of the files its own part references and, per round, which of its sender's referenced files its root
        holds already (an earlier peer copy brought them); a sender then sends only what its peer lacks. Returns
        (this rank's referenced files: size and ranges, every rank's report); ({}, []) for a full checkpoint."""
        if not referenced_files.listed(manifest):
            return {}, []
        mine: dict[str, tuple[int, list]] = {}
        if own is not None and files_of_rank(own, self.rank):
            try:
                mine = referenced_files.of_ranks(self.fast.fs, directory, own, [self.rank])
            except (CorruptCheckpoint, OSError) as err:
                problems.append(f"rank {self.rank}: its part is unreadable, its referenced files stay unsent: {err}")
        held: dict[int, list[str]] = {}
        for k in range(1, self.config.factor):
            src = (self.rank - k * self.config.jump) % self.world_size
            candidates = referenced_files.of_rank(manifest, src)
            lacking = set(referenced_files.missing(self.fast.fs, directory, manifest, candidates))
            held[k] = [ref for ref in candidates if ref not in lacking]
        sizes = {ref: size for ref, (size, _) in mine.items()}
        return mine, all_gather_objects("peer-references", (sizes, held), self.group)

    def _group_of(self, manifest: dict[str, Any], rank: int) -> range:
        table = manifest[groups.GROUPS_FIELD]
        return groups.group_ranks(rank // table["size"], table["size"], table["count"])

    def _table_held_by(self, manifest: dict[str, Any], rank: int) -> str | None:
        """The group table `rank` sends its peers in phase one: its group's, when it is its group's lowest rank on its
        root (node_groups.table_holders: the save wrote the table on every root its group spans), else None."""
        ranks = self._group_of(manifest, rank)
        if node_groups.table_holders(self._roots, ranks)[self._roots[rank]] != rank:
            return None
        return groups.group_filename(rank // manifest[groups.GROUPS_FIELD]["size"])

    def _written_on(self, manifest: dict[str, Any], rank: int, other: int) -> bool:
        """Whether the save wrote `rank`'s group table on `other`'s root (a root that group spans)."""
        return self._roots[other] in {self._roots[r] for r in self._group_of(manifest, rank)}

    def _table_reaches(self, manifest: dict[str, Any], k: int, rank: int, landed: set[tuple[int, int]]) -> bool:
        """Round `k`: whether the group table listing `rank`'s files is on the storage of `rank`'s peer of that round
        (v1-v4: no table to need): written there by the save, or received in phase one (`landed`) by the round's peer
        of the rank holding it on `rank`'s root; with `jump` the ranks per node, that is the same node's storage."""
        if not groups.is_grouped(manifest):
            return True
        if rank in self._unreadable:  # phase one: it cannot list its own files, so it sends none
            return False
        receiver = (rank + k * self.config.jump) % self.world_size
        if self._written_on(manifest, rank, receiver):
            return True
        ranks = self._group_of(manifest, rank)
        holder = node_groups.table_holders(self._roots, ranks)[self._roots[rank]]
        sent_to = (holder + k * self.config.jump) % self.world_size
        return (k, holder) in landed and self._storage[sent_to] == self._storage[receiver]

    def _record(self, name: str, manifest: dict[str, Any], src: int) -> None:
        record = {
            "checkpoint": name,
            "step": manifest.get("step"),
            "run_id": manifest.get("run_id"),
            "from_rank": src,
            "from_root": self._roots[src],
            "files": {rel: file_size(manifest, rel) for rel in files_of_rank(manifest, src)},
            "verified": True,
            "received_at": time.time(),
        }
        path = record_path(self.fast, name, src)
        try:
            self.fast.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            fsio.replace_small_file(self.fast.fs, path, json.dumps(record).encode())
        except Exception:  # noqa: BLE001 - the files are there and verified; listing just lacks the note
            log.warning("could not record the peer copy of %s from rank %d", name, src, exc_info=True)

    def _first_of_root(self) -> bool:
        return self._storage.index(self._storage[self.rank]) == self.rank

    def _commit_node_copy(
        self, name: str, manifest: dict, manifest_bytes: bytes, record_bytes: bytes, signature: bytes | None = None
    ) -> str | None:
        """The node root's first rank: when this root now holds every file of `name`, commit it here too; else keep
        its commit documents beside the peer records (the resume's way to it when node 0 is lost).
        Returns this root's URL when the checkpoint is complete in it."""
        if not self._first_of_root():
            return None
        directory = join(self.fast.path, name)
        if not holds_all(self.fast, directory, manifest):
            if not self.on_coordinators_storage:  # node 0 committed it: it holds the documents already
                try:
                    keep_documents(self.fast, name, manifest_bytes, record_bytes, signature)
                except Exception:  # noqa: BLE001 - the copy stands; only a resume without node 0 misses them
                    log.warning("could not keep the manifest of %s in %s", name, self.fast.url, exc_info=True)
            return None
        fs = self.fast.fs
        try:
            if not fs.exists(join(directory, MANIFEST)):
                if signature is not None:  # the manifest is byte-identical: the original's signature holds, as a save's
                    fsio.write_new_file(fs, join(directory, signing.SIGNATURE), signature)
                fsio.write_new_file(fs, join(directory, COMMIT_RECORD), record_bytes)
                fsio.create_if_absent(fs, join(directory, MANIFEST), manifest_bytes)
        except Exception:  # noqa: BLE001 - an incomplete copy: the files stay, the resume fetches what lacks
            log.warning("could not commit the peer copy of %s in %s", name, self.fast.url, exc_info=True)
            return None
        return self.fast.url

    def _follow_owner_retention(self, kept: list[str], step: int, retired: list[str] | tuple[str, ...] = ()) -> None:
        """The first rank of every other node root deletes the checkpoints older than the one just copied that the
        coordinator's root no longer holds (its retention deleted them): peer copies live as long as the owner's.
        One the coordinator's retention retired (a later checkpoint references its files) is uncommitted here too,
        as retention uncommits (RETIRED, then the manifest): a peer root never lists as committed what the owner
        retired; its files stay until the owner's directory goes."""
        if not self._first_of_root() or self.on_coordinators_storage:
            return
        keep, gone = set(kept), set(retired)
        try:
            for path in self.fast.fs.ls(self.fast.path, detail=False):
                other = str(path).rstrip("/").rsplit("/", 1)[-1]
                parsed = parse_dirname(other)
                if parsed is not None and parsed.step < step and other not in keep:
                    self.fast.fs.rm(join(self.fast.path, other), recursive=True)
                elif other in gone and self.fast.fs.exists(join(self.fast.path, other, MANIFEST)):
                    directory = join(self.fast.path, other)
                    self.fast.fs.pipe_file(join(directory, refs.RETIRED), b"retired by the owner's retention\n")
                    for document in (MANIFEST, COMMIT_RECORD, signing.SIGNATURE):
                        if self.fast.fs.exists(join(directory, document)):
                            self.fast.fs.rm(join(directory, document))
        except Exception:  # noqa: BLE001 - the next copy retries
            log.debug("following the coordinator's retention failed in %s", self.fast.url, exc_info=True)

    def _gc(self) -> None:
        """Peer records of checkpoints retention deleted from this root go with them (first rank of each root)."""
        if not self._first_of_root():
            return
        try:
            for info in self.fast.fs.ls(join(self.fast.path, PEERS_DIR), detail=False):
                name = str(info).rstrip("/").rsplit("/", 1)[-1]
                if parse_dirname(name) is not None and not self.fast.fs.exists(join(self.fast.path, name)):
                    self.fast.fs.rm(join(self.fast.path, PEERS_DIR, name), recursive=True)
        except FileNotFoundError:
            pass
        except Exception:  # noqa: BLE001 - the next copy retries
            log.debug("peer record cleanup failed in %s", self.fast.url, exc_info=True)

    def _stopped_event(self, name: str) -> None:
        """A commit after the thread stopped: reported as a failed copy, with every commit since counted as lag."""
        parsed = parse_dirname(name)
        self._publish(
            name,
            {
                "step": parsed.step if parsed else None,
                "run_id": None,
                "outcome": "failed",
                "cause": f"peer replication stopped: {self.broken}",
                "seconds": 0.0,
                "complete_on": [],
                "lag_checkpoints": self.lag,
            },
        )

    def _event(self, name: str, manifest: dict, ok: bool, cause: str, nodes: list[str], seconds: float) -> None:
        self._publish(
            name,
            {
                "step": manifest.get("step"),
                "run_id": manifest.get("run_id"),
                "outcome": "committed" if ok else "failed",
                "cause": cause or None,
                "seconds": seconds,
                "complete_on": nodes,
                # commits still waiting for a peer copy (this one too when it failed): what the health rule watches
                "lag_checkpoints": sum(1 for item in list(self._queue.queue) if item is not _STOP) + (0 if ok else 1),
            },
        )

    def _publish(self, name: str, facts: dict[str, Any]) -> None:
        """The coordinator writes one `peer_replication` event per copy (or stopped commit) and tells listeners."""
        if self.rank != 0:
            return
        event = {"event": "peer_replication", "name": name, **facts, "created_at": time.time()}
        metrics.write_json_event(self.fast, f"peers-{name}-{event['outcome']}", event)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - metrics never fail a copy
                log.warning("a peer replication listener failed", exc_info=True)


def holds_all(root: Location, directory: str, manifest: dict[str, Any]) -> bool:
    """`directory` in this view holds every data file of the checkpoint at its committed size (v5: its group
    tables read here, checked against the manifest, list the rest)."""
    try:
        listing = {
            str(i["name"]).rstrip("/").rsplit("/", 1)[-1]: i.get("size") for i in root.fs.ls(directory, detail=True)
        }
    except FileNotFoundError:
        return False
    tables = (
        {entry["path"]: entry["bytes"] for entry in groups.table_files(manifest)} if groups.is_grouped(manifest) else {}
    )
    if any(listing.get(rel) != size for rel, size in tables.items()):
        return False  # v5: its parts are listed in its group tables, every one of which must be here first
    if referenced_files.missing(root.fs, directory, manifest):
        return False  # incremental: an earlier file its parts read is not in this root
    try:
        expanded = groups.expanded(root.fs, directory, manifest)
    except (CorruptCheckpoint, OSError):
        return False  # a table here does not match the manifest: not a complete copy
    return all(listing.get(rel) == size for rel, size in all_files(expanded).items())


def node_roots(template: str, storage_options: dict[str, Any] | None = None) -> dict[int, Location]:
    """The node roots a `{node_rank}` fast-tier template names that exist, by node rank."""
    import re

    from .config import NODE_RANK

    pattern = fsio.resolve(template.replace(NODE_RANK, "*"), storage_options)
    number = re.compile(re.escape(pattern.path).replace(r"\*", r"(\d+)") + "$")
    roots = {}
    for path in pattern.fs.glob(pattern.path):
        match = number.match(str(path).rstrip("/"))
        if match:
            url = template.replace(NODE_RANK, match[1])
            roots[int(match[1])] = fsio.resolve(url, storage_options)
    return dict(sorted(roots.items()))


def complete_on(roots: dict[int, Location]) -> dict[str, list[int]]:
    """For each committed checkpoint of any node root: the nodes whose root holds it whole (manifest and every file
    at its committed size), the owner's copy and peer copies alike."""
    from .. import catalog

    out: dict[str, list[int]] = {}
    for node, root in roots.items():
        for entry in catalog.list_checkpoints(root):
            out.setdefault(entry.name, [])
            if entry.committed and holds_all(root, entry.path, entry.committed_manifest):
                out[entry.name].append(node)
    return out
