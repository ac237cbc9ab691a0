"""Which entry of a Checkpointer state a checkpoint fills, whichever front door wrote it.

The three front doors write one engine's checkpoints in two layouts:

- the Checkpointer: the user's names at the top level ({"model": ..., "optim": ...}) and its own "checkpointer"
  section (sampler position, every rank's RNG, plug-in state); a bare CheckpointSaver: the caller's names only;
- the Trainer (ShardedStrategy) and Fabric (ShardedFabricStrategy): "model" (the one model), "optimizers.0",
  "optimizers.1", ... (in order) and one pickled section ("lightning", "fabric": loops, data position, RNG).

`CheckpointTarget` is handed to the loader, which calls it with the picked checkpoint's manifest: a state entry
loads from the section of its own name; when the checkpoint has none, a module loads from "model" and an
optimizer from "optimizers.0", provided the state holds exactly one of each and the checkpoint exactly one
optimizer. What the state asks for and the checkpoint lacks fails the load unless `strict=False` (then it keeps
its value and is named in `not_restored`). The other door's pickled section is not read: its data position and
RNG are reported as not restored. The sections' names are lightning/lightning_state.py's and
lightning/fabric/state.py's (training/ does not import lightning/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import user_state

MODEL = "model"  # the Trainer's and Fabric's model section
OPTIMIZERS = "optimizers"  # theirs: optimizers.<index>
WRITERS = {  # a section only that front door writes -> the front door, in words
    user_state.RESERVED_KEY: "the Checkpointer",
    "lightning": "the Trainer (ShardedStrategy)",
    "fabric": "Fabric (ShardedFabricStrategy)",
}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where each entry of the state is read from in one checkpoint."""

    writer: str  # the front door that wrote it, in words
    native: bool  # written by a Checkpointer: its own section is there
    sources: dict[str, tuple[str, ...]]  # state key -> the path of its section in the checkpoint
    missing: tuple[str, ...]  # state keys the checkpoint holds nothing for

    def mapped(self) -> dict[str, str]:
        """State keys read from a section of another name: {"optim": "optimizers.0"}."""
        return {key: ".".join(path) for key, path in self.sources.items() if path != (key,)}


def sections(manifest: dict[str, Any]) -> set[str]:
    """The checkpoint's top-level sections, and "optimizers.<i>" for each optimizer of the Trainer's layout."""
    fqns = [item["fqn"] for kind in ("tensors", "objects") for item in manifest.get(kind, [])]
    found = {fqn.split(".", 1)[0] for fqn in fqns}
    found |= {".".join(fqn.split(".", 2)[:2]) for fqn in fqns if fqn.startswith(f"{OPTIMIZERS}.")}
    return found


def layout_of(state: dict[str, Any], manifest: dict[str, Any]) -> Layout:
    held = sections(manifest)
    writer = next((name for key, name in WRITERS.items() if key in held), "a CheckpointSaver (no front door's section)")
    native = user_state.RESERVED_KEY in held
    sources: dict[str, tuple[str, ...]] = {}
    missing: list[str] = []
    for key, value in state.items():
        if key in held:
            sources[key] = (key,)
        elif not native and (path := _other_doors_section(state, key, value, held)) is not None:
            sources[key] = path
        else:
            missing.append(key)
    return Layout(writer=writer, native=native, sources=sources, missing=tuple(missing))


def _other_doors_section(state: dict[str, Any], key: str, value: Any, held: set[str]) -> tuple[str, ...] | None:
    """The Trainer's / Fabric's section for a model or an optimizer the checkpoint has no section of its name for;
    None where the mapping is not one to one (two models, two optimizers, or the state names a section itself)."""
    if user_state.is_module(value):
        alone = sum(user_state.is_module(other) for other in state.values()) == 1
        return (MODEL,) if alone and MODEL in held and MODEL not in state else None
    if user_state.is_optimizer(value):
        alone = len(user_state.optimizers_of(state)) == 1
        saved = sorted(section for section in held if section.startswith(f"{OPTIMIZERS}."))
        return (OPTIMIZERS, "0") if alone and saved == [f"{OPTIMIZERS}.0"] and OPTIMIZERS not in state else None
    return None


class CheckpointTarget:
    """For the loader: the DCP state to load into, shaped by the picked checkpoint's layout (it may be called
    again for another checkpoint: a fallback to another tier or to the last known-good)."""

    def __init__(self, state: dict[str, Any], *, strict: bool) -> None:
        self.state, self.strict = state, strict
        self.dcp_state = user_state.to_dcp(state)  # live tensors: a load fills them in place
        self.layout: Layout | None = None
        self.target: dict[str, Any] = {}

    def __call__(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.layout = layout = layout_of(self.state, manifest)
        target: dict[str, Any] = {}
        for key, value in self.dcp_state.items():
            # strict: a missing entry stays in, so the loader's check names it (and strict=False as the fix)
            path = layout.sources.get(key, (key,) if self.strict else None)
            if path is not None:
                node = target
                for part in path[:-1]:
                    node = node.setdefault(part, {})
                node[path[-1]] = value
        if layout.native:
            target[user_state.RESERVED_KEY] = b""
        self.target = target
        return target

    def restored(self) -> dict[str, Any]:
        """After the load: what it filled, by state key (plain values were replaced in the target)."""
        assert self.layout is not None, "restored() before a load"
        return {key: _at(self.target, path) for key, path in self.layout.sources.items()}

    def own_section(self) -> bytes:
        return self.target.get(user_state.RESERVED_KEY, b"")


def _at(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        tree = tree[part]
    return tree
