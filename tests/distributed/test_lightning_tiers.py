"""A Lightning run with a fast tier and a durable tier (loopback S3) on 2 ranks; resumes pick the right tier."""

from __future__ import annotations

import os

import pytest

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from tests.helpers import training_state as ts
from tests.helpers.spawn import run_ranks
from tests.helpers.tiers_ranks import fit_tiers_on_rank

pytestmark = pytest.mark.timeout(400)


def test_lightning_run_replicates_to_s3_and_resume_picks_the_right_tier(tmp_path, s3_root):
    fast = str(tmp_path / "fast")
    options = {
        "fast": {"dirpath": fast, "keep_last": 2},
        "durable": {"dirpath": s3_root.url, "storage_options": s3_root.storage_options, "keep_last": 2},
        "retry_backoff_s": 0.2,
        "retry_backoff_max_s": 1.0,
        "flush_timeout_s": 60,
    }
    saved = run_ranks(fit_tiers_on_rank, 2, options, 6, None, timeout_s=240)
    durable = [e for e in catalog.list_checkpoints(fsio.resolve(s3_root.url, s3_root.storage_options)) if e.committed]
    fast_entries = [e for e in catalog.list_checkpoints(fsio.resolve(fast)) if e.committed]
    # the fit-end flush copied the last checkpoint; each tier applies its own keep_last (the fast tier also
    # keeps what was not yet on the durable tier when its retention ran)
    assert durable[-1].step == 6 and durable[-1].checkpoint_id == fast_entries[-1].checkpoint_id
    assert len(durable) <= 2 and [e.step for e in fast_entries][-2:] == [4, 6]
    assert saved[0].value["counters"].get("replicated", 0) >= 1
    final = saved[0].value["final"]

    # both tiers hold step 6: the fast copy is read (the resumed run saves step 7 at its end, on both tiers)
    resumed = run_ranks(fit_tiers_on_rank, 2, options, 7, "latest", timeout_s=240)
    assert resumed[0].value["loaded_from"] == f"{fast}/{fast_entries[-1].name}"
    ts.assert_bit_exact(final, resumed[0].value["at_start"]["full"])

    # a corrupt fast copy (a flipped byte in a shard): the durable copy of the same checkpoint is read, bit-exact
    newest, final = _newest(fast), resumed[0].value["final"]
    shard = tmp_path / "fast" / newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    resumed = run_ranks(fit_tiers_on_rank, 2, options, 8, "latest", timeout_s=240)
    assert resumed[0].value["loaded_from"] == f"{s3_root.url}/{newest}"
    ts.assert_bit_exact(final, resumed[0].value["at_start"]["full"])

    # a replaced node: the fast tier lost a shard; no rank can read it whole, so 3 ranks read the durable copy
    newest, final = _newest(fast), resumed[0].value["final"]
    os.remove(tmp_path / "fast" / newest / "__0_0.distcp")
    resumed = run_ranks(fit_tiers_on_rank, 3, options, 9, "latest", timeout_s=240)
    assert resumed[0].value["loaded_from"] == f"{s3_root.url}/{newest}"
    ts.assert_bit_exact(final, resumed[0].value["at_start"]["full"])
    assert resumed[0].value["global_step"] == 9


def _newest(root: str) -> str:
    return [e for e in catalog.list_checkpoints(fsio.resolve(root)) if e.committed][-1].name


def test_full_fast_tier_degrades_to_saving_on_the_durable_tier_and_resume_reads_it(tmp_path):
    """A real full disk (quota://, ENOSPC past its budget) under the fast tier: saves go on, to the durable tier."""
    from tests.helpers.quota_fs import quota_options, quota_url

    disk = tmp_path / "small-disk"
    os.makedirs(disk)
    # room for one ~100 KB checkpoint of the tiny model, not two
    options = {
        "fast": {"dirpath": quota_url(disk / "fast"), "storage_options": quota_options(disk, 160_000)},
        "durable": {"dirpath": str(tmp_path / "durable")},
        "retry_backoff_s": 0.2,
        "retry_backoff_max_s": 1.0,
    }
    saved = run_ranks(fit_tiers_on_rank, 2, options, 8, None, timeout_s=240)
    assert [e.step for e in catalog.list_checkpoints(fsio.resolve(str(disk / "fast"))) if e.committed] == [2]
    durable = [e.step for e in catalog.list_checkpoints(fsio.resolve(str(tmp_path / "durable"))) if e.committed]
    # step 4 failed on the full disk (step 6 was requested before that was known, and failed too); step 8 went
    # straight to the durable tier
    assert durable[-1] == 8 and 4 not in durable
    assert saved[0].value["counters"]["degraded_saves"] >= 1
    resumed = run_ranks(fit_tiers_on_rank, 2, options, 9, "latest", timeout_s=240)
    assert resumed[0].value["loaded_from"].startswith(str(tmp_path / "durable"))
    ts.assert_bit_exact(saved[0].value["final"], resumed[0].value["at_start"]["full"])


