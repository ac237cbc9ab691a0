"""Issue 46 item 6, refuse before writing: a save configuration whose checkpoints no reader could load
(`save.format_version=2` with a manifest over the readers' bound) is refused by every door before its first
training step, before anything is written to the root (no `.owner.json`, no checkpoint), with the ConfigError that
names the option that fixes it; not at the first save, hours in. One spawned rank runs each door as its user
writes it (tests/helpers/refused_doors.py: the bound lowered there, a tiny model over it)."""

from __future__ import annotations

import pytest

from lightning_shardckpt.engine.format.names import OWNER
from tests.helpers.refused_doors import doors_over_the_bound
from tests.helpers.spawn import run_ranks, values

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def doors(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("refused")
    return values(run_ranks(doors_over_the_bound, 1, str(workdir), timeout_s=240))[0]


def assert_refused_before_training(outcome: dict) -> None:
    assert outcome["steps"] == 0, outcome  # not one training step ran
    assert OWNER not in (outcome["root"] or []), outcome  # nothing claimed the root
    assert not [name for name in outcome["root"] or [] if name.startswith("step")], outcome
    assert outcome["refused"] is not None, outcome
    assert "save.format_version=2 writes every chunk in the manifest" in outcome["refused"]
    assert "set save.format_version=5" in outcome["refused"]
    assert "rerun with save.run_id" not in outcome["refused"]  # no run id to explain


def test_a_trainer_fit_over_the_manifest_bound_is_refused_before_its_first_step(doors):
    assert_refused_before_training(doors["trainer"])


def test_a_fabric_loop_over_the_manifest_bound_is_refused_at_its_load_before_its_first_step(doors):
    assert_refused_before_training(doors["fabric"])


def test_a_checkpointer_loop_over_the_manifest_bound_is_refused_at_its_load_before_its_first_step(doors):
    assert_refused_before_training(doors["checkpointer"])
