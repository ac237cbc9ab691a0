"""The model identity is a property of the model, not of how it is sharded: FSDP2 on 2 ranks records
the same class, global shapes, parameter count and digest as the plain module."""

from __future__ import annotations

from lightning_shardckpt.identity.blocks import model_identity
from tests.helpers import training_state as ts
from tests.helpers.spawn import run_ranks


def sharded_identity(rank, world_size):
    model, _ = ts.build("fsdp", seed=1, world_size=world_size)
    return model_identity(model)


def test_fsdp2_sharded_model_has_the_identity_of_the_unsharded_model():
    plain = model_identity(ts.build_model(seed=1))
    for outcome in run_ranks(sharded_identity, 2):
        assert outcome.value == plain
    assert plain["tensors"]["0.weight"] == [[7, 13], "torch.float32"]
