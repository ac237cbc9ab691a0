"""ShardedFabricStrategy on 2 real gloo ranks: a checkpoint the Trainer saved loads into a Fabric loop, and a Fabric
DDP loop's state round-trips. One spawn (tests/helpers/fabric_ranks.py does the work); the tests assert on it."""

from __future__ import annotations

import pytest

from tests.helpers.fabric_ranks import trainer_then_fabric
from tests.helpers.spawn import run_ranks, values

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fabric")
    return values(run_ranks(trainer_then_fabric, 2, str(workdir), timeout_s=240))


def test_fabric_loads_a_trainer_checkpoint_weights_and_optimizer_state_equal(ranks):
    for rank in ranks:
        loaded = rank["trainer"]
        assert loaded["keys_equal"] and loaded["unequal"] == [], loaded
        assert loaded["loaded_step"] == 3 and loaded["global_step"] == 3
        assert loaded["lr"] != 1.0  # the Trainer's param groups (its lr), not the Fabric optimizer's own


def test_fabric_load_of_a_trainer_checkpoint_restores_the_sampler_and_returns_the_rest(ranks):
    for rank in ranks:
        loaded = rank["trainer"]
        assert loaded["position"] == 3 * 2 * 4  # 3 steps x 2 ranks x batch 4, from ShardedCheckpoint's state
        assert {"epoch", "loops", "callbacks"} <= set(loaded["remainder_keys"])


def test_a_plain_torch_file_still_loads_through_fabric_load_raw(ranks):
    for rank in ranks:
        assert rank["trainer"]["raw_unequal"] == []


def test_latest_of_an_empty_root_starts_fresh(ranks):
    for rank in ranks:
        assert rank["fabric"]["fresh"] == {} and rank["fabric"]["step_after_fresh"] == 0


def test_fabric_round_trip_restores_every_kind_of_state(ranks):
    for rank in ranks:
        out = rank["fabric"]
        assert out["returned_before_commit"] and out["committed"]  # asynchronous, then committed
        assert out["unequal"] == []  # model and optimizer
        assert out["step"] == 2 and out["notes"] == {"tokens": [1, 2, 3]}
        assert out["position"] == out["position_saved"] == 2 * 2 * 2
        assert out["last_lr"] == out["last_lr_saved"]
        assert out["remainder"] == {}


def test_what_cannot_be_loaded_is_named_when_saved_and_fails_naming_it_when_loaded(ranks):
    for rank in ranks:
        out = rank["fabric"]
        if rank is ranks[0]:  # rank 0 writes the pickled section: it says so, once, at the first save holding it
            assert len(out["unsafe_warnings"]) == 1, out["unsafe_warnings"]
            warning = out["unsafe_warnings"][0]
            assert "fabric_ranks.NotAllowed" in warning and "trust_checkpoint': True" in warning
            assert "add_safe_globals([NotAllowed])" in warning
        assert "NotAllowed" in out["unsafe_error"] and "add_safe_globals" in out["unsafe_error"]  # as it said
        assert "'missing'" in out["missing_error"] and "strict=False" in out["missing_error"]
        # strict=False: what the state did not ask for comes back (plain values, and state dicts of stateful objects)
        assert set(out["partial"]) == {"step", "notes", "scheduler", "loader"}
