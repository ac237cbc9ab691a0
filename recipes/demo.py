"""Engine demo: save an FSDP2-sharded model + AdamW on 2 CPU ranks, load it back on 1 and on 3 ranks.

Run: python recipes/demo.py [--dirpath checkpoints/demo]   (it starts its own ranks; no torchrun)

The engine directly (CheckpointSaver, load_checkpoint). Running it again continues the same run: the save
phase loads the newest checkpoint first and creates the saver with that checkpoint's run id, which the
root's owner check requires. `lightning_shardckpt.Checkpointer` does this for you in a training loop
(recipes/plain_fsdp.py, docs/howto/plain-pytorch.md).
"""

from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_shardckpt import CheckpointNotFound, CheckpointSaver, SaveConfig, load_checkpoint


def build(world_size: int, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 509), torch.nn.GELU(), torch.nn.Linear(509, 256))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def checksum_of(model) -> float:
    with torch.no_grad():
        return float(sum(p.full_tensor().double().sum() for p in model.parameters()))


def rank_main(rank: int, world_size: int, port: int, mode: str, dirpath: str, queue) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    model, optimizer = build(world_size, seed=0 if mode == "save" else 123)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "progress": {"step": 0}}
    if mode == "save":
        run_id = None  # a new run: the saver generates an id and claims the root
        try:
            # a second demo run continues the first: its state, and its run id, or the saver is refused
            run_id = load_checkpoint(state, dirpath).manifest["run_id"]
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        except CheckpointNotFound:
            pass
        for _ in range(3):
            model(torch.randn(16, 256)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        step = state["progress"]["step"] + 3
        state = {"model": model_sd, "optim": optim_sd, "progress": {"step": step}}
        saver = CheckpointSaver(dirpath, SaveConfig(parallelism="fsdp", run_id=run_id))  # created after the load
        result = saver.save(state, step=step).result()
        saver.close()
        message = (
            f"saved step {step} -> {result.path} (run {saver.run_id}, committed={result.committed}, "
            f"{result.bytes_rank} bytes from this rank)"
        )
    else:
        result = load_checkpoint(state, dirpath)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        message = f"loaded {result.path} (step {result.step}) in {result.seconds:.2f}s, progress={state['progress']}"
    total = checksum_of(model)
    if rank == 0:
        queue.put((message, total))
    dist.destroy_process_group()


def run(world_size: int, mode: str, dirpath: str):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(
        rank_main, args=(world_size, port, mode, dirpath, queue), nprocs=world_size, start_method="spawn"
    )
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirpath", default="checkpoints/demo", help="checkpoint root: a local path or an fsspec URL")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    message, saved_sum = run(2, "save", args.dirpath)
    print(f"[2 ranks] {message}; parameter sum {saved_sum:.6f}")
    for world_size in (1, 3):
        message, loaded_sum = run(world_size, "load", args.dirpath)
        status = "bit-exact" if loaded_sum == saved_sum else "MISMATCH"
        print(f"[{world_size} ranks] {message}; parameter sum {loaded_sum:.6f} ({status})")
        if loaded_sum != saved_sum:
            raise SystemExit(1)
    print(f"inspect it: .venv/bin/shardckpt ls {args.dirpath}")


if __name__ == "__main__":
    main()
