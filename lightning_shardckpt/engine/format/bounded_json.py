"""JSON documents read from storage, parsed within a size and a nesting-depth bound.

Anything in a checkpoint root may have been written by someone else: a 6 KB `[[[...]]]` nested 3000 deep
makes `json.loads` raise RecursionError, which no caller expects, and a nested document that does parse
can still exhaust the stack of code that walks it later. And Python objects cost more than the text that
makes them: `{}` is two bytes and a 64-byte dict, so a 20 MiB manifest of `[{}, {}, ...]` takes half a
gigabyte to parse. Every JSON document read from storage (manifests, commit records, drill records, events,
owner markers, lease files) goes through `loads`, which raises UnreadableJson (a ValueError) instead; each
caller turns that into the problem of that one file (a corrupt checkpoint, an ignored record), never of the
whole root. The bytes come from storage/small_files.py's bounded read (backend.read_small): a FIFO, a symlink or
a file over its bound is refused before it is read, so the size check here never sees more than bound + 1 bytes.
"""

from __future__ import annotations

import json
from typing import Any

# what lightning_shardckpt writes stays far below these: a manifest of a million chunks is ~200 MB, a commit
# record, drill record, event or owner marker a few KB (with a user's hyperparameters, a few hundred KB)
MANIFEST_MAX_BYTES = 1 << 30
SMALL_MAX_BYTES = 4 << 20
# ours nest under 10 levels; a user's config inside identity blocks may add a few dozen
MAX_DEPTH = 100

# What a parse may cost, judged from the text before parsing (a few bytes.count passes, ~1 GB/s): every
# container is charged 80 bytes and every other value (one per `,` or `:`) 64, its text once more. That
# bounds json.loads on CPython 3.11 from above: measured peaks are 4.5x the size for our manifests (indent 1)
# and 6.8x compact (charged 7x and 10x), and 25x for the densest JSON there is, `[{},{},...]` (charged 49x).
# A document charged more than MAX_EXPANSION times its size is refused: padded or crafted, never ours.
CONTAINER_COST, VALUE_COST = 80, 64
MAX_EXPANSION = 20
SMALL_DOCUMENT = 1 << 20  # below this any charge is harmless (at most ~50 MiB): small files are never refused for it


class UnreadableJson(ValueError):
    """A document from storage is over its size bound, nested too deep, or not JSON; the message says which."""


def loads(data: bytes, max_bytes: int, max_depth: int = MAX_DEPTH, schema_checked: tuple[str, ...] = ()) -> Any:
    """Parse `data`; UnreadableJson when it holds more than `max_bytes` bytes, nests deeper than `max_depth`
    levels or is not JSON.

    `schema_checked`: top-level keys whose values a schema checks field by field (a manifest's tensor, object
    and file tables): the depth walk skips them, since it would cost as much as the parse on a large manifest
    and nothing walks those entries recursively: the schema reads the fields it knows, one level each."""
    if len(data) > max_bytes:
        raise UnreadableJson(f"{len(data)} bytes, over the {max_bytes} bytes such a file may hold")
    check_parse_cost(data)
    try:
        document = json.loads(data)
    except RecursionError:
        # the C parser recurses once per level: a document this deep is refused before any walk of ours
        raise UnreadableJson(f"nested deeper than {max_depth} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnreadableJson(f"not valid JSON ({err})") from err
    walked = {k: v for k, v in document.items() if k not in schema_checked} if isinstance(document, dict) else document
    if _deeper_than(walked, max_depth):
        raise UnreadableJson(f"nested deeper than {max_depth} levels")
    return document


def parse_cost(data: bytes) -> int:
    """An upper bound on the bytes `json.loads(data)` allocates (see CONTAINER_COST)."""
    containers = data.count(b"{") + data.count(b"[")
    values = data.count(b",") + data.count(b":")
    return CONTAINER_COST * containers + VALUE_COST * values + len(data)


def check_parse_cost(data: bytes) -> None:
    """UnreadableJson when parsing `data` could cost more than MAX_EXPANSION times its size."""
    if len(data) <= SMALL_DOCUMENT:
        return
    cost = parse_cost(data)
    if cost > MAX_EXPANSION * len(data):
        raise UnreadableJson(
            f"{len(data)} bytes packed with {cost // VALUE_COST} JSON values and containers: parsing it could take "
            f"{cost >> 20} MiB, over {MAX_EXPANSION}x its size; no file we write is that dense, so it was padded or "
            "crafted and is not parsed"
        )


def _deeper_than(document: Any, max_depth: int) -> bool:
    """Whether containers nest more than `max_depth` levels; iterative, so no depth can exhaust the stack."""
    stack = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > max_depth:
                    return True
                stack.append((child, depth + 1))
    return False
