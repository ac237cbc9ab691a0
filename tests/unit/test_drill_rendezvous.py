"""Drill ranks meet on a port rank 0's listener got from the kernel, never one the starter chose beforehand
(a port found free could be taken by any connection before rank 0 listened: a false failed drill)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from lightning_shardckpt.policies.drills.worker import DrillFailed, rendezvous_store


def test_drill_ranks_meet_at_the_port_rank_0_was_given_and_left_in_the_scratch_directory(tmp_path):
    timeout = timedelta(seconds=30)
    stores: dict[int, object] = {}

    def join(rank: int) -> None:
        stores[rank] = rendezvous_store(str(tmp_path), rank, 3, timeout)

    others = [threading.Thread(target=join, args=(rank,)) for rank in (1, 2)]
    for thread in others:  # the others start first: they wait for rank 0's port file
        thread.start()
    join(0)
    for thread in others:
        thread.join(timeout=30)
    assert sorted(stores) == [0, 1, 2]
    stores[2].set("from rank 2", "seen")  # type: ignore[attr-defined]
    assert stores[0].get("from rank 2") == b"seen"  # type: ignore[attr-defined]
    assert int((tmp_path / "rendezvous.port").read_text()) == stores[0].port  # type: ignore[attr-defined]
    assert not (tmp_path / "rendezvous.port.tmp").exists()


def test_a_drill_rank_whose_rank_0_never_listens_fails_naming_rank_0_within_its_timeout(tmp_path):
    with pytest.raises(DrillFailed, match="drill rank 0 did not open the rendezvous within 0.3 s"):
        rendezvous_store(str(tmp_path), 1, 2, timedelta(seconds=0.3))
