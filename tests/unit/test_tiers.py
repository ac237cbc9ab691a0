"""Tiers in one process: config validation, the verified copy, which tier a resume picks, fast-tier retention."""

from __future__ import annotations

import json
import os
import shutil
import time
from types import SimpleNamespace

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, ConfigError, SaveConfig, ShardedCheckpoint
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format.names import checkpoint_dirname, new_checkpoint_id
from lightning_shardckpt.engine.metrics import CheckpointRecord
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.engine.tiers.config import TierConfig, TiersConfig, tiers_config_from
from lightning_shardckpt.engine.tiers.replicate import REPLICATED_FROM, Replicator
from lightning_shardckpt.engine.tiers.restore import choose
from lightning_shardckpt.engine.tiers.verified_copy import copy_verified
from lightning_shardckpt.errors import CorruptCheckpoint
from lightning_shardckpt.policies.tiers.checkpoint_tiers import CheckpointTiers


# --- configuration ---
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"fast": {"dirpath": ""}}, "dirpath='' is empty"),
        ({"fast": {"dirpath": "/x"}, "durable": {"dirpath": "s3://b/r/{node_rank}"}}, "durable tier must be one place"),
        ({"fast": {"dirpath": "/x/{host}"}}, "placeholder other than {node_rank}"),
        (
            {"fast": {"dirpath": "/x"}, "durable": {"dirpath": "s3://b/r", "every_n_checkpoints": 0}},
            "every_n_checkpoints=0",
        ),
        (
            {
                "fast": {"dirpath": "/x"},
                "durable": {"dirpath": "s3://b/r", "every_n_checkpoints": 2, "every_minutes": 5},
            },
            "not both",
        ),
        ({"fast": {"dirpath": "/x", "keep_last": 0}}, "keep_last=0 would delete"),
        ({"fast": {"dirpath": "/x", "every_minutes": 3}}, "the fast tier receives every save"),
        ({"fast": {"dirpath": "/x"}, "durable": {"dirpath": "/x"}}, "give the durable tier its own root"),
        ({"fast": {"dirpath": "/x"}, "flush_timeout_s": -1}, "flush_timeout_s=-1"),
        ({"fast": {"dirpath": "/x", "colour": 1}}, r"unknown tiers.fast option\(s\) \['colour'\]"),
        ({"fast": {"dirpath": "/x"}, "slow": {}}, r"unknown tiers option\(s\) \['slow'\]"),
    ],
)
def test_tier_config_rejects_nonsense_naming_the_option_and_fix(options, message):
    with pytest.raises(ConfigError, match=message):
        tiers_config_from(options)


def test_tiers_config_from_hydra_dict_templates_the_node_rank():
    config = tiers_config_from(
        {
            "fast": {"dirpath": "/local/ckpt/node{node_rank}", "keep_last": 2},
            "durable": {"dirpath": "s3://b/run", "every_n_checkpoints": 3, "storage_options": {"anon": False}},
        }
    )
    assert config.fast.node_local and not config.durable.node_local
    assert config.fast.dirpath_for(3) == "/local/ckpt/node3"
    assert tiers_config_from(None) is None and tiers_config_from({"fast": None}) is None  # the `single` preset


def test_callback_takes_its_root_from_the_fast_tier_and_refuses_a_second_one():
    callback = ShardedCheckpoint(
        tiers={"fast": {"dirpath": "/tmp/fast{node_rank}"}, "durable": {"dirpath": "/tmp/durable"}}
    )
    assert callback.dirpath == "/tmp/fast{node_rank}"
    with pytest.raises(ConfigError, match="leave dirpath unset"):
        ShardedCheckpoint("/elsewhere", tiers={"fast": {"dirpath": "/tmp/fast"}})


# --- the verified copy ---
def _commit(root: str, step: int, value: float = 1.0, run_id: str | None = None) -> str:
    saver = CheckpointSaver(
        root, SaveConfig(async_save=False, write_events=False, run_id=run_id, allow_shared_root=True)
    )
    result = saver.save({"w": torch.full((2**16,), value), "meta": {"step": step}}, step=step).result(timeout=60)
    saver.close()
    assert result.committed, result.error
    return result.path.rsplit("/", 1)[-1]


