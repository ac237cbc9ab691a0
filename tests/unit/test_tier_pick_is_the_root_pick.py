"""A tiered resume picks what `Root.pick` picks: the rules for which checkpoint a selector names exist once
(engine/catalog.py `candidates`), and the tier agreement (engine/tiers/restore.py) only chooses which copy to read.

The tiers hold two runs. Run A committed steps 1, 2 (drilled: the last known-good) and 4; run B, later, steps 2
and 6, none drilled. Both tiers hold every checkpoint but run A's step 1, which only the durable tier still has.
For each selector, the tiered Checkpointer resumes the checkpoint `resolve_checkpoint` names on the tier it read.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from lightning_shardckpt import Checkpointer, CheckpointSaver, SaveConfig, resolve_checkpoint
from lightning_shardckpt.engine.format import drill_records
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.engine.tiers.config import TierConfig, TiersConfig
from lightning_shardckpt.engine.tiers.replicate import Replicator

RUN_A, RUN_B = "run-a", "run-b"


class TwoRuns:
    def __init__(self, fast: str, durable: str, names: dict[tuple[str, int], str]) -> None:
        self.fast, self.durable, self.names = fast, durable, names

    def tiers(self) -> dict:
        return {"fast": {"dirpath": self.fast}, "durable": {"dirpath": self.durable}}


def _commit(root: str, step: int, run_id: str) -> str:
    saver = CheckpointSaver(
        root, SaveConfig(async_save=False, write_events=False, run_id=run_id, allow_shared_root=True)
    )
    result = saver.save({"w": torch.full((64,), float(step)), "meta": {"step": step}}, step=step).result(timeout=60)
    saver.close()
    assert result.committed, result.error
    return result.path.rsplit("/", 1)[-1]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> TwoRuns:
    base = tmp_path_factory.mktemp("tier-pick")
    fast, durable = str(base / "fast"), str(base / "durable")
    names = {(run, step): _commit(fast, step, run) for run, step in ((RUN_A, 1), (RUN_A, 2), (RUN_A, 4))}
    names.update({(RUN_B, step): _commit(fast, step, RUN_B) for step in (2, 6)})
    config = TiersConfig(fast=TierConfig(dirpath=fast), durable=TierConfig(dirpath=durable))
    replicator = Replicator(config, fsio.resolve(fast), fsio.resolve(durable), group=None)
    for name in names.values():  # in commit order, as a run replicates
        replicator.submit(name)
        assert replicator.flush(30)
    replicator.close(5)
    shutil.rmtree(base / "fast" / names[RUN_A, 1])  # fast-tier retention took it; the durable copy remains
    record = {"checkpoint": names[RUN_A, 2], "drill_id": drill_records.new_drill_id(), "verdict": drill_records.PASSED}
    drill_records.write_record(fsio.resolve(fast), {**record, "cause": None})  # drills run on the fast tier
    return TwoRuns(fast, durable, names)


# selector (a function of the checkpoints' names) -> (run, step) of the checkpoint it names, and the tier read
SELECTORS = {
    "latest": (lambda names: "latest", (RUN_B, 6), "fast"),
    # run B, the run `latest` comes from, has none drilled: the newest drilled of every run (run A's step 2)
    "last-good": (lambda names: "last-good", (RUN_A, 2), "fast"),
    "a step one checkpoint has": (lambda names: 4, (RUN_A, 4), "fast"),
    "a step only the durable tier has": (lambda names: "step-1", (RUN_A, 1), "durable"),
    # both runs committed a step 2: the newer commit, run B's (run A's has the higher seq within its own run)
    "a step two runs committed": (lambda names: "2", (RUN_B, 2), "fast"),
    "an id": (lambda names: names[RUN_A, 2].rsplit("-", 1)[-1], (RUN_A, 2), "fast"),
    "a directory name": (lambda names: names[RUN_A, 4], (RUN_A, 4), "fast"),
    "ROOT/latest of the durable tier": (lambda names: "DURABLE/latest", (RUN_B, 6), "durable"),
}


@pytest.mark.parametrize("label", list(SELECTORS))
def test_a_tiered_resume_loads_what_resolve_checkpoint_names_on_the_tier_it_reads(two_runs, label):
    spell, (run, step), tier = SELECTORS[label]
    selector = spell(two_runs.names)
    if selector == "DURABLE/latest":
        selector = f"{two_runs.durable}/latest"
    with Checkpointer(None, tiers=two_runs.tiers(), save={"async_save": False}) as checkpointer:
        state = {"w": torch.zeros(64)}
        assert checkpointer.load(state, selector) == step
        loaded = checkpointer.last_load
    assert loaded is not None and state["w"][0].item() == float(step)
    read_root = two_runs.fast if tier == "fast" else two_runs.durable
    assert loaded.path.rstrip("/").rsplit("/", 1) == [read_root, two_runs.names[run, step]]
    within = selector if isinstance(selector, str) and "/" in selector else read_root
    named = resolve_checkpoint(within, selector if within == read_root else "latest")
    assert named.path == loaded.path
