"""Format v5's two-step gather: members to their group's leader, leaders to rank 0 (FORMAT.md §10.5).

In v4 rank 0 receives and unpickles every rank's PartSummary (~177 bytes a rank; half of its 0.16 s commit
at 16,384 ranks) and writes a per-rank table into the manifest. Here each group's leader (its highest rank,
groups.group_leader) receives its members' summaries, checks them as rank 0 does in v4
(part_summary.summary_problems, over its own ranks only), writes the group table `__g<g>.parts.json`, and sends
rank 0 one GroupSummary: the table's entry for the manifest, the sums a manifest records, and problems. Rank 0
leads no group and hears ranks / size leaders; a leader hears size - 1 members (both ~sqrt(world) beyond 16,384
ranks: groups.writer_group_size).

Point-to-point messages over the dedicated checkpoint group, not sub-groups: torch's new_group is collective
over every rank and would have to be made once per saver; and gather_object over the whole group would make
every rank send (torch 2.13's gather_object all-gathers the sizes and pads each rank's bytes to the largest).
A world of one group gathers as v4 does: no extra collective (the writer writes v4 there: persist._group_size).
A node-local save also writes each table on every other node root its group spans (copy_table, node_groups.py).
Every rank reaches every step whatever failed on it: errors travel in the summaries.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..collectives import gather_to, gather_to_coordinator, rank_and_world
from ..format import groups, part_references
from ..format.names import join
from ..storage import fsio
from . import node_groups
from .part_summary import PartSummary, PickledAsValues, summary_problems
from .save_layout import SaveLayout

log = logging.getLogger(__name__)

MAX_GROUP_PROBLEMS = 5  # a leader names this many of its group's problems, then counts the rest


@dataclass
class GroupSummary(PickledAsValues):
    """What a leader tells rank 0 about its group of one save (all rank 0 hears of it)."""

    group: int
    layout_digest: str
    problems: list[str] = field(default_factory=list)
    entry: dict[str, Any] | None = None  # groups.group_entry of its written table
    chunks: int = 0
    bytes_total: int = 0
    verified_chunks: int = 0
    verified_bytes: int = 0
    nonfinite: list[str] = field(default_factory=list)
    slowest: dict[str, Any] | None = None  # its slowest writer's {rank, bytes, write_s, write_gbps}
    parts: list[tuple[int, dict[str, Any] | None]] | None = None  # (rank, part): only when rank 0 writes .metadata
    referenced: list[dict[str, Any]] = field(default_factory=list)  # incremental: its ranks' references table


def gather_groups(
    summary: PartSummary,
    layout: SaveLayout,
    size: int,
    *,
    fs: Any,
    directory: str,
    checkpoint_id: str,
    verify_mode: str,
    pg: Any,
    digest: str | None = None,
    node_roots: Sequence[str] | None = None,
) -> list[GroupSummary | None] | None:
    """Rank 0: every group's summary, in group order; other ranks: None. A leader writes its group's table
    (`digest`, signing on: with its ranks' part digests, and its own digest in its summary for the manifest).
    `node_roots` (node-local saves, node_groups.py): each rank's root; the table is also written on every other root
    its group spans, before the leader reports to rank 0."""
    rank, world = rank_and_world(pg)
    count = groups.group_count(world, size)
    group = rank // size
    ranks = groups.group_ranks(group, size, world)
    # collective "part-summaries": one group, as v4 (a gather); several: point to point, members to their leader
    if count == 1:
        members = gather_to_coordinator("part-summaries", summary, pg)
    else:
        members = gather_to("part-summaries", summary, groups.group_leader(group, size, world), ranks, pg)
    own = None
    table: list[bytes] = []
    if members is not None:
        try:
            own = lead_group(
                members, layout, group, size, world, fs, directory, checkpoint_id, verify_mode, digest, table
            )
        except Exception as err:  # reported to rank 0, which refuses the commit, naming it
            log.error("rank %d: leading group %d of %s failed: %s", rank, group, directory, err)
            own = GroupSummary(
                group, layout.digest, [f"group {group} (leader rank {rank}): {type(err).__name__}: {err}"]
            )
    if node_roots is not None:
        # a group of one gathers as v4, at rank 0, which then leads it
        leader = 0 if count == 1 else groups.group_leader(group, size, world)
        problems = copy_table(table[0] if table else None, group, ranks, leader, node_roots, fs, directory, pg)
        if own is not None and problems:
            own.problems.extend(problems)
    if count == 1:
        return [own] if own is not None else None
    # collective "group-summaries": the leaders to rank 0, point to point. Rank 0 leads no group unless its group
    # is itself alone (size 1): then its own summary comes first, else its place in the gather is dropped
    leaders = [groups.group_leader(g, size, world) for g in range(count)]
    heard = gather_to("group-summaries", own, 0, leaders if leaders[0] == 0 else [0, *leaders], pg)
    if heard is None or leaders[0] == 0:
        return heard
    return heard[1:]


def copy_table(
    data: bytes | None,
    group: int,
    ranks: Sequence[int],
    leader: int,
    node_roots: Sequence[str],
    fs: Any,
    directory: str,
    pg: Any,
) -> list[str]:
    """Point-to-point collective "group-table-copies" (node-local saves): the leader sends its table's bytes (`data`;
    None: it wrote none) to one rank on each other root its group spans (node_groups.table_copiers), which writes it
    there and answers with its problem or None. The leader returns the problems; every other rank []."""
    import torch.distributed as dist

    from ..collectives import is_distributed

    rank = rank_and_world(pg)[0]
    copiers = node_groups.table_copiers(node_roots, ranks, leader)
    if not copiers or not is_distributed() or (rank != leader and rank not in copiers):
        return []
    log.debug("collective group-table-copies: group %d, leader %d, %d copies", group, leader, len(copiers))
    if rank == leader:
        for copier in copiers:
            dist.send_object_list([data], group_dst=copier, group=pg)
        answers: list[Any] = []
        for copier in copiers:
            answer: list[Any] = [None]
            dist.recv_object_list(answer, group_src=copier, group=pg)
            answers.append(answer[0])
        return [problem for problem in answers if problem]
    received: list[Any] = [None]
    dist.recv_object_list(received, group_src=leader, group=pg)
    problem = None
    if received[0] is not None:
        try:
            fsio.write_new_file(fs, join(directory, groups.group_filename(group)), received[0])
        except Exception as err:  # noqa: BLE001 - the leader reports it: rank 0 refuses the commit, naming it
            problem = (
                f"group {group}: rank {rank} could not write its copy of the group table: {type(err).__name__}: {err}"
            )
    dist.send_object_list([problem], group_dst=leader, group=pg)
    return []


def lead_group(
    members: list[PartSummary | None],
    layout: SaveLayout,
    group: int,
    size: int,
    world: int,
    fs: Any,
    directory: str,
    checkpoint_id: str,
    verify_mode: str,
    digest: str | None = None,
    table: list[bytes] | None = None,
) -> GroupSummary:
    """A leader's work: check its members' summaries as v4's rank 0 checks every rank's, write the group table,
    sum up what rank 0 needs. Problems are in the summary, not raised (storage errors are). `table`: the written
    table's bytes are appended to it (for its copies on other nodes)."""
    own = GroupSummary(group, layout.digest)
    own.problems = summary_problems(members, layout, verify_mode, groups.group_ranks(group, size, world))
    if len(own.problems) > MAX_GROUP_PROBLEMS:
        own.problems = own.problems[:MAX_GROUP_PROBLEMS] + [
            f"(and {len(own.problems) - MAX_GROUP_PROBLEMS} more in group {group})"
        ]
    if not own.problems:  # so every member sent its summary (a missing one is a problem above)
        data = _write_table(
            own, [s for s in members if s is not None], size, world, fs, directory, checkpoint_id, digest
        )
        if table is not None:
            table.append(data)
    return own


