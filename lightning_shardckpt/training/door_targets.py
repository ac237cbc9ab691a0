"""Which entry of a front door's state a checkpoint fills, whichever front door wrote it.

The three front doors write one engine's checkpoints in two layouts:

- the Trainer (ShardedStrategy) and Fabric (ShardedFabricStrategy): "model" (the one model), "optimizers.0",
  "optimizers.1", ... (in order) and one pickled section of their own ("lightning": loops, callbacks, data
  position, RNG; "fabric": plain values, state dicts, RNG);
- the Checkpointer: the user's names at the top level ({"model": ..., "optim": ...}) and its own "checkpointer"
  section (sampler position, every rank's RNG, plug-in state); a bare CheckpointSaver: the caller's names only.

A door describes what it loads into as a `DoorTarget`: its entries by path, which one is the model, which are
the optimizers (in order), which is its own section and which other doors' own sections it can read (Fabric
reads the Trainer's). The loader calls the target with the picked checkpoint's manifest, and the target maps:

1. an entry whose path the checkpoint holds loads from it (a door reading its own checkpoints);
2. else the model loads from the writer's model section, the optimizers from the writer's optimizers, one to
   one in order, when both hold the same number (a Checkpointer's are found by their `param_groups`; its model
   is the one section holding every key of the door's model);
3. the door's own section loads from the checkpoint's own section when the door reads that kind;
4. anything else is not restored: with `strict`, a model or optimizer that finds nothing fails the load with
   an error naming the door that wrote the checkpoint and what loads; without, it keeps its value. What the
   writer's own section carries (loops, data position, RNG) is reported as not restored, never an error: a
   checkpoint of another door is a warm start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import IncompatibleCheckpoint

log = logging.getLogger(__name__)

MODEL = "model"  # the Trainer's and Fabric's model section
OPTIMIZERS = "optimizers"  # theirs: optimizers.<index>
PARAM_GROUPS = "param_groups"  # every optimizer state's own key
Path = tuple[str, ...]

# a door's own section -> the door that writes it, and what it carries that another door cannot map
OWN_SECTIONS = {
    "checkpointer": ("the Checkpointer", "the sampler's position, the RNG states, the plug-ins' state"),
    "lightning": (
        "the Trainer (ShardedStrategy)",
        "the loops (step, epoch), callbacks, LR schedulers, data position, RNG",
    ),
    "fabric": ("Fabric (ShardedFabricStrategy)", "the state's plain values and state dicts, data position, RNG"),
}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where each entry of a door's state is read from in one checkpoint."""

    writer: str  # the front door that wrote it, in words
    native: bool  # written by this door: its own section is there
    sources: dict[Path, Path]  # door path -> the checkpoint path it loads from
    missing: tuple[Path, ...]  # door paths the checkpoint holds nothing for
    own_source: str | None  # the checkpoint's own section this door reads ("fabric", or the Trainer's "lightning")
    not_carried: str | None  # what the writer's own section carries that this door does not read

    def mapped(self) -> dict[str, str]:
        """Entries read from a section of another name: {"optim": "optimizers.0"}."""
        return {".".join(key): ".".join(path) for key, path in self.sources.items() if path != key}

    def not_restored(self) -> list[str]:
        """What the door asked for and this checkpoint did not give back, in words."""
        lacking = [".".join(path) for path in self.missing]
        return lacking + ([self.not_carried] if self.not_carried else [])


def sections(manifest: dict[str, Any]) -> dict[str, set[str]]:
    """The checkpoint's top-level sections and "optimizers.<i>" ones, each with its flattened keys below it."""
    found: dict[str, set[str]] = {}
    for kind in ("tensors", "objects"):
        for item in manifest.get(kind, []):
            fqn = item["fqn"]
            head, _, rest = fqn.partition(".")
            if head == OPTIMIZERS and rest:
                index, _, rest = rest.partition(".")
                head = f"{OPTIMIZERS}.{index}"
            found.setdefault(head, set()).add(rest)
    return found


