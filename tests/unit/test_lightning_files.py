"""Which `ckpt_path` is a checkpoint Lightning's own strategies wrote (lightning/trainer/lightning_files.py)."""

from __future__ import annotations

import torch

from lightning_shardckpt.engine.format.names import MANIFEST, checkpoint_dirname, new_checkpoint_id
from lightning_shardckpt.lightning.trainer.lightning_files import written_by_lightning


def test_a_torch_save_file_and_a_dcp_directory_with_lightnings_meta_are_lightnings_own(tmp_path):
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, ckpt)
    assert written_by_lightning(str(ckpt))
    dcp = tmp_path / "sharded.ckpt"  # ModelParallelStrategy's save_distributed_checkpoint=True
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"x")
    (dcp / "__0_0.distcp").write_bytes(b"x")
    torch.save({"global_step": 3}, dcp / "meta.pt")
    assert written_by_lightning(str(dcp))


def test_a_text_file_a_missing_path_a_bare_dcp_directory_and_a_root_of_ours_are_not(tmp_path):
    text = tmp_path / "notes.ckpt"
    text.write_text("a Lightning .ckpt, say")
    assert not written_by_lightning(str(text))
    assert not written_by_lightning(str(tmp_path / "missing.ckpt"))
    bare = tmp_path / "dcp"  # DCP's own directory without Lightning's meta.pt: not Lightning's dict
    bare.mkdir()
    (bare / ".metadata").write_bytes(b"x")
    assert not written_by_lightning(str(bare))
    ours = tmp_path / "root.ckpt"  # trainer.save_checkpoint(path) under ShardedStrategy: a root of ours
    checkpoint = ours / checkpoint_dirname(3, new_checkpoint_id())
    checkpoint.mkdir(parents=True)
    (checkpoint / MANIFEST).write_text("{}")
    assert not written_by_lightning(str(ours))
