"""Saves onto storage that runs out of space, in a process of their own: an abort shows as its exit code.

    python -m tests.helpers.full_disk ROOT_URL OPTIONS_JSON BUDGETS_JSON [--async]

For each budget in BUDGETS_JSON (bytes of a quota:// disk of its own; `null` for a plain root) a fresh saver saves one small state
under ROOT_URL/b<i> with `on_error="log"`; the results are kept alive (as a training loop keeps the
saver and its first error) until a final `gc.collect()` and a normal interpreter exit. Prints one JSON
line: the outcome and cause of every save. The exit status is the verdict: 134 (SIGABRT) is the bug
of a half-written tensor record whose C++ writer throws from its destructor.

Also: `mounted_tmpfs`, a real small tmpfs for a test (root only); `mounted_ext4`, a real small ext4 disk on a loop
device, which (unlike tmpfs) takes O_DIRECT writes (root, mkfs.ext4 and a loop device).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def mounted_tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of `size` (e.g. "4m") on `directory` for the duration; raises PermissionError if refused."""
    directory.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise PermissionError(f"mount -t tmpfs refused ({proc.returncode}): {proc.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


@contextlib.contextmanager
def mounted_ext4(directory: Path, size_mib: int) -> Iterator[Path]:
    """Mount an ext4 filesystem of `size_mib` MiB (no journal, nothing reserved) from an image file beside
    `directory`, on a loop device, for the duration; raises PermissionError where that is refused."""
    directory.mkdir(parents=True, exist_ok=True)
    image = directory.parent / f"{directory.name}.ext4"
    with open(image, "wb") as handle:
        handle.truncate(size_mib * 2**20)
    try:
        made = subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", str(image)], capture_output=True, text=True
        )
    except FileNotFoundError as err:
        raise PermissionError(f"no mkfs.ext4 here: {err}") from err
    if made.returncode != 0:
        raise PermissionError(f"mkfs.ext4 refused ({made.returncode}): {made.stderr.strip()}")
    proc = subprocess.run(["mount", "-o", "loop", str(image), str(directory)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise PermissionError(f"mount -o loop refused ({proc.returncode}): {proc.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(
            ["umount", "-l", str(directory)], capture_output=True
        )  # the loop device clears itself (autoclear)


def run_saves(
    root_url: str, options: dict, budgets: list, *, async_save: bool = False, timeout: float = 120
) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tests.helpers.full_disk", root_url, json.dumps(options), json.dumps(budgets)]
    if async_save:
        command.append("--async")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def state() -> dict:
    import torch

    generator = torch.Generator().manual_seed(0)
    return {
        "small": torch.randn(7, generator=generator),
        "weights": torch.randn(64, 1024, generator=generator),  # 256 KiB
        "bias": torch.randn(1024, generator=generator),
        "note": {"step": 3, "text": "x" * 300},
    }


def main(argv: list[str]) -> int:
    import torch  # noqa: F401  (before the saver: the same import order as a training script)

    from lightning_shardckpt.engine.config import SaveConfig
    from lightning_shardckpt.engine.save.saver import CheckpointSaver
    from tests.helpers import quota_fs  # noqa: F401  (registers quota://)

    root_url, options, budgets = argv[0], json.loads(argv[1]), json.loads(argv[2])
    async_save = "--async" in argv
    kept, report = [], []
    for index, budget in enumerate(budgets):
        storage_options = dict(options)
        if budget is not None:  # a quota:// root: each save gets a disk of its own, `budget` bytes large
            storage_options.update(quota_fs.quota_options(root_url.split("://", 1)[1] + f"/b{index}", budget))
        config = SaveConfig(
            async_save=async_save, on_error="log", storage_options=storage_options, teardown_timeout_s=60
        )
        saver = CheckpointSaver(f"{root_url}/b{index}", config)
        result = saver.save(state(), step=index + 1).result(timeout=60)
        saver.close()
        kept.append((saver, result))  # a training loop keeps its saver, and the saver its first error
        report.append(
            {
                "budget": budget,
                "committed": result.committed,
                "cause": None if result.error is None else str(result.error),
                "counters": saver.counters.snapshot(),
            }
        )
    gc.collect()
    print(json.dumps(report))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
