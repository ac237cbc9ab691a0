"""The one resume of every front door: which checkpoint, from which copy, what if it fails, and the line it shows.

`resume(plan, target, reference, group)` is what `trainer.fit(ckpt_path=...)`, `fabric.load(path, state)` and
`Checkpointer.load(state, which)` do:

- the reference is parsed once (engine/root.parse_reference). A selector ("latest", "last-good", a step, an
  id, a directory name) is looked up in the plan's root, or across the tiers when the plan has them (any
  selector: a step only the durable tier still holds is found there). Anything else is a path, which must hold a
  committed checkpoint: a typo'd or emptied path never trains from scratch;
- `latest` on a root with nothing committed starts fresh (None), unless the plan says `resume_required`;
- a checkpoint that fails its checksums is loaded again from another copy of it (the other tier's), then, with
  `fallback_to_last_good`, from the last known-good; the log names the copy read;
- every rank decides alike: rank 0 lists, the others get its answer on `group`.

`resume_line` is the one line every door shows (rank 0, once the state is applied): path, step, world size
before and after, the tier read, seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine import catalog, metrics
from ..engine.collectives import broadcast_from_coordinator, rank_and_world
from ..engine.config import CHECKPOINTER, ENGINE, FABRIC, LIGHTNING, LoadConfig
from ..engine.format.names import join, parse_dirname
from ..engine.load.loader import LoadResult, load_checkpoint
from ..engine.root import parse_reference, root_of
from ..engine.storage import fsio
from ..errors import CheckpointNotFound, ConfigError, CorruptCheckpoint
from ..policies.plan import CheckpointPlan, Fallback

log = logging.getLogger(__name__)

Target = dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]  # or shaped by the picked manifest


@dataclass(frozen=True)
class DoorWords:
    """How a front door's user spells a resume, for the errors that tell them what to do."""

    asked: str  # the call, with {!r} for the reference
    latest: str  # how to resume the run's own root (an empty one starts fresh)
    last_good: str  # how to resume from the last known-good
    needs_root: str  # what gives a selector its root


WORDS = {
    LIGHTNING: DoorWords(
        "ckpt_path={!r}",
        "ckpt_path='latest' (Hydra: resume=latest)",
        "ckpt_path='last-good' (Hydra: resume=last-good)",
        "add ShardedCheckpoint(dirpath=...) to the Trainer's callbacks or pass a path",
    ),
    FABRIC: DoorWords(
        "fabric.load({!r})",
        "fabric.load('latest', state) with the strategy's root=",
        "fabric.load('last-good', state)",
        "pass ShardedFabricStrategy(root=...) or a path",
    ),
    CHECKPOINTER: DoorWords(
        "load(state, which={!r})",
        "load(state) (which='latest')",
        "load(state, which='last-good')",
        "pass Checkpointer(root=...) or a path",
    ),
    ENGINE: DoorWords("{!r}", "which='latest'", "which='last-good'", "pass a checkpoint root"),
}


