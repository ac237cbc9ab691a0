"""Signed checkpoints on 2 real gloo ranks, on a local disk and on S3 (moto on loopback): the issue-39 attack (a
shard's values replaced and every checksum recomputed) is refused by every rank's load and by `shardckpt verify`,
`latest` resumes the newest validly signed checkpoint instead, and without a policy the forgery loads as before."""

from __future__ import annotations

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, SignatureRefused, SignConfig, load_checkpoint
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.ops.verify import SIGNATURE_PROBLEM, verify_checkpoint
from tests.helpers import training_state as ts
from tests.helpers.forgery import forge_tensor_values
from tests.helpers.spawn import run_ranks
from tests.unit.test_signing import make_key

FORGED = 7.0
FQN = "model.0.weight"


def save_worker(rank, world_size, backend, key_path):
    model, optimizer = ts.build("fsdp", seed=1, world_size=world_size)
    saver = CheckpointSaver(backend.url, backend.save_config(sign=SignConfig(key_path=key_path), run_id="signed-run"))
    for step in (1, 2):
        ts.train_steps(model, optimizer, steps=1, seed=step)
        result = saver.save(ts.sharded_state(model, optimizer), step=step).result(timeout=60)
        assert result.committed, result.error
    saver.close()
    full = ts.full_state(model, optimizer)  # a collective: every rank takes part
    return full[FQN] if rank == 0 else None


def load_worker(rank, world_size, backend, which, public_keys):
    model, optimizer = ts.build("fsdp", seed=99, world_size=world_size)
    state = ts.sharded_state(model, optimizer)
    options = {"require_signature": True, "public_keys": public_keys} if public_keys else {}
    try:
        result = load_checkpoint(state, backend.url, which, config=backend.load_config(**options))
    except SignatureRefused as err:
        return {"refused": str(err)}
    ts.apply_state(model, optimizer, state)
    local = state["model"]["0.weight"]
    local = local.to_local() if hasattr(local, "to_local") else local
    weight = ts.full_state(model, optimizer).get(FQN)  # a collective; the full tensor lands on rank 0
    return {"step": result.step, "forged": bool(torch.all(local == FORGED)), "weight": weight}


def test_forged_signed_checkpoint_is_refused_on_every_rank_and_latest_resumes_the_older(backend, tmp_path):
    private, public, _ = make_key(tmp_path, "writer")
    saved = run_ranks(save_worker, 2, backend, private)[0].value
    location = backend.location()
    newest = catalog.find(location, "latest")
    assert newest.step == 2
    forge_tensor_values(location, newest.path, FQN, FORGED)

    refused = [outcome.value for outcome in run_ranks(load_worker, 2, backend, 2, [public])]
    assert all("manifest.json: its signature by key" in value["refused"] for value in refused), refused
    resumed = [outcome.value for outcome in run_ranks(load_worker, 2, backend, "latest", [public])]
    assert [value["step"] for value in resumed] == [1, 1]  # the newest validly signed one
    assert not any(value["forged"] for value in resumed)

    report = verify_checkpoint(backend.url, 2, backend.storage_options or None, public_keys=[public])
    assert [problem["kind"] for problem in report.problems] == [SIGNATURE_PROBLEM]
    assert verify_checkpoint(backend.url, 1, backend.storage_options or None, public_keys=[public]).ok

    unchecked = [outcome.value for outcome in run_ranks(load_worker, 2, backend, "latest", None)]
    # the forged chunk is rank 0's shard of the weight (the first part that holds one)
    assert [value["step"] for value in unchecked] == [2, 2] and unchecked[0]["forged"]
    assert not torch.equal(saved, unchecked[0]["weight"])  # without a policy the attacker's values load, as before


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_signed_checkpoint_loads_resharded_on_one_rank(backend, tmp_path):
    private, public, _ = make_key(tmp_path, "writer")
    saved = run_ranks(save_worker, 2, backend, private)[0].value
    loaded = run_ranks(load_worker, 1, backend, "latest", [public])[0].value
    assert loaded["step"] == 2
    assert torch.equal(saved, loaded["weight"])
