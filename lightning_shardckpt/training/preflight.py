"""Every rank writes its own shards: each checks the root before training, and all raise the first problem."""

from __future__ import annotations

from ..engine.collectives import all_gather_objects
from ..engine.storage import fsio
from ..errors import StorageUnavailable


def preflight_on_every_rank(location: fsio.Location) -> None:
    try:
        fsio.preflight(location)
        problem = None
    except StorageUnavailable as err:
        problem = str(err)
    problems = all_gather_objects("storage-preflight", problem, None)  # no rank may go on alone
    first = next((p for p in problems if p), None)
    if first is not None:
        raise StorageUnavailable(first)
