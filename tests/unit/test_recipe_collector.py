"""The main job's start-up without garbage collection (recipes/train.py): off only in the job's own process, frozen
once after the imports, never again.

A later job of a Hydra multirun runs `main` again in the same process; freezing then would put the previous job's
trainer and model in the permanent generation, where their reference cycles are never collected. Each case runs in
its own interpreter: the collector's state is per process, and the test worker's own must not change.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"

LOAD = f"""
import gc, importlib.util, json
spec = importlib.util.spec_from_file_location("shardckpt_recipe_train", {str(TRAIN)!r})
train = importlib.util.module_from_spec(spec)
"""


def run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", LOAD + code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_module_loading_the_recipe_keeps_its_collector_on():
    seen = run("spec.loader.exec_module(train)\nprint(json.dumps({'enabled': gc.isenabled()}))")
    assert seen == {"enabled": True}


def test_the_job_freezes_once_and_a_second_multirun_job_freezes_nothing():
    seen = run(
        "gc.disable()  # as the top of the file does when it runs as the job\n"
        "spec.loader.exec_module(train)\n"
        "train.imports_done()  # the first job, after its imports\n"
        "first = gc.get_freeze_count()\n"
        "previous_job = [[object()] for _ in range(50_000)]  # what a finished job leaves to the collector\n"
        "train.imports_done()  # the second job of the multirun\n"
        "print(json.dumps({'enabled': gc.isenabled(), 'first': first, 'second': gc.get_freeze_count()}))"
    )
    assert seen["enabled"] and seen["first"] > 0
    assert seen["second"] == seen["first"], "the second job froze the first job's objects"
