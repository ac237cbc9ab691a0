#!/usr/bin/env bash
# The whole test suite, in its own environment (.venv, created when missing): house style first, then pytest.
#   ./scripts/run_tests.sh            everything (what CI runs)
#   ./scripts/run_tests.sh --fast     unit tests only (no spawned ranks, no end-to-end runs), about 2 minutes
#   ./scripts/run_tests.sh ARGS...    pytest ARGS (e.g. tests/unit/test_gc.py -k retention)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
if [ "${1:-}" = "--fast" ]; then
    shift
    exec .venv/bin/python -m pytest -q -p no:cacheprovider -m "not distributed and not e2e and not slow" "$@"
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"  # the slowest 25: where the 15-minute budget goes
