"""Python's cyclic garbage collector paused while metadata is built: many small objects, no cycles.

Parsing parts and building a rank's resume metadata, or unpickling every rank's summary on the coordinator,
allocates tens of thousands of small dicts, lists and tuples. Each burst triggers collections that walk the
whole heap, and a training process's heap is large: `json.loads` of a 2,048-rank manifest took 4.1-4.7 s with
the collector on and 1.6 s off (issue 35); three 1,000-chunk parts were indexed in 0.2 s instead of ~2 ms.
None of these objects form cycles, so nothing is lost by collecting after the burst instead of during it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector for the block (nesting-safe: only the outermost block re-enables it)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
