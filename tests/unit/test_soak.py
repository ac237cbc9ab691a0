"""A short soak (benchmarks/soak.py): 30 async checkpoints, 10% failing at random points, keep_last=3."""

from __future__ import annotations

import importlib.util
import pickle
import sys
from pathlib import Path

import pytest

from tests.helpers.faults import PRE_COMMIT_POINTS, RandomFailures

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20


def load_soak():
    """benchmarks/soak.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("shardckpt_benchmark_soak", REPO / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


soak = load_soak()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return soak.run_soak(
        soak.SoakConfig(checkpoints=30, failure_rate=0.1, keep_last=3, seed=0),
        str(tmp_path_factory.mktemp("soak") / "root"),
    )


def test_counters_add_up_and_every_injected_failure_is_counted_once(report):
    counters = report["checks"]["counters"]
    assert counters["attempted"] == 30 and counters["skipped"] == 0
    assert counters["committed"] + counters["failed"] == 30
    assert counters["failed"] == counters["injected"] == 3
    assert set(report["failure_points"]) <= set(PRE_COMMIT_POINTS)


def test_exactly_the_last_three_committed_steps_are_on_storage_and_verify(report):
    retention, verify = report["checks"]["retention"], report["checks"]["verify"]
    assert retention["on_storage"] == retention["expected"] and len(retention["expected"]) == 3, retention
    assert verify["ok"] and verify["verified"] == verify["committed"] == 3, verify["problems"]
    assert verify["latest_loaded_step"] == retention["expected"][-1]


def test_gc_leaves_no_old_orphan_and_with_grace_zero_no_uncommitted_directory_at_all(report):
    check = report["checks"]["gc"]
    assert check["removed_with_grace"] == 0 and check["kept_younger_than_grace"] == 3  # failures of seconds ago
    assert check["older_than_grace_left"] == [] and check["uncommitted_left"] == []
    assert check["removed_with_grace_0"] == 3 and check["ok"]


def test_host_memory_stays_flat_from_checkpoint_10_to_30(report):
    memory = report["checks"]["memory"]
    # keeping one state per checkpoint would add 20 states; the bound is a small fraction of that
    assert memory["bound"] < memory["leak_of_one_state_per_checkpoint"] / 2
    assert memory["rss_growth"] < memory["bound"], f"RSS grew {memory['rss_growth'] / MIB:.1f} MiB"
    assert memory["peak_growth"] < memory["bound"], f"peak RSS grew {memory['peak_growth'] / MIB:.1f} MiB"
    assert report["ok"], soak.render(report)


def test_random_failures_are_seeded_exact_and_picklable():
    hook = pickle.loads(pickle.dumps(RandomFailures(0.1, seed=4, saves=50)))
    failed = []
    for save in range(60):
        try:
            for point in (
                "before_write",
                "mid_shard",
                "after_write",
                "before_receipt",
                "before_metadata",
                "before_manifest",
                "after_manifest",
            ):
                hook(point)
        except OSError as err:
            failed.append(save)
            assert "injected storage failure" in str(err)
    assert len(failed) == 5 and max(failed) < 50
    assert [index for index, _ in hook.injected] == failed
    again = RandomFailures(0.1, seed=4, saves=50)
    assert again._doomed == set(failed)
