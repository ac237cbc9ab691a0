"""A plain PyTorch FSDP2 loop (no Lightning) with asynchronous, resumable checkpoints: the Checkpointer.

Train on 2 CPU ranks, stop it, resume on 3 (the sampler continues with the next unseen sample):

    torchrun --nproc_per_node 2 recipes/plain_fsdp.py --root checkpoints/plain --max-steps 8 --stop-after 5
    torchrun --nproc_per_node 3 recipes/plain_fsdp.py --root checkpoints/plain --max-steps 8
    shardckpt ls checkpoints/plain

The checkpoint code is marked `# ckpt` (docs/howto/plain-pytorch.md walks through it). `--global-batch` samples
are trained per step whatever the world size (each rank takes global-batch / world), so a resized resume
sees the same batches as an uninterrupted run. `--record FILE` (rank 0) saves the sample ids of every step
and the full parameters at the start and after every step, for tests/e2e/test_plain_fsdp_recipe.py.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from lightning_shardckpt import Checkpointer, ResumableDistributedSampler


class Regression(Dataset):
    """`size` fixed samples (index, features, target); the index lets a test see which samples were trained on."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, 16, generator=generator)
        self.y = self.x[:, :4] * 2.0 - self.x[:, 4:8]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return index, self.x[index], self.y[index]


def build_model(world_size: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank, whatever the world size
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered from its shards (a collective: every rank calls it)."""
    return {name: param.full_tensor().detach().clone() for name, param in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="checkpoints/plain", help="checkpoint root: a local path or an fsspec URL")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2, help="save every N optimizer steps")
    parser.add_argument("--stop-after", type=int, default=None, help="stop after this step without saving it")
    parser.add_argument("--global-batch", type=int, default=6, help="samples per step, all ranks together")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--record", default=None, help="rank 0 saves sample ids per step and parameters here")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch={args.global_batch} must divide by the world size {world}")
    batch = args.global_batch // world
    model = build_model(world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset = Regression(args.samples)
    sampler = ResumableDistributedSampler(dataset, seed=7, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler)

    ckpt = Checkpointer(
        args.root, every_n_steps=args.every, keep_last=3, max_steps=args.max_steps, sampler=sampler
    )  # ckpt
    state = {"model": model, "optim": optimizer}  # ckpt
    step = ckpt.load(state) or 0  # ckpt: the newest committed checkpoint of the run, or None: start fresh
    record = {"resumed_from": step or None, "start": full_parameters(model), "steps": {}, "params": {}}

    epoch = sampler.epoch  # a resume continues the saved epoch at the saved position
    while step < args.max_steps and step != args.stop_after:
        sampler.set_epoch(epoch)
        for ids, x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            sampler.mark_consumed(1, batch)  # ckpt: the data position counts what an optimizer step applied
            ckpt.maybe_save(step, state)  # ckpt: async; commits in the background
            if args.record:
                record["steps"][step], record["params"][step] = gathered_ids(ids, world), full_parameters(model)
            if rank == 0:
                print(f"step {step} loss {loss.item():.5f}", flush=True)
            if step in (args.max_steps, args.stop_after):
                break
        epoch += 1
    ckpt.close()  # ckpt: waits for the last commit

    if args.record and rank == 0:
        torch.save(record, args.record)
    dist.destroy_process_group()


def gathered_ids(ids: torch.Tensor, world: int) -> list[int]:
    """The sample ids every rank trained on at this step, sorted (a collective)."""
    every = [None] * world
    dist.all_gather_object(every, ids.tolist())
    return sorted(i for rank_ids in every for i in rank_ids)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
