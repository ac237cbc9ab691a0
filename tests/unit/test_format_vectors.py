"""docs/FORMAT.md's test vectors (§11) are what the code writes and reads: each record kind, checked both ways."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import struct
import zipfile
from pathlib import Path

import fsspec
import pytest
import torch
import xxhash

from lightning_shardckpt.engine.format import chunk_layout, groups, parts, parts_manifest
from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format.checksum import ChunkCheck, HashingWriter, block_size_for, checksum
from lightning_shardckpt.engine.format.names import checkpoint_dirname
from lightning_shardckpt.engine.storage.chunk_reads import decode_tensor_record

FORMAT = Path(__file__).parents[2] / "docs" / "FORMAT.md"
VECTOR = re.compile(r"<!-- vector: (?P<name>[^>]+?) -->\n```\w*\n(?P<body>.*?)\n```", re.S)


def vectors() -> dict[str, str]:
    return {match["name"]: match["body"] for match in VECTOR.finditer(FORMAT.read_text())}


def test_every_record_kind_has_a_vector():
    assert set(vectors()) == {
        "manifest",
        "commit record",
        "part 0",
        "part 1",
        "layout cells",
        "index marker",
        "tensor record",
        "object record",
        "blocked chunk",
        "v5 manifest",
        "group table 0",
        "group table 1",
        "incremental v5 manifest",  # §10.6: the next save of the v5 one, referencing its unchanged chunks
        "incremental v5 part 0",
        "incremental v5 part 1",
        "incremental v5 group table 0",
        "incremental v5 group table 1",
        "signature key seed",  # §12, checked by tests/unit/test_signing.py
        "signature manifest",
        "signature record",
        "signature window manifest",  # §12.1, checked by tests/unit/test_signing_key_windows.py
        "signature window verdicts",
        "signed part 0",  # §12: a whole signed v4 checkpoint
        "signed manifest",
        "signed manifest record",
        "signed v5 part 0",  # §12.2: a whole signed v5 checkpoint
        "signed v5 group table 0",
        "signed v5 group table 1",
        "signed v5 manifest",
        "signed v5 manifest record",
        "signed blocked chunk",
    }


def test_the_manifest_vector_parses_and_the_writer_writes_exactly_its_bytes():
    data = (vectors()["manifest"] + "\n").encode()
    where = f"/root/{checkpoint_dirname(7, '0123456789ab')}"
    manifest = manifest_format.parse(data, where)
    assert manifest_format.to_bytes(manifest) == data  # the writer's own layout, byte for byte
    assert [f["path"] for f in manifest_format.files_of(manifest)] == [
        "__0_0.distcp",
        "__0_0.part.json",
        "__1_0.distcp",
        "__1_0.part.json",
    ]


def test_the_commit_record_vector_is_the_record_of_the_manifest_vector():
    manifest_bytes = (vectors()["manifest"] + "\n").encode()
    record_bytes = (vectors()["commit record"] + "\n").encode()
    where = f"/root/{checkpoint_dirname(7, '0123456789ab')}"
    record = manifest_format.parse_commit_record(record_bytes, where)
    manifest = json.loads(manifest_bytes)
    assert record["manifest_checksum"] == checksum(manifest_bytes)
    assert manifest_format.to_bytes(manifest_format.build_commit_record(manifest, manifest_bytes)) == record_bytes
    assert record["bytes_total"] == sum(f["bytes"] for f in manifest_format.files_of(manifest))


def test_the_part_vectors_parse_and_match_the_manifests_sizes_checksums_and_layouts():
    manifest = json.loads(vectors()["manifest"])
    table = manifest["parts"]
    for rank in (0, 1):
        data = (vectors()[f"part {rank}"] + "\n").encode()
        part = parts.parse(data, parts.part_filename(rank), checkpoint_id=manifest["id"], rank=rank)
        assert parts.to_bytes(part) == data
        digests = {
            column: table[column][16 * rank : 16 * (rank + 1)] for column in ("part_checksums", "file_checksums")
        }
        assert (len(data), checksum(data)) == (table["part_bytes"][rank], digests["part_checksums"])
        assert (part["file_bytes"], part["file_checksum"]) == (table["file_bytes"][rank], digests["file_checksums"])
        cells = {
            (t["fqn"], c.offsets, c.sizes)
            for t in manifest["tensors"]
            for c in chunk_layout.cells(chunk_layout.from_json(t["layout"]), t["shape"])
            if c.rank == rank
        }
        assert {(c["fqn"], tuple(c["offsets"]), tuple(c["sizes"])) for c in part["chunks"]} == cells
        assert {o["fqn"] for o in part["objects"]} == {o["fqn"] for o in manifest["objects"] if o["rank"] == rank}
    assert parts_manifest.writing_ranks(manifest) == [0, 1]


def _v5_directory(tmp_path: Path) -> Path:
    directory = tmp_path / checkpoint_dirname(7, "0123456789ab")
    directory.mkdir()
    for group in (0, 1):
        (directory / groups.group_filename(group)).write_bytes((vectors()[f"group table {group}"] + "\n").encode())
    return directory


def test_the_v5_vectors_parse_and_their_group_tables_give_the_v4_parts_table_and_files(tmp_path):
    data = (vectors()["v5 manifest"] + "\n").encode()
    directory = _v5_directory(tmp_path)
    manifest = manifest_format.parse(data, str(directory))
    assert manifest_format.to_bytes(manifest) == data
    assert (
        manifest_format.total_bytes(manifest)
        == 6905
        == manifest_format.build_commit_record(manifest, data)["bytes_total"]
    )
    assert groups.file_count(manifest) == 6
    # each group table as the writer builds it from its ranks' entries, and as the manifest lists it
    v4 = json.loads(vectors()["manifest"])["parts"]
    entries = {
        rank: {
            "file_bytes": v4["file_bytes"][rank],
            "part_bytes": v4["part_bytes"][rank],
            "file_checksum": v4["file_checksums"][16 * rank : 16 * (rank + 1)],
            "part_checksum": v4["part_checksums"][16 * rank : 16 * (rank + 1)],
        }
        for rank in (0, 1)
    }
    tables = [
        groups.build_group_table(manifest["id"], 0, 2, 3, entries),
        groups.build_group_table(manifest["id"], 1, 2, 3, {}),
    ]
    listed = [groups.group_entry(table, groups.to_bytes(table)) for table in tables]
    assert groups.groups_table(3, 2, listed) == manifest["groups"]
    for group, table in enumerate(tables):
        assert groups.to_bytes(table) == (vectors()[f"group table {group}"] + "\n").encode()
    # a reader of the tables: rank 2 wrote nothing; ranks 0 and 1 are the v4 vector's parts
    expanded = groups.expanded(fsspec.filesystem("file"), str(directory), manifest)
    assert parts_manifest.writing_ranks(expanded) == [0, 1]
    for rank in (0, 1):
        part_bytes = (vectors()[f"part {rank}"] + "\n").encode()
        assert parts_manifest.part_of(expanded, rank) == (
            parts.part_filename(rank),
            len(part_bytes),
            checksum(part_bytes),
        )
    with pytest.raises(KeyError):
        parts_manifest.part_of(expanded, 2)
    assert [f["path"] for f in manifest_format.files_of(expanded)] == [
        "__0_0.distcp",
        "__0_0.part.json",
        "__1_0.distcp",
        "__1_0.part.json",
        "__g0.parts.json",
        "__g1.parts.json",
    ]


def test_a_v5_reader_reads_only_the_group_table_of_the_ranks_it_needs(tmp_path):
    manifest = json.loads(vectors()["v5 manifest"])
    directory = _v5_directory(tmp_path)
    (directory / groups.group_filename(1)).unlink()  # group 1 (rank 2) is not needed to find rank 1's part
    tables = groups.GroupTables(fsspec.filesystem("file"), str(directory), manifest)
    table = tables.parts_table([1])
    assert tables.tables_read == 1 and table["part_bytes"][1] == 400


@pytest.mark.parametrize("damage", ["missing", "altered", "torn"])
def test_a_damaged_v5_group_table_makes_the_checkpoint_corrupt_naming_it(tmp_path, damage):
    from lightning_shardckpt.errors import CorruptCheckpoint

    manifest = json.loads(vectors()["v5 manifest"])
    directory = _v5_directory(tmp_path)
    path = directory / groups.group_filename(0)
    if damage == "missing":
        path.unlink()
    elif damage == "altered":
        path.write_bytes(path.read_bytes().replace(b"4000", b"4001"))
    else:
        path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CorruptCheckpoint, match=r"__g0\.parts\.json"):
        groups.expanded(fsspec.filesystem("file"), str(directory), manifest)


def _incremental_v5_root(tmp_path: Path) -> tuple[Path, Path]:
    """The v5 vector checkpoint (step 7: its group tables and parts) and the incremental one (step 8) beside it."""
    base = _v5_directory(tmp_path)
    for rank in (0, 1):
        (base / parts.part_filename(rank)).write_bytes((vectors()[f"part {rank}"] + "\n").encode())
    directory = tmp_path / checkpoint_dirname(8, "0123456789ac")
    directory.mkdir()
    for name in ("group table 0", "group table 1"):
        (directory / groups.group_filename(int(name[-1]))).write_bytes(
            (vectors()[f"incremental v5 {name}"] + "\n").encode()
        )
    for rank in (0, 1):
        (directory / parts.part_filename(rank)).write_bytes((vectors()[f"incremental v5 part {rank}"] + "\n").encode())
    return base, directory


def test_the_incremental_v5_vectors_parse_and_their_references_are_the_base_parts_records(tmp_path):
    from lightning_shardckpt.engine.format import part_references
    from lightning_shardckpt.engine.format import references as refs
    from lightning_shardckpt.engine.format.chunk_index import ChunkIndex

    base, directory = _incremental_v5_root(tmp_path)
    data = (vectors()["incremental v5 manifest"] + "\n").encode()
    manifest = manifest_format.parse(data, str(directory))
    assert manifest_format.to_bytes(manifest) == data
    record = manifest_format.build_commit_record(manifest, data)
    assert (record["bytes_total"], record["bytes_referenced"]) == (4085, 3000)
    assert part_references.files(manifest) == {base.name: {"__0_0.distcp", "__1_0.distcp"}}  # what retention pins
    chunks = dict(
        ((fqn, tuple(c.get("offsets", ()))), c)
        for fqn, c in ChunkIndex(fsspec.filesystem("file"), str(directory), manifest).all_chunks()
    )
    # each referenced record is the base part's record of the same cell, its holder file named and sized
    for rank, offsets in ((0, (0, 0)), (1, (2, 0))):
        held = json.loads(vectors()[f"part {rank}"])
        original = next(c for c in held["chunks"] if c["fqn"] == "model.w")
        copied = chunks[("model.w", offsets)]
        assert copied == {**original, "file": refs.make(base.name, held["file"]), "file_bytes": held["file_bytes"]}
    # the writer's own bytes: each part as build_part writes it, rank 1's file empty (every chunk referenced)
    for rank in (0, 1):
        part_bytes = (vectors()[f"incremental v5 part {rank}"] + "\n").encode()
        part = parts.parse(part_bytes, parts.part_filename(rank), checkpoint_id="0123456789ac", rank=rank)
        rebuilt = parts.build_part(
            checkpoint_id=part["checkpoint_id"],
            rank=rank,
            file=part["file"],
            file_bytes=part["file_bytes"],
            tensor_chunks=[part_references.resolve(c, part) if "holder" in c else c for c in part["chunks"]],
            objects=part["objects"],
            verification=part["verification"],
            write_s=part["write_s"],
        )
        assert parts.to_bytes(rebuilt) == part_bytes
    assert json.loads(vectors()["incremental v5 part 1"])["file_bytes"] == 0


def test_an_incremental_v5_part_whose_reference_is_unlisted_or_escapes_is_corrupt(tmp_path):
    from lightning_shardckpt.engine.format.chunk_index import ChunkIndex
    from lightning_shardckpt.errors import CorruptCheckpoint

    _, directory = _incremental_v5_root(tmp_path)
    manifest = json.loads(vectors()["incremental v5 manifest"])
    unlisted = {**manifest, "references": [{**manifest["references"][0], "ranks": [[0, 0]]}]}  # rank 1's not listed
    with pytest.raises(
        CorruptCheckpoint, match=r"__1_0\.part\.json.*__1_0\.distcp, a file the manifest's .* do not list"
    ):
        list(ChunkIndex(fsspec.filesystem("file"), str(directory), unlisted).all_chunks())
    part = json.loads(vectors()["incremental v5 part 1"])
    part["holders"][0]["file"] = "../../elsewhere/__1_0.distcp"
    with pytest.raises(ValueError, match="sibling checkpoint"):
        parts.parse(parts.to_bytes(part), parts.part_filename(1), checkpoint_id="0123456789ac", rank=1)


def test_the_layout_vectors_are_the_cells_the_code_computes():
    for line in vectors()["layout cells"].splitlines():
        case = json.loads(line)
        layout = chunk_layout.from_json(case["layout"])
        got = [[list(c.offsets), list(c.sizes), c.rank] for c in chunk_layout.cells(layout, case["shape"])]
        assert got == case["cells"]


def test_the_index_marker_vector_names_the_manifest_vectors_directory():
    manifest = json.loads(vectors()["manifest"])
    assert vectors()["index marker"] == checkpoint_dirname(manifest["step"], manifest["id"])


def test_the_index_marker_vectors_file_name_is_the_one_the_writer_gives_and_readers_parse():
    from lightning_shardckpt.engine.commit_index import marker_name, parse_marker_name

    named = re.search(r"A commit index marker \(§4\.1\), `ROOT/index/[^/`]+/([^`]+)`", FORMAT.read_text())[1]
    dirname = vectors()["index marker"]
    assert named == marker_name(1, dirname)
    assert parse_marker_name(named) == (1, dirname)
    assert parse_marker_name("000000001") == (1, None)  # the first format: the name is inside


def test_the_tensor_record_vector_decodes_without_torch_and_with_it():
    text = FORMAT.read_text()
    data = bytes.fromhex("".join(vectors()["tensor record"].split()))
    expected_sum = re.search(r"its\s+xxh3_64 is `([0-9a-f]{16})`", text)[1]
    assert checksum(data) == expected_sum
    # as §3.1 tells a reader without torch: stored zip members, found by their local headers
    archive = zipfile.ZipFile(io.BytesIO(data))
    names = [info.filename for info in archive.infolist()]
    assert names[:6] == [
        "archive/data.pkl",
        "archive/.format_version",
        "archive/.storage_alignment",
        "archive/byteorder",
        "archive/data/0",
        "archive/version",
    ]
    info = archive.getinfo("archive/data/0")
    assert info.compress_type == zipfile.ZIP_STORED and info.CRC == 0
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    assert start % 64 == 0
    element_bytes = data[start : start + info.file_size]
    assert element_bytes.hex(" ") == "80 3f 00 40 40 40 00 bf 80 3e 00 41"
    # bfloat16 without torch: the upper 16 bits of a float32
    values = [struct.unpack("<f", b"\x00\x00" + element_bytes[i : i + 2])[0] for i in range(0, 12, 2)]
    assert values == [1.0, 2.0, 3.0, -0.5, 0.25, 8.0]
    tensor = decode_tensor_record(memoryview(bytearray(data)), (2, 3), torch.bfloat16)
    assert torch.equal(tensor, torch.tensor([[1.0, 2.0, 3.0], [-0.5, 0.25, 8.0]], dtype=torch.bfloat16))
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), tensor)


def test_the_blocked_chunk_vector_is_what_the_writer_records_and_an_independent_reader_recomputes():
    vector = json.loads(vectors()["blocked chunk"])
    length = vector["length"]
    data = (bytes(range(251)) * (length // 251 + 1))[:length]
    # as §3 tells an independent reader: xxh3_64 of each block, then of their hex digests concatenated
    size = vector["blocks"]["size"]
    blocks = [xxhash.xxh3_64(data[start : start + size]).hexdigest() for start in range(0, length, size)]
    assert blocks == vector["blocks"]["checksums"]
    assert xxhash.xxh3_64("".join(blocks).encode()).hexdigest() == vector["checksum"]
    old = re.search(r"its `checksum` was the xxh3_64 of all its bytes, `([0-9a-f]{16})`", FORMAT.read_text())[1]
    assert xxhash.xxh3_64(data).hexdigest() == old
    # what the writer records for such a chunk, through the same streaming pass a save makes
    stream = HashingWriter(io.BytesIO())
    stream.begin_chunk(block_size_for(length))
    for start in range(0, length, 3 * 2**20 + 17):  # writes of any size: blocks do not follow write boundaries
        stream.write(data[start : start + 3 * 2**20 + 17])
    assert stream.end_chunk() == (0, length, vector["checksum"])
    assert stream.chunk_blocks == (size, tuple(vector["blocks"]["checksums"]))
    # and how every reader checks it, under both algorithms
    assert ChunkCheck.of_record(vector).actual(data) == vector["checksum"]
    assert ChunkCheck.of_record({**vector, "checksum": old}).actual(data) == vector["checksum"]


class _NoGlobals(pickle.Unpickler):
    """What FORMAT.md §3.1 lets a reader without torch use on a plain object's data.pkl: no global at all."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed")


