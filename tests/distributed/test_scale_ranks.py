"""As many gloo ranks as this machine holds: a format-v4 checkpoint saved on 32 ranks resumes on 7, bit-exact.

The protocol end to end at a world size where a per-chunk coordinator would already show (issue 35): 32 ranks
each write a shard and a part; rank 0 commits from 32 summaries; the manifest lists tensors by rule (row-sharded
over 32) and no chunk; each of 7 new ranks plans its share from the parts it needs (those of the old ranks
whose rows overlap its own, not all 32) and reads exactly its rows, every byte checked. Tiny tensors: what is measured is the metadata path.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_shardckpt import CheckpointSaver, LoadConfig, SaveConfig, SignConfig, load_checkpoint
from lightning_shardckpt.engine.catalog import list_checkpoints
from lightning_shardckpt.engine.format import chunk_layout, groups, parts_manifest
from lightning_shardckpt.engine.format import parts as part_format
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.ops.verify import verify_checkpoint
from tests.helpers import counting_fs
from tests.helpers.row_sharded import COLUMNS, global_tensor, loaded_exactly, row_sharded_state, shard_rows
from tests.helpers.signing_keys import Keys
from tests.helpers.spawn import run_ranks

SAVED_ON, LOADED_ON = 32, 7
NOTE = "saved-on-32"


def save_on_32(rank, world_size, root, group_size=None, key_path=None):
    if group_size is not None:  # format v5 in groups of `group_size` (a tests-only variable)
        os.environ[groups.GROUP_SIZE_ENV] = str(group_size)
    sign = SignConfig(key_path=key_path) if key_path else SignConfig()
    saver = CheckpointSaver(root, SaveConfig(async_save=False, write_events=False, collective_timeout_s=120, sign=sign))
    result = saver.save(row_sharded_state(rank, world_size, zeros=False, note=NOTE), step=7).result(timeout=120)
    saver.close()
    assert result.committed, result.error
    return result.manifest if rank == 0 else None


def load_on_7(rank, world_size, root, public_key=None):
    state = row_sharded_state(rank, world_size, zeros=True, note=NOTE)
    policy = LoadConfig(require_signature=True, public_keys=[public_key]) if public_key else None
    result = load_checkpoint(state, root, config=policy)
    exact = loaded_exactly(state)
    return {
        "step": result.step,
        "exact": exact,
        "scalar": int(state["model"]["step"]),
        "progress": state["progress"],
        "parts_read": result.parts_read,
    }


def test_a_checkpoint_saved_on_32_ranks_resumes_on_7_bit_exact_reading_only_the_parts_each_needs(tmp_path):
    root = str(tmp_path / "ckpt")
    manifest = run_ranks(save_on_32, SAVED_ON, root, timeout_s=240, pg_timeout_s=120)[0].value

    assert manifest["format_version"] == 4 and manifest["parts"]["count"] == SAVED_ON
    assert all("chunks" not in tensor for tensor in manifest["tensors"])  # per checkpoint, not per chunk
    weight = next(t for t in manifest["tensors"] if t["fqn"] == "model.layer00.weight")
    assert weight["layout"] == {"rank": 0, "split": [[0, SAVED_ON, 1]]}  # one rule, not 32 entries
    writers = parts_manifest.writing_ranks(manifest)
    assert writers == list(range(SAVED_ON))  # 96 rows: every rank holds 3 and wrote a part
    five_rows = chunk_layout.from_json(
        next(t for t in manifest["tensors"] if t["fqn"] == "model.layer03.weight")["layout"]
    )
    assert len(list(chunk_layout.cells(five_rows, [5, COLUMNS]))) == SAVED_ON  # 27 empty chunks, written as DCP does
    [entry] = list_checkpoints(resolve(root))
    assert entry.committed

    loaded = [o.value for o in run_ranks(load_on_7, LOADED_ON, root, timeout_s=240, pg_timeout_s=120)]
    assert all(r["step"] == 7 and r["exact"] and r["scalar"] == 7 for r in loaded), loaded
    assert all(r["progress"] == {"global_step": 7, "note": "saved-on-32"} for r in loaded)
    # each new rank reads the parts of exactly the old ranks whose rows overlap its own (and rank 0, the coordinator,
    # rank 0's part, which holds the objects and the replicated scalar it reads for every rank): never all 32
    expected = [len(_old_ranks_overlapping(manifest, rank)) for rank in range(LOADED_ON)]
    assert [r["parts_read"] for r in loaded] == expected and max(expected) < SAVED_ON, expected


def test_a_v5_checkpoint_saved_on_32_ranks_in_4_groups_resumes_on_7_bit_exact(tmp_path):
    """The two-step gather at the largest world here: 4 leaders (ranks 7, 15, 23, 31) each hear 7 members, rank 0
    hears the 4 leaders."""
    root = str(tmp_path / "ckpt")
    manifest = run_ranks(save_on_32, SAVED_ON, root, 8, timeout_s=240, pg_timeout_s=120)[0].value

    assert manifest["format_version"] == 5 and "parts" not in manifest
    assert manifest["groups"]["writers"] == [8, 8, 8, 8]  # 96 rows: every rank wrote, per group of 8
    [entry] = list_checkpoints(resolve(root))
    expanded = groups.expanded(resolve(root).fs, entry.path, entry.manifest)
    assert parts_manifest.writing_ranks(expanded) == list(range(SAVED_ON))

    loaded = [o.value for o in run_ranks(load_on_7, LOADED_ON, root, timeout_s=240, pg_timeout_s=120)]
    assert all(r["step"] == 7 and r["exact"] and r["scalar"] == 7 for r in loaded), loaded
    assert all(r["progress"] == {"global_step": 7, "note": "saved-on-32"} for r in loaded)
    expected = [len(_old_ranks_overlapping(manifest, rank)) for rank in range(LOADED_ON)]
    assert [r["parts_read"] for r in loaded] == expected


def test_a_signed_v5_checkpoint_saved_on_32_ranks_in_4_groups_resumes_on_7_bit_exact_under_require_signature(
    tmp_path,
):
    """Signed at scale (issue 46): the digests chained manifest -> 4 group tables -> 32 parts -> each chunk, and each
    of 7 new ranks checks only what it reads under the policy; the forged-byte refusals are test_signed_v5.py's."""
    keys = Keys.make(tmp_path)
    root = str(tmp_path / "ckpt")
    manifest = run_ranks(save_on_32, SAVED_ON, root, 8, keys.private, timeout_s=240, pg_timeout_s=120)[0].value

    assert manifest["format_version"] == 5 and manifest["groups"]["writers"] == [8, 8, 8, 8]
    assert len(manifest["groups"][groups.TABLE_DIGESTS]) == 64 * 4  # each table bound by its digest
    loaded = [o.value for o in run_ranks(load_on_7, LOADED_ON, root, keys.public, timeout_s=240, pg_timeout_s=120)]
    assert all(r["step"] == 7 and r["exact"] and r["scalar"] == 7 for r in loaded), loaded
    assert all(r["progress"] == {"global_step": 7, "note": "saved-on-32"} for r in loaded)
    expected = [len(_old_ranks_overlapping(manifest, rank)) for rank in range(LOADED_ON)]
    assert [r["parts_read"] for r in loaded] == expected