def test_copy_verification_catches_a_flipped_byte(tmp_path):
    name = _commit(str(tmp_path / "fast"), 1)
    src = tmp_path / "fast" / name
    manifest = json.loads((src / "manifest.json").read_text())
    fs = fsio.resolve(str(tmp_path)).fs
    os.makedirs(tmp_path / "ok")
    assert (
        copy_verified(fs, str(src), fs, str(tmp_path / "ok"), "__0_0.distcp", manifest, piece_bytes=4096)
        == (src / "__0_0.distcp").stat().st_size
    )
    data = bytearray((src / "__0_0.distcp").read_bytes())
    data[-100] ^= 0x01
    (src / "__0_0.distcp").write_bytes(bytes(data))
    os.makedirs(tmp_path / "bad")
    with pytest.raises(CorruptCheckpoint, match="the fast-tier copy is damaged"):
        copy_verified(fs, str(src), fs, str(tmp_path / "bad"), "__0_0.distcp", manifest, piece_bytes=4096)
    assert os.listdir(tmp_path / "bad") == []  # no damaged bytes left under the name (its first pieces were written)
    with pytest.raises(CorruptCheckpoint, match="not listed in the manifest"):
        copy_verified(fs, str(src), fs, str(tmp_path / "bad"), "__9_0.distcp", manifest)


def _replicate(fast: str, durable: str, names: list[str]) -> None:
    config = TiersConfig(fast=TierConfig(dirpath=fast), durable=TierConfig(dirpath=durable))
    replicator = Replicator(config, fsio.resolve(fast), fsio.resolve(durable), group=None)
    for name in names:
        replicator.submit(name)
        assert replicator.flush(30)
    replicator.close(5)


# --- which tier a resume reads ---
def test_restore_prefers_the_fast_tier_at_equal_checkpoint_and_the_newer_one_otherwise(tmp_path):
    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    first = _commit(fast, 1)
    _replicate(fast, durable, [first])
    choices = choose(fsio.resolve(fast), fsio.resolve(durable), "latest", None)
    assert [(c.tier, c.name) for c in choices[:2]] == [("fast", first), ("durable", first)]
    assert "fast tier wins at a tie" in choices[0].reason
    manifest = json.loads((tmp_path / "durable" / first / "manifest.json").read_text())
    assert manifest[REPLICATED_FROM]["tier"] == "fast" and manifest["id"] == first.rsplit("-", 1)[-1]
    second = _commit(fast, 2)  # not replicated yet: the fast tier is newer
    assert choose(fsio.resolve(fast), fsio.resolve(durable), "latest", None)[0].name == second


def test_restore_skips_a_fast_copy_this_rank_cannot_read_completely(tmp_path):
    """A node-local fast tier on another node: the manifest is there, a shard is not (or not whole)."""
    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    first = _commit(fast, 1)
    _replicate(fast, durable, [first])
    second = _commit(fast, 2)
    _replicate(fast, durable, [second])
    os.remove(tmp_path / "fast" / second / "__0_0.distcp")
    choices = choose(fsio.resolve(fast), fsio.resolve(durable), "latest", None)
    assert (choices[0].tier, choices[0].name) == ("durable", second)
    assert "not readable by every rank" in choices[0].reason
    assert choose(fsio.resolve(str(tmp_path / "nothing")), None, "latest", None) == []


