"""Drill a checkpoint root from the command line (options in conf/drill.yaml):

    python recipes/drill.py                                   # the main job's latest checkpoint, 1 rank, lm:probe
    python recipes/drill.py root=s3://bucket/run-7 which=500 world_size=2
    python recipes/drill.py follow=true root=s3://bucket/run-7    # the drill service (drill.mode=external runs)

Exit status: 0 when the drill passed, 1 when it failed or could not run (the record says why); a follower
exits 0 when stopped.
"""

from __future__ import annotations

import json
import os
import sys

RECIPES_DIR = os.path.dirname(os.path.abspath(__file__))
if RECIPES_DIR not in sys.path:  # the probe `lm:probe` lives next to this file
    sys.path.insert(0, RECIPES_DIR)

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402


@hydra.main(config_path="../conf", config_name="drill", version_base="1.3")
def main(cfg: DictConfig) -> int:
    from lightning_shardckpt.engine.validate import require_bool
    from lightning_shardckpt.policies.drills.runner import DrillOptions, run_drill
    from lightning_shardckpt.policies.drills.trust import spec_of

    options = DrillOptions(
        world_size=cfg.world_size,
        timeout_s=cfg.timeout_s,
        threads=cfg.threads,
        keep_memory_gib=cfg.keep_memory_gib,
        probe=cfg.probe,
        tolerance=cfg.tolerance,
        trust_checkpoint=cfg.trust_checkpoint,
        safe_globals=tuple(spec_of(name) for name in cfg.allow_globals),
        storage_options=OmegaConf.to_container(cfg.storage_options, resolve=True),
        # a windowed entry ({path, not_after_step, not_after}) stays a mapping; DrillOptions checks it
        public_keys=OmegaConf.to_container(cfg.public_keys, resolve=True) if cfg.get("public_keys") else (),
        revoked_keys=tuple(cfg.get("revoked_keys") or ()),
    )
    if require_bool("follow", cfg.follow):  # a quoted "false" is truthy: it would start the service
        from lightning_shardckpt.policies.drills.follower import DrillFollower

        follower = DrillFollower(
            cfg.root, options, every_n_checkpoints=cfg.every_n_checkpoints, interval_s=cfg.interval_s
        )
        follower.run(exit_when_idle_s=cfg.exit_when_idle_s)
        return 0
    record = run_drill(str(cfg.which), options, root=cfg.root)
    print(
        json.dumps(
            {
                key: record.get(key)
                for key in (
                    "checkpoint",
                    "verdict",
                    "cause",
                    "unpickle_trust",
                    "world_size",
                    "writer_world_size",
                    "time_to_resume_s",
                    "read_gbps",
                )
            },
            indent=1,
        )
    )
    if record["verdict"] != "passed":
        sys.exit(1)
    return 0


if __name__ == "__main__":
    main()
