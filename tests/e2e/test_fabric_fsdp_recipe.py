"""The Fabric recipe end to end: recipes/fabric_fsdp.py on 2 CPU ranks started by Fabric itself (it re-runs the
script for rank 1), then resumed from its step-4 checkpoint on 2, 1 and 3 ranks (forked with torchrun's environment).

What we check:
- on the same world size the resumed run ends bit-identical to the uninterrupted one (parameters and optimizer
  state restored exactly, the same samples in the same order);
- on 1 and 3 ranks the parameters right after the load are bit-identical to those saved (resharded), and the
  first resumed steps train on exactly the samples the saved run had not seen yet in its epoch;
- every save committed; the resume that saves into the root it resumed from continues that run (its run id,
  its `latest`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.spawn import fork_launched_ranks, wait_for_ranks

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "fabric_fsdp.py"
DATASET = 40  # the recipe's IndexedData
BATCH = 4
RESUME_WORLDS = (2, 1, 3)

pytestmark = pytest.mark.timeout(300)


def run_recipe(workdir: Path, name: str, devices: int, *extra: str, root: str | None = None) -> Path:
    """One run of the recipe, saving under workdir/ckpt-<root or name>; returns its record directory. The first run
    (no --resume) is started as a user starts it, and Fabric starts its other ranks; a resume's ranks are forked with
    torchrun's environment (Fabric launches nothing then), so none of them re-imports torch and Lightning."""
    record = workdir / f"record-{name}"
    argv = [str(RECIPE), "--root", str(workdir / f"ckpt-{root or name}"), "--devices", str(devices)]
    argv += ["--max-steps", "8", "--save-every", "4", "--record", str(record), *extra]
    if "--resume" not in extra:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for launched in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(launched, None)  # Fabric launches the ranks itself
        done = subprocess.run(
            [sys.executable, *argv], cwd=workdir, env=env, capture_output=True, text=True, timeout=240
        )
        assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return record
    log = workdir / f"{name}.log"
    codes = wait_for_ranks(fork_launched_ranks(argv, devices, workdir, [log] * devices), 240)
    assert codes == [0] * devices, f"{name}: ranks exited {codes}:\n{log.read_text()[-6000:]}"
    return record


def samples(record: Path) -> dict[int, list[int]]:
    return {row["step"]: row["samples"] for row in map(json.loads, (record / "samples.jsonl").read_text().splitlines())}


def params(record: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(record / f"{name}.pt", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fabric")
    records = {"full": run_recipe(workdir, "full", 2)}
    root = fsio.resolve(str(workdir / "ckpt-full"))
    entries = catalog.list_checkpoints(root)
    step4 = next(entry for entry in entries if entry.step == 4 and entry.committed)
    for world in RESUME_WORLDS:
        # the resume on 2 ranks saves into the root it resumed from (a rollback to step 4: it continues that run)
        same_root = "full" if world == 2 else None
        records[world] = run_recipe(workdir, f"resume{world}", world, "--resume", step4.path, root=same_root)
    after = catalog.list_checkpoints(root)
    return {"records": records, "entries": entries, "after": after, "latest": catalog.resolve_latest(root)}


def test_every_save_commits_and_a_resume_into_the_same_root_continues_its_run(runs):
    assert [(entry.step, entry.committed) for entry in runs["entries"]] == [(4, True), (8, True)]
    # the resumed run adopted the root's run id (the owner check let it in) and its step 8 is now `latest`
    assert [(entry.step, entry.committed) for entry in runs["after"]] == [(4, True), (8, True), (8, True)]
    assert len({entry.run_id for entry in runs["after"]}) == 1
    first_eight = next(entry for entry in runs["entries"] if entry.step == 8)
    assert runs["latest"].step == 8 and runs["latest"].name != first_eight.name


def test_resume_on_the_same_world_size_ends_bit_identical_to_the_uninterrupted_run(runs):
    full, resumed = runs["records"]["full"], runs["records"][2]
    assert {step: rows for step, rows in samples(full).items() if step > 4} == samples(resumed)
    expected, got = params(full, "step-8"), params(resumed, "step-8")
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


@pytest.mark.parametrize("world", RESUME_WORLDS)
def test_resume_on_another_world_size_loads_the_saved_parameters_bit_exactly(runs, world):
    saved, loaded = params(runs["records"]["full"], "step-4"), params(runs["records"][world], "start-4")
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), key


@pytest.mark.parametrize("world", (1, 3))
def test_resume_on_another_world_size_trains_on_the_unseen_rest_of_the_epoch_first(runs, world):
    full = samples(runs["records"]["full"])
    seen = [index for step in range(1, 5) for index in full[step]]
    unseen = sorted(set(range(DATASET)) - set(seen))
    assert len(seen) == len(set(seen)) == 32  # 4 steps x 2 ranks x 4 samples, none twice
    resumed = samples(runs["records"][world])
    # the rest of epoch 0 (8 samples) on `world` ranks: ceil(8 / world) per rank, in batches of 4, padded
    per_rank = -(-len(unseen) // world)
    steps = -(-per_rank // BATCH)
    first = [index for step in range(5, 5 + steps) for index in resumed[step]]
    padding = per_rank * world - len(unseen)
    assert sorted(set(first)) == unseen
    assert len(first) == len(unseen) + padding