# --- fast-tier retention ---
def test_fast_retention_spares_unreplicated_checkpoints_up_to_max_unreplicated_then_counts_drops(tmp_path):
    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    run = "run-a"
    names = [_commit(fast, step, run_id=run) for step in range(1, 7)]
    config = TiersConfig(
        fast=TierConfig(dirpath=fast, keep_last=1, max_unreplicated=2), durable=TierConfig(dirpath=durable)
    )
    tiers = CheckpointTiers(config, node_rank=0, local_rank=0)
    tiers.replicator = SimpleNamespace(newest_durable=names[1], snapshot=lambda: {})  # steps 1-2 are durable
    spare = tiers.fast_spare(keep_last=1, run_id=run)
    # unreplicated: steps 3-6; keep_last keeps 6; of 3-5 the newest two are spared, step 3 is dropped and counted
    assert spare == {names[3], names[4]}
    assert tiers.counters()["unreplicated_dropped"] == 1
    tiers.replicator = SimpleNamespace(newest_durable=names[5], snapshot=lambda: {})
    assert tiers.fast_spare(keep_last=1, run_id=run) == set()  # all replicated: plain keep_last
    assert [e.step for e in catalog.list_checkpoints(fsio.resolve(fast)) if e.committed] == [1, 2, 3, 4, 5, 6]


def test_a_node_other_than_0_prunes_its_shard_directories_by_commit_order_not_by_step(tmp_path):
    """After a rollback (resume from step 4 while 6-10 exist) the new branch's shards are the newest to keep."""
    config = TiersConfig(fast=TierConfig(dirpath=str(tmp_path / "node{node_rank}"), keep_last=1, max_unreplicated=0))
    tiers = CheckpointTiers(config, node_rank=1, local_rank=0)  # keeps keep_last + max_unreplicated + 1 = 2
    node = tmp_path / "node1"

    def shards(step: int, written_at: float) -> str:  # what node 1 holds of a checkpoint: its own shard file only
        name = checkpoint_dirname(step, new_checkpoint_id())
        (node / name).mkdir(parents=True)
        (node / name / "__1_0.distcp").write_bytes(b"shard")
        os.utime(node / name, (written_at, written_at))
        return name

    # an earlier process wrote steps 2..10 (an hour ago, in order); node 0's retention kept them all so far
    earlier = [shards(step, time.time() - 3600 + step) for step in (2, 4, 6, 8, 10)]
    branch = []
    for step in (6, 8):  # this process resumed from step 4: the new branch commits 6 and 8 again
        branch.append(shards(step, time.time()))
        tiers.prune_node_local(CheckpointRecord(step=step, rank=1, outcome="committed", path=str(node / branch[-1])))
    # the two newest commits are the new branch's; the abandoned branch's higher steps (8, 10) are gone
    assert sorted(os.listdir(node)) == sorted(branch), (earlier, branch)


def test_ls_shows_both_tiers_side_by_side_and_which_copy_latest_resumes(tmp_path, run_cli):

    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    first = _commit(fast, 1)
    _replicate(fast, durable, [first])
    second = _commit(fast, 2)
    code, out, _ = run_cli("ls", fast, "--durable", durable)
    assert code == 0
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert lines["1"][2:4] == ["committed", "committed"] and lines["2"][2:4] == ["committed", "-"]
    assert lines["2"][5] == "fast" and f"resumes the fast copy of {second}" in out
    code, out, _ = run_cli("ls", fast, "--durable", durable, "--json")
    assert code == 0
    document = json.loads(out)
    assert [(r["step"], r["fast"], r["durable"]) for r in document["checkpoints"]] == [
        (1, "committed", "committed"),
        (2, "committed", None),
    ]


def test_replicator_copies_every_nth_commit_and_the_newest_at_close(tmp_path):
    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    config = TiersConfig(fast=TierConfig(dirpath=fast), durable=TierConfig(dirpath=durable, every_n_checkpoints=2))
    replicator = Replicator(config, fsio.resolve(fast), fsio.resolve(durable), group=None)
    names = []
    for step in range(1, 6):
        names.append(_commit(fast, step, run_id="run-b"))
        replicator.submit(names[-1])
        deadline = time.monotonic() + 30
        while replicator.pending and time.monotonic() < deadline:
            time.sleep(0.01)
    on_durable = [e.step for e in catalog.list_checkpoints(fsio.resolve(durable)) if e.committed]
    assert on_durable == [2, 4]  # every 2nd
    assert replicator.snapshot()["replication_lag_checkpoints"] >= 1  # step 5 waits for its turn
    assert replicator.close(30)  # fit end / preemption: the newest is copied whatever the cadence
    assert [e.step for e in catalog.list_checkpoints(fsio.resolve(durable)) if e.committed] == [2, 4, 5]


