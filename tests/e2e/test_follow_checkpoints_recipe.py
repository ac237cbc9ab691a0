"""A script outside the tests, using only `from lightning_shardckpt import ...`, lists, picks, inspects and waits
for checkpoints on local disk and on the loopback S3 server (issue 38, item 6: recipes/follow_checkpoints.py, what an
evaluation job beside training runs), against a root committed by real saves and a save that commits while it waits.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from lightning_shardckpt import CheckpointSaver
from lightning_shardckpt.engine.format import drill_records
from tests.helpers.backends import Backend
from tests.helpers.checkpoints import RUN_ID, dirname_of, fresh_state

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "recipes" / "follow_checkpoints.py"


def save(backend: Backend, step: int) -> str:
    saver = CheckpointSaver(backend.url, backend.save_config(async_save=False, run_id=RUN_ID))
    try:
        result = saver.save(fresh_state(seed=step), step=step).result(timeout=60)
    finally:
        saver.close()
    assert result.committed, result.error
    return dirname_of(result.manifest)


def test_the_script_imports_only_the_public_api():
    tree = ast.parse(SCRIPT.read_text())
    ours = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    modules = {node.module for node in ours if isinstance(node, ast.ImportFrom)}
    modules |= {alias.name for node in ours if isinstance(node, ast.Import) for alias in node.names}
    assert {m for m in modules if m and m.startswith("lightning_shardckpt")} == {"lightning_shardckpt"}


def test_the_follow_script_lists_picks_inspects_and_waits_for_a_commit(backend):
    ten, twenty = save(backend, 10), save(backend, 20)
    record = {"checkpoint": ten, "drill_id": drill_records.new_drill_id(), "verdict": drill_records.PASSED}
    drill_records.write_record(backend.location(), record)
    options = [f"--storage-option={key}={json.dumps(value)}" for key, value in backend.storage_options.items()]
    command = [sys.executable, str(SCRIPT), backend.url, "--pick", "10", "--pick", "77"]
    command += ["--timeout", "60", "--poll", "0.2", "--count", "1", *options]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        before = []
        while not (line := process.stdout.readline()).startswith("waiting for new commits"):
            assert line, f"the script ended before waiting: {''.join(before)}{process.stderr.read()}"
            before.append(line)
        thirty = save(backend, 30)  # commits while the script waits
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, err
    printed = "".join(before) + out
    assert f"root {backend.url}: 2 checkpoint(s), committed steps [10, 20]" in printed
    assert f"latest: {backend.url}/{twenty}" in printed and f"last-good: {backend.url}/{ten}" in printed
    assert f"pick 10: {backend.url}/{ten}" in printed and "pick 77: no committed checkpoint 77 in" in printed
    assert f"inspect {backend.url}/{twenty}: step 20, saved on 1 rank(s)" in printed
    assert f"new commit: {backend.url}/{thirty} (step 30, committed)" in printed
    assert printed.rstrip().endswith("done: 1 new commit(s)") and "Traceback" not in err
