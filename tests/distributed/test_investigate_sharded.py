"""Export and compare read global tensors: an FSDP checkpoint written on 4 gloo ranks exports bit-exactly
(both formats) to what the ranks gather, and compares equal to the same state resharded onto 2 ranks."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lightning_shardckpt import CheckpointSaver, SaveConfig, load_checkpoint
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.load.global_tensors import GlobalTensorReader
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.ops.compare import compare_readers, summary
from lightning_shardckpt.ops.export import ExportOptions, export_checkpoint
from tests.helpers import training_state as ts
from tests.helpers.spawn import run_ranks

OPTIM_STATE = "optim.state."  # how the checkpoint names AdamW state; training_state.full_state says "optim."


def save_fsdp(rank, world_size, root):
    model, optimizer = ts.build("fsdp", seed=1, world_size=world_size)
    ts.train_steps(model, optimizer, steps=2, seed=2)
    saver = CheckpointSaver(root, SaveConfig(async_save=False, parallelism="fsdp"))
    result = saver.save(ts.sharded_state(model, optimizer), step=2).result(timeout=60)
    saver.close()
    assert result.committed, result.error
    full = ts.full_state(model, optimizer)  # a collective: every rank takes part
    return full if rank == 0 else None


def reshard_onto(rank, world_size, source, target):
    """Load the 4-rank checkpoint on this world size and save it again, untouched: same global tensors."""
    model, optimizer = ts.build("fsdp", seed=99, world_size=world_size)
    state = ts.sharded_state(model, optimizer)
    load_checkpoint(state, source)
    saver = CheckpointSaver(target, SaveConfig(async_save=False, parallelism="fsdp"))
    result = saver.save(state, step=2).result(timeout=60)
    saver.close()
    assert result.committed, result.error
    return result.manifest["topology"]["world_size"] if rank == 0 else None  # the coordinator holds the manifest


@pytest.fixture(scope="module")
def fsdp_roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp-investigate")
    four, two = str(base / "four"), str(base / "two")
    reference = run_ranks(save_fsdp, 4, four)[0].value
    assert run_ranks(reshard_onto, 2, four, two)[0].value == 2
    # the checkpoint's names for the gathered state: optim.<param>.<key> is optim.state.<param>.<key> there
    expected = {
        name if name.startswith("model.") else OPTIM_STATE + name.removeprefix("optim."): tensor
        for name, tensor in reference.items()
    }
    return four, two, expected


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_export_of_a_4_rank_fsdp_checkpoint_equals_the_gathered_state_bit_exactly(fsdp_roots, tmp_path, fmt):
    four, _, expected = fsdp_roots
    out = str(tmp_path / f"exported.{fmt}")
    export_checkpoint(four, out, ExportOptions(format=fmt))
    exported = torch.load(out, weights_only=True) if fmt == "torch" else load_file(out)
    tensors = {name: exported[name] for name in exported if name.startswith("model.") or name.startswith(OPTIM_STATE)}
    assert sorted(tensors) == sorted(expected)
    for name, tensor in expected.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name


def test_compare_across_world_sizes_reads_global_tensors_and_finds_them_equal(fsdp_roots):
    four, two, expected = fsdp_roots
    readers = []
    for root in (four, two):
        location = fsio.resolve(root)
        readers.append(GlobalTensorReader(location, catalog.find(location)))
    with readers[0] as a, readers[1] as b:
        assert a.manifest["topology"]["world_size"] == 4 and b.manifest["topology"]["world_size"] == 2
        assert any(spec.chunk_count == 4 for spec in a.specs.values())  # really sharded: chunks from every rank
        changes = compare_readers(a, b)
    counts = summary(changes)
    assert counts["equal"] == len(changes) >= len(expected), [c for c in changes if c.status != "equal"]
