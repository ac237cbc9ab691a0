"""Which run owns a checkpoint root, so that two runs pointed at one root by mistake cannot mix.

Two runs writing into one root would delete each other's checkpoints (retention keeps the newest N
of the root, not of a run), move `latest` back and forth, and resume from each other's state. So the
first saver of a root claims it: the coordinator creates `ROOT/.owner.json` ({run_id, created_at,
host, pid}) with create-if-absent, and every later saver compares its run id with the one recorded
there. A different run id is refused before anything is written, unless `allow_shared_root`. A
resumed run adopts the run id of the checkpoint it resumed from (the callback does this), so
continuing a run on a new launch, host or world size is never refused.

The marker is written once and never rewritten; readers ignore it (docs/FORMAT.md §1).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from datetime import datetime, timezone
from typing import Any

from ..errors import ConfigError, StorageUnavailable
from .collectives import broadcast_from_coordinator, rank_and_world
from .config import CHECKPOINTER, ENGINE, FABRIC, LIGHTNING
from .format import bounded_json
from .format.names import OWNER, join
from .storage import fsio
from .storage.fsio import Location
from .storage.small_files import SmallFileRefused

log = logging.getLogger(__name__)


def new_run_id() -> str:
    """A fresh run id: sortable by start time, unique by its random tail (`20261202-144226-3f9a1c`)."""
    return f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def read_owner(root: Location) -> dict[str, Any] | None:
    """The root's owner record, None when the root has none; ConfigError when the marker is unreadable."""
    path = join(root.path, OWNER)
    record, problem = None, None
    try:
        data = fsio.read_small(root.fs, path, bounded_json.SMALL_MAX_BYTES)
    except FileNotFoundError:
        return None
    except SmallFileRefused as err:  # a FIFO, a link or a huge file: never opened or read whole
        problem = err.why
    else:
        try:
            record = bounded_json.loads(data, bounded_json.SMALL_MAX_BYTES)
        except bounded_json.UnreadableJson as err:
            problem = str(err)
        else:
            has_run = isinstance(record, dict) and isinstance(record.get("run_id"), str)
            problem = None if has_run else "no run_id in it"
    if problem:
        raise ConfigError(
            f"{join(root.url, OWNER)} is not an owner marker of lightning_shardckpt: {problem}. Delete it if no "
            "other run writes into this root, or set save.allow_shared_root=true"
        )
    return record


def claim(root: Location, run_id: str) -> dict[str, Any]:
    """Return the root's owner record, first creating it for `run_id` if the root has none."""
    existing = read_owner(root)
    if existing is not None:
        return existing
    record = {
        "run_id": run_id,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    try:
        # create-if-absent: of two runs starting at once on an unowned root, exactly one becomes the owner
        root.backend.create_if_absent(join(root.path, OWNER), (json.dumps(record, sort_keys=True) + "\n").encode())
    except FileExistsError:
        return read_owner(root) or record
    log.info("%s: claimed for run %s", root.url, run_id)
    return record


# How to continue the owning run, said in the words of the API that created the saver (SaveConfig.front_door)
CONTINUE_ADVICE = {
    ENGINE: (
        "give this saver its own root; to continue that run, load its checkpoint first and create the saver with its "
        "run id: result = load_checkpoint(state, root), then CheckpointSaver(root, "
        "SaveConfig(run_id=result.manifest['run_id'])) (lightning_shardckpt.Checkpointer does this for you); or, if the "
        "runs should share the root, set SaveConfig(allow_shared_root=True)"
    ),
    CHECKPOINTER: (
        "give this run its own root; to continue that run, call checkpointer.load(state) before the first save, which "
        "continues its run id; or, if the runs should share the root, pass save={'allow_shared_root': True}"
    ),
    FABRIC: (
        "give this run its own root; to continue that run, fabric.load('latest', state) with the strategy's root= "
        "before the first save, which continues its run id; or, if the runs should share the root, pass "
        "save={'allow_shared_root': True} to the strategy"
    ),
    LIGHTNING: (
        "give this run its own dirpath; to continue that run, resume it (ckpt_path='latest', or resume=latest in "
        "recipes/train.py), which adopts its run id; or, if the runs should share the root, set "
        "save.allow_shared_root=true"
    ),
}


def conflict_message(root: Location, owner: dict[str, Any], run_id: str, front_door: str = ENGINE) -> str:
    return (
        f"{root.url} belongs to another run: {OWNER} names run {owner.get('run_id')!r} (host {owner.get('host')}, "
        f"pid {owner.get('pid')}, since {owner.get('created_at')}), and this run is {run_id!r}. Two runs in one root "
        "delete each other's checkpoints (retention) and move `latest` back and forth. Fix one of: "
        + CONTINUE_ADVICE.get(front_door, CONTINUE_ADVICE[ENGINE])
    )


def ensure_owner(root: Location, run_id: str, allow_shared_root: bool, group: Any, front_door: str = ENGINE) -> str:
    """Collective "root-owner": claim or check `root` on the coordinator; every rank gets the same outcome.

    `front_door`: the API that creates the saver (SaveConfig.front_door), whose words the refusal's advice uses.

    Returns the coordinator's run id (so all ranks record one). Raises ConfigError on every rank when
    another run owns the root and sharing is off, and StorageUnavailable when the marker could not be
    read or written, so no rank is left waiting in a later collective.
    """
    decision: tuple[str, str | None, str | None] = (run_id, None, None)  # (run id, error kind, message)
    if rank_and_world(group)[0] == 0:
        try:
            owner = claim(root, run_id)
            if owner["run_id"] != run_id:
                message = conflict_message(root, owner, run_id, front_door)
                if not allow_shared_root:
                    decision = (run_id, "config", message)
                else:
                    log.warning(
                        "%s is owned by run %s; writing into it as run %s because allow_shared_root=true",
                        root.url,
                        owner["run_id"],
                        run_id,
                    )
        except ConfigError as err:
            if allow_shared_root:
                log.warning("%s; going on because allow_shared_root=true", err)
            else:
                decision = (run_id, "config", str(err))
        except Exception as err:  # raised below on every rank, not only here: the others wait in the broadcast
            decision = (run_id, "storage", f"cannot check who owns {root.url} ({type(err).__name__}: {err})")
    run_id, kind, message = broadcast_from_coordinator("root-owner", decision, group)
    if kind == "config":
        raise ConfigError(message)
    if kind == "storage":
        raise StorageUnavailable(message)
    return run_id