def test_preemption_saves_on_the_fast_tier_then_flushes_the_copy_to_the_durable_tier(tmp_path):
    options = {
        "fast": {"dirpath": str(tmp_path / "fast")},
        "durable": {"dirpath": str(tmp_path / "durable")},
        "flush_timeout_s": 60,
    }
    # SIGUSR1 at step 3; no periodic save before it (every 100): the preemption save is the only checkpoint
    saved = run_ranks(fit_tiers_on_rank, 2, options, 20, None, 100, 3, timeout_s=240)
    assert saved[0].value["global_step"] == 3
    fast = [e for e in catalog.list_checkpoints(fsio.resolve(str(tmp_path / "fast"))) if e.committed]
    durable = [e for e in catalog.list_checkpoints(fsio.resolve(str(tmp_path / "durable"))) if e.committed]
    assert [e.step for e in fast] == [3]
    assert [(e.checkpoint_id, e.step) for e in durable] == [(fast[0].checkpoint_id, 3)]  # flushed before the job ended


def test_with_tiers_a_corrupt_latest_falls_back_to_the_last_good_of_the_tier_root(tmp_path):
    """fallback_to_last_good with tiers reads the drill records of the tier roots, not of the picked checkpoint."""
    from pathlib import Path

    from lightning_shardckpt.engine.format import drill_records

    fast = str(tmp_path / "fast")
    options = {"fast": {"dirpath": fast}}
    drill = {"every_n_checkpoints": 2, "probe": "tests.helpers.drill_probes:weighted_sum", "timeout_s": 120}
    run_ranks(fit_tiers_on_rank, 2, options, 9, None, 3, None, drill, timeout_s=300)  # commits 3, 6, 9: 6 drilled
    location = fsio.resolve(fast)
    entries = [e for e in catalog.list_checkpoints(location) if e.committed]
    states = drill_records.trust_states(location, entries)
    assert [(e.step, states[e.name]) for e in entries] == [(3, "committed"), (6, "drilled"), (9, "committed")]

    # the newest checkpoint goes bad after its commit (a flipped byte in a shard)
    shard = next(Path(entries[2].path).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    resumed = run_ranks(
        fit_tiers_on_rank, 2, options, 10, "latest", 3, None, {"fallback_to_last_good": True}, timeout_s=240
    )
    assert resumed[0].value["loaded_from"] == f"{fast}/{entries[1].name}"
    assert resumed[0].value["at_start"]["global_step"] == 6


def test_after_a_rollback_node_1_keeps_the_new_branchs_shards_and_drops_the_abandoned_ones(tmp_path):
    """Two simulated nodes (one rank each) with a node-local fast tier: node 1 prunes its shards by commit order."""
    durable = str(tmp_path / "durable")
    options = {
        "fast": {"dirpath": str(tmp_path / "node{node_rank}"), "keep_last": 1, "max_unreplicated": 0},
        "durable": {"dirpath": durable},
        "flush_timeout_s": 60,
    }
    run_ranks(fit_tiers_on_rank, 2, options, 10, None, 2, None, None, 2, timeout_s=240)  # commits 2, 4, ..., 10
    step_4 = next(e for e in catalog.list_checkpoints(fsio.resolve(durable)) if e.step == 4)
    # a rollback: resume from step 4 while 6..10 exist; the new branch commits 6 and 8 again
    resumed = run_ranks(fit_tiers_on_rank, 2, options, 8, step_4.path, 2, None, None, 2, timeout_s=240)
    assert resumed[0].value["at_start"]["global_step"] == 4
    entries = catalog.list_checkpoints(fsio.resolve(durable))
    newest = catalog.committed_of_run(entries, step_4.run_id)[-2:]  # commit order: the new branch's 6 and 8
    assert [e.step for e in newest] == [6, 8]
    # node 1 holds only its own shards; it keeps keep_last + max_unreplicated + 1 = 2 directories, the newest commits
    assert sorted(os.listdir(tmp_path / "node1")) == sorted(e.name for e in newest)