def test_the_object_record_vector_is_what_a_save_writes_and_reads_without_torch(tmp_path):
    from lightning_shardckpt import CheckpointSaver, SaveConfig

    text = FORMAT.read_text()
    data = bytes.fromhex("".join(vectors()["object record"].split()))
    assert checksum(data) == re.search(r"An object record.*?xxh3_64 is\s+`([0-9a-f]{16})`", text, re.S)[1]
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert [info.filename for info in archive.infolist()] == [
        "archive/data.pkl",
        "archive/.format_version",
        "archive/.storage_alignment",
        "archive/byteorder",
        "archive/version",
        "archive/.data/serialization_id",
    ]
    pickled = archive.read("archive/data.pkl")  # zipfile checks the computed CRC-32s as it reads
    assert pickled.hex(" ") == "80 02 4b 07 2e"
    assert _NoGlobals(io.BytesIO(pickled)).load() == 7
    assert torch.load(io.BytesIO(data), weights_only=True) == 7
    # a save writes exactly these bytes for the object
    saver = CheckpointSaver(str(tmp_path), SaveConfig(async_save=False, write_events=False))
    result = saver.save({"model": {"w": torch.zeros(2)}, "progress": {"global_step": 7}}, step=7).result(timeout=60)
    saver.close()
    part = json.loads((Path(result.path) / parts.part_filename(0)).read_bytes())
    [record] = part["objects"]
    with open(os.path.join(result.path, part["file"]), "rb") as shard:
        shard.seek(record["offset"])
        assert shard.read(record["length"]) == data and record["checksum"] == checksum(data)


