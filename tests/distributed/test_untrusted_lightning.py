"""Through Lightning on 2 gloo ranks: a checkpoint whose Lightning state holds a class outside the
allow-list is named with both fixes when it is saved, refused on resume with trust off, naming the class,
the checkpoint and the fix, and resumes with `trust_checkpoint=True`. The normal state (hparams, loops, schedulers, callbacks, RNG,
sampler) of DDP and FSDP2 checkpoints resumes with trust off in the other Lightning tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_shardckpt import ShardedCheckpoint
from lightning_shardckpt.engine.format import safe_pickle
from lightning_shardckpt.engine.format.names import DCP_METADATA
from lightning_shardckpt.errors import UntrustedCheckpoint
from tests.helpers.lightning_run import TinyData, TinyModule, ddp_trainer, lightning_env
from tests.helpers.log_capture import warnings_of
from tests.helpers.spawn import run_ranks, values


class Opaque:
    """A user's own class, saved by `on_save_checkpoint`; on no allow-list."""

    def __init__(self, step: int) -> None:
        self.step = step


class ModuleWithOpaqueExtra(TinyModule):
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["my_extra"] = Opaque(self.global_step)


def _fit(root: str, world_size: int, max_steps: int, ckpt_path: Any, trust: bool) -> ModuleWithOpaqueExtra:
    callback = ShardedCheckpoint(root, every_n_train_steps=2, log_artifact=False, trust_checkpoint=trust)
    trainer = ddp_trainer(world_size, max_steps, [callback])
    module = ModuleWithOpaqueExtra()
    trainer.fit(module, datamodule=TinyData(), ckpt_path=ckpt_path)
    return module


def untrusted_on_rank(rank: int, world_size: int, root: str) -> dict:
    lightning_env(rank, world_size)
    with warnings_of("lightning_shardckpt.training.loadable") as warned:
        _fit(root, world_size, 2, None, trust=False)
    refused: dict[str, Any] = {}
    try:
        _fit(root, world_size, 4, "latest", trust=False)
    except UntrustedCheckpoint as err:
        refused = {"message": str(err), "blocked": err.blocked}
    with warnings_of("lightning_shardckpt.training.loadable") as warned_trusted:
        resumed = _fit(root, world_size, 4, "latest", trust=True)
    extra = resumed.extra_loaded
    return {
        "refused": refused,
        "extra_class": type(extra).__name__,
        "extra_step": getattr(extra, "step", None),
        "warned": warned,
        "warned_trusted": warned_trusted,
    }


def test_lightning_state_with_a_blocked_class_is_refused_with_trust_off_and_resumes_with_trust_on(tmp_path):
    root = str(tmp_path / "ckpt")
    results = values(run_ranks(untrusted_on_rank, 2, root, timeout_s=300))
    for rank, result in enumerate(results):
        refused = result["refused"]
        assert refused, f"rank {rank} resumed a checkpoint holding {Opaque.__qualname__} with trust off"
        assert refused["blocked"] == f"{__name__}.Opaque"
        assert "step-000000002-" in refused["message"] and root in refused["message"]
        assert "trust_checkpoint=True" in refused["message"] and "add_safe_globals" in refused["message"]
        assert (result["extra_class"], result["extra_step"]) == ("Opaque", 2)
        # the save that wrote it said so, once, on rank 0 (which writes the Lightning state), naming both fixes
        assert len(result["warned"]) == (1 if rank == 0 else 0), result["warned"]
        if rank == 0:
            assert f"{__name__}.Opaque" in result["warned"][0] and "'lightning'" in result["warned"][0]
            assert "ShardedCheckpoint(..., trust_checkpoint=True)" in result["warned"][0]
            assert "add_safe_globals([Opaque])" in result["warned"][0]
        assert result["warned_trusted"] == []  # a run that trusts its checkpoints loads it: nothing to say
    # what DCP wrote for a Lightning run reads through the .metadata allow-list
    for name in sorted(os.listdir(root)):
        if name.startswith("step-"):
            data = Path(root, name, DCP_METADATA).read_bytes()
            assert safe_pickle.load_dcp_metadata(data, name).storage_data
