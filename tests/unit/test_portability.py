"""A committed checkpoint is plain DCP: it loads without this package; checksum checks can be turned off."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_shardckpt import CorruptCheckpoint, LoadConfig, load_checkpoint
from lightning_shardckpt.engine.catalog import find
from lightning_shardckpt.engine.format.chunk_index import ChunkIndex
from lightning_shardckpt.engine.storage.fsio import resolve
from tests.helpers.checkpoints import SHARD, chunk_of, fresh_state, save_checkpoint


@pytest.mark.slow  # a fresh Python process of its own (imports torch): ~3 s, more under load
def test_committed_checkpoint_loads_with_plain_dcp_in_a_process_without_this_package(tmp_path):
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, step=3)
    path = find(resolve(root), "latest").path
    expected = fresh_state(seed=3)["model"]
    torch.save(expected, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys
        import torch
        import torch.distributed.checkpoint as dcp
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        target = {{"model": {{k: torch.zeros_like(v) for k, v in expected.items()}}, "progress": {{"global_step": 0}}}}
        dcp.load(target, checkpoint_id={path!r})
        assert "lightning_shardckpt" not in sys.modules, "the load imported our package"
        assert all(torch.equal(target["model"][k], v) for k, v in expected.items())
        assert target["progress"] == {{"global_step": 3}}
        print("plain-dcp-ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "plain-dcp-ok" in done.stdout


def test_checksum_checks_on_load_can_be_turned_off(tmp_path):
    root = str(tmp_path / "ckpt")
    manifest = save_checkpoint(root, step=3)
    bias = chunk_of(manifest, "model.2.bias")
    shard = find(resolve(root), "latest").path + "/" + SHARD
    with open(shard, "r+b") as handle:  # flip one byte near the end of the bias record (its raw data)
        handle.seek(bias["offset"] + bias["length"] - 40)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpoint, match="model.2.bias"):
        load_checkpoint(fresh_state(seed=9), root)
    load_checkpoint(fresh_state(seed=9), root, config=LoadConfig(verify_checksums=False))  # off: loads as stored


def test_views_and_transposed_tensors_round_trip_exactly(tmp_path):
    from lightning_shardckpt import CheckpointSaver, SaveConfig

    base = torch.arange(24.0).reshape(4, 6)
    state = {"transposed": base.t(), "row_view": base[1], "strided": base[:, ::2], "scalar": torch.tensor(3.5)}
    saver = CheckpointSaver(str(tmp_path), SaveConfig(async_save=False))
    assert saver.save(state, step=1).result().committed
    saver.close()
    target = {name: torch.zeros_like(value) for name, value in state.items()}
    load_checkpoint(target, str(tmp_path))
    for name, value in state.items():
        assert torch.equal(target[name], value), name
    entry = find(resolve(str(tmp_path)), "latest")
    row = ChunkIndex(resolve(str(tmp_path)).fs, entry.path, entry.manifest).tensor_chunks("row_view")[0]
    compact = io.BytesIO()
    torch.save(base[1].clone(), compact)  # a record of the row's 6 elements alone, not the 24 of its base
    assert row["length"] == len(compact.getvalue()), "a view's record must hold only its own elements"
