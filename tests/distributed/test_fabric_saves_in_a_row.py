"""Issue 47 item 5: two Fabric saves in a row to different paths, as LitGPT's pretrain loop does (`step-N/` at each
interval, then `final/` at once). The second path's saver is made while the first path's save still commits on the
background thread; the new saver's "root-owner" collective then met that save's collectives on the one checkpoint
group (a hang in DDP and FSDP, a gloo size mismatch in a LitGPT-style DDP run). Each save must wait for the previous
path's commit (docs/howto/fabric.md), and every path must load back what was saved there. 2 real gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_shardckpt import ShardedFabricStrategy
from tests.helpers.fabric_ranks import full_state
from tests.helpers.lightning_run import lightning_env
from tests.helpers.litgpt_shaped import LitGPTShaped, tokens
from tests.helpers.spawn import run_ranks, values

pytestmark = pytest.mark.timeout(240)


def _setup(fabric: Fabric, seed: int) -> dict[str, Any]:
    model = fabric.setup_module(LitGPTShaped(seed=seed))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    return {"model": model, "optimizer": optimizer, "iter_num": 0}


def _train_and_save(fabric: Fabric, state: dict[str, Any], paths_by_iter: dict[int, list[str]]) -> dict[str, Any]:
    """Train 4 iterations; after iteration i save to each of `paths_by_iter[i]` at once, one after the other."""
    model, optimizer = state["model"], state["optimizer"]
    saved = {}
    for iter_num in range(1, 5):
        fabric.backward(model(tokens(iter_num * 10 + fabric.global_rank)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        state["iter_num"] = iter_num
        for path in paths_by_iter.get(iter_num, []):
            fabric.save(path, state)  # returns once staged: the previous path's save may still be committing
            saved[path] = (iter_num, full_state(model.module, optimizer.optimizer))
    return saved


def _loads_back(fabric: Fabric, saved: dict[str, Any]) -> dict[str, Any]:
    """Each path's checkpoint loaded into a fresh model: the step and the tensors that differ from what was saved."""
    out = {}
    for path, (iter_num, expected) in saved.items():
        fresh = _setup(fabric, seed=99)
        fabric.load(path, fresh)
        loaded = full_state(fresh["model"].module, fresh["optimizer"].optimizer)
        unequal = sorted(key for key in expected if not torch.equal(expected[key], loaded[key]))
        out[path.rsplit("/", 1)[-1]] = {"iter_num": fresh["iter_num"], "expected": iter_num, "unequal": unequal}
    return out


def saves_in_a_row(rank: int, world_size: int, workdir: str, parallelism: str) -> dict[str, Any]:
    lightning_env(rank, world_size)
    results = {}
    # LitGPT's pretrain loop: no root=, every interval a directory of its own, then final/ right after the last
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ShardedFabricStrategy(parallelism=parallelism))
    fabric.launch()
    out = f"{workdir}/litgpt-{parallelism}"
    saves = {2: [f"{out}/step-00000002"], 4: [f"{out}/step-00000004", f"{out}/final"]}
    saved = _train_and_save(fabric, _setup(fabric, seed=3), saves)
    results["litgpt"] = _loads_back(fabric, saved)
    fabric.strategy.teardown()

    # the run's root (root=) then at once another path, twice
    run = f"{workdir}/run-{parallelism}"
    strategy = ShardedFabricStrategy(parallelism=parallelism, root=run)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    saves = {2: [run, f"{workdir}/other-{parallelism}"], 4: [run, f"{workdir}/third-{parallelism}"]}
    saved = _train_and_save(fabric, _setup(fabric, seed=4), saves)
    strategy.wait()
    results["run_root_then_other"] = _loads_back(fabric, saved)
    fabric.strategy.teardown()
    return results


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_saves_to_two_paths_in_a_row_each_commit_and_load_back_bit_exact(tmp_path, parallelism):
    for rank in values(run_ranks(saves_in_a_row, 2, str(tmp_path), parallelism, timeout_s=150, pg_timeout_s=30)):
        litgpt = rank["litgpt"]
        assert sorted(litgpt) == ["final", "step-00000002", "step-00000004"], litgpt
        run_root = rank["run_root_then_other"]
        assert sorted(run_root) == [f"other-{parallelism}", f"run-{parallelism}", f"third-{parallelism}"], run_root
        for loaded in (*litgpt.values(), *run_root.values()):
            assert loaded["unequal"] == [] and loaded["iter_num"] == loaded["expected"], (litgpt, run_root)
