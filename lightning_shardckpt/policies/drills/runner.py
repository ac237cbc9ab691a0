"""Restore drills: prove a committed checkpoint restores, in fresh processes, on another world size.

`run_drill` forks `world_size` rank processes (policies/drills/worker.py) from a warm pool that has
already imported torch and the engine (policies/drills/pool.py), at low priority with a bounded number
of threads each; they form a fresh gloo group of their own, restore the checkpoint through the
resume path and check it. The outcome becomes a write-once drill record (ops/drill_records.py):
`passed` only when the drill ranks said so; a drill that times out or dies is `failed` with the cause;
a drill that cannot start is `not-drilled`. The process that wrote a checkpoint never decides that it
passed: it only starts the drill and files what the drill processes report.

`DrillRunner` runs drills one at a time on a background thread for the training callback, so a drill
never holds up a save or the training thread; it keeps one warm pool for the run, and with it the last
drill's ranks (up to `keep_memory_gib` of destination memory), so the next drill restores at resume speed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ...engine.format import drill_records, signing
from ...engine.format.drill_records import FAILED, NOT_DRILLED, PASSED, outcome_details
from ...engine.format.names import MANIFEST, join
from ...engine.root import open_reference
from ...engine.validate import require_number, typed_options
from ...errors import ConfigError, SignatureRefused, StorageUnavailable
from . import trust as drill_trust
from .pool import KEEP_BYTES, PoolFailed, WarmPool, destination_bytes
from .scratch import scratch_directory

log = logging.getLogger(__name__)

# Drills yield the CPU to training: at +19 a drill gets ~1.5% of a core that training wants (CFS weights
# 15 vs 1024), and whatever training leaves idle.
NICE_INCREMENT = 19


@dataclass(frozen=True, kw_only=True)
@typed_options("drill")
class DrillOptions:
    """How a drill runs. `world_size=None` picks one that differs from the writer's (1, or 2 after 1)."""

    world_size: int | None = None
    timeout_s: float = 600.0  # a drill still running then is killed and recorded as failed
    threads: int = 1  # torch threads per drill rank
    probe: str | None = None  # "module:function": state dict of the model -> float, compared with the saved value
    tolerance: float = 1e-4  # relative tolerance of the probe comparison
    nice: int = NICE_INCREMENT  # added to the drill processes' niceness (0: same priority as training)
    trust_checkpoint: bool = (
        False  # True: the drill unpickles any class the checkpoint names (trusted checkpoints only)
    )
    # classes the run added with torch.serialization.add_safe_globals, as "module:qualname" (policies/drills/trust.py):
    # the drill processes allow them too, so a checkpoint the run resumes is one its drill restores
    safe_globals: tuple[str, ...] = ()
    storage_options: dict[str, Any] = field(default_factory=dict)
    # PEM public key files (several: rotation). Set: only a checkpoint one of them signed is drilled; one that fails
    # the policy gets a failed record naming the file and key (engine/format/signing.py), never a pass
    public_keys: tuple[Any, ...] = ()  # an AcceptedKey entry: a key with a validity window (LoadConfig's)
    revoked_keys: tuple[str, ...] = ()  # key ids or PEM files refused whoever lists them (LoadConfig's)
    # destination memory the drill ranks keep between drills, all ranks together (policies/drills/pool.py): the
    # ranks of a drill that fits stay alive for the next; 0: every drill forks its ranks and frees it all
    keep_memory_gib: float = KEEP_BYTES / 2**30

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_keys", signing.public_key_specs(self.public_keys))
        if self.public_keys:  # an unreadable key is the operator's mistake: refused now, not recorded per checkpoint
            signing.load_public_keys(self.public_keys)
        object.__setattr__(self, "revoked_keys", signing.public_key_specs(self.revoked_keys))
        signing.revoked_key_ids(self.revoked_keys)
        require_number(
            "drill.world_size",
            self.world_size,
            integer=True,
            at_least=1,
            allow_none=True,
            none_means="differs from the writer's",
        )
        require_number("drill.timeout_s", self.timeout_s, above=0, hint="seconds")
        require_number("drill.threads", self.threads, integer=True, at_least=1)
        # NaN would compare False with every difference: a probe that changed would pass
        require_number("drill.tolerance", self.tolerance, at_least=0, hint="relative, e.g. 1e-4")
        require_number("drill.nice", self.nice, integer=True, at_least=0, at_most=19, hint="0: training's priority")
        host_gib = host_memory_gib()
        require_number(
            "drill.keep_memory_gib",
            self.keep_memory_gib,
            at_least=0,
            at_most=host_gib,
            hint=f"GiB the drill ranks keep between drills, at most this host's {host_gib:.1f} GiB; 0: keep none",
        )
        if any(not isinstance(spec, str) or ":" not in spec for spec in self.safe_globals):
            raise ConfigError(
                f"drill safe_globals={self.safe_globals!r} must be 'module:qualname' names, e.g. mypkg.state:MyState"
            )
        if self.probe is not None and ":" not in self.probe:
            raise ConfigError(f"drill probe={self.probe!r} must be 'module:function', e.g. recipes.lm:probe")


