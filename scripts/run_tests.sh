#!/usr/bin/env bash
# The whole test suite, in its own environment (.venv, created when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
