"""Signed checkpoints on format v5 (FORMAT.md §12.2), on real gloo ranks in groups of 2: a signed save of several
groups writes group tables carrying its parts' digests (the signed manifest carrying each table's) and parts carrying
each chunk's digest, never a v4 manifest of every rank; it resumes bit-exact on another world size under
require_signature, each rank checking only the tables, parts and chunks it reads (never a whole shard file it only
partly needs); and a forgery at any level (every checksum recomputed; a shard, a part or a group table edited) is
refused naming the file, by a resume and by `shardckpt verify --public-key`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from lightning_shardckpt import CheckpointSaver, SaveConfig, SignatureRefused, SignConfig, load_checkpoint
from lightning_shardckpt.engine.catalog import list_checkpoints
from lightning_shardckpt.engine.config import LoadConfig, VerifyConfig
from lightning_shardckpt.engine.format import groups, parts_manifest, signing
from lightning_shardckpt.engine.format.names import shard_filename
from lightning_shardckpt.engine.format.parts import parse as parse_part
from lightning_shardckpt.engine.format.parts import part_filename
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.ops.verify import SIGNATURE_PROBLEM, verify_checkpoint
from tests.helpers import training_state as ts
from tests.helpers.forgery import _replace, forge_tensor_values
from tests.helpers.spawn import run_ranks
from tests.unit.test_signing import make_key

GROUP_SIZE = "2"  # 4 ranks make two groups: the writer goes v5 only for a world of several groups
FQN = "model.0.weight"


def save_worker(rank, world_size, root, key_path, digest):
    os.environ[groups.GROUP_SIZE_ENV] = GROUP_SIZE  # this rank process only (a tests-only variable)
    model, optimizer = ts.build("fsdp", seed=1, world_size=world_size)
    ts.train_steps(model, optimizer, steps=2, seed=2)
    state = ts.sharded_state(model, optimizer)
    state["progress"] = {"global_step": 2}
    sign = SignConfig(key_path=key_path, digest=digest) if key_path else SignConfig()
    config = SaveConfig(async_save=False, write_events=False, sign=sign, verify=VerifyConfig(mode="off"))
    saver = CheckpointSaver(root, config)
    result = saver.save(state, step=2).result(timeout=60)
    saver.close()
    assert result.committed, result.error
    full = ts.full_state(model, optimizer)  # a collective: every rank takes part
    return {"full": full, "manifest": result.manifest} if rank == 0 else None


def load_worker(rank, world_size, root, public_key, options=None, which="latest"):
    """This rank's resume of `root` (with `public_key`: under require_signature); its bytes read per file when
    `root` is a counting:// URL (tests/helpers/counting_fs.py, reads through open() logged too)."""
    from tests.helpers import counting_fs

    model, optimizer = ts.build("fsdp", seed=99, world_size=world_size)  # different init on purpose
    state = ts.sharded_state(model, optimizer)
    state["progress"] = {"global_step": 0}
    policy = {"require_signature": True, "public_keys": [public_key]} if public_key else {}
    log_id = "signed-v5"  # one per process (each rank's): rank 0's pick, broadcast, carries its storage options
    storage = {"log_id": log_id, "log_opens": True} if root.startswith(counting_fs.PROTOCOL) else None
    try:
        config = LoadConfig(storage_options=storage, **policy, **(options or {}))
        result = load_checkpoint(state, root, which, config=config)
    except SignatureRefused as err:
        return {"refused": str(err)}
    ts.apply_state(model, optimizer, state)
    reads: dict[str, int] = {}
    for path, start, stop in counting_fs.LOGS[log_id].reads if storage else ():
        reads[os.path.basename(path)] = reads.get(os.path.basename(path), 0) + stop - start
    return {"full": ts.full_state(model, optimizer), "step": result.step, "reads": reads}


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """One signed v5 checkpoint saved on 4 ranks in groups of 2, and the key pair: (root, saved, public)."""
    directory = tmp_path_factory.mktemp("signed-v5")
    private, public, _ = make_key(directory, "writer")
    root = str(directory / "root")
    saved = run_ranks(save_worker, 4, root, private, "blake3")[0].value
    assert saved["manifest"]["format_version"] == 5  # what every test here is about: signed, yet flat
    return root, saved, public


