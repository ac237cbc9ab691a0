"""Format v5 on node-local storage: writer groups that never straddle two nodes.

A v5 group's leader writes its group table into the root it writes to (group_summaries.py). On a node-local
fast tier (`{node_rank}` roots) that root is its node's disk, which no other node reads: a group whose ranks sat
on two nodes would leave the other node's ranks without the table that lists their parts, so neither they nor
that node's peer copies could resume it without the durable tier. Here each saver learns once, when it is made,
how many consecutive ranks share each node root, and the writer keeps every group inside one node: a group's
table then lands on the disk of every rank it lists, and a peer copy of that node's files carries it along
(engine/tiers/peers.py). The manifest and rank 0's commit stay O(groups), as for a shared root.
"""

from __future__ import annotations

import math

from ..collectives import all_gather_objects
from ..format.checksum import checksum
from ..storage.fsio import Location


def ranks_per_node(root: Location, group: object) -> int:
    """Collective "node-roots", once per saver: the largest number of consecutive ranks every run of ranks sharing a
    node root is a multiple of (1 when the roots interleave); groups of a divisor of it stay inside one node.
    Each rank sends 16 characters (its root's checksum), not its URL."""
    roots = all_gather_objects("node-roots", checksum(root.url.encode()), group)
    runs, length = [], 1
    for before, here in zip(roots, roots[1:]):
        if here == before:
            length += 1
        else:
            runs.append(length)
            length = 1
    runs.append(length)
    return math.gcd(*runs)


def group_size_within(size: int, node_ranks: int | None) -> int:
    """The largest group of at most `size` ranks whose groups (rank // group) each stay inside one node of
    `node_ranks` consecutive ranks: the largest divisor of `node_ranks` not above `size` (1 when unknown)."""
    if not node_ranks or node_ranks < 1:
        return 1
    return max(d for d in range(1, min(size, node_ranks) + 1) if node_ranks % d == 0)
