#!/usr/bin/env bash
# The main job, in its own environment (.venv, created when missing): trains the small LM of
# recipes/lm.py on 2 CPU ranks with asynchronous sharded checkpoints under checkpoints/<run_name>.
# Extra arguments are Hydra overrides, e.g.: ./scripts/run_train.sh trainer.devices=3 trainer.max_steps=80 resume=latest
# (max_steps counts the whole run: a resume needs more than the finished run's, 40 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python recipes/train.py "$@"
