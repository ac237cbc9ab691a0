#!/usr/bin/env bash
# Create and fill .venv when missing or when pyproject.toml changed. Idempotent; ~1 minute the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.installed-$(cat pyproject.toml scripts/setup_env.sh | sha1sum | cut -c1-12)"
if [ -f "$STAMP" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# torch first and pinned: 2.13.0 is a CPU wheel on local disk; an unpinned torch pulls a multi-GB CUDA build.
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet -e ".[dev]"
# transformers, for the tests of Fabric's wrapping of HF models (tiny Llama and GPT-2 built from a config), in a
# directory of its own that only those tests put on their path (tests/helpers/hf_tiny.py): installed in the venv,
# torchmetrics (which `import lightning` imports) would import it in every Lightning process of the suite, ~0.7 s
# each. 5.x: the version the tests were written against.
"$VENV/bin/python" -m pip install --quiet --target "$VENV/hf-site" "transformers>=5.0,<6"
rm -f "$VENV"/.installed-*
touch "$STAMP"