def resume(
    plan: CheckpointPlan, target: Target, reference: str | int, group: Any, *, strict: bool = True
) -> LoadResult | None:
    """Load the checkpoint `reference` names into `target` in place, resharded onto this world size; None:
    nothing to resume from (`latest` of an empty root). `strict=False`: what the checkpoint lacks keeps its value.
    Collective over `group` (the checkpoint group: no save may run on it meanwhile)."""
    words = WORDS.get(plan.save.front_door, WORDS[ENGINE])
    ref = parse_reference(reference)
    asked = words.asked.format(ref.text)
    root, config = plan.root, plan.load
    fallbacks: list[Fallback] = []
    which: str | int = "latest" if ref.selector is None else ref.selector  # a path: its own newest (below)
    tier_skipped: tuple[str, ...] = ()  # what the tier choice passed over for the signature policy
    if ref.is_path:  # a path names its own root (or one checkpoint directory): it must hold a checkpoint
        root = ref.text
        if not _agreed_has_committed(root, config, group):
            raise CheckpointNotFound(
                f"{asked} holds no committed checkpoint: found {_contents(root, config, group)}; pass a checkpoint "
                f"root or checkpoint directory that holds one (`shardckpt ls ROOT` lists them), or {words.latest} to "
                "resume from the run's own root, starting fresh if it is empty"
            )
    elif not plan.root:
        raise ConfigError(
            f"{asked} names a checkpoint relative to a checkpoint root, but there is none; {words.needs_root}"
        )
    elif plan.tier_restore is not None:
        picked = plan.tier_restore.pick(which, plan.load, group)  # collective
        if picked is None and not ref.newest:
            raise CheckpointNotFound(f"{asked}: no committed checkpoint {which!r} on the fast or the durable tier")
        if picked is not None:
            root, config, fallbacks, tier_skipped = picked
            which = "latest"  # `root` is now the picked checkpoint's own directory
    if ref.newest and not _agreed_has_committed(root, config, group):
        if plan.resume_required:
            raise CheckpointNotFound(
                f"{asked} but {root} holds no committed checkpoint and resume_required=true; check the root, or "
                "set resume_required=false to start fresh"
            )
        if rank_and_world()[0] == 0:
            log.warning("no committed checkpoint in %s: starting fresh", root)
        return None
    try:
        loaded = load_checkpoint(target, root, which, config=config, strict=strict, process_group=group)
    except CorruptCheckpoint as err:  # every rank raises it alike (DCP gathers failures)
        loaded = _from_another_copy(
            plan, err, target, fallbacks, strict, group, words, newest=ref.newest or ref.is_path
        )
    if plan.tier_restore is not None:
        loaded.source = plan.tier_restore.tier_of(loaded.path)
    if tier_skipped and loaded.signature_skipped is not None:
        # the loader opened one named directory (it passed over nothing): the tier choice's skips are the resume's,
        # counted and named as `latest` without tiers counts them
        loaded.signature_skipped = tier_skipped + tuple(n for n in loaded.signature_skipped if n not in tier_skipped)
    return loaded


def resume_event(loaded: LoadResult, world_size: int, **identity: Any) -> dict[str, Any]:
    """The `resume` event document every door writes under ROOT/events/ (`write_resume_event`): what
    `shardckpt timeline` shows and the health rules' `resume_s`. `identity`: the door's identity comparison."""
    return {
        "event": "resume",
        "from": loaded.path,
        "step": loaded.step,
        "seconds": loaded.seconds,
        "from_id": loaded.checkpoint_id,
        "world_size": world_size,  # `shardckpt timeline` shows before -> after
        "from_world_size": (loaded.manifest.get("topology") or {}).get("world_size"),
        **identity,
        "run_id": loaded.manifest.get("run_id"),
        "created_at": time.time(),
        **_signature_fields(loaded),
    }


SIGNATURE_SKIPPED_METRIC = "checkpoint/signature_skipped"


def resume_metrics(loaded: LoadResult) -> dict[str, float]:
    """What a resume tells the run's loggers (rank 0, once): its time, the step, and with a signature policy how
    many newer checkpoints `latest`/`last-good` passed over because the policy refused them (the health metric
    `signature_skipped`: a forged or unsigned checkpoint in the root is somebody's doing, not rot)."""
    return {
        "checkpoint/resume_s": loaded.seconds,
        "checkpoint/resumed_step": float(loaded.step),
        **signature_metrics(loaded),
    }


def signature_metrics(loaded: LoadResult) -> dict[str, float]:
    """`checkpoint/signature_skipped` under a signature policy (0 included: a dashboard tells "none skipped" from
    "not watched"); nothing without one. The doors whose loggers get no other resume metric (Fabric, the plain
    loop) log just this."""
    if loaded.signature_skipped is None:
        return {}
    return {SIGNATURE_SKIPPED_METRIC: float(len(loaded.signature_skipped))}


def _signature_fields(loaded: LoadResult) -> dict[str, Any]:
    """The event's `signature_skipped` (count) and their names, only under a signature policy: without one the
    event is what it always was."""
    if loaded.signature_skipped is None:
        return {}
    return {
        "signature_skipped": len(loaded.signature_skipped),
        "signature_skipped_names": list(loaded.signature_skipped),
    }


def write_resume_event(location: fsio.Location, event: dict[str, Any]) -> None:
    metrics.write_json_event(location, f"resume-step-{event['step']:09d}", event)


