"""What `shardckpt diff` computes: two committed checkpoints side by side, as a plain JSON-ready dict.

They are *identical* when their config, data (version, fingerprint, length, seed), model and code identity
blocks and their topology are equal. A block recorded in one checkpoint and not the other counts as a
difference; one recorded in neither does not. Position (step, epoch, samples consumed) and the run block
(launch command, hosts, logger run) are shown but never count: they differ between any two checkpoints of one
run, or between two launches of it.
"""

from __future__ import annotations

from typing import Any

from ..engine.format.manifest import IDENTITY_BLOCKS
from ..identity.diff import IdentityPolicy, compare
from .references import Resolved

POSITION, TOPOLOGY = "position", "topology"
COMPARED = ("config", "data", "model", "code", TOPOLOGY)  # what `identical` means
SHOWN = (POSITION, "config", "data", "model", "code", TOPOLOGY, "run")  # display order
SAME, DIFFERS, UNRECORDED, ONLY_A, ONLY_B = "same", "differs", "unrecorded", "only_a", "only_b"
_ALL_IGNORE = IdentityPolicy(model="ignore", config="ignore", data="ignore", code="ignore", run="ignore")


def diff(a: Resolved, b: Resolved) -> dict[str, Any]:
    """Identity blocks, topology and position of A and B side by side; `identical` per the module doc."""
    blocks = compare_manifests(
        a.entry.committed_manifest, b.entry.committed_manifest, labels=(a.entry.name, b.entry.name)
    )
    differs = [name for name in COMPARED if blocks[name]["status"] not in (SAME, UNRECORDED)]
    return {
        "a": _header(a),
        "b": _header(b),
        "identical": not differs,
        "differs": differs,
        "compared": list(COMPARED),
        "blocks": blocks,
    }


def compare_manifests(
    a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str] = ("A", "B")
) -> dict[str, dict[str, Any]]:
    """Per block: status, whether it counts, each side's summary and the readable differences."""
    id_a, id_b = a.get("identity") or {}, b.get("identity") or {}
    report = compare(id_a, id_b, _ALL_IGNORE, where=labels[0])  # all-ignore: reports, never raises
    lines = report.differences
    blocks: dict[str, dict[str, Any]] = {}
    for block in IDENTITY_BLOCKS:
        value_a, value_b = id_a.get(block), id_b.get(block)
        if value_a is None or value_b is None:
            status = UNRECORDED if value_a is None and value_b is None else ONLY_A if value_b is None else ONLY_B
        else:
            status = DIFFERS if block in lines else SAME
        block_lines = lines.get(block, [])
        if block == "config":
            block_lines = _relabel(block_lines, labels)
        blocks[block] = {
            "status": status,
            "compared": block in COMPARED,
            "lines": block_lines,
            "a": _summary(block, value_a),
            "b": _summary(block, value_b),
        }
    blocks[TOPOLOGY] = _plain_block(a.get(TOPOLOGY), b.get(TOPOLOGY), compared=True)
    blocks[POSITION] = _plain_block(_position(a), _position(b), compared=False)
    return blocks


def changed_blocks(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], dict[str, list[str]]]:
    """The compared blocks that differ from manifest `a` to `b`, and their differences."""
    blocks = compare_manifests(a, b)
    changed = [name for name in COMPARED if blocks[name]["status"] not in (SAME, UNRECORDED)]
    return changed, {name: blocks[name]["lines"] or [_recorded_note(blocks[name]["status"])] for name in changed}


def _header(side: Resolved) -> dict[str, Any]:
    manifest = side.entry.committed_manifest
    return {
        "ref": side.ref,
        "path": side.path,
        "name": side.entry.name,
        "id": manifest["id"],
        "step": manifest["step"],
        "created_at": manifest["created_at"],
    }


def _summary(block: str, value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if block == "config":
        return {"digest": value.get("digest")}
    if block == "model":
        tensors = value.get("tensors")
        return {
            **_pick(value, "class", "parameters", "trainable_parameters", "digest"),
            "tensors": len(tensors) if isinstance(tensors, dict) else None,
        }
    if block == "data":  # epoch and samples consumed are position: shown in that block
        return _pick(value, "kind", "class", "version", "fingerprint", "length", "file_count", "seed")
    if block == "code":
        return _pick(value, "commit", "dirty", "versions")
    if block == "run":
        return _pick(value, "world_size", "device_type", "mesh_shape", "num_hosts", "command", "wandb")
    return dict(value)


def _plain_block(a: dict[str, Any] | None, b: dict[str, Any] | None, *, compared: bool) -> dict[str, Any]:
    a, b = a or {}, b or {}
    lines = [
        f"{key} {a.get(key)!r} -> {b.get(key)!r}" for key in sorted(a.keys() | b.keys()) if a.get(key) != b.get(key)
    ]
    return {"status": DIFFERS if lines else SAME, "compared": compared, "lines": lines, "a": a, "b": b}


def _position(manifest: dict[str, Any]) -> dict[str, Any]:
    data = (manifest.get("identity") or {}).get("data") or {}
    position = {"step": manifest.get("step")}
    for key in ("epoch", "samples_consumed"):
        position[key] = manifest.get(key) if manifest.get(key) is not None else data.get(key)
    return position


def _relabel(lines: list[str], labels: tuple[str, str]) -> list[str]:
    # identity_diff labels the sides checkpoint/current; here they are A and B
    heads = {"--- checkpoint": f"--- A {labels[0]}", "+++ current": f"+++ B {labels[1]}"}
    return [heads.get(line, line) for line in lines]


def _recorded_note(status: str) -> str:
    return {ONLY_A: "recorded in the earlier checkpoint only", ONLY_B: "recorded in this checkpoint only"}.get(
        status, status
    )


def _pick(value: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {key: value.get(key) for key in keys}
