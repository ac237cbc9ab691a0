"""The plain PyTorch front door end to end: `torchrun recipes/plain_fsdp.py` (FSDP2, gloo, CPU, no Lightning).

One module-scoped set of runs, each as `torchrun --nproc_per_node N recipes/plain_fsdp.py ...` would start it
(the ranks get torchrun's environment):
- interrupted: 2 ranks, stopped after step 7; checkpoints at steps 2, 4, 6, so step 7 is lost as in a crash.
  Up to step 7 it is the uninterrupted run: what the resumed runs must reproduce;
- then, side by side: resumed on 3 ranks from its root, and resumed on 2 ranks from a copy of it, to step 8.
The recipe records, on rank 0, the sample ids of every step and the full parameters at the start and after
every step.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.spawn import ForkedMain, fork_launched_ranks

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "plain_fsdp.py"
MAX_STEPS, EVERY, STOP_AFTER = 8, 2, 7
SAMPLES = 24  # 6 a step (--global-batch): 4 steps an epoch
RESUMED_AT = 6  # the newest checkpoint of the interrupted run

pytestmark = pytest.mark.timeout(300)


def start(workdir: Path, world: int, root: str, name: str, *extra: str) -> list[tuple[ForkedMain, Path]]:
    """`torchrun --nproc_per_node {world} recipes/plain_fsdp.py ...`: each rank forked with the environment torchrun
    gives it (fork_launched_ranks), so the test pays for no launcher process and no rank re-imports torch."""
    argv = [
        str(RECIPE),
        f"--root={workdir / root}",
        f"--max-steps={MAX_STEPS}",
        f"--every={EVERY}",
        f"--samples={SAMPLES}",
        f"--record={workdir / (name + '.pt')}",
        *extra,
    ]
    logs = [workdir / f"{name}.rank{rank}.log" for rank in range(world)]
    return list(zip(fork_launched_ranks(argv, world, workdir, logs), logs))


def finish(*runs: list[tuple[ForkedMain, Path]]) -> None:
    for process, log in (rank for ranks in runs for rank in ranks):
        code = process.wait(timeout=240)
        assert code == 0, f"{log.name} exited {code}:\n" + log.read_text()[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("plain_fsdp")
    finish(start(workdir, 2, "ckpt", "interrupted", f"--stop-after={STOP_AFTER}"))
    shutil.copytree(workdir / "ckpt", workdir / "ckpt_copy")
    finish(start(workdir, 3, "ckpt", "resumed3"), start(workdir, 2, "ckpt_copy", "resumed2"))
    records = {name: torch.load(workdir / f"{name}.pt") for name in ("interrupted", "resumed3", "resumed2")}
    return {"workdir": workdir, **records}


def test_a_resume_on_2_ranks_trains_the_lost_step_bit_exact_as_the_uninterrupted_run_did(runs):
    uninterrupted, resumed = runs["interrupted"], runs["resumed2"]
    assert resumed["resumed_from"] == RESUMED_AT
    for name, value in uninterrupted["params"][RESUMED_AT].items():
        assert torch.equal(resumed["start"][name], value), name
    # step 7: the same samples, and the same parameters to the last bit (model, AdamW state, data position)
    assert resumed["steps"][STOP_AFTER] == uninterrupted["steps"][STOP_AFTER]
    for name, value in uninterrupted["params"][STOP_AFTER].items():
        assert torch.equal(resumed["params"][STOP_AFTER][name], value), name


def test_a_resume_on_3_ranks_loads_the_2_rank_state_bit_exact_and_trains_on_the_next_unseen_samples(runs):
    uninterrupted, resumed, resumed2 = runs["interrupted"], runs["resumed3"], runs["resumed2"]
    assert resumed["resumed_from"] == RESUMED_AT  # the newest committed checkpoint; step 7 was never saved
    for name, value in uninterrupted["params"][RESUMED_AT].items():
        assert torch.equal(resumed["start"][name], value), name  # resharded 2 -> 3 ranks, bit-exact
    # the data consumed: the interrupted run's steps up to the checkpoint, then the resumed run's, are the samples
    # of the uninterrupted run step by step (4 steps an epoch: the first run crossed an epoch boundary, the
    # resumed one starts mid-epoch), and those a 2-rank resume takes
    assert resumed["steps"][STOP_AFTER] == uninterrupted["steps"][STOP_AFTER]
    assert resumed["steps"] == resumed2["steps"]
    consumed = [ids for step, ids in sorted({**uninterrupted["steps"], **resumed["steps"]}.items())]
    for epoch in range(2):
        assert sorted(i for ids in consumed[4 * epoch : 4 * epoch + 4] for i in ids) == list(range(SAMPLES))
    # 3 ranks sum the same gradients in another order: equal to float32 rounding, no more
    for name, value in uninterrupted["params"][STOP_AFTER].items():
        torch.testing.assert_close(resumed["params"][STOP_AFTER][name], value, rtol=1e-5, atol=1e-6)


def test_the_resumed_run_continues_the_interrupted_runs_id_and_retention_keeps_the_last_3(runs):
    entries = catalog.list_checkpoints(fsio.resolve(str(runs["workdir"] / "ckpt")))
    committed = [entry for entry in entries if entry.committed]
    assert [entry.step for entry in committed] == [4, 6, 8]
    assert len({entry.run_id for entry in committed}) == 1  # one run: no ownership error, no second run id