def _write_table(
    own: GroupSummary,
    members: list[PartSummary],
    size: int,
    world: int,
    fs: Any,
    directory: str,
    checkpoint_id: str,
    digest: str | None = None,
) -> bytes:
    written = [s for s in members if s.file_bytes is not None]
    if digest is not None and any(s.part_digest is None for s in written):
        missing = next(s.rank for s in written if s.part_digest is None)
        raise ValueError(f"rank {missing} sent no digest of its part, which a signed group table records")
    table = groups.build_group_table(
        checkpoint_id,
        own.group,
        size,
        world,
        {
            s.rank: {
                "file_bytes": s.file_bytes,
                "file_checksum": s.file_checksum,
                "part_bytes": s.part_bytes,
                "part_checksum": s.part_checksum,
                "part_digest": s.part_digest,
            }
            for s in written
        },
        part_digests=digest is not None,
    )
    data = groups.to_bytes(table)
    fsio.write_new_file(fs, join(directory, groups.group_filename(own.group)), data)
    own.entry = groups.group_entry(table, data, digest)
    own.chunks = sum(s.chunks for s in members)
    own.bytes_total = sum(s.bytes_total for s in members)
    own.verified_chunks = sum(s.verified_chunks for s in members)
    own.verified_bytes = sum(s.verified_bytes for s in members)
    own.nonfinite = sorted({fqn for s in members for fqn in s.nonfinite})
    own.referenced = part_references.references_table(entry for s in members for entry in s.referenced)
    timed = [(s.file_bytes / s.write_s, s) for s in written if s.write_s and s.file_bytes is not None]
    if timed:
        rate, slowest = min(timed, key=lambda pair: pair[0])
        own.slowest = {
            "rank": slowest.rank,
            "bytes": slowest.file_bytes,
            "write_s": slowest.write_s,
            "write_gbps": rate / 1e9,
        }
    if any(s.part is not None for s in written):
        own.parts = [(s.rank, s.part) for s in written]
    return data
