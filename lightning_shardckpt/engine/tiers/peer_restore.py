"""Resume from the nearest complete copy of a fast-tier checkpoint, before any durable-tier read.

Collective "peer-restore", on every rank before the tier choice (restore.py):

1. each rank reports what it holds: for the newest few checkpoint directories of every root it can read, and the
   newest few it holds peer copies of (a copy that fell behind holds older ones)
   (its own node root and, with `scan_local_roots`, the other `{node_rank}` roots on this machine's disk),
   every file at its size, and the manifests it has (all-gather "peer-holdings"): a committed one, or the commit
   documents a partial peer copy keeps (peers.keep_documents; with 3 or more nodes only node 0 commits, so
   without them losing node 0 would lose the checkpoint's only manifest);
2. every rank computes the same plan: the newest checkpoint whose every file some rank holds at its
   committed size; for each node root of the new world, the files it lacks and the nearest source of each:
   a root its first rank reads itself (a verified local copy), else another rank (sent over the group,
   checked as it arrives: peer_transfer.py);
3. the manifest goes from one holder to every rank ("peer-manifest": read once, by the holder), the copies run in
   the plan's order, and each node root that now holds every file commits the checkpoint there (commit record,
   manifest).

Format v5 lists its parts and shard files in its group tables, which a node-local save leaves on the nodes of the
ranks they list (engine/save/node_groups.py): steps 2 and 3 first assemble what the manifest lists (the tables), then
every rank learns the rest from them and steps 2 and 3 run again for the rest ("peer-parts", "peer-holdings-files").

Afterwards every node root holds the checkpoint whole, so the tier choice finds the fast copy readable by
every rank and DCP reshards it onto the new world as usual. Nothing is read from the durable tier here.
"""

from __future__ import annotations

import glob
import logging
from dataclasses import dataclass, field
from typing import Any

from ...errors import CorruptCheckpoint, SignatureRefused
from ..collectives import all_gather_objects, broadcast_from, rank_and_world
from ..format import bounded_json, groups, parts_manifest, signing
from ..format import manifest as manifest_format
from ..format.manifest import transfer_order
from ..format.manifest_schema import parse_time
from ..format.names import COMMIT_RECORD, MANIFEST, join, parse_dirname
from ..format.parts_manifest import PARTS_FIELD
from ..format.signing import SignaturePolicy
from ..storage import fsio
from ..storage.fsio import Location
from . import referenced_files
from .config import NODE_RANK, PeersConfig
from .peer_transfer import Incoming, Outgoing, exchange
from .peers import PEERS_DIR, all_files, documents_dir, holds_all
from .verified_copy import PIECE_BYTES, RangeCheck, copy_checked, copy_verified, expected_ranges

log = logging.getLogger(__name__)

CANDIDATES_PER_ROOT = 3  # newest checkpoint directories reported per root, and newest with a peer record


@dataclass(frozen=True)
class PeerRestore:
    name: str | None  # the checkpoint made whole in every node root (None: no complete copy survives)
    step: int | None
    copied_locally: int  # bytes copied from another root on the same machine
    fetched: int  # bytes received from other ranks over the group
    reason: str
    # newer checkpoints passed over because the signature policy refused them: {name: (why, order_of)}
    refused: dict[str, tuple[str, tuple]] = field(default_factory=dict)


def visible_roots(own: Location, template: str, scan: bool) -> dict[str, Location]:
    """This rank's own root, then the other node roots of the template on this machine's disk."""
    roots = {own.url: own}
    if scan and NODE_RANK in template and "://" not in template:
        for path in sorted(glob.glob(template.replace(NODE_RANK, "*"))):
            location = fsio.resolve(path)
            if not location.same_place(own):
                roots[location.url] = location
    return roots


