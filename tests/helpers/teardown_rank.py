"""One rank of a plain-torch job that saves in the background and exits: `python -m tests.helpers.teardown_rank ROOT SAVES`.

Started once per rank with torch's env:// variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE). It
does what a training script's end does: the last save is still in flight when it closes the saver,
destroys the checkpoint group and the default group, and returns from main. The exit status and the
output are the verdict (tests/distributed/test_teardown.py).
"""

from __future__ import annotations

import sys


def main(root: str, saves: int) -> int:
    import torch
    import torch.distributed as dist

    from lightning_shardckpt.engine.config import SaveConfig
    from lightning_shardckpt.engine.save.saver import CheckpointSaver

    dist.init_process_group("gloo")
    saver = CheckpointSaver(root, SaveConfig(async_save=True, teardown_timeout_s=60, collective_timeout_s=60))
    state = {"w": torch.randn(256, 256), "step": torch.zeros(())}
    for step in range(1, saves + 1):
        state["w"].add_(1.0)
        state["step"].fill_(step)
        saver.save(state, step=step)
    saver.close()  # the last save is in flight here
    assert saver.stopped, "close() returned with the checkpoint worker still running"
    dist.destroy_process_group(saver.group)
    dist.destroy_process_group()
    print(f"rank {dist.get_rank() if dist.is_initialized() else '-'}: done, {saver.counters.snapshot()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
