"""Lightning's own conventions, compared with plain Lightning (DDPStrategy + its checkpoint file) on the
same world size, or with an uninterrupted run."""

from __future__ import annotations

import torch

from tests.helpers.lightning_conventions import (
    fsdp_mesh_on_rank,
    hooks_on_rank,
    mid_epoch_on_rank,
    partial_on_rank,
    rank_sources_on_rank,
)
from tests.helpers.spawn import run_ranks


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_state_that_differs_per_rank_is_restored_from_rank_0_like_plain_lightning(tmp_path):
    outcomes = [o.value for o in run_ranks(rank_sources_on_rank, 2, str(tmp_path), timeout_s=240)]
    running = "net.1.running_mean", "net.1.running_var"
    for name in running:  # the premise: each rank's BatchNorm statistics are its own
        assert not torch.equal(outcomes[0]["saved_sharded"][name], outcomes[1]["saved_sharded"][name])
    rank0 = outcomes[0]["saved_sharded"]
    assert _equal(rank0, outcomes[0]["saved_plain"])  # the two runs trained alike
    for rank, outcome in enumerate(outcomes):
        assert _equal(outcome["plain"]["model"], rank0), f"plain Lightning restores rank 0's state (rank {rank})"
        assert _equal(outcome["sharded"]["model"], rank0), f"rank {rank} restored buffers no rank had at the save"
        assert outcome["plain"]["extra"] == outcome["sharded"]["extra"] == 0  # on_save_checkpoint extras: rank 0's
        assert outcome["plain"]["callback"] == outcome["sharded"]["callback"] == {"rank": 0}


def test_checkpoint_hooks_see_and_edit_the_model_state_dict_like_plain_lightning(tmp_path):
    outcomes = [o.value for o in run_ranks(hooks_on_rank, 2, str(tmp_path), timeout_s=240)]
    for outcome in outcomes:
        ema = outcome["ema"]  # EMAWeightAveraging: live weights and the average both come back
        assert _equal(ema["sharded"]["model"], ema["plain"]["model"])
        assert _equal(ema["sharded"]["average"], ema["plain"]["average"])
        assert not _equal(ema["plain"]["model"], ema["plain"]["average"])  # the premise: they differ
        edit = outcome["edit"]  # on_load_checkpoint's edit of checkpoint["state_dict"] is what gets loaded
        assert _equal(edit["sharded"]["model"], edit["plain"]["model"])
        assert torch.equal(edit["sharded"]["model"]["net.2.bias"], edit["saved"]["net.2.bias"] + 1.0)


def test_strict_loading_false_loads_a_partial_checkpoint_like_plain_lightning(tmp_path):
    outcomes = [o.value for o in run_ranks(partial_on_rank, 2, str(tmp_path), timeout_s=240)]
    for outcome in outcomes:
        for pattern in ("state_dict", "hook"):
            plain, sharded, fresh = outcome[pattern]["plain"], outcome[pattern]["sharded"], outcome[pattern]["fresh"]
            assert _equal(sharded["model"], plain["model"]), pattern
            backbone = [k for k in fresh if k.startswith("backbone.")]
            assert all(torch.equal(sharded["model"][k], fresh[k]) for k in backbone), (
                "the backbone keeps its initial values"
            )
            assert not torch.equal(sharded["model"]["head.weight"], fresh["head.weight"]), "the head is restored"
    named = [m for m in outcomes[0]["log"] if "keep their initialised values" in m and "backbone.0.weight" in m]
    assert len(named) == 2, outcomes[0]["log"]  # the log names what was left as initialised, in both patterns


def test_fsdp_quickstart_shards_over_every_rank_like_model_parallel_with_explicit_sizes(tmp_path):
    outcomes = [o.value for o in run_ranks(fsdp_mesh_on_rank, 2, str(tmp_path), timeout_s=240)]
    for outcome in outcomes:
        assert outcome["sharded"]["mesh"] == outcome["plain"]["mesh"] == (2, 1)
        assert outcome["sharded"]["local_rows"] == 8  # Linear(13, 16) split over 2 ranks
        assert _equal(outcome["sharded"]["full"], outcome["plain"]["full"])
    assert _equal(outcomes[0]["sharded"]["full"], outcomes[1]["sharded"]["full"])  # one model, not diverged replicas


def _merged(before: dict, after: dict) -> dict:
    applied = {
        e: before["applied"].get(e, []) + after["applied"].get(e, [])
        for e in set(before["applied"]) | set(after["applied"])
    }
    steps = {
        e: before["steps"].get(e, 0) + after["steps"].get(e, 0) for e in set(before["steps"]) | set(after["steps"])
    }
    return {"applied": applied, "steps": steps, "validated_at": before["validated_at"] + after["validated_at"]}


def test_mid_epoch_resume_continues_the_epoch_like_an_uninterrupted_run(tmp_path):
    # 40 samples on 2 ranks, batches of 4: 5 micro-batches per rank and epoch; 2 per step -> steps after
    # batches 2, 4 and the epoch's last (5). Stopped after step 1, mid-epoch 0.
    size, accumulate = 40, 2
    outcomes = [o.value for o in run_ranks(mid_epoch_on_rank, 2, str(tmp_path), size, accumulate, 1, timeout_s=300)]
    plain = [o["plain"] for o in outcomes]
    whole = [o["uninterrupted"] for o in outcomes]
    resumed = [_merged(o["before"], o["after"]) for o in outcomes]
    assert outcomes[0]["before"]["steps"] == {0: 1}
    for rank in range(2):
        assert whole[rank]["validated_at"] == plain[rank]["validated_at"] == [(0, 3), (1, 6)]
        assert whole[rank]["steps"] == plain[rank]["steps"] == {0: 3, 1: 3}
        assert resumed[rank]["validated_at"] == whole[rank]["validated_at"], "validation at the resumed epoch's end"
        assert resumed[rank]["steps"] == whole[rank]["steps"], "K micro-batches per step and a step on the last batch"
        assert outcomes[rank]["after"]["unapplied"] == []
    for epoch in (0, 1):  # every sample applied once per epoch, over both ranks
        applied = sorted(i for r in resumed for i in r["applied"][epoch])
        assert applied == list(range(size)), f"epoch {epoch}: {applied}"


def test_mid_epoch_resume_on_more_ranks_steps_on_the_last_batch_and_validates_at_the_epochs_end(tmp_path):
    # stopped after step 1 on 2 ranks (16 of 40 samples); on 3 ranks an epoch is 14 samples = 4 batches
    # per rank, of which the remaining 24 samples fill the last 2: one step, then validation
    size, accumulate = 40, 2
    before = [o.value["before"] for o in run_ranks(mid_epoch_on_rank, 2, str(tmp_path), size, accumulate, 1, "before")]
    after = [o.value["after"] for o in run_ranks(mid_epoch_on_rank, 3, str(tmp_path), size, accumulate, 1, "after")]
    for ledger in after:
        assert ledger["validated_at"] == [(0, 2), (1, 4)]
        assert ledger["steps"] == {0: 1, 1: 2} and ledger["unapplied"] == []
    applied = sorted(i for ledger in before + after for i in ledger["applied"][0])
    assert applied == list(range(size))  # epoch 0: every sample applied once across both world sizes