def test_the_signed_v4_vectors_are_what_the_writer_signs_and_a_policy_accepts(tmp_path):
    """§12's signed checkpoint: the part's five-column entry, its `file_digest`, and the signature, checked as a
    reader with a policy checks them, over real files (the shard is §11's object record)."""
    import hashlib

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from lightning_shardckpt.engine.format import signing
    from lightning_shardckpt.engine.format.checksum import checksum_of_checksums
    from lightning_shardckpt.engine.format.names import MANIFEST, shard_filename

    shard = bytes.fromhex("".join(vectors()["object record"].split()))
    part_bytes = (vectors()["signed part 0"] + "\n").encode()
    manifest_bytes = (vectors()["signed manifest"] + "\n").encode()
    record_bytes = (vectors()["signed manifest record"] + "\n").encode()
    directory = tmp_path / checkpoint_dirname(7, "0123456789ab")
    directory.mkdir()
    for name, data in (
        (shard_filename(0), shard),
        (parts.part_filename(0), part_bytes),
        (MANIFEST, manifest_bytes),
        (signing.SIGNATURE, record_bytes),
    ):
        (directory / name).write_bytes(data)

    manifest = manifest_format.parse(manifest_bytes, str(directory))
    assert manifest_format.to_bytes(manifest) == manifest_bytes
    part = parts.parse(part_bytes, parts.part_filename(0), checkpoint_id=manifest["id"], rank=0)
    assert parts.to_bytes(part) == part_bytes  # compact, sorted keys, one trailing newline (§10.2)
    table = manifest["parts"]
    assert sorted(set(table) - {"count"}) == sorted(
        ["file_bytes", "part_bytes", "file_checksums", "part_checksums", "part_digests"]
    )
    assert (table["part_bytes"], table["part_checksums"]) == ([len(part_bytes)], checksum(part_bytes))
    assert table["part_digests"] == hashlib.sha256(part_bytes).hexdigest()
    assert (part["file_bytes"], part["file_digest"]) == (len(shard), hashlib.sha256(shard).hexdigest())
    assert part["file_checksum"] == table["file_checksums"] == checksum_of_checksums([checksum(shard)])
    assert part["objects"][0]["checksum"] == checksum(shard)

    seed = bytes.fromhex(vectors()["signature key seed"].strip())
    key = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
    assert signing.signature_bytes(manifest_bytes, signing.signer_from_private_key(key, "vector")) == record_bytes
    public = tmp_path / "vector.pub"
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    policy = signing.accepted_policy([str(public)])
    fs = fsspec.filesystem("file")
    kid = policy.check_manifest(fs, str(directory), manifest)
    assert policy.check_files(fs, str(directory), manifest, [0], kid) == len(part_bytes) + len(shard)