def _copy(root: str, tmp_path: Path) -> tuple[str, str]:
    """A copy of the checkpoint root to forge in, and its one checkpoint's directory."""
    copy = str(tmp_path / "forged")
    shutil.copytree(root, copy)
    [entry] = list_checkpoints(resolve(copy))
    return copy, entry.path


def test_a_signed_save_of_several_groups_writes_v5_with_digests_down_to_each_chunk(signed):
    root, saved, _ = signed
    manifest = saved["manifest"]
    assert manifest["format_version"] == 5 and parts_manifest.PARTS_FIELD not in manifest  # no per-rank table
    assert manifest[signing.DIGEST_FIELD] == "blake3"
    [entry] = list_checkpoints(resolve(root))
    directory = Path(entry.path)
    table = manifest[groups.GROUPS_FIELD]
    for group in (0, 1):
        data = (directory / groups.group_filename(group)).read_bytes()
        assert table[groups.TABLE_DIGESTS][64 * group : 64 * group + 64] == signing.digest_of(data, "blake3")
        written = json.loads(data)
        for index in range(written["count"]):
            rank = written["first_rank"] + index
            part = (directory / part_filename(rank)).read_bytes()
            assert written[signing.PART_DIGESTS][64 * index : 64 * index + 64] == signing.digest_of(part, "blake3")
            record = parse_part(part, part_filename(rank))  # its digest_column given back to the records
            assert signing.FILE_DIGEST not in record  # a digest per chunk, not per file
            shard = (directory / shard_filename(rank)).read_bytes()
            for chunk in [*record["chunks"], *record["objects"]]:
                piece = shard[chunk["offset"] : chunk["offset"] + chunk["length"]]
                assert chunk["digest"] == signing.digest_of(piece, "blake3")


@pytest.mark.parametrize("loaded_on", [3, 1])
def test_a_signed_v5_checkpoint_resumes_bit_exact_on_another_world_under_require_signature(signed, loaded_on):
    root, saved, public = signed
    loaded = run_ranks(load_worker, loaded_on, root, public)
    assert all("refused" not in outcome.value for outcome in loaded), [o.value for o in loaded]
    ts.assert_bit_exact(saved["full"], loaded[0].value["full"])


def test_a_signed_v5_resume_reads_no_whole_shard_file_it_only_partly_needs(signed):
    from tests.helpers.counting_fs import counting_url

    root, _, public = signed
    url = counting_url(root)
    checked = [outcome.value for outcome in run_ranks(load_worker, 3, url, public)]
    plain = [outcome.value for outcome in run_ranks(load_worker, 3, url, None)]
    signature = {"manifest.json", signing.SIGNATURE}  # what the signature check reads (rank 0, once)
    for rank, (with_policy, without) in enumerate(zip(checked, plain)):
        assert "refused" not in with_policy, with_policy
        # every shard file, part and group table read exactly as much as without a policy: each chunk read once
        # and hashed as it streams, no file read again whole to check a digest
        assert {n: c for n, c in with_policy["reads"].items() if n not in signature} == {
            n: c for n, c in without["reads"].items() if n not in signature
        }, (rank, with_policy["reads"], without["reads"])
    # 4 saved ranks' rows over 3: some rank needs part of a file, and reads only that part
    sizes = {path.name: path.stat().st_size for path in Path(root).rglob("*.distcp")}
    shards = [(n, c, sizes[n]) for value in checked for n, c in value["reads"].items() if n.endswith(".distcp")]
    assert all(count <= size for _, count, size in shards), shards
    assert any(count < size for _, count, size in shards), shards


