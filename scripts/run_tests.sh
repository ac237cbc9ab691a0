#!/usr/bin/env bash
# The whole test suite, in its own environment (.venv, created when missing): house style first, then pytest,
# with the type check (mypy) beside it.
#   ./scripts/run_tests.sh            everything (what CI runs), on 4 pytest-xdist workers
#   ./scripts/run_tests.sh --fast     tests/unit without `slow` (no spawned ranks, no end-to-end runs, no
#                                     Python processes of their own), on 2 workers, under a minute
#   ./scripts/run_tests.sh ARGS...    pytest ARGS on the workers (e.g. -m distributed); add `-n 0` for one
#                                     process (one file: tests/unit/test_gc.py -k retention -n 0)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
# Types (pyproject's [tool.mypy]: the package, strict for the public API and the plug-in contract), in the
# background while pytest runs and reported at the end: mypy is one process (~50 CPU-s from a cold cache, ~3 s
# warm). It runs only on CPU time nothing else wants (SCHED_IDLE): the tests all run at nice 19 (tests/conftest.py),
# so a mypy at nice 0 took a whole core from them for its first minute; the suite leaves ~14 % of its two cores idle
# (waits, rendezvous), more than mypy needs. The fast lane runs it too: a type error is the cheapest failure there.
mypy_log="$(mktemp)"
if command -v chrt >/dev/null && chrt --idle 0 true 2>/dev/null; then idle=(chrt --idle 0); else idle=(nice -n 19); fi
"${idle[@]}" .venv/bin/mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
status=0
if [ "${1:-}" = "--fast" ]; then
    shift
    # 2 workers, one a core: the fast lane is CPU-bound (~70 CPU-seconds), and each worker pays ~6 s to import
    # torch, Lightning and the test modules, so more workers than cores would only add that
    .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 -m "not distributed and not e2e and not slow" tests/unit "$@" || status=$?
else
    # 4 workers on 2 cores: most of the suite waits (process start-up, gloo rendezvous, polling, timeouts), so twice
    # the cores keeps both busy (tests/conftest.py hands out the long tests first and keeps tests that share a module
    # fixture on one worker). A later -n in ARGS wins.
    .venv/bin/python -m pytest -q -p no:cacheprovider -n 4 --dist loadgroup --no-loadscope-reorder --durations=25 "$@" || status=$?
fi
if ! wait "$mypy_pid"; then
    cat "$mypy_log"
    echo "mypy failed (the errors above); run it alone: .venv/bin/mypy" >&2
    status=1
fi
rm -f "$mypy_log"
exit "$status"