class DoorTarget:
    """For the loader: a door's DCP state to load into, shaped by the picked checkpoint's layout. It may be called
    again for another checkpoint (a fallback to another copy or to the last known-good)."""

    def __init__(
        self,
        entries: dict[Path, Any],
        *,
        model: Path | None,
        optimizers: tuple[Path, ...],
        own: Path | None,
        reads_own: tuple[str, ...] = (),
        strict: bool,
        strict_hint: str = "strict=False",
    ) -> None:
        """`entries`: door path -> its DCP state (live tensors fill in place); `model`, `optimizers`, `own`: the
        paths of those roles; `reads_own`: other doors' own sections this door can read; `strict_hint`: how this
        door's user loads only what maps."""
        self.entries, self.model, self.optimizers, self.own = entries, model, optimizers, own
        self.reads_own = tuple({*reads_own, *([own[0]] if own else [])})
        self.strict, self.strict_hint = strict, strict_hint
        self.layout: Layout | None = None
        self.target: dict[str, Any] = {}
        self._put_back: list[tuple[dict, str, Any]] = []

    def __call__(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.layout = layout = self.layout_of(manifest)
        target: dict[str, Any] = {}
        for key, value in self.entries.items():
            # strict: an entry that finds nothing stays in, so the loader's key diff names it (`explain` adds who
            # wrote the checkpoint); the door's own section is never required (another door's is a warm start)
            path = layout.sources.get(key, key if self.strict and key != self.own else None)
            if path is None:
                continue
            node = target
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        self.target = target
        self._put_back = [] if layout.native else self._options_the_writer_lacks(manifest, layout)
        return target

    def restored(self) -> dict[Path, Any]:
        """After the load: what it filled, by door path (plain values were replaced in the target)."""
        assert self.layout is not None, "restored() before a load"
        for group, key, value in self._put_back:
            group.setdefault(key, value)
        return {key: _at(self.target, path) for key, path in self.layout.sources.items() if key != self.own}

    def own_section(self) -> bytes:
        """The pickled own section the load filled (b"" when the checkpoint has none this door reads)."""
        if self.layout is None or self.layout.own_source is None:
            return b""
        return self.target.get(self.layout.own_source, b"")

    def explain(self, error: IncompatibleCheckpoint) -> IncompatibleCheckpoint:
        """The loader's key diff, with the door that wrote the checkpoint and what will load."""
        if self.layout is None or self.layout.native:
            return error
        return IncompatibleCheckpoint(f"{error}\n{self._what_loads(self.layout)}")

    def _options_the_writer_lacks(self, manifest: dict[str, Any], layout: Layout) -> list[tuple[dict, str, Any]]:
        """An optimizer from another door: its param-group options the writer did not record (an LR scheduler's
        `initial_lr`) are taken out of what the load must find, and put back with this run's values after it."""
        saved = {item["fqn"] for kind in ("tensors", "objects") for item in manifest.get(kind, [])}
        put_back = []
        for key in self.optimizers:
            path, state = layout.sources.get(key), self.entries[key]
            if path is None or not isinstance(state, dict):
                continue
            for index, group in enumerate(state.get(PARAM_GROUPS) or []):
                for option in list(group):
                    if f"{'.'.join(path)}.{PARAM_GROUPS}.{index}.{option}" not in saved:
                        put_back.append((group, option, group.pop(option)))
        return put_back

    # --- the mapping ---
    def layout_of(self, manifest: dict[str, Any]) -> Layout:
        held = sections(manifest)
        own_sections = [name for name in OWN_SECTIONS if name in held]
        writer_own = own_sections[0] if own_sections else None
        writer = OWN_SECTIONS[writer_own][0] if writer_own else "a CheckpointSaver (no front door's section)"
        native = self.own is not None and writer_own == self.own[0]
        writer_model, writer_optimizers = self._writer_roles(held, writer_own)
        sources: dict[Path, Path] = {}
        missing: list[Path] = []
        for key in self.entries:
            if key == self.own:
                if writer_own in self.reads_own:
                    sources[key] = (writer_own,)
                else:
                    missing.append(key)
            elif ".".join(key) in held:
                sources[key] = key
            elif not native and (path := self._by_role(key, writer_model, writer_optimizers)) is not None:
                sources[key] = path
            else:
                missing.append(key)
        not_carried = OWN_SECTIONS[writer_own][1] if writer_own and writer_own not in self.reads_own else None
        return Layout(
            writer=writer,
            native=native,
            sources=sources,
            missing=tuple(missing),
            own_source=writer_own if writer_own in self.reads_own else None,
            not_carried=not_carried,
        )

    def _writer_roles(self, held: dict[str, set[str]], writer_own: str | None) -> tuple[Path | None, list[Path]]:
        """The writer's model section and its optimizers, in order."""
        if writer_own in ("lightning", "fabric") or any(name.startswith(f"{OPTIMIZERS}.") for name in held):
            optimizers = sorted((name for name in held if name.startswith(f"{OPTIMIZERS}.")), key=_index)
            return ((MODEL,) if MODEL in held else None), [tuple(name.split(".", 1)) for name in optimizers]
        optimizers = sorted(name for name, keys in held.items() if any(k.startswith(f"{PARAM_GROUPS}.") for k in keys))
        model = None
        if self.model is not None:  # the one section holding every key of this door's model
            wanted = _flat_keys(self.entries[self.model])
            fits = [
                name for name, keys in held.items() if name not in optimizers and name != writer_own and wanted <= keys
            ]
            model = (fits[0],) if len(fits) == 1 else None
        return model, [(name,) for name in optimizers]

    def _by_role(self, key: Path, writer_model: Path | None, writer_optimizers: list[Path]) -> Path | None:
        if key == self.model:
            return writer_model
        if key in self.optimizers and len(self.optimizers) == len(writer_optimizers):
            return writer_optimizers[self.optimizers.index(key)]
        return None

    def _what_loads(self, layout: Layout) -> str:
        loads = ", ".join(f"{key} <- {path}" for key, path in layout.mapped().items()) or "entries of the same names"
        return (
            f"It was written by {layout.writer}: here its model and optimizers load ({loads}); "
            f"{', '.join(layout.not_restored()) or 'nothing else'} would not be restored. Load it with "
            f"{self.strict_hint} to take what maps and keep the rest as initialised"
        )


def warn_not_restored(where: str, layout: Layout, lacking: list[str], spell: Callable[[str], str] = str) -> None:
    """Rank 0, once per load: what the door asked for and the checkpoint did not give back, never silently (the
    loop runs on with its own values for them). `spell`: how the door's user names an entry (`state['optim']`)."""
    if not lacking:
        return
    mapped = ", ".join(f"{spell(key)} <- {path!r}" for key, path in layout.mapped().items())
    log.warning(
        "%s was written by %s%s; not restored (they keep their current values): %s",
        where,
        layout.writer,
        f" (loaded {mapped})" if mapped else "",
        ", ".join(lacking),
    )


def _index(section: str) -> int:
    tail = section.split(".", 1)[1]
    return int(tail) if tail.isdigit() else 1 << 30


def _flat_keys(value: Any, prefix: str = "") -> set[str]:
    if isinstance(value, dict):
        out: set[str] = set()
        for key, inner in value.items():
            out |= _flat_keys(inner, f"{prefix}{key}.")
        return out
    return {prefix[:-1]}


def _at(tree: dict[str, Any], path: Path) -> Any:
    for part in path:
        tree = tree[part]
    return tree