def resume_line(loaded: LoadResult, world_size: int) -> str:
    """`lightning_shardckpt: resumed from PATH (step 40) on 4 -> 2 ranks, durable tier, in 1.23s` (the words of
    `shardckpt timeline`)."""
    before = (loaded.manifest.get("topology") or {}).get("world_size")
    source = f", {loaded.source}" if loaded.source else ""
    return (
        f"lightning_shardckpt: resumed from {loaded.path} (step {loaded.step}) on "
        f"{before if before is not None else '?'} -> {world_size} ranks{source}, in {loaded.seconds:.2f}s"
    )


def _from_another_copy(
    plan: CheckpointPlan,
    err: CorruptCheckpoint,
    target: Target,
    fallbacks: list[Fallback],
    strict: bool,
    group: Any,
    words: DoorWords,
    *,
    newest: bool,
) -> LoadResult:
    """After a load failed its checks: the same checkpoint's other copies, then (for `latest`) the last known-good."""
    for fallback in fallbacks:
        if rank_and_world()[0] == 0:
            log.warning("%s (%s)", fallback.why, err)
        try:
            if fallback.prepare is not None:
                fallback.prepare(group)  # every rank: a repair of the copy before it is read again
            return load_checkpoint(target, fallback.path, config=fallback.config, strict=strict, process_group=group)
        except CorruptCheckpoint as again:  # every rank alike, as the first
            err = again
        except CheckpointNotFound:  # that copy does not exist (a tier that never got it): the next one
            if rank_and_world()[0] == 0:
                log.warning("%s holds no copy of it", fallback.path)
    if not newest:  # a checkpoint named explicitly is that one or none
        raise err
    good, config = _last_good(plan, group)
    if good is None or not plan.fallback_to_last_good:
        hint = (
            f"The last known-good checkpoint (newest that passed a restore drill) is {good}: resume from it with "
            f"{words.last_good}, or set drill.fallback_to_last_good=true to do so automatically"
            if good
            else "No checkpoint of this root has passed a restore drill, so there is no known-good one to fall back "
            "to; pick an older one with `shardckpt ls` and resume from its path"
        )
        raise CorruptCheckpoint(f"{err}\n{hint}", problems=err.problems) from err
    if rank_and_world()[0] == 0:
        log.warning("the latest checkpoint did not load (%s); fallback_to_last_good: resuming from %s", err, good)
    return load_checkpoint(target, good, config=config, strict=strict, process_group=group)


def _last_good(plan: CheckpointPlan, group: Any) -> tuple[str | None, LoadConfig]:
    """(path, load config) of the last known-good checkpoint every rank can read (both tiers with tiers: drill
    records live in a tier's root); (None, ...) without one. Collective."""
    if plan.tier_restore is not None:
        good = plan.tier_restore.last_good(plan.load, group)
        return good if good is not None else (None, plan.load)
    path = None
    if rank_and_world()[0] == 0 and plan.root:
        try:
            entries = catalog.last_good(plan.location, catalog.list_checkpoints(plan.location))
            path = join(plan.location.url, entries[-1].name) if entries else None
        except Exception:  # noqa: BLE001 - a hint for an error being raised; never a second error
            log.debug("could not look up the last known-good checkpoint of %s", plan.root, exc_info=True)
    return broadcast_from_coordinator("last-good", path, group), plan.load


def _agreed_has_committed(root: str, config: LoadConfig, group: Any) -> bool:
    """Rank 0 lists `root` (a checkpoint directory itself counts: the loader opens it or says why not)."""
    answer = None
    if rank_and_world(group)[0] == 0:
        # ROOT/latest and a checkpoint directory name their root (engine/root.py)
        within = root_of(fsio.resolve(root, config.storage_options))
        answer = parse_dirname(root.rstrip("/").rsplit("/", 1)[-1]) is not None or (
            catalog.newest_committed(catalog.list_checkpoints(within)) is not None
        )
    return bool(broadcast_from_coordinator("has-committed", answer, group))


def _contents(root: str, config: LoadConfig, group: Any) -> str:
    """What a path that holds no committed checkpoint holds instead (rank 0 looks)."""
    found = None
    if rank_and_world(group)[0] == 0:
        found = catalog.describe_contents(root_of(fsio.resolve(root, config.storage_options)))
    return broadcast_from_coordinator("path-contents", found, group)
