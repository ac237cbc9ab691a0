"""Incremental vs full checkpoints of a 1 GiB model with 95% frozen parameters, in one run.

    python benchmarks/incremental.py                     1 GiB, 6 saves per mode
    python benchmarks/incremental.py --size-gib 0.25 --saves 3

One process, CPU. The model: float32 tensors of --tensor-mib each, --frozen of the bytes frozen (never
changed), the rest trainable with two Adam-like moment tensors each (the optimizer state). Before every
save a "training step" changes the trainable parameters and their moments in place (as an optimizer
step does), so the tracker sees them changed and the frozen ones unchanged.

Measured, per save after the first (the first of a run is full in both modes):
  bytes   the bytes of the checkpoint's own shard files
  pause   until CheckpointSaver.save() returns (the copy into staging memory: what training waits for)
  total   until .result() returns (written, verified, committed)
and, as the floor, a copy_ of the trainable state only (params + moments) into preallocated,
already-used buffers, timed right before each save (the machine's load varies; a ratio of medians).
Targets: incremental bytes <= 1.1x the trainable state; incremental pause <= 1.2x the copy of the
trainable state.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig


def build(size_gib: float, tensor_mib: int, frozen: float) -> tuple[dict, list[torch.Tensor]]:
    """A state dict {model: {...}, optim: {...}} and the list of tensors a training step changes."""
    numel = tensor_mib * 2**20 // 4
    count = max(2, round(size_gib * 1024 / tensor_mib))
    trainable_count = max(1, round(count * (1 - frozen)))
    model, optim, changing = {}, {}, []
    generator = torch.Generator().manual_seed(0)
    for index in range(count):
        tensor = torch.randn(numel, generator=generator)
        model[f"layer{index}.weight"] = tensor
        if index >= count - trainable_count:
            moments = {"exp_avg": torch.zeros(numel), "exp_avg_sq": torch.zeros(numel)}
            optim[f"layer{index}.weight"] = moments
            changing += [tensor, *moments.values()]
    return {"model": model, "optim": optim}, changing


def train_step(changing: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for tensor in changing:
            tensor.add_(1e-3)


def own_bytes(path: str) -> int:
    return sum(file.stat().st_size for file in Path(path).glob("*.distcp"))


class TrainableCopy:
    """The floor: a copy of the trainable state only into preallocated, already-used buffers."""

    def __init__(self, changing: list[torch.Tensor]) -> None:
        self.pairs = [(torch.empty_like(t), t) for t in changing]
        self.seconds()  # used memory, as staging buffers are after the first save

    def seconds(self) -> float:
        started = time.perf_counter()
        for buffer, tensor in self.pairs:
            buffer.copy_(tensor)
        return time.perf_counter() - started


def run_mode(
    root: str, state: dict, changing: list[torch.Tensor], incremental: bool, saves: int, floor: TrainableCopy
) -> list[dict]:
    config = SaveConfig(incremental=incremental, full_every_n=1000, overlap_staging=False, write_events=False)
    saver = CheckpointSaver(root, config)
    rows = []
    try:
        for step in range(saves + 1):
            train_step(changing)
            copy = floor.seconds()  # measured next to each save: the shared machine's load varies
            started = time.perf_counter()
            pending = saver.save(state, step)
            pause = time.perf_counter() - started
            result = pending.result(timeout=600)
            total = time.perf_counter() - started
            assert result.committed, result.error
            if step > 0:  # the first save of a run is full in both modes
                rows.append({"bytes": own_bytes(result.path), "pause": pause, "total": total, "copy": copy})
    finally:
        saver.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--tensor-mib", type=int, default=16)
    parser.add_argument("--frozen", type=float, default=0.95)
    parser.add_argument("--saves", type=int, default=6, help="measured saves per mode (after the first, full one)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    state, changing = build(args.size_gib, args.tensor_mib, args.frozen)
    model_bytes = sum(t.numel() * 4 for t in state["model"].values())
    trainable_state = sum(t.numel() * 4 for t in changing)
    floor = TrainableCopy(changing)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-incremental-"))
    results = {}
    try:
        for mode in ("full", "incremental"):
            root = str(workdir / mode)
            results[mode] = run_mode(root, state, changing, mode == "incremental", args.saves, floor)
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def median(mode: str, key: str) -> float:
        return statistics.median(row[key] for row in results[mode])

    copy_s = median("incremental", "copy")
    print(
        f"model {model_bytes / 2**30:.2f} GiB, {args.frozen:.0%} frozen; trainable state (params + 2 moments) "
        f"{trainable_state / 2**20:.0f} MiB; copy of the trainable state {copy_s:.4f} s "
        "(median, measured right before each incremental save)"
    )
    print(
        f"{'mode':<12} {'bytes MiB':>10} {'pause s':>9} {'total s':>9}   (medians over {args.saves} saves after the first)"
    )
    for mode in ("full", "incremental"):
        print(
            f"{mode:<12} {median(mode, 'bytes') / 2**20:>10.1f} {median(mode, 'pause'):>9.4f} {median(mode, 'total'):>9.3f}"
        )
    bytes_ratio = median("incremental", "bytes") / trainable_state
    pause_ratio = median("incremental", "pause") / copy_s
    print(
        f"incremental vs full: bytes {median('incremental', 'bytes') / median('full', 'bytes'):.3f}x, "
        f"pause {median('incremental', 'pause') / median('full', 'pause'):.3f}x, "
        f"total {median('incremental', 'total') / median('full', 'total'):.3f}x"
    )
    print(
        f"incremental bytes / trainable state = {bytes_ratio:.3f} (target <= 1.1: {'met' if bytes_ratio <= 1.1 else 'MISSED'})"
    )
    print(
        f"incremental pause / copy of trainable state = {pause_ratio:.3f} (target <= 1.2: {'met' if pause_ratio <= 1.2 else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