def _old_ranks_overlapping(manifest: dict, rank: int) -> set[int]:
    ranks = {0} if rank == 0 else set()  # the coordinator reads rank 0's part for what it sends every rank
    for tensor in manifest["tensors"]:
        if tensor["shape"] == []:
            continue
        rows = tensor["shape"][0]
        piece = -(-rows // LOADED_ON)
        start = min(rank * piece, rows)
        box = ((start, 0), (min(piece, rows - start), COLUMNS))
        layout = chunk_layout.from_json(tensor["layout"])
        ranks |= {cell.rank for cell in chunk_layout.cells_within(layout, tensor["shape"], box)}
    return ranks


# --- no hot object on resume, no empty record (issue 46, item 4) ---


@pytest.fixture(scope="module")
def saved_32_in_groups_of_8(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hot") / "ckpt")
    manifest = run_ranks(save_on_32, SAVED_ON, root, 8, timeout_s=240, pg_timeout_s=120)[0].value
    return root, manifest


def test_ranks_holding_no_rows_of_a_tensor_write_no_record_for_it_and_a_plain_dcp_load_still_reads_it(
    saved_32_in_groups_of_8,
):
    """FSDP2's uneven Shard(0): a [5, 8] tensor on 32 ranks leaves ranks 5..31 without a row; they write nothing for
    it (before: 27 records of zero elements, ~1.5 KB of DCP header each, in their files and parts)."""
    root, manifest = saved_32_in_groups_of_8
    [entry] = list_checkpoints(resolve(root))
    directory = Path(entry.path)
    records = []
    for rank in range(SAVED_ON):
        part = json.loads((directory / part_format.part_filename(rank)).read_bytes())
        records += [(rank, chunk["fqn"], chunk["sizes"]) for chunk in part[part_format.TENSOR_CHUNKS]]
    assert [r for r in records if 0 in r[2]] == []  # no empty record anywhere
    five_rows = sorted(rank for rank, fqn, _ in records if fqn == "model.layer03.weight")
    assert five_rows == [0, 1, 2, 3, 4]
    # per rank the rows it holds of [96, 70, 33, 5]-row tensors x 3 each, and rank 0 the replicated scalar
    counts = Counter(rank for rank, _, _ in records)
    assert counts[0] == 13 and counts[31] == 3  # rank 31: rows of the three 96-row tensors only

    # DCP's own reader, without this package's, plans from .metadata, which names no empty chunk either
    target = {
        "model": {
            t["fqn"][len("model.") :]: torch.zeros(t["shape"]) for t in manifest["tensors"] if t["fqn"] != "model.step"
        },
        "progress": {"global_step": 0, "note": ""},
    }
    target["model"]["step"] = torch.tensor(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(directory), no_dist=True)
    assert all(torch.equal(target["model"][f"layer{i:02d}.weight"], global_tensor(i)) for i in range(12))
    assert int(target["model"]["step"]) == 7 and target["progress"] == {"global_step": 7, "note": "saved-on-32"}
    report = verify_checkpoint(root)
    assert report.ok, report.problems


def load_on_7_counting(rank, world_size, root, log_id):
    state = row_sharded_state(rank, world_size, zeros=True, note=NOTE)
    load_checkpoint(
        state, counting_fs.counting_url(root), config=LoadConfig(storage_options={"log_id": log_id, "log_opens": True})
    )
    exact = loaded_exactly(state)
    assert exact and int(state["model"]["step"]) == 7 and state["progress"]["note"] == "saved-on-32"
    return [(Path(path).name, start, stop) for path, start, stop in counting_fs.LOGS[log_id].reads]


def test_a_resume_of_32_ranks_on_7_reads_no_file_on_every_rank_and_each_file_in_at_most_2_requests_per_rank(
    saved_32_in_groups_of_8,
):
    """Before: every rank read group table 0 and rank 0's part (and ranges of rank 0's shard file): the objects and
    the replicated scalar live there. Now the coordinator reads them once and broadcasts them."""
    root, _ = saved_32_in_groups_of_8
    log_id = uuid.uuid4().hex
    reads = [o.value for o in run_ranks(load_on_7_counting, LOADED_ON, root, log_id, timeout_s=240, pg_timeout_s=120)]
    readers: dict[str, set[int]] = {}
    requests: Counter = Counter()
    for rank, log in enumerate(reads):
        for name, _, _ in log:
            readers.setdefault(name, set()).add(rank)
            requests[(name, rank)] += 1
    hot = sorted(name for name, ranks in readers.items() if len(ranks) == LOADED_ON)
    assert hot == [], f"read by every one of {LOADED_ON} ranks: {hot}"
    metadata = {key: n for key, n in requests.items() if not key[0].endswith(".distcp")}
    assert metadata and max(metadata.values()) <= 2, sorted(metadata.items(), key=lambda kv: -kv[1])[:5]
    assert any(name.startswith("__g") for name, _ in metadata)  # group tables were read (v5), each by few ranks
    # and a shard file's small chunks a rank needs are neighbours, read in one request (coalesced_reads.py): before,
    # one request per chunk, 12 from one file here (~1,000 for a 1,000-tensor model)
    shards = {key: n for key, n in requests.items() if key[0].endswith(".distcp")}
    assert shards and max(shards.values()) <= 2, sorted(shards.items(), key=lambda kv: -kv[1])[:5]


# --- a 2-D mesh, and ranks that disagree on their keys ---


def save_on_a_2d_mesh(rank, world_size, root):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = global_tensor(0)[:, :8]  # [96, 8]: rows over dp, columns over tp
    local = full.chunk(2, dim=0)[mesh.get_coordinate()[0]].chunk(2, dim=1)[mesh.get_coordinate()[1]]
    tensor = DTensor.from_local(local.clone(), mesh, [Shard(0), Shard(1)], shape=full.shape, stride=full.stride())
    saver = CheckpointSaver(root, SaveConfig(async_save=False, write_events=False))
    result = saver.save({"w": tensor}, step=1).result(timeout=60)
    saver.close()
    assert result.committed, result.error
    return result.manifest if rank == 0 else None


def load_1d(rank, world_size, root):
    state = {"w": shard_rows(torch.zeros(96, 8), init_device_mesh("cpu", (world_size,)), world_size, rank)}
    load_checkpoint(state, root)
    return torch.equal(state["w"].full_tensor(), global_tensor(0)[:, :8])


def test_a_2d_mesh_is_one_rule_of_two_cuts_and_resumes_on_a_1d_mesh_bit_exact(tmp_path):
    root = str(tmp_path / "ckpt")
    manifest = run_ranks(save_on_a_2d_mesh, 4, root)[0].value
    (tensor,) = manifest["tensors"]
    assert tensor["layout"] == {"rank": 0, "split": [[0, 2, 2], [1, 2, 1]]}
    assert all(outcome.value for outcome in run_ranks(load_1d, 3, root))


def save_with_a_key_only_rank_1_holds(rank, world_size, root):
    state = {"model": {"w": torch.full((4,), 7.0)}}
    if rank == 1:
        state["rank1_only"] = {"note": "only here"}  # DCP's dedup still writes it (its lowest holder)
    saver = CheckpointSaver(root, SaveConfig(async_save=False, write_events=False))
    result = saver.save(state, step=1).result(timeout=60)
    saver.close()
    assert result.committed, result.error
    return result.manifest if rank == 0 else None


def test_ranks_holding_different_keys_fall_back_to_dcps_collective_planning_and_lose_nothing(tmp_path):
    root = str(tmp_path / "ckpt")
    manifest = run_ranks(save_with_a_key_only_rank_1_holds, 2, root)[0].value
    assert manifest["format_version"] == 2  # the layouts' digests differed: DCP planned it (format v2)
    state = {"model": {"w": torch.zeros(4)}, "rank1_only": {"note": ""}}
    load_checkpoint(state, root)
    assert torch.equal(state["model"]["w"], torch.full((4,), 7.0)) and state["rank1_only"] == {"note": "only here"}


# --- incremental on parts (FORMAT.md §10.6), at the largest world here ---


def save_incrementally_on_32(rank, world_size, root, group_size):
    """Step 6 with layers 06-11 zeroed, then those set in place and step 7 saved: layers 00-05 (and the replicated
    scalar) unchanged, so step 7's parts reference them in step 6's files."""
    os.environ[groups.GROUP_SIZE_ENV] = str(group_size)
    state = row_sharded_state(rank, world_size, zeros=False, note=NOTE)
    later = {name: value for name, value in state["model"].items() if name[:7] >= "layer06" and name != "step"}
    saved = {name: value.to_local().clone() for name, value in later.items()}
    for value in later.values():
        value.to_local().zero_()
    config = SaveConfig(async_save=False, write_events=False, collective_timeout_s=120, incremental=True)
    saver = CheckpointSaver(root, config)
    first = saver.save(state, step=6).result(timeout=120)
    for name, value in later.items():
        value.to_local().copy_(saved[name])  # in place: the tracker sees these changed, layers 00-05 not
    second = saver.save(state, step=7).result(timeout=120)
    saver.close()
    assert first.committed and second.committed, (first.error, second.error)
    return second.manifest if rank == 0 else None


def test_an_incremental_v5_checkpoint_saved_on_32_ranks_in_4_groups_resumes_on_7_bit_exact(tmp_path):
    root = str(tmp_path / "ckpt")
    manifest = run_ranks(save_incrementally_on_32, SAVED_ON, root, 8, timeout_s=300, pg_timeout_s=120)[0].value

    assert manifest["format_version"] == 5 and all("chunks" not in tensor for tensor in manifest["tensors"])
    base = next(entry for entry in list_checkpoints(resolve(root)) if entry.step == 6)
    # one entry: step 6's files of all 32 ranks (layer00 and layer04 have 96 rows: every rank references a chunk)
    [references] = manifest["references"]
    assert references["dir"] == base.name and references["ranks"] == [[0, SAVED_ON - 1]]
    loaded = [o.value for o in run_ranks(load_on_7, LOADED_ON, root, timeout_s=240, pg_timeout_s=120)]
    assert all(r["step"] == 7 and r["exact"] and r["scalar"] == 7 for r in loaded), loaded
    assert all(r["progress"] == {"global_step": 7, "note": "saved-on-32"} for r in loaded)