def test_replicator_with_every_minutes_copies_the_newest_once_the_interval_passed(tmp_path):
    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    config = TiersConfig(fast=TierConfig(dirpath=fast), durable=TierConfig(dirpath=durable, every_minutes=0.05))  # 3 s
    replicator = Replicator(config, fsio.resolve(fast), fsio.resolve(durable), group=None)

    def commit_and_wait(step: int) -> None:
        replicator.submit(_commit(fast, step, run_id="run-m"))
        deadline = time.monotonic() + 30
        while replicator.pending and time.monotonic() < deadline:
            time.sleep(0.01)

    def on_durable() -> list[int]:
        return [e.step for e in catalog.list_checkpoints(fsio.resolve(durable)) if e.committed]

    commit_and_wait(1)
    assert on_durable() == []  # within 3 s of the start: waits
    time.sleep(3.2)
    commit_and_wait(2)
    assert on_durable() == [2]  # the interval passed: the newest is copied (step 1 is passed over)
    commit_and_wait(3)
    assert on_durable() == [2]  # the interval restarts at the copy
    assert replicator.close(30)
    assert on_durable() == [2, 3]  # close copies the newest whatever the interval


def test_each_copy_attempt_is_an_event_health_rules_observe(tmp_path):
    from lightning_shardckpt.engine.metrics import read_events
    from lightning_shardckpt.policies.health.observe import observe
    from lightning_shardckpt.policies.health.rules import health_config_from

    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    _replicate(fast, durable, [_commit(fast, 1)])
    events = [e for e in read_events(fast) if e.get("event") == "replication"]
    assert [(e["outcome"], e["step"], e["lag_checkpoints"]) for e in events] == [("committed", 1, 0)]
    seen = {(o.metric, o.value) for o in observe(events[0]) if o.slice == "run"}
    assert seen == {("replication_ok", 1.0), ("replication_lag_checkpoints", 0.0)}
    rule = {
        "name": "replication-behind",
        "metric": "replication_lag_checkpoints",
        "owner": "infra",
        "range": {"kind": "static", "max": 3},
    }
    assert health_config_from([rule]).rules[0].metric == "replication_lag_checkpoints"  # a rule may watch it


