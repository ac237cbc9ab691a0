#!/usr/bin/env bash
# The main job, in its own environment (.venv, created when missing). Extra arguments go to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python recipes/demo.py "$@"
