"""Format v5 on node-local storage: every group table on the disk of every node whose ranks it lists.

A v5 group's leader writes its group table into the root it writes to (group_summaries.py). On a node-local fast
tier (`{node_rank}` roots) that root is its node's disk, which no other node reads: the group's ranks on other nodes
would have no table listing their parts, so neither they nor those nodes' peer copies could resume it without the
durable tier. Here each saver learns once, when it is made, which root each rank writes to (collective
"node-roots": 16 characters a rank); at each save the leader sends its table's bytes to one rank on each other
root its group spans (its lowest there), which writes it there before the leader reports to rank 0.

Groups stay the writer's usual ones (groups.writer_group_size), so the manifest, rank 0's commit and the messages
it hears are those of a shared root at every scale; a group spans ~size / ranks-per-node nodes (46 at 131,072 ranks
of 8 a node), and its leader sends that many small copies (~50 bytes a rank each). A peer copy of a node's files
carries the tables it holds along (engine/tiers/peers.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..collectives import all_gather_objects
from ..format.checksum import checksum
from ..storage.fsio import Location


def node_roots(root: Location, group: Any) -> tuple[str, ...]:
    """Collective "node-roots", once per saver: each rank's root, as a checksum of its URL (ranks writing to one
    node root share it), in rank order."""
    return tuple(all_gather_objects("node-roots", checksum(root.url.encode()), group))


def table_copiers(roots: Sequence[str], ranks: Sequence[int], leader: int) -> list[int]:
    """The ranks of a group (`ranks`, led by `leader`) that write a copy of its table: the lowest on each root the
    group spans other than its leader's, in rank order."""
    return sorted(rank for root, rank in table_holders(roots, ranks).items() if root != roots[leader])


def table_holders(roots: Sequence[str], ranks: Sequence[int]) -> dict[str, int]:
    """{root: the group's lowest rank on it}: on each root a group spans, the rank whose view holds its table (the
    leader's copy or one written by table_copiers's rank): who sends it on to the root's peers."""
    first: dict[str, int] = {}
    for rank in ranks:
        first.setdefault(roots[rank], rank)
    return first
