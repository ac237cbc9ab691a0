"""The main job (recipes/train.py) started as `world` externally launched ranks, as torchrun or SLURM would.

Each rank is a process of the test's own, with its own log file, so each rank's exit status and output can
be checked (Lightning's own launcher would re-run the script and ignore how ranks 1..N-1 exit).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.spawn import free_port, launched_rank_env

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"


def start_recipe_ranks(workdir: Path, world: int, *overrides: str) -> list[tuple[subprocess.Popen, Path]]:
    """Start the recipe's ranks under `workdir` (checkpoints in workdir/ckpt); (process, log path) per rank."""
    port = free_port()
    ranks = []
    for rank in range(world):
        command = [
            sys.executable,
            str(TRAIN),
            f"hydra.run.dir={workdir / 'hydra'}",
            f"checkpoint.dirpath={workdir / 'ckpt'}",
            f"trainer.devices={world}",
            "trainer.enable_progress_bar=false",
            *overrides,
        ]
        log = workdir / f"rank{rank}.log"
        with open(log, "w") as out:
            env = launched_rank_env(rank, world, port)
            ranks.append((subprocess.Popen(command, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT), log))
    return ranks