def _holdings(
    root: Location, only: str | None = None, policy: SignaturePolicy | None = None
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, Any]]]:
    """{checkpoint: {file: size}} of the newest directories in `root`, and {checkpoint: manifest facts}. `only`: that
    one checkpoint, every file checked against its manifest's checksums (a damaged one is not held). `policy`: each
    manifest's signature is checked too; the facts of one it refuses say why (`refused`)."""
    try:
        infos = root.fs.ls(root.path, detail=True)
    except FileNotFoundError:
        return {}, {}
    if only is not None:
        return _verified_holding(root, only)
    dirs = _newest(infos)
    try:  # checkpoints this root holds peer copies of: a replicator that fell behind copied older ones than the newest
        recorded = {str(info).rstrip("/").rsplit("/", 1)[-1] for info in root.fs.ls(join(root.path, PEERS_DIR))}
    except FileNotFoundError:
        recorded = set()
    dirs = sorted(set(dirs) | set(_newest([info for info in infos if _name(info) in recorded])))
    held, manifests = {}, {}
    for _, name in dirs:
        directory = join(root.path, name)
        try:
            listing = {
                str(i["name"]).rstrip("/").rsplit("/", 1)[-1]: i.get("size") for i in root.fs.ls(directory, detail=True)
            }
            held[name] = listing
            # the committed copy, else the documents a partial peer copy keeps (peers.keep_documents): node 0 lost
            documents = directory if MANIFEST in listing and COMMIT_RECORD in listing else _kept(root, name)
            if documents is not None:
                # validated as every reader does: a directory `ls` marks corrupt offers nothing, never stops a resume
                manifest = manifest_format.parse(
                    fsio.read_small(root.fs, join(documents, MANIFEST), bounded_json.MANIFEST_MAX_BYTES), documents
                )
                facts = {
                    # what the manifest itself lists (v5: its group tables, read in restore_from_peers's second step)
                    "files": all_files(groups.for_ranks(root.fs, directory, manifest, [])),
                    "seq": manifest.get("seq") or 0,
                    "step": manifest.get("step"),
                    "created_at": manifest.get("created_at") or "",
                    "documents": documents[len(root.path) :].lstrip("/"),  # where in the root the holder reads them
                }
                if policy is not None:  # a read that fails here: this root offers no manifest of it (below)
                    try:
                        policy.check_manifest(root.fs, documents, manifest)
                    except SignatureRefused as err:
                        facts["refused"] = str(err)
                manifests[name] = facts
        except Exception:  # noqa: BLE001 - an unreadable directory offers nothing
            log.debug("cannot read %s", directory, exc_info=True)
    return held, manifests


def _kept(root: Location, name: str) -> str | None:
    """The directory holding the commit documents a partial peer copy of `name` keeps in `root`, if it has them."""
    directory = documents_dir(root, name)
    try:
        kept = {_name(info) for info in root.fs.ls(directory, detail=True)}
    except FileNotFoundError:
        return None
    return directory if MANIFEST in kept and COMMIT_RECORD in kept else None


def _verified_holding(root: Location, name: str) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, Any]]]:
    """The files of checkpoint `name` in `root` whose every byte matches its manifest (read whole: the repair after a
    load failed its checks, never the usual resume); a root without the manifest offers nothing."""
    directory = join(root.path, name)
    try:
        manifest = manifest_format.parse(
            fsio.read_small(root.fs, join(directory, MANIFEST), bounded_json.MANIFEST_MAX_BYTES), directory
        )
        listing = {_name(info): info.get("size") for info in root.fs.ls(directory, detail=True)}
    except Exception:  # noqa: BLE001 - no readable manifest here: nothing this root can vouch for
        log.debug("cannot read %s", directory, exc_info=True)
        return {}, {}
    # step one checks what the manifest lists (v5: its tables); restore_from_peers's second step checks the rest
    listed = manifest = groups.for_ranks(root.fs, directory, manifest, [])
    held = {}
    for relative, size in listing.items():
        # v5's parts and shards are no file of `listed` yet (held here as stray files are): step two checks them
        if relative in (MANIFEST, COMMIT_RECORD) or _intact(root, join(directory, relative), manifest, relative):
            held[relative] = size
        else:
            log.warning(
                "%s does not match its manifest's checksums: fetching it from a peer copy", join(directory, relative)
            )
    facts = {"files": all_files(listed), "seq": manifest.get("seq") or 0, "step": manifest.get("step")}
    return {name: held}, {name: {**facts, "created_at": manifest.get("created_at") or "", "documents": name}}