def test_a_forgery_with_every_checksum_and_digest_recomputed_is_refused_by_the_signature(signed, tmp_path):
    root, _, public = signed
    copy, directory = _copy(root, tmp_path)
    forge_tensor_values(resolve(copy), directory, FQN, 7.0)
    [refused] = [outcome.value for outcome in run_ranks(load_worker, 1, copy, public, None, 2)]
    assert "manifest.json: its signature by key" in refused["refused"], refused
    report = verify_checkpoint(copy, public_keys=[public])
    assert [problem["kind"] for problem in report.problems] == [SIGNATURE_PROBLEM]


@pytest.mark.parametrize("verify_checksums", [True, False])
def test_shard_bytes_changed_under_a_signed_v5_manifest_are_refused_by_their_chunk_digest(
    signed, tmp_path, verify_checksums
):
    # as an xxh3 second preimage would leave it: the part, its table and the manifest as signed, only the shard
    # changed; the chunk's digest refuses it before its xxh3 is looked at, even with checksums off
    root, _, public = signed
    copy, directory = _copy(root, tmp_path)
    part = json.loads(Path(directory, part_filename(0)).read_bytes())
    chunk = next(chunk for chunk in part["chunks"] if chunk["fqn"] == FQN)
    shard = os.path.join(directory, shard_filename(0))
    data = bytearray(Path(shard).read_bytes())
    data[chunk["offset"] + chunk["length"] - 200] ^= 0xFF  # inside the tensor's bytes, before the record's trailer
    _replace(resolve(copy).fs, shard, bytes(data))
    options = {"verify_checksums": verify_checksums}
    [refused] = [outcome.value for outcome in run_ranks(load_worker, 1, copy, public, options, 2)]
    assert f"{shard_filename(0)} @ {chunk['offset']}: the blake3 digest of its chunk of {FQN!r}" in refused["refused"]
    report = verify_checkpoint(copy, public_keys=[public])
    assert (SIGNATURE_PROBLEM, shard_filename(0)) in [(p["kind"], p["file"]) for p in report.problems], report


@pytest.mark.parametrize("name", [part_filename(1), groups.group_filename(0)])
def test_a_part_or_group_table_edited_under_a_signed_v5_manifest_is_refused_naming_it(signed, tmp_path, name):
    root, _, public = signed
    copy, directory = _copy(root, tmp_path)
    path = os.path.join(directory, name)
    data = Path(path).read_bytes()
    edited = data.replace(b'"checkpoint_id"', b'"checkpoint_iD"', 1)  # same size: only a digest can tell
    assert edited != data and len(edited) == len(data)
    _replace(resolve(copy).fs, path, edited)
    [refused] = [outcome.value for outcome in run_ranks(load_worker, 1, copy, public, None, 2)]
    assert f"{name}: its blake3 digest differs from the one the manifest signed by key" in refused["refused"]
    report = verify_checkpoint(copy, public_keys=[public])
    assert (SIGNATURE_PROBLEM, name) in [(p["kind"], p["file"]) for p in report.problems], report


def test_bytes_appended_to_a_shard_file_under_a_signed_v5_manifest_are_refused_by_its_signed_size(signed, tmp_path):
    # after every chunk: no chunk digest (nor xxh3) covers them, the part's signed `file_bytes` does; a resume
    # knows each file's size from opening it, so the check costs no request
    root, _, public = signed
    copy, directory = _copy(root, tmp_path)
    shard = os.path.join(directory, shard_filename(1))
    _replace(resolve(copy).fs, shard, Path(shard).read_bytes() + b"appended by someone without the key")
    [refused] = [outcome.value for outcome in run_ranks(load_worker, 1, copy, public, None, 2)]
    assert f"{shard_filename(1)}: its blake3 digest differs" in refused["refused"], refused
    assert "bytes were added or cut after it was signed" in refused["refused"]
    report = verify_checkpoint(copy, public_keys=[public])
    assert (SIGNATURE_PROBLEM, shard_filename(1)) in [(p["kind"], p["file"]) for p in report.problems], report
