"""The example plug-in of docs/ARCHITECTURE.md ("Write a plug-in") runs as printed through all three doors: a
newcomer's plug-in, taking an event (on_commit), a saver listener and a decision (spare), with its state carried in
every checkpoint (the Checkpointer here in process; the Trainer and Fabric on one spawned gloo rank)."""

from __future__ import annotations

import pytest
import torch

from lightning_shardckpt import Checkpointer, ConfigError
from tests.helpers.example_plugin import committed_steps, example_plugin, example_plugin_through_trainer_and_fabric
from tests.helpers.spawn import run_ranks, values


def save_four(root: str, plugins: list) -> None:
    model = torch.nn.Linear(4, 2)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    with Checkpointer(root, keep_last=1, plugins=plugins) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, state, blocking=True)


def test_the_documented_plugin_keeps_the_steps_it_names_whatever_keep_last_says(tmp_path):
    keep_steps = example_plugin()({2})
    save_four(str(tmp_path / "with"), [keep_steps])
    save_four(str(tmp_path / "without"), [])
    assert committed_steps(str(tmp_path / "with")) == [2, 4]
    assert committed_steps(str(tmp_path / "without")) == [4]
    assert keep_steps.commits == 4  # the on_commit event, once per commit, on the training thread


def test_the_plugins_state_travels_in_the_checkpoint_and_comes_back_on_resume(tmp_path):
    KeepSteps = example_plugin()
    root = str(tmp_path / "run")
    save_four(root, [KeepSteps({2})])
    resumed = KeepSteps(set())
    model = torch.nn.Linear(4, 2)
    with Checkpointer(root, keep_last=1, plugins=[resumed]) as ckpt:
        assert ckpt.load({"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}) == 4
    assert [name.split("-")[1] for name in resumed.kept] == ["000000002"]


def test_a_plugin_that_is_not_a_plugin_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="not a lightning_shardckpt.Plugin"):
        Checkpointer(str(tmp_path / "run"), plugins=[object()])


@pytest.mark.slow
def test_the_documented_plugin_keeps_its_steps_and_resumes_its_state_through_the_trainer_and_fabric(tmp_path):
    (result,) = values(run_ranks(example_plugin_through_trainer_and_fabric, 1, str(tmp_path), timeout_s=240))
    for door in ("trainer", "fabric"):
        assert result[door]["steps"] == [2, 4], (door, result)  # keep_last=1 kept step 4; the plug-in spared 2
        assert result[door]["commits"] == 4, (door, result)  # on_commit, once per commit
        assert result[door]["resumed_kept"] == [2], (door, result)  # its state came back with the checkpoint
        assert result[door]["steps_after_resume"] == [2, 5], (door, result)  # and still spares step 2
    assert result["fabric"]["loaded_step"] == 4