# --- degraded mode: one lineage across the tiers ---
def test_degraded_saves_continue_the_runs_seq_and_an_older_fast_copy_never_supersedes_them(tmp_path):
    """The fast tier fills at step 6 while step 5 waits for its copy (every 3rd): step 7 commits on the durable
    tier (degraded mode), then the close owes step 5. Step 7's seq continues the fast tier's (so the run's commit
    order is one across the tiers), and step 5 is not copied over it: it would be the durable `latest`, and the
    durable keep_last=1 would delete step 7."""
    from lightning_shardckpt import Checkpointer, list_checkpoints, load_checkpoint
    from tests.helpers.quota_fs import quota_options, quota_url, used_bytes

    def state(step: int) -> dict:
        return {"w": torch.full((2**14,), float(step))}

    probe = tmp_path / "probe"
    with Checkpointer(str(probe), save={"async_save": False}) as sizing:
        sizing.save(1, state(1), blocking=True)
    disk, durable = tmp_path / "disk", str(tmp_path / "durable")
    disk.mkdir()
    tiers = {  # room for five checkpoints on the fast tier, not six
        "fast": {
            "dirpath": quota_url(disk / "fast"),
            "storage_options": quota_options(disk, used_bytes(probe) * 11 // 2),
        },
        "durable": {"dirpath": durable, "every_n_checkpoints": 3, "keep_last": 1},
    }
    checkpointer = Checkpointer(None, tiers=tiers, save={"async_save": False})
    committed = [checkpointer.save(step, state(step), blocking=True).result().committed for step in range(1, 8)]
    checkpointer.close()
    assert committed == [True] * 5 + [False, True]  # step 6 found the fast tier full; step 7 went to the durable tier
    fast = catalog.committed_of_run(catalog.list_checkpoints(fsio.resolve(str(disk / "fast"))), checkpointer.run_id)
    on_durable = catalog.committed_of_run(catalog.list_checkpoints(fsio.resolve(durable)), checkpointer.run_id)
    assert [e.step for e in fast] == [1, 2, 3, 4, 5]
    assert on_durable[-1].step == 7 and on_durable[-1].seq > fast[-1].seq  # seq monotonic across the tiers
    assert 5 not in [e.step for e in on_durable]  # superseded, counted
    assert checkpointer.plugins.counters()["replication_superseded"] == 1
    assert list_checkpoints(durable).latest.step == 7
    restored = state(0)
    load_checkpoint(restored, durable)
    assert restored["w"][0].item() == 7.0
    with Checkpointer(None, tiers=tiers, save={"async_save": False}) as restart:  # the next run resumes step 7
        at_restart = state(0)
        assert restart.load(at_restart) == 7 and at_restart["w"][0].item() == 7.0


def test_a_resume_from_a_fast_tier_on_other_storage_names_the_fast_tier(tmp_path, caplog):
    """The fast tier is a filesystem that needs options of its own (a quota'd node-local disk) and the durable tier
    is plain disk: the resume picks the fast tier's newest checkpoint and says which tier it read. Asking whether
    that path belongs to the durable tier must not open it with the durable tier's options (it raised TypeError)."""
    from lightning_shardckpt import Checkpointer
    from tests.helpers.quota_fs import quota_options, quota_url

    disk = tmp_path / "disk"
    disk.mkdir()
    tiers = {
        "fast": {"dirpath": quota_url(disk / "fast"), "storage_options": quota_options(disk, 10**8)},
        "durable": {"dirpath": str(tmp_path / "durable"), "every_n_checkpoints": 3},
    }
    with Checkpointer(None, tiers=tiers, save={"async_save": False}) as first:
        for step in (1, 2):  # neither is copied yet (every 3rd checkpoint)
            first.save(step, {"w": torch.full((64,), float(step))}, blocking=True)
    with Checkpointer(None, tiers=tiers, save={"async_save": False}) as restart, caplog.at_level("INFO"):
        state = {"w": torch.zeros(64)}
        assert restart.load(state) == 2 and state["w"][0].item() == 2.0
    assert any("fast tier" in r.getMessage() and "resumed from quota://" in r.getMessage() for r in caplog.records)


def test_a_run_back_on_the_fast_tier_continues_the_seq_the_durable_tier_reached(tmp_path):
    """A run resumed from a durable commit newer than anything on the fast tier (degraded mode saved it, or the
    fast tier was wiped) saves on the fast tier again: its commits continue the durable tier's seq, so their
    copies are newer there (not left out as superseded) and the run has one commit order."""
    from lightning_shardckpt import Checkpointer

    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    tiers = {"fast": {"dirpath": fast}, "durable": {"dirpath": durable}}
    with Checkpointer(None, tiers=tiers, save={"async_save": False}) as first:
        for step in (1, 2, 3):
            first.save(step, {"w": torch.full((64,), float(step))}, blocking=True)
    shutil.rmtree(fast)  # the fast tier is lost (a replaced node's disk): the durable tier holds seqs 1-3
    with Checkpointer(None, tiers=tiers, save={"async_save": False}) as second:
        state = {"w": torch.zeros(64)}
        assert second.load(state) == 3
        second.save(4, {"w": torch.full((64,), 4.0)}, blocking=True)
    on_fast = [e for e in catalog.list_checkpoints(fsio.resolve(fast)) if e.committed]
    on_durable = [e for e in catalog.list_checkpoints(fsio.resolve(durable)) if e.committed]
    assert [(e.step, e.seq) for e in on_fast] == [(4, 4)]
    assert [(e.step, e.seq) for e in on_durable] == [(1, 1), (2, 2), (3, 3), (4, 4)]  # copied, newest
    assert second.plugins.counters().get("replication_superseded", 0) == 0