def host_memory_gib() -> float:
    """This host's physical memory in GiB (the bound of drill.keep_memory_gib)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # a platform without these: no bound but the option's own
        return float("inf")


def warm_pool(options: DrillOptions) -> WarmPool:
    """The warm workers for drills with these options (a run's runner, a follower, one-off drills)."""
    return WarmPool(threads=options.threads, nice=options.nice, keep_bytes=int(options.keep_memory_gib * 2**30))


def default_world_size(writer_world_size: int) -> int:
    """A world size other than the writer's, so every drill also proves resharding."""
    return 2 if writer_world_size == 1 else 1


def run_drill(
    checkpoint: str,
    options: DrillOptions | None = None,
    *,
    root: str | None = None,
    pool: WarmPool | None = None,
    record_fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Drill one checkpoint (a checkpoint directory URL, or `root` + a selector); return its record.

    The record is written to ROOT/drills/ before this returns. Never raises for a bad checkpoint:
    that is a failed drill. Raises CheckpointNotFound when there is nothing committed to drill.
    `pool`: warm workers to fork the ranks from (kept warm by the caller); None starts one for this drill.
    `record_fields`: added to the record (who drilled it: the follower names itself).
    """
    options = options or DrillOptions()
    if pool is None:
        pool = warm_pool(options)
        try:
            return run_drill(checkpoint, options, root=root, pool=pool, record_fields=record_fields)
        finally:
            pool.close()
    _check_probe_importable(options.probe)  # the operator's mistake is not the checkpoint's: refuse, record nothing
    drill_trust.check_importable(options.safe_globals)
    location, entry = open_reference(checkpoint if root else "latest", root or checkpoint, options.storage_options)
    path = join(location.url, entry.name)
    _check_records_writable(location)
    writer_world = int((entry.committed_manifest.get("topology") or {}).get("world_size") or 1)
    world_size = options.world_size or default_world_size(writer_world)
    record: dict[str, Any] = {
        "checkpoint": entry.name,
        "checkpoint_id": entry.checkpoint_id,
        "step": entry.step,
        "drill_id": drill_records.new_drill_id(),
        "world_size": world_size,
        "writer_world_size": writer_world,
        "started_at": _now(),
        "probe": options.probe,
        # the run's trust, carried over (policies/drills/trust.py): what this drill let the checkpoint unpickle
        "unpickle_trust": drill_trust.label(options.trust_checkpoint, options.safe_globals),
        "allowed_globals": list(options.safe_globals),
        **(record_fields or {}),
    }
    if options.public_keys:
        refused = _signature_refusal(location, entry, options, record)
        if refused is not None:
            return refused
    outcome = _run_ranks(
        path, world_size, options, record, pool, destination_bytes(entry.committed_manifest, world_size)
    )
    if outcome.get("verdict") == PASSED:
        record = outcome["record"]  # filed by drill rank 0 itself: the starter never files a pass
    elif _deleted(location, entry.name):
        # retention (of a run that does not know this drill), gc or a person removed it meanwhile: the drill proves
        # nothing either way, as when it is gone before the drill starts; no record is filed for a checkpoint gone
        record.update(
            verdict=NOT_DRILLED,
            cause=f"{entry.name} was deleted while it was drilled (retention, gc or a person); not a failed restore",
            deleted=True,
            finished_at=_now(),
        )
    else:
        record.update(outcome)
        record["finished_at"] = _now()
        drill_records.write_record(location, record)
    level = logging.INFO if record["verdict"] == PASSED else logging.WARNING
    log.log(
        level,
        "drill of %s on %d rank(s): %s%s",
        entry.name,
        world_size,
        record["verdict"],
        f" ({record['cause']})" if record.get("cause") else "",
    )
    return record


def _signature_refusal(location: Any, entry: Any, options: DrillOptions, record: dict[str, Any]) -> dict | None:
    """Before forking: the manifest's signature (a small read). A checkpoint that fails the policy is refused and
    recorded as a failed drill naming the file and key: it is settled (a follower does not come back to it), shows
    in `shardckpt ls`, and is never known-good. Accepted: the key id joins the record, and the drill ranks check
    every file they read against the signed digests (the resume path's check: a pass means a resume with this
    policy restores it, and the bytes are hashed as they are read for the drill, in parallel, not read twice)."""
    policy = signing.accepted_policy(options.public_keys, options.revoked_keys)
    try:
        record["signed_by"] = policy.check_manifest(location.fs, entry.path, entry.manifest)
    except SignatureRefused as err:
        record.update(verdict=FAILED, cause=f"SignatureRefused: {err}", signature_refused=True, finished_at=_now())
        drill_records.write_record(location, record)
        log.warning("drill of %s refused: %s", entry.name, err)
        return record
    return None


def _deleted(location: Any, name: str) -> bool:
    """Whether checkpoint `name` is uncommitted now: deletion removes the manifest first (FORMAT.md §2)."""
    try:
        location.fs.invalidate_cache()  # an object store's listing cache still holds what was there
        return not location.fs.exists(join(location.path, name, MANIFEST))
    except OSError:  # cannot tell: the drill's own verdict stands
        return False


def _check_records_writable(location: Any) -> None:
    try:
        drill_records.check_writable(location)
    except OSError as err:  # read-only file system, no permission, a bucket that refuses writes
        raise StorageUnavailable(
            f"drill records go into {join(location.url, drill_records.DRILLS_DIR)}/, which cannot be written here "
            f"({type(err).__name__}: {err}); drill with write access to the root (object storage: credentials that "
            "may write), or copy the checkpoint directory into a writable root and drill it there"
        ) from err


def _check_probe_importable(probe: str | None) -> None:
    if not probe:
        return
    module = probe.partition(":")[0]
    if (
        os.getcwd() not in sys.path
    ):  # as the drill ranks look (drill_worker.load_callable): recipes.lm from the repo root
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(
            f"drill probe {probe!r}: module {module!r} cannot be imported from here (sys.path: the current directory "
            "and PYTHONPATH); run from the directory that holds it, add it to PYTHONPATH, or name it by its package path"
        )


def _run_ranks(
    path: str, world_size: int, options: DrillOptions, header: dict[str, Any], pool: WarmPool, rank_bytes: int = 0
) -> dict[str, Any]:
    """Fork the drill ranks from the warm pool, wait at most timeout_s, and turn what happened into verdict +
    details."""
    with scratch_directory() as scratch:
        out = os.path.join(scratch, "outcome.json")
        try:
            pool_start_s = pool.ensure_started()  # before the clock: time to resume measures the restore
        except OSError as err:  # no processes, no memory: not a verdict on the checkpoint
            return {"verdict": NOT_DRILLED, "cause": f"the drill could not start: {err}"}
        header["worker_pool"] = {"warm": pool_start_s == 0.0, "start_s": round(pool_start_s, 3)}
        with open(os.path.join(scratch, "header.json"), "w") as handle:  # rank 0 completes it into the record
            json.dump(header, handle)
        logs = [os.path.join(scratch, f"rank{rank}.log") for rank in range(world_size)]
        try:
            spawned_at = time.time()
            ranks = [
                (_rank_argv(path, rank, world_size, out, spawned_at, options), logs[rank]) for rank in range(world_size)
            ]
            reply = pool.run(ranks, options.timeout_s, destination_bytes=rank_bytes, kept_key=_kept_key(options))
        except PoolFailed as err:
            return {"verdict": FAILED, "cause": str(err), "logs": [_tail(log) for log in logs]}
        except OSError as err:  # the pool could not be asked: not a verdict on the checkpoint
            return {"verdict": NOT_DRILLED, "cause": f"the drill could not start: {err}"}
        codes, tails = reply["codes"], [_tail(log) for log in logs]
        processes = {"rank_process": reply["rank_process"], "rank_pids": reply["pids"]}
        if any(code not in (None, 0) for code in codes):
            rank, code = next((r, c) for r, c in enumerate(codes) if c not in (None, 0))
            how = f"killed by signal {-code}" if code < 0 else f"exited with {code}"
            cause = f"drill rank {rank} {how} before it finished"
            return {"verdict": FAILED, "cause": cause, "logs": tails, **processes}
        if any(code is None for code in codes):
            cause = f"the drill did not finish within timeout_s={options.timeout_s:g}; killed"
            return {"verdict": FAILED, "cause": cause, "logs": tails, **processes}
        try:
            with open(out) as handle:
                outcome = json.load(handle)
        except (OSError, ValueError) as err:
            return {"verdict": FAILED, "cause": f"drill rank 0 left no outcome ({err})", "logs": tails, **processes}
    if outcome.get("ok") and outcome.get("record"):
        return {"verdict": PASSED, "record": outcome["record"]}
    return {
        "verdict": FAILED,
        "cause": outcome.get("cause", "drill rank 0 reported success but filed no record"),
        **processes,
        **outcome_details(outcome),
    }


def _kept_key(options: DrillOptions) -> str:
    """What a kept drill rank carries from one drill to the next besides its group and memory: its torch threads
    and the safe globals it allowed (process-wide). Kept ranks started with another key are replaced."""
    return json.dumps({"threads": options.threads, "safe_globals": sorted(options.safe_globals)})


def _rank_argv(path: str, rank: int, world_size: int, out: str, spawned_at: float, options: DrillOptions) -> list[str]:
    """policies/drills/worker.py's command line for one rank."""
    argv = [
        "--checkpoint",
        path,
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
        "--out",
        out,
        "--record-header",
        os.path.join(os.path.dirname(out), "header.json"),
        "--spawned-at",
        repr(spawned_at),
        "--threads",
        str(options.threads),
        "--tolerance",
        repr(options.tolerance),
        "--storage-options",
        json.dumps(options.storage_options),
    ]
    if options.probe:
        argv += ["--probe", options.probe]
    if options.trust_checkpoint:
        argv.append("--trust")
    for spec in options.safe_globals:
        argv += ["--safe-global", spec]
    for key in options.public_keys:
        argv += ["--public-key", key.argument() if isinstance(key, signing.AcceptedKey) else key]
    for key in options.revoked_keys:
        argv += ["--revoked-key", key]
    return argv


def _tail(log_path: str, limit: int = 2000) -> str:
    try:
        with open(log_path, "rb") as handle:
            output = handle.read()
    except OSError:
        output = b""
    return output[-limit:].decode(errors="replace")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class DrillRunner:
    """Runs drills one at a time on a daemon thread, in request order; results go to `on_result`.

    Requests beyond `max_queued` drop the oldest waiting one (the newest checkpoint matters most).
    """

    def __init__(
        self, options: DrillOptions, on_result: Callable[[dict[str, Any]], None], *, max_queued: int = 2
    ) -> None:
        self.options = options
        self._on_result = on_result
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._max_queued = max_queued
        # created on the drill thread, which it dies with (drill_pool: PR_SET_PDEATHSIG); warm for the run
        self._pool = warm_pool(options)
        self._thread = threading.Thread(target=self._run, name="shardckpt-drill", daemon=True)
        self._pending: list[str] = []  # checkpoint paths queued or being drilled
        self._pending_lock = threading.Lock()
        self._thread.start()
        self.dropped = 0

    def pending(self) -> set[str]:
        """Directory names queued or being drilled: retention must not delete them under the drill."""
        with self._pending_lock:
            return {path.rstrip("/").rsplit("/", 1)[-1] for path in self._pending}

    def request(self, checkpoint_path: str) -> None:
        while self._queue.qsize() >= self._max_queued:
            try:
                self._forget(self._queue.get_nowait())
                self.dropped += 1
            except queue.Empty:
                break
        with self._pending_lock:
            self._pending.append(checkpoint_path)
        self._queue.put(checkpoint_path)

    def _forget(self, path: str | None) -> None:
        with self._pending_lock:
            if path in self._pending:
                self._pending.remove(path)

    def close(self, timeout: float | None = None, *, finish_queued: bool = False) -> None:
        """Let the running drill finish (and the waiting ones with `finish_queued`), then stop the thread.

        `timeout` bounds each drill; a drill still running when the thread is abandoned keeps its own
        deadline (DrillOptions.timeout_s) and files its record when it ends.
        """
        while not finish_queued:
            try:
                self._forget(self._queue.get_nowait())
                self.dropped += 1
            except queue.Empty:
                break
        pending = self._queue.qsize() + 1
        self._queue.put(None)
        self._thread.join(None if timeout is None else timeout * pending)

    def _run(self) -> None:
        try:
            self._drill_until_closed()
        finally:
            self._pool.close()

    def _drill_until_closed(self) -> None:
        while (path := self._queue.get()) is not None:
            try:
                record = run_drill(path, self.options, pool=self._pool)
            except Exception as err:  # nothing to drill (deleted by retention meanwhile), storage down
                record = {
                    "checkpoint": path.rstrip("/").rsplit("/", 1)[-1],
                    "verdict": NOT_DRILLED,
                    "cause": f"{type(err).__name__}: {err}",
                }
                log.warning("drill of %s did not run: %s", path, record["cause"])
            self._forget(path)
            try:
                self._on_result(record)
            except Exception:  # a logger error must not stop later drills
                log.exception("drill result handler failed")