def _signed_v5_directory(tmp_path: Path) -> tuple[Path, Path]:
    """§12.2's signed v5 checkpoint as files, and the PEM public key of §12's vector key: (directory, key)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from lightning_shardckpt.engine.format import signing
    from lightning_shardckpt.engine.format.names import MANIFEST, shard_filename

    directory = tmp_path / "root" / checkpoint_dirname(7, "0123456789ab")
    directory.mkdir(parents=True)
    for name, data in (
        (shard_filename(0), bytes.fromhex("".join(vectors()["object record"].split()))),
        (parts.part_filename(0), (vectors()["signed v5 part 0"] + "\n").encode()),
        (groups.group_filename(0), (vectors()["signed v5 group table 0"] + "\n").encode()),
        (groups.group_filename(1), (vectors()["signed v5 group table 1"] + "\n").encode()),
        (MANIFEST, (vectors()["signed v5 manifest"] + "\n").encode()),
        (signing.SIGNATURE, (vectors()["signed v5 manifest record"] + "\n").encode()),
    ):
        (directory / name).write_bytes(data)
    key = ed25519.Ed25519PrivateKey.from_private_bytes(bytes.fromhex(vectors()["signature key seed"].strip()))
    public = tmp_path / "vector.pub"
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return directory, public


def test_the_signed_v5_vectors_verify_with_hashlib_alone_and_are_what_the_writer_signs(tmp_path):
    """§12.2's signed v5 checkpoint: every binding recomputed as an independent reader would (hashlib and the
    Ed25519 key, no project code), then the writer's own signature, builders and a policy over the files."""
    import hashlib

    from cryptography.hazmat.primitives.asymmetric import ed25519

    from lightning_shardckpt.engine.format import signing

    directory, public = _signed_v5_directory(tmp_path)
    read = {path.name: path.read_bytes() for path in directory.iterdir()}
    manifest, record = json.loads(read["manifest.json"]), json.loads(read[signing.SIGNATURE])
    key = ed25519.Ed25519PrivateKey.from_private_bytes(bytes.fromhex(vectors()["signature key seed"].strip()))
    raw = bytes.fromhex("03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8")
    assert record["key_id"] == hashlib.sha256(raw).hexdigest()
    ed25519.Ed25519PublicKey.from_public_bytes(raw).verify(base64_decode(record["signature"]), read["manifest.json"])
    table = manifest["groups"]
    for group in (0, 1):
        data = read[groups.group_filename(group)]
        assert table["table_digests"][64 * group : 64 * group + 64] == hashlib.sha256(data).hexdigest()
    group_table = json.loads(read[groups.group_filename(0)])
    assert group_table["part_digests"] == hashlib.sha256(read[parts.part_filename(0)]).hexdigest()
    assert json.loads(read[groups.group_filename(1)])["part_digests"] == "-" * 64
    stored = json.loads(read[parts.part_filename(0)])
    [item] = stored["objects"]
    chunk = read["__0_0.distcp"][item["offset"] : item["offset"] + item["length"]]
    # §12.2's digest_column: the one record's digest, 32 bytes, base64
    assert base64_decode(stored["digest_column"]) == hashlib.sha256(chunk).digest() and "digest" not in item
    assert item["checksum"] == checksum(chunk)

    # the writer's own: the same signature (Ed25519 is deterministic), the same table bytes and entries
    signer = signing.signer_from_private_key(key, "vector")
    assert signing.signature_bytes(read["manifest.json"], signer) == read[signing.SIGNATURE]
    assert (
        manifest_format.to_bytes(manifest_format.parse(read["manifest.json"], str(directory))) == read["manifest.json"]
    )
    assert groups.to_bytes(group_table) == read[groups.group_filename(0)]
    entries = [
        groups.group_entry(json.loads(read[groups.group_filename(g)]), read[groups.group_filename(g)], "sha256")
        for g in (0, 1)
    ]
    assert groups.groups_table(2, 1, entries) == table
    policy = signing.accepted_policy([str(public)])
    fs = fsspec.filesystem("file")
    kid = policy.check_manifest(fs, str(directory), manifest)
    assert policy.check_every_file(fs, str(directory), manifest, kid) == len(read[parts.part_filename(0)]) + len(chunk)


