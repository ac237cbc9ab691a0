"""Two checkpoints as `compare` and `investigate` name them: each a path, or a selector within `--root` or
within the other one's root. What one reference means is engine/root.py's (`locate`), as everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine import catalog
from ..engine.format.names import join
from ..engine.root import open_reference, open_root, parse_reference
from ..engine.storage.fsio import Location
from ..errors import ConfigError


@dataclass
class Resolved:
    """A checkpoint reference resolved to a committed checkpoint."""

    ref: str
    root: Location
    entry: catalog.CheckpointEntry

    @property
    def path(self) -> str:
        return join(self.root.url, self.entry.name)


def resolve_pair(
    ref_a: str, ref_b: str, root: str | None, storage_options: dict[str, Any]
) -> tuple[Resolved, Resolved]:
    """Resolve A and B. Selectors go to `root`, else to the root of the other reference, which is a path."""
    root_location = open_root(root, storage_options) if root is not None else None
    resolved: dict[str, Resolved] = {}
    for ref in (ref_a, ref_b):
        if root_location is None and not parse_reference(ref).is_path:
            continue  # a selector: resolved next to the other reference, once it has named its root
        location, entry = open_reference(ref, root_location, storage_options)
        resolved[ref] = Resolved(ref, location, entry)
        root_location = root_location or location  # bare selectors resolve next to the first path
    for ref in (ref_a, ref_b):
        if ref not in resolved:
            if root_location is None:
                raise ConfigError(
                    f"{ref_a!r} and {ref_b!r} are both selectors; say which root they are in: "
                    f"shardckpt diff --root ROOT {ref_a} {ref_b} (or write ./{ref_a} for a directory here)"
                )
            resolved[ref] = Resolved(ref, *open_reference(ref, root_location, storage_options))
    return resolved[ref_a], resolved[ref_b]
