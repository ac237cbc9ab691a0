"""A Fabric FSDP2 training loop with sharded, asynchronous, committed checkpoints (docs/howto/fabric.md).

    python recipes/fabric_fsdp.py --root checkpoints/fabric --devices 2 --max-steps 8   # Fabric starts 2 CPU ranks
    python recipes/fabric_fsdp.py --root checkpoints/fabric --devices 1 --max-steps 12  # resume its latest on 1 rank
    torchrun --nproc-per-node 2 recipes/fabric_fsdp.py --root checkpoints/fabric --devices 2   # or torchrun starts them

Every run resumes from the newest committed checkpoint under --root (or --resume PATH; nothing under --root:
a fresh start), trains to --max-steps and saves every --save-every steps and at the end. `fabric.save` returns
once the state is copied; the write and commit run while training goes on. `--record DIR` (tests) writes the
samples every step trained on and the full parameters at the start and at every save.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, Dataset

from lightning_shardckpt import ShardedFabricStrategy


class IndexedData(Dataset):
    """Random regression pairs that also return their index, so a run can show which samples it trained on."""

    def __init__(self, size: int = 40) -> None:
        generator = torch.Generator().manual_seed(3)
        self.inputs = torch.randn(size, 13, generator=generator)
        self.targets = torch.randn(size, 5, generator=generator)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        return index, self.inputs[index], self.targets[index]


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 13, 7, 5: no world size from 2 to 4 divides them evenly, so the shards are uneven
        self.net = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="checkpoint root: saves go here, 'latest' resumes from here")
    parser.add_argument("--resume", default="latest", help="'latest' (under --root), a checkpoint path, or 'none'")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--parallelism", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--record", default=None, help="tests: a directory for samples and parameters")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    strategy = ShardedFabricStrategy(parallelism=args.parallelism, root=args.root)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()  # with devices > 1 and no torchrun: starts the other ranks by running this script again
    fabric.seed_everything(0)  # the same initial model on every rank (FSDP2 shards it in setup_module)

    model = fabric.setup_module(TinyNet())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))  # after sharding
    # a plain shuffled loader: Fabric injects a DistributedSampler, the strategy makes it resumable
    loader = fabric.setup_dataloaders(DataLoader(IndexedData(), batch_size=args.batch_size, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "train_dataloader": loader, "step": 0}
    if args.resume != "none":
        fabric.load(args.resume, state)  # restores all four in place; an empty --root starts fresh
    record = Recorder(fabric, model, args.record)
    record.params(f"start-{state['step']}")

    sampler = loader.sampler  # FabricResumableSampler: where in the data we are
    while state["step"] < args.max_steps:
        for indices, inputs, targets in loader:  # continues the saved epoch at the saved position
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            sampler.mark_consumed(1, args.batch_size)  # these samples are trained on: a resume starts after them
            state["step"] += 1
            record.samples(state["step"], indices)
            if state["step"] % args.save_every == 0 or state["step"] == args.max_steps:
                fabric.save(args.root, state)  # returns after staging; commits in the background
                record.params(f"step-{state['step']}")
            if state["step"] >= args.max_steps:
                break
    fabric.strategy.close()  # wait for the last checkpoint to commit
    fabric.print(f"trained to step {state['step']}; checkpoints under {args.root}")


class Recorder:
    """Tests only (`--record DIR`): what each step trained on and the full parameters at named points."""

    def __init__(self, fabric: Fabric, model: torch.nn.Module, directory: str | None) -> None:
        self.fabric, self.model = fabric, model
        self.directory = Path(directory) if directory else None
        if self.directory is not None and fabric.global_rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)

    def samples(self, step: int, indices: torch.Tensor) -> None:
        if self.directory is None:
            return
        gathered = self.fabric.all_gather(indices)  # (world, batch) on every rank
        if self.fabric.global_rank == 0:
            with open(self.directory / "samples.jsonl", "a") as out:
                out.write(json.dumps({"step": step, "samples": gathered.reshape(-1).tolist()}) + "\n")

    def params(self, name: str) -> None:
        if self.directory is None:
            return
        full = get_model_state_dict(self.model.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.fabric.global_rank == 0:
            torch.save(full, self.directory / f"{name}.pt")


if __name__ == "__main__":
    main()
