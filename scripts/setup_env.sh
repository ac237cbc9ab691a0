#!/usr/bin/env bash
# Create and fill .venv when missing or when pyproject.toml changed. Idempotent; ~1 minute the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ -f "$STAMP" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# torch first and pinned: 2.13.0 is a CPU wheel on local disk; an unpinned torch pulls a multi-GB CUDA build.
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet -e ".[dev]"
rm -f "$VENV"/.installed-*
touch "$STAMP"
