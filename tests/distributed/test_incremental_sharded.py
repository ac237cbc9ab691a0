"""Incremental saves on 2 gloo ranks, DDP and FSDP2: a LoRA-style model (frozen base, trainable head)
writes about its trainable state per checkpoint after the first, and one incremental checkpoint restores
bit-exact on another world size.

Engine-level (CheckpointSaver + DCP state dicts); the Lightning strategy passes the same SaveConfig.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_shardckpt import CheckpointSaver, SaveConfig, load_checkpoint
from tests.helpers import training_state as ts
from tests.helpers.spawn import run_ranks

WIDTH, OUT = 512, 32  # base 1 MiB frozen, head 64 KiB trainable


def build(parallelism: str, seed: int, world_size: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, OUT))
    model[0].requires_grad_(False)  # the frozen base: most of the bytes
    if parallelism == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, optimizer


def train(model, optimizer, seed: int) -> None:
    batch = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed))
    model(batch).pow(2).mean().backward()
    if not ts._is_fsdp(model):
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
    optimizer.step()
    optimizer.zero_grad()


def save_worker(rank, world_size, root, parallelism):
    model, optimizer = build(parallelism, seed=1, world_size=world_size)
    saver = CheckpointSaver(root, SaveConfig(incremental=True, parallelism=parallelism, run_id="inc"))
    written = []
    for step in range(3):
        train(model, optimizer, seed=step)
        result = saver.save(ts.sharded_state(model, optimizer), step=step).result(timeout=60)
        assert result.committed, result.error
        written.append(result.bytes_rank)
    saver.close()
    full = ts.full_state(model, optimizer)
    return {"full": full if rank == 0 else None, "written": written}


def load_worker(rank, world_size, root, parallelism):
    model, optimizer = build(parallelism, seed=99, world_size=world_size)
    train(model, optimizer, seed=0)  # optimizer state exists to load into
    state = ts.sharded_state(model, optimizer)
    result = load_checkpoint(state, root)
    ts.apply_state(model, optimizer, state)
    return {"full": ts.full_state(model, optimizer), "step": result.step}


@pytest.mark.parametrize("parallelism,loaded_on", [("ddp", 1), ("fsdp", 1), ("fsdp", 3)])
def test_incremental_lora_checkpoints_write_the_trainable_state_and_restore_resharded(tmp_path, parallelism, loaded_on):
    root = str(tmp_path / "ckpt")
    saved = run_ranks(save_worker, 2, root, parallelism)
    head = WIDTH * OUT * 4 + OUT * 4  # trainable params, float32
    trainable_state = 3 * head  # + AdamW exp_avg and exp_avg_sq
    for step in (1, 2):
        total = sum(outcome.value["written"][step] for outcome in saved)
        first = sum(outcome.value["written"][0] for outcome in saved)
        assert total < first / 4, (total, first)
        # trainable params + moments, plus a fixed ~1.3 KB record header per item (~20 items: AdamW's step
        # counters and param_groups entries, always rewritten; they are small)
        assert trainable_state <= total <= 1.1 * trainable_state + 32 * 1024, (total, trainable_state)
    manifests = sorted(Path(root).glob("step-*/manifest.json"))
    assert '"references"' in manifests[-1].read_text()
    loaded = run_ranks(load_worker, loaded_on, root, parallelism)
    assert loaded[0].value["step"] == 2
    ts.assert_bit_exact(saved[0].value["full"], loaded[0].value["full"])