def _intact(root: Location, path: str, manifest: dict[str, Any], relative: str) -> bool:
    directory = path[: -len(relative) - 1]
    try:  # format v4: a shard's ranges are in its rank's part, read here (and checked against the manifest)
        ranges = expected_ranges(manifest, relative, [(root.fs, directory)])
    except (CorruptCheckpoint, OSError):
        return False
    if not ranges:
        return relative not in all_files(manifest)  # a stray file is harmless; a listed one must be checkable
    check = RangeCheck(path, ranges, all_files(manifest)[relative])
    try:
        with root.fs.open(path, "rb") as source:
            while piece := source.read(PIECE_BYTES):
                check.feed(piece)
        check.finish()
    except (CorruptCheckpoint, OSError):
        return False
    return True


def _name(info: dict[str, Any]) -> str:
    return str(info.get("name", "")).rstrip("/").rsplit("/", 1)[-1]


def _newest(infos: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """The newest checkpoint directories of a listing by when this disk last wrote them, not by step: after a
    rollback the new branch's smaller steps are the newest commits (a node root without manifests knows no seq)."""
    dirs = [
        (fsio.written_at(info), parsed.step, _name(info)) for info in infos if (parsed := parse_dirname(_name(info)))
    ]
    return [(step, name) for _, step, name in sorted(dirs)[-CANDIDATES_PER_ROOT:]]


def restore_from_peers(
    own: Location,
    template: str,
    config: PeersConfig,
    group: Any,
    *,
    repair: str | None = None,
    policy: SignaturePolicy | None = None,
) -> PeerRestore:
    """Collective: make the newest checkpoint any rank can still assemble whole in every node root. `repair`: make
    that checkpoint whole again after a load found a file of it damaged: every file is checked against the
    manifest's checksums, and one that fails is replaced from an intact copy (a peer's, checked as it arrives).
    `policy` (the resume's signature policy): a checkpoint whose every reported manifest it refuses is passed over
    (never copied; named in `refused`), as `latest` passes over it; a validly signed copy is the one copied.

    Format v5 in two steps: its manifest lists its group tables, which list its parts and shard files, and on a
    node-local tier no one root need hold every table. So its tables are assembled first (every node root then
    holds them all), then every rank learns the rest of its files from them and the rest is assembled; a candidate
    whose tables survive but not every part or shard is passed over for the next, as v4's is."""
    rank = rank_and_world(group)[0]
    roots = visible_roots(own, template, config.scan_local_roots)
    report: dict[str, Any] = {"own": own.url, "roots": {}, "manifests": {}}
    for url, location in roots.items():
        report["roots"][url], manifests = _holdings(location, only=repair, policy=policy)
        for name, facts in manifests.items():
            if _preferred({**facts, "holder": url}, report["manifests"].get(name)):
                report["manifests"][name] = {**facts, "holder": url}
    reports = all_gather_objects("peer-holdings", report, group)
    passed: dict[str, str] = {}  # v5 candidates whose tables were assembled but not every file they list survives
    failed: list[str] = []
    while True:
        plan, refused = _plan(reports, skip=set(passed))
        if isinstance(plan, str):
            return PeerRestore(None, None, 0, 0, "; ".join([*passed.values(), plan]), refused)
        name, step, holder_rank, holder_root, transfers = plan
        documents = None
        # the holder reads them once for every rank: the committed copy, or those a partial peer copy keeps
        kept_at = reports[holder_rank]["manifests"][name]["documents"]
        if rank == holder_rank:
            directory = join(roots[holder_root].path, kept_at)
            fs = roots[holder_root].fs
            signature_path = join(directory, signing.SIGNATURE)
            documents = (
                fsio.read_small(fs, join(directory, MANIFEST), bounded_json.MANIFEST_MAX_BYTES),
                fsio.read_small(fs, join(directory, COMMIT_RECORD), bounded_json.SMALL_MAX_BYTES),
                fsio.read_small(fs, signature_path, bounded_json.SMALL_MAX_BYTES)
                if fs.exists(signature_path)
                else None,  # a signed checkpoint stays signed
            )
        manifest_bytes, record_bytes, signature = broadcast_from("peer-manifest", documents, holder_rank, group)
        manifest = bounded_json.loads(manifest_bytes, bounded_json.MANIFEST_MAX_BYTES)
        # what the manifest itself lists (v5: its group tables, and .metadata), as _holdings reported it
        listed = groups.for_ranks(own.fs, "", manifest, [])
        local, fetched, failed = _assemble(own, roots, name, listed, transfers, group)
        if groups.is_grouped(manifest) and not failed:
            # step two: every node root holds every table now; rank 0 reads them from its own root (each checked
            # against the manifest) and every rank learns every file, then plans what each root still lacks
            parts: Any = None
            if rank == 0:
                try:
                    parts = _parts_of(own.fs, join(own.path, name), manifest)
                except Exception as err:  # noqa: BLE001 - every rank learns it (broadcast): all fail alike
                    parts = f"rank 0: reading the group tables of {name}: {type(err).__name__}: {err}"
            parts = broadcast_from("peer-parts", parts, 0, group)
            if isinstance(parts, str):
                failed = [parts]
                break
            listed = {**manifest, PARTS_FIELD: parts}
            held = {url: _listing(location, name, listed, repair is not None) for url, location in roots.items()}
            listings = all_gather_objects("peer-holdings-files", {"own": own.url, "roots": held}, group)
            transfers, lacking = _transfers(name, all_files(listed), listings)
            if lacking:
                passed[name] = f"{name}: no complete copy survives ({', '.join(lacking[:4])} lost with their nodes)"
                continue
            more_local, more_fetched, failed = _assemble(own, roots, name, listed, transfers, group)
            local, fetched = local + more_local, fetched + more_fetched
        if referenced_files.listed(manifest) and not failed:
            # incremental (FORMAT.md §10.6): the earlier files its parts read, in their sibling directories
            lacking, more_local, more_fetched, failed = _assemble_references(own, roots, name, listed, group)
            local, fetched = local + more_local, fetched + more_fetched
            if lacking:
                passed[name] = f"{name}: no complete copy survives ({', '.join(lacking[:4])} lost with their nodes)"
                continue
        break
    if not failed:
        failed = _commit_copy(own, reports, name, listed, manifest_bytes, record_bytes, signature, group)
    if failed:
        return PeerRestore(None, step, local, fetched, f"assembling {name} failed: {'; '.join(failed[:3])}", refused)
    reason = (
        f"{name} assembled from peer copies: {local} bytes copied on the same machine, {fetched} bytes fetched from "
        f"other ranks; its manifest from {join(holder_root, kept_at)} (rank {holder_rank})"
    )
    if refused:
        reason += f"; passed over (the signature policy refused them): {', '.join(refused)}"
    return PeerRestore(name, step, local, fetched, reason, refused)


def _assemble(
    own: Location,
    roots: dict[str, Location],
    name: str,
    manifest: dict[str, Any],
    transfers: list[tuple[str, int, int, str]],
    group: Any,
    references: dict[str, tuple[int, list[int]]] | None = None,
) -> tuple[int, int, list[str]]:
    """Collective "peer-restored": run this rank's share of `transfers`, each file checked against `manifest` (v5:
    with the rows of the files it moves); (bytes copied locally, bytes fetched, every rank's problems), all ranks.
    `references` (incremental): the transfers are those referenced files (size, referencing ranks), each checked
    against the referencing parts' records, read in this rank's root (which holds every part by now)."""
    rank = rank_and_world(group)[0]
    problems: list[str] = []
    local = fetched = 0
    own_dir = join(own.path, name)
    sizes = all_files(manifest) if references is None else {ref: size for ref, (size, _) in references.items()}
    for relative, writer, source, source_root in transfers:
        if rank not in (writer, source):
            continue
        size = sizes[relative]
        try:
            if writer == source and references is not None:  # a referenced file: checked by the referencing records
                src = roots[source_root]
                checked = _referenced_ranges(own, name, manifest, references, relative)
                local += copy_checked(
                    src.fs, join(src.path, name, relative), own.fs, join(own_dir, relative), checked, size
                )
            elif writer == source:  # the nearest copy is on this machine: a verified local copy
                src = roots[source_root]
                own.fs.makedirs(own_dir, exist_ok=True)
                local += copy_verified(src.fs, join(src.path, name), own.fs, own_dir, relative, manifest)
            elif rank == source:
                src = roots[source_root]
                result = exchange([Outgoing(src.fs, join(src.path, name, relative), size)], writer, [], None, group)
                problems.extend(result.problems)
            else:
                ranges: Any = (
                    _incoming_ranges(manifest, relative, own, roots, name)
                    if references is None
                    else lambda relative=relative: _referenced_ranges(own, name, manifest, references, relative)
                )
                incoming = Incoming(own.fs, join(own_dir, relative), size, ranges)
                result = exchange([], None, [incoming], source, group)
                fetched += result.bytes
                problems.extend(result.problems)
        except Exception as err:  # noqa: BLE001 - gathered below: the tier choice then falls back
            problems.append(f"rank {rank}: {relative}: {type(err).__name__}: {err}")
    outcomes = all_gather_objects("peer-restored", (problems, local, fetched), group)
    return sum(o[1] for o in outcomes), sum(o[2] for o in outcomes), [p for o in outcomes for p in o[0]]


def _assemble_references(
    own: Location, roots: dict[str, Location], name: str, listed: dict[str, Any], group: Any
) -> tuple[list[str], int, int, list[str]]:
    """Incremental on parts, once every node root holds every part of `name`: each root gets the earlier files those
    parts reference (engine/tiers/referenced_files.py), from the nearest copy, checked against the referencing
    records. Collectives "peer-references" (each rank reads a share of the parts in its own root: their referenced
    files' sizes and referencing ranks) and "peer-holdings-references" (what every root holds of them). Returns (the
    files no rank holds, bytes copied locally, bytes fetched, every rank's problems); all ranks alike."""
    rank, world = rank_and_world(group)
    own_dir = join(own.path, name)
    writers = parts_manifest.writing_ranks(listed)  # every part is in this root by now
    found: dict[str, tuple[int, list[int]]] = {}
    problem = None
    try:
        for writer in writers[rank::world]:
            for reference, (size, _) in referenced_files.of_ranks(own.fs, own_dir, listed, [writer]).items():
                found.setdefault(reference, (size, []))[1].append(writer)
    except Exception as err:  # noqa: BLE001 - every rank learns it: all fail alike
        problem = f"rank {rank}: reading the parts of {name}: {type(err).__name__}: {err}"
    gathered = all_gather_objects("peer-references", (found, problem), group)
    problems = [p for _, p in gathered if p]
    if problems:
        return [], 0, 0, problems
    references: dict[str, tuple[int, list[int]]] = {}
    for part_refs, _ in gathered:
        for reference, (size, ranks) in part_refs.items():
            references.setdefault(reference, (size, []))[1].extend(ranks)
    held = {url: _referenced_listing(location, name, references) for url, location in roots.items()}
    listings = all_gather_objects("peer-holdings-references", {"own": own.url, "roots": held}, group)
    sizes = {reference: size for reference, (size, _) in references.items()}
    transfers, lacking = _transfers(name, sizes, listings)
    if lacking:
        return lacking, 0, 0, []
    if [r["own"] for r in listings].index(own.url) == rank:  # the root's first rank: a replaced node's empty root
        for reference in sorted(references):
            referenced_files.mark_kept_for_references(own.fs, referenced_files.sibling_dir(own_dir, reference))
    local, fetched, failed = _assemble(own, roots, name, listed, transfers, group, references)
    return [], local, fetched, failed


def _referenced_listing(
    root: Location, name: str, references: dict[str, tuple[int, list[int]]]
) -> dict[str, dict[str, int]]:
    """{name: {reference: size}} of the referenced files `root` holds (one listing per sibling directory)."""
    directory = join(root.path, name)
    out: dict[str, int] = {}
    listings: dict[str, dict[str, Any]] = {}
    for reference in references:
        sibling, file = referenced_files.sibling_dir(directory, reference), reference.rsplit("/", 1)[-1]
        if sibling not in listings:
            try:
                listings[sibling] = {_name(info): info.get("size") for info in root.fs.ls(sibling, detail=True)}
            except Exception:  # noqa: BLE001 - absent or unreadable: holds none of it
                listings[sibling] = {}
        if file in listings[sibling]:
            out[reference] = listings[sibling][file]
    return {name: out}


def _commit_copy(
    own: Location,
    reports: list[dict[str, Any]],
    name: str,
    manifest: dict[str, Any],
    manifest_bytes: bytes,
    record_bytes: bytes,
    signature: bytes | None,
    group: Any,
) -> list[str]:
    """Collective "peer-committed": the first rank of each node root commits the checkpoint there once the root holds
    it whole (commit record, then the manifest's original bytes, create-if-absent); every rank's problems."""
    rank = rank_and_world(group)[0]
    problems = []
    own_dir = join(own.path, name)
    if reports[rank]["own"] == own.url and [r["own"] for r in reports].index(own.url) == rank:
        try:
            if holds_all(own, own_dir, manifest) and not own.fs.exists(join(own_dir, MANIFEST)):
                if signature is not None:
                    fsio.write_new_file(own.fs, join(own_dir, signing.SIGNATURE), signature)
                fsio.write_new_file(own.fs, join(own_dir, COMMIT_RECORD), record_bytes)
                fsio.create_if_absent(own.fs, join(own_dir, MANIFEST), manifest_bytes)
        except Exception as err:  # noqa: BLE001
            problems.append(f"rank {rank}: committing {name} in {own.url}: {err}")
    return [p for rank_problems in all_gather_objects("peer-committed", problems, group) for p in rank_problems]


def _referenced_ranges(
    own: Location, name: str, manifest: dict[str, Any], references: dict[str, tuple[int, list[int]]], relative: str
) -> list:
    ranks = references[relative][1]
    return referenced_files.of_ranks(own.fs, join(own.path, name), manifest, ranks)[relative][1]


def _listing(root: Location, name: str, manifest: dict[str, Any], verified: bool) -> dict[str, dict[str, int]]:
    """{name: {file: size}} of checkpoint `name` in `root` (`verified`, a repair: only the files whose every byte
    matches `manifest`, with its parts' rows); {} when the root lacks it."""
    directory = join(root.path, name)
    try:
        listing = {_name(info): info.get("size") for info in root.fs.ls(directory, detail=True)}
    except FileNotFoundError:
        return {}
    except Exception:  # noqa: BLE001 - an unreadable directory offers nothing
        log.debug("cannot list %s", directory, exc_info=True)
        return {}
    if verified:
        listing = {
            rel: size
            for rel, size in listing.items()
            if rel in (MANIFEST, COMMIT_RECORD) or _intact(root, join(directory, rel), manifest, rel)
        }
    return {name: listing}


def _parts_of(fs: Any, directory: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """A v5 manifest's v4-shaped parts table, from its group tables in `directory` (each checked against it)."""
    parts: dict[str, Any] = groups.expanded(fs, directory, manifest)[PARTS_FIELD]
    return parts


def _preferred(facts: dict[str, Any], held: dict[str, Any] | None) -> bool:
    """The first manifest reported for a checkpoint, unless a later one is accepted where it was refused."""
    return held is None or ("refused" in held and "refused" not in facts)


def order_of(facts: dict[str, Any]) -> tuple:
    """A reported checkpoint's place in commit order: (seq, commit time, step), as restore.py ranks catalog entries."""
    stamp = parse_time(facts.get("created_at"))
    return (facts.get("seq") or 0, stamp.timestamp() if stamp is not None else 0.0, facts.get("step") or 0)


def _incoming_ranges(
    manifest: dict[str, Any], relative: str, own: Location, roots: dict[str, Location], name: str
) -> Any:
    """What a fetched file is checked against; a v4 shard's ranges come from its part, looked up when the shard
    starts arriving: in this node's root (the part was fetched first) or any root this rank sees."""
    if not manifest_format.is_parts_format(manifest):
        return expected_ranges(manifest, relative)
    places = [(own.fs, join(own.path, name))] + [(root.fs, join(root.path, name)) for root in roots.values()]
    return lambda: expected_ranges(manifest, relative, places)


def _plan(
    reports: list[dict[str, Any]], skip: set[str] | None = None
) -> tuple[tuple[str, int, int, str, list[tuple[str, int, int, str]]] | str, dict[str, tuple[str, tuple]]]:
    """The same plan on every rank: (checkpoint, step, manifest holder rank, its root, transfers) or why none; and the
    newer checkpoints passed over because the signature policy refused every manifest reported for them
    ({name: (why, order_of)}, newest first). `skip`: candidates already found incomplete (v5's second step)."""
    manifests: dict[str, dict[str, Any]] = {}
    holder: dict[str, tuple[int, str]] = {}
    for rank, report in enumerate(reports):
        for name, facts in report["manifests"].items():
            if _preferred(facts, manifests.get(name)):
                manifests[name], holder[name] = facts, (rank, facts["holder"])
    refused: dict[str, tuple[str, tuple]] = {}
    if not manifests:
        return "no fast-tier checkpoint survives on any node", refused
    reasons = []
    # newest commit first: within a run by seq, as `latest` orders (a rollback's new branch after the old one)
    for name in sorted(manifests, key=lambda n: (manifests[n]["seq"], manifests[n]["created_at"]), reverse=True):
        if "refused" in manifests[name]:  # every reported copy of its manifest: none is worth copying
            refused[name] = (manifests[name]["refused"], order_of(manifests[name]))
            reasons.append(f"{name}: refused by the signature policy ({manifests[name]['refused']})")
            continue
        if skip and name in skip:
            continue
        transfers, lacking = _transfers(name, manifests[name]["files"], reports)
        if lacking:
            reasons.append(f"{name}: no complete copy survives ({', '.join(lacking[:4])} lost with their nodes)")
            continue
        return (name, manifests[name]["step"], *holder[name], transfers), refused
    return "; ".join(reasons), refused


def _transfers(
    name: str, expected: dict[str, int], reports: list[dict[str, Any]]
) -> tuple[list[tuple[str, int, int, str]], list[str]]:
    """(file, writer rank, source rank, source root) for every file of `expected` a node root of the new world lacks
    (each root's first rank writes it; the nearest copy is the source), and the files no rank holds at their size."""
    holders: dict[str, list[tuple[int, str]]] = {rel: [] for rel in expected}
    for rank, report in enumerate(reports):
        for url, held in report["roots"].items():
            for rel, size in held.get(name, {}).items():
                if rel in expected and expected[rel] == size:
                    holders[rel].append((rank, url))
    lacking = sorted(rel for rel, found in holders.items() if not found)
    if lacking:
        return [], lacking
    writers: dict[str, int] = {}
    for rank, report in enumerate(reports):
        writers.setdefault(report["own"], rank)
    transfers = []
    for own_url, writer in sorted(writers.items(), key=lambda item: item[1]):
        present = reports[writer]["roots"].get(own_url, {}).get(name, {})
        for rel in sorted(expected, key=transfer_order):  # a v4 part lands before the shard it describes
            if present.get(rel) == expected[rel]:
                continue
            mine = [url for rank, url in holders[rel] if rank == writer and url != own_url]
            if mine:
                transfers.append((rel, writer, writer, mine[0]))
            else:
                source, url = min(holders[rel])
                transfers.append((rel, writer, source, url))
    return transfers, []