def test_the_signed_v5_vector_checkpoint_loads_under_a_policy_and_refuses_its_object_changed(tmp_path):
    from lightning_shardckpt import LoadConfig, SignatureRefused, load_checkpoint

    directory, public = _signed_v5_directory(tmp_path)
    policy = LoadConfig(require_signature=True, public_keys=[str(public)])
    state = {"progress": {"global_step": 0}}
    assert load_checkpoint(state, str(directory), config=policy).step == 7 and state["progress"]["global_step"] == 7
    shard = directory / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-30] ^= 0x01  # the record's trailer: its xxh3 would catch it too, its digest is checked first
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    with pytest.raises(
        SignatureRefused, match=r"__0_0.distcp @ 0: the sha256 digest of its chunk of 'progress.global_step'"
    ):
        load_checkpoint({"progress": {"global_step": 0}}, str(directory), config=policy)


def test_the_signed_blocked_chunk_vector_is_what_the_writer_records(tmp_path):
    """§12.2's blocked chunk: each block's digest, and the chunk's as the digest of theirs, as HashingWriter makes
    them in the one pass that makes the xxh3 block checksums (and as hashlib recomputes them)."""
    import hashlib

    vector = json.loads(vectors()["signed blocked chunk"])
    data = bytes(i % 251 for i in range(vector["length"]))
    size = vector["blocks"]["size"]
    blocks = [hashlib.sha256(data[i : i + size]).hexdigest() for i in range(0, len(data), size)]
    assert blocks == vector["blocks"]["digests"]
    assert hashlib.sha256("".join(blocks).encode()).hexdigest() == vector["digest"]
    stream = HashingWriter(io.BytesIO(), chunk_digest="sha256")
    stream.begin_chunk(block_size_for(len(data)))
    stream.write(data)
    stream.end_chunk()
    assert stream.chunk_crypto == (vector["digest"], tuple(vector["blocks"]["digests"]))


def base64_decode(text: str) -> bytes:
    import base64

    return base64.b64decode(text, validate=True)
