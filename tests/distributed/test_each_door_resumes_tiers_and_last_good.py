"""Issue 38: one resume for three doors. A tiered run (fast + durable, every commit copied) written by a plain loop's
Checkpointer on 2 real gloo ranks, step 2 proven by a real restore drill; then the Trainer, Fabric and the
Checkpointer each resume `latest` with the same tiers and `fallback_to_last_good`:

- step 3's fast copy damaged (same size, one byte flipped): every door loads step 3 from the durable copy;
- its durable copy damaged too: every door falls back to the last known-good, step 2;

and every door says so in the same console line (path, step, world size before -> after, tier, seconds).
"""

from __future__ import annotations

import json
import re

import pytest

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format.names import join
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.policies.drills.runner import run_drill
from tests.helpers.spawn import run_ranks, values
from tests.helpers.tiered_doors import DOORS, each_door_resumes, flip_byte, write_tiered

pytestmark = pytest.mark.timeout(420)

LINE = re.compile(r"^lightning_shardckpt: resumed from (\S+) \(step (\d+)\) on 2 -> 2 ranks, (fast|durable) tier, in ")


def weight_bytes_of(root: str, step: int) -> tuple[str, int]:
    """(file, byte offset) in the middle of the stored record of the model's first weight: every door reads it."""
    location = fsio.resolve(root)
    (entry,) = [e for e in catalog.list_checkpoints(location) if e.step == step and e.committed]
    # format v4: a chunk's record is in the part of the rank that wrote it
    for part_file in sorted(
        f["path"] for f in manifest_format.files_of(entry.manifest) if f["path"].endswith(".part.json")
    ):
        part = json.loads(location.fs.cat_file(join(entry.path, part_file)))
        for chunk in part["chunks"]:
            if chunk["fqn"] == "model.net.0.weight":
                return join(entry.path, part["file"]), chunk["offset"] + chunk["length"] // 2
    raise AssertionError(f"no part of {entry.path} holds model.net.0.weight")


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("tiered"))
    run_ranks(write_tiered, 2, workdir, timeout_s=180)
    fast = fsio.resolve(f"{workdir}/fast")
    (two,) = [e for e in catalog.list_checkpoints(fast) if e.step == 2]
    assert run_drill(join(fast.url, two.name))["verdict"] == "passed"  # step 2 is the last known-good
    flip_byte(*weight_bytes_of(f"{workdir}/fast", 3))
    durable_weight = weight_bytes_of(f"{workdir}/durable", 3)
    return values(run_ranks(each_door_resumes, 2, workdir, durable_weight, timeout_s=360)), workdir


@pytest.mark.parametrize("door", list(DOORS))
def test_a_damaged_fast_copy_resumes_from_the_durable_copy_in_every_door(rounds, door):
    ranks, workdir = rounds
    for rank in ranks:
        resumed = rank["fast copy damaged"][door]
        assert resumed["step"] == 3 and resumed["path"].startswith(f"{workdir}/durable/"), resumed
    (line,) = [line for line in ranks[0]["fast copy damaged"][door]["lines"] if LINE.match(line)]
    assert LINE.match(line).groups()[1:] == ("3", "durable"), line
    assert not [line for line in ranks[1]["fast copy damaged"][door]["lines"] if LINE.match(line)]  # rank 0 says it


@pytest.mark.parametrize("door", list(DOORS))
def test_both_copies_damaged_falls_back_to_the_last_known_good_in_every_door(rounds, door):
    ranks, workdir = rounds
    for rank in ranks:
        resumed = rank["both copies damaged"][door]
        assert resumed["step"] == 2 and resumed["path"].startswith(f"{workdir}/fast/"), resumed
    (line,) = [line for line in ranks[0]["both copies damaged"][door]["lines"] if LINE.match(line)]
    assert LINE.match(line).groups()[1:] == ("2", "fast"), line
