"""A signed v5 part stores its chunk digests as one binary column (FORMAT.md §12.2 `digest_column`): what a
reader gets back is exactly the records the writer held, a part of the earlier form reads unchanged, and a
column that does not fit its records is refused naming the part."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_shardckpt.engine.format import parts
from lightning_shardckpt.engine.format.checksum import checksum


def _digest(seed: int) -> str:
    return hashlib.sha256(str(seed).encode()).hexdigest()


def _part(block_counts: list[int | None]) -> dict:
    """A signed part whose chunk i has `block_counts[i]` blocks (None: not blocked), then one object."""
    chunks, offset = [], 0
    for index, blocks in enumerate(block_counts):
        length = 16 if blocks is None else 4 * blocks  # blocks of 4 bytes
        record = {
            "fqn": f"w{index}",
            "offsets": [0],
            "sizes": [4],
            "offset": offset,
            "length": length,
            "checksum": checksum(str(index).encode()),
            "digest": _digest(index),
        }
        if blocks is not None:
            record["blocks"] = {
                "size": 4,
                "checksums": [checksum(f"{index}.{b}".encode()) for b in range(blocks)],
                "digests": [_digest(1000 * index + b) for b in range(blocks)],
            }
        chunks.append(record)
        offset += length
    objects = [{"fqn": "step", "offset": offset, "length": 8, "checksum": checksum(b"step"), "digest": _digest(-1)}]
    return parts.build_part(
        checkpoint_id="0123456789ab",
        rank=0,
        file="__0_0.distcp",
        file_bytes=offset + 8,
        tensor_chunks=chunks,
        objects=objects,
        verification={"mode": "off"},
    )


@given(st.lists(st.one_of(st.none(), st.integers(min_value=1, max_value=4)), max_size=6))
def test_a_signed_part_reads_back_as_the_records_the_writer_held(block_counts):
    part = _part(block_counts)
    stored = parts.to_bytes(part)
    assert b'"digest":' not in stored and b'"digests":' not in stored
    assert parts.parse(stored, "part") == part


def test_the_column_costs_44_bytes_a_digest_where_hex_members_cost_75():
    part = _part([None] * 100)
    as_members = (json.dumps(part, sort_keys=True, separators=(",", ":")) + "\n").encode()
    unsigned = _part([None] * 100)
    for record in [*unsigned["chunks"], *unsigned["objects"]]:
        del record["digest"]
    plain = parts.to_bytes(unsigned)
    assert len(as_members) - len(plain) >= 75 * 101
    assert len(parts.to_bytes(part)) - len(plain) <= 44 * 101 + len('"digest_column":"",')


def test_a_part_with_digests_in_its_records_reads_as_it_stands():
    part = _part([None, 2])
    earlier_form = (json.dumps(part, sort_keys=True, separators=(",", ":")) + "\n").encode()
    assert parts.parse(earlier_form, "part") == part


def test_an_unsigned_part_has_no_column():
    part = _part([None])
    for record in [*part["chunks"], *part["objects"]]:
        del record["digest"]
    assert b"digest_column" not in parts.to_bytes(part)


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda stored: stored.update(digest_column=stored["digest_column"][:-4]), "holds"),
        (lambda stored: stored.update(digest_column="not base64!"), "not base64"),
        (lambda stored: stored.update(digest_column=7), "not a base64 string"),
        (lambda stored: stored["objects"][0].update(digest=_digest(5)), "beside digest_column"),
        (lambda stored: stored["chunks"][1]["blocks"]["checksums"].append("0" * 16), "holds"),
    ],
)
def test_a_column_that_does_not_fit_its_records_is_refused_naming_the_part(damage, named):
    stored = json.loads(parts.to_bytes(_part([None, 2])))
    damage(stored)
    with pytest.raises(ValueError, match=rf"__0_0\.part\.json: part is invalid: .*{named}"):
        parts.parse(json.dumps(stored).encode(), "__0_0.part.json")
