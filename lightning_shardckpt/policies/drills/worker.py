"""One rank of a restore drill: a fresh process restores a checkpoint and checks what it got.

Forked by the warm pool of policies/drills/pool.py (or run as `python -m lightning_shardckpt.policies.drills.worker
...`), N of them forming a fresh gloo group of their own (never the training ranks' group or memory). Each rank allocates its share of
every tensor the manifest lists (sharded along dim 0 across the drill's ranks, so DCP reshards from
the writer's layout), loads through `load_checkpoint` (the resume path: checksums on every byte,
`.metadata` checked before use), then checks:

- every tensor came back with the manifest's dtype and global shape;
- no tensor holds NaN/Inf unless the writer recorded that it already did (`finite` per tensor);
- the Lightning state, when there is one, deserialises through the allow-list and has its loops;
- a probe, when given: a function of the model's state dict returning a scalar, compared with the
  value the callback recorded at save time (manifest `extra.probe`), within a tolerance.

Rank 0 writes the outcome as JSON to `--out` for the parent; the parent writes the drill record.

A rank either runs one drill and exits (`main`: forked for it) or is kept for the drills after it (`DrillRank`:
the pool's kept ranks), keeping its gloo group and its `Destination`: the tensors it restores into, reused
while the checkpoints' tensors keep their shapes and dtypes. Those tensors hold NaN bytes before every load
(refilled after each drill, while the rank waits for the next), so no value of an earlier checkpoint can pass
for a restored one: a tensor or part of one that the load did not write fails the NaN check.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import torch
import torch.distributed as dist

from ...engine.config import LoadConfig
from ...engine.format import safe_pickle, signing
from ...engine.load.loader import load_checkpoint
from ...engine.root import open_reference
from ...engine.storage.writer import is_finite
from ...errors import ShardCkptError
from . import trust as drill_trust

MODEL_PREFIX = "model."  # the Lightning strategy saves the model's state dict under "model"
LIGHTNING_FQN = "lightning"  # the pickled rest of Lightning's checkpoint (lightning/lightning_state.py)
PROBE_EXTRA = "probe"  # manifest extra: {"name": "module:function", "value": float}


class DrillFailed(Exception):
    """A check failed; the message is the drill's recorded cause."""


def main(argv: list[str] | None = None) -> int:
    """One drill in this process (forked by the pool for it, or run as a module), then exit."""
    entered = time.time()  # forked from the warm pool: the fork; run cold: interpreter start and imports too
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    try:
        run_rank(args, entered, Destination(), "forked")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


class DrillRank:
    """A kept drill rank (policies/drills/pool.py `_KeptRanks`): one drill per request line on `requests`
    ({"argv", "log"}), one reply line on `replies` after each ({"ok"}). Its gloo group (formed at the first
    drill, on that drill's port) and its destination serve every drill after; the pool replaces the rank when
    the world size or its options change. After a failed drill it exits: its peers' collectives end as a
    forked rank's exit ends them, and nothing of a broken group or a half-done load serves another drill."""

    def __init__(self, requests: int, replies: int) -> None:
        self._requests, self._replies = requests, replies
        self._destination = Destination()

    def serve(self) -> int:
        with os.fdopen(self._requests, "r") as requests:
            for line in requests:  # until the pool closes its end
                entered = time.time()
                request = json.loads(line)
                log_to(request["log"])
                args = _parse(request["argv"])
                torch.set_num_threads(args.threads)
                outcome = run_rank(args, entered, self._destination, "kept")
                sys.stderr.flush()
                reply = (json.dumps({"ok": bool(outcome.get("ok"))}) + "\n").encode()
                os.write(self._replies, reply)  # under PIPE_BUF: one write
                if not outcome.get("ok"):
                    return 0
                self._destination.scrub()  # NaN again now, off the next drill's clock
        return 0


def rendezvous_store(scratch: str, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The drill's meeting point: rank 0 listens on a port the kernel gives it and leaves the number in the
    drill's scratch directory; the other ranks read it there.

    A port the starter found free could be taken by any outgoing connection on the host (they get their local
    ports from the same range) before rank 0 listened on it; that drill then failed with EADDRINUSE, a false
    alert about a sound checkpoint. Binding port 0 cannot collide."""
    port_file = os.path.join(scratch, "rendezvous.port")
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        with open(port_file + ".tmp", "w") as handle:
            handle.write(str(store.port))
        os.replace(port_file + ".tmp", port_file)  # whole or absent: a reader never sees half a number
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while not os.path.exists(port_file):
        if time.monotonic() > deadline:
            raise DrillFailed(f"drill rank 0 did not open the rendezvous within {timeout.total_seconds():g} s")
        time.sleep(0.01)
    with open(port_file) as handle:
        port = int(handle.read())
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)


def log_to(path: str) -> None:
    """This process's stdout and stderr go to the drill's log file (the starter keeps its tail for the record)."""
    sys.stderr.flush()
    output = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)


def run_rank(args: argparse.Namespace, entered: float, destination: Destination, rank_process: str) -> dict[str, Any]:
    """One drill on this rank: join (or reuse) the drill's gloo group, restore, check; rank 0 files a pass and
    writes the outcome for the starter. Returns this rank's outcome."""
    timings: dict[str, float] = {"process_start_s": entered - args.spawned_at}
    outcome: dict[str, Any] = {"rank": args.rank, "world_size": args.world_size, "rank_process": rank_process}
    destination.reused = False  # until this drill's target() says otherwise
    try:
        started, cpu = time.time(), time.process_time()
        if args.world_size > 1 and not dist.is_initialized():
            timeout = timedelta(seconds=args.collective_timeout_s)
            store = rendezvous_store(os.path.dirname(args.out), args.rank, args.world_size, timeout)
            dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world_size, timeout=timeout)
        timings["init_s"] = time.time() - started
        timings["init_cpu_s"] = time.process_time() - cpu
        outcome.update(drill(args, timings, destination))
        outcome["ok"] = True
    except DrillFailed as err:
        outcome.update(ok=False, cause=str(err))
    except ShardCkptError as err:  # corrupt, missing, incompatible: the loader's own words
        outcome.update(ok=False, cause=f"{type(err).__name__}: {err}")
    except Exception as err:  # anything else is a failed drill too, with its traceback for the record
        outcome.update(ok=False, cause=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=8))
    outcome["timings"], outcome["destination_reused"] = timings, destination.reused
    if args.rank == 0:
        if outcome["ok"]:
            outcome["record"] = file_passed_record(args, outcome)
        with open(args.out, "w") as handle:
            json.dump(outcome, handle, default=str)
    return outcome


def drill(args: argparse.Namespace, timings: dict[str, float], destination: Destination) -> dict[str, Any]:
    with _phase(timings, "listing"):
        drill_trust.allow_in_this_process(args.safe_global)  # the run's add_safe_globals, before anything unpickles
        storage_options = json.loads(args.storage_options) if args.storage_options else {}
        _, entry = open_reference("latest", args.checkpoint, storage_options)
        manifest = entry.committed_manifest
    with _phase(timings, "target"):  # the device mesh and the NaN-filled tensors to restore into
        target = destination.target(manifest, args.world_size)
    with _phase(timings, "load"):  # listing (again, on rank 0), metadata, planning, read, reshard
        config = LoadConfig(
            verify_checksums=True,
            storage_options=storage_options,
            trust_checkpoint=args.trust,
            # with keys: each rank hashes the files it reads against the signed digests, as a resume with the policy
            require_signature=bool(args.public_key),
            public_keys=tuple(signing.public_key_argument(key) for key in args.public_key),
            revoked_keys=tuple(args.revoked_key),
        )
        result = load_checkpoint(target, args.checkpoint, config=config)
    timings["metadata_s"], timings["read_s"] = result.metadata_s, result.read_s  # rank 0's
    timings["reshard_s"] = max(0.0, timings["load_s"] - result.metadata_s - result.read_s)
    timings["time_to_resume_s"] = time.time() - args.spawned_at
    checks: dict[str, Any] = {"tensors": len(manifest["tensors"]), "objects": len(manifest["objects"])}

    with _phase(timings, "checks"):
        check_shapes(manifest, target)
        checks["nonfinite"] = check_finite(manifest, target)
        checks["lightning_state"] = check_lightning_state(target.get(LIGHTNING_FQN), trust=args.trust)
        if args.probe:
            checks["probe"] = check_probe(args.probe, manifest, target, args.tolerance)
    return {
        "checkpoint": entry.name,
        "step": entry.step,
        "bytes_read": _sum_across_ranks(result.bytes_read),
        "rank_pids": _gather_pids(),
        "checks": checks,
    }


@contextlib.contextmanager
def _phase(timings: dict[str, float], name: str) -> Iterator[None]:
    """Wall seconds (`NAME_s`) and this process's CPU seconds, every thread (`NAME_cpu_s`), of one drill phase:
    CPU well below wall time is waiting (on another rank, on the disk, on a busy machine's scheduler)."""
    started, cpu = time.time(), time.process_time()
    try:
        yield
    finally:
        timings[f"{name}_s"] = time.time() - started
        timings[f"{name}_cpu_s"] = time.process_time() - cpu


def warm_imports() -> None:
    """What a drill imports on first use (DTensor, the device mesh, DCP's planners): the warm pool
    (policies/drills/pool.py) imports them once, so no drill pays for them."""
    import torch._dynamo  # noqa: F401  (DTensor's factories are wrapped in torch._disable_dynamo: ~2 s at first use)
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    from ...engine.storage.fsio import resolve  # noqa: F401  (rank 0 files its pass with it)


def file_passed_record(args: argparse.Namespace, outcome: dict[str, Any]) -> dict[str, Any] | None:
    """Rank 0 of the drill files the pass itself: no process that wrote or started it can make it drilled."""
    from ...engine.format import drill_records
    from ...engine.storage.fsio import resolve

    with open(args.record_header) as handle:
        record = json.load(handle)
    record.update(
        verdict=drill_records.PASSED,
        finished_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        **drill_records.outcome_details(outcome),
    )
    root = resolve(args.checkpoint.rstrip("/").rsplit("/", 1)[0], json.loads(args.storage_options or "{}"))
    try:
        drill_records.write_record(root, record)
    except Exception as err:  # the starter files a failure instead: a pass nobody can see is not a pass
        outcome.update(
            ok=False, cause=f"the drill passed but its record could not be written: {type(err).__name__}: {err}"
        )
        return None
    return record


class Destination:
    """The tensors one drill rank restores into. Rebuilt when a checkpoint's tensors (name, global shape, dtype,
    in manifest order) differ from the last one's; otherwise the same tensors again, already in memory: no page
    faults, no allocation. Every byte is NaN (0xFF; -1 in an integer tensor) before each load: filled when built
    and by `scrub()` after each drill, so a load that leaves any element unwritten fails the NaN check instead of
    showing the last checkpoint's value."""

    def __init__(self) -> None:
        self._layout: list[tuple[str, list[int], str]] | None = None
        self._tensors: dict[str, Any] = {}
        self._mesh: Any = None
        self._scrubbed = False
        self.reused = False  # whether the last target() handed out the tensors of the drill before

    def target(self, manifest: dict[str, Any], world_size: int) -> dict[str, Any]:
        """The state dict the load fills: every tensor the manifest lists, this rank's dim-0 share of it (NaN
        bytes), and None for each object (replaced by the loaded object)."""
        if world_size > 1 and self._mesh is None:
            self._mesh = _mesh(world_size)  # once per process: the group and its mesh serve every drill
        layout = [(t["fqn"], list(t["shape"]), str(t["dtype"])) for t in manifest["tensors"]]
        self.reused = layout == self._layout
        if not self.reused:
            self._tensors, self._layout = {}, None  # the old tensors go before the new ones are allocated
            self._tensors, self._layout, self._scrubbed = build_target(manifest, self._mesh), layout, False
        if not self._scrubbed:
            self.scrub()
        self._scrubbed = False  # the load writes into them now
        return {**self._tensors, **{obj["fqn"]: None for obj in manifest["objects"]}}

    def scrub(self) -> None:
        """Every byte of every tensor to 0xFF (NaN in every float dtype)."""
        for value in self._tensors.values():
            local = value.to_local() if hasattr(value, "to_local") else value
            local.reshape(-1).view(torch.uint8).fill_(0xFF)
        self._scrubbed = True


def build_target(manifest: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """New empty tensors of the manifest's global shapes and dtypes, this rank's dim-0 share of each."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import empty as dtensor_empty

    target: dict[str, Any] = {}
    for tensor in manifest["tensors"]:
        shape, dtype = tensor["shape"], _dtype(tensor["dtype"])
        if mesh is None:
            target[tensor["fqn"]] = torch.empty(shape, dtype=dtype)
        else:
            placements = [Shard(0) if shape and shape[0] > 0 else Replicate()]
            target[tensor["fqn"]] = dtensor_empty(shape, dtype=dtype, device_mesh=mesh, placements=placements)
    return target


def check_shapes(manifest: dict[str, Any], target: dict[str, Any]) -> None:
    wrong = []
    for tensor in manifest["tensors"]:
        value = target[tensor["fqn"]]
        if list(value.shape) != tensor["shape"] or str(value.dtype) != tensor["dtype"]:
            wrong.append(
                f"{tensor['fqn']}: saved {tensor['dtype']}{tensor['shape']}, restored {value.dtype}{list(value.shape)}"
            )
    if wrong:
        raise DrillFailed(f"{len(wrong)} tensor(s) restored with the wrong dtype or shape: " + "; ".join(wrong[:5]))


def check_finite(manifest: dict[str, Any], target: dict[str, Any]) -> list[str]:
    """Tensors holding NaN/Inf; a failure when the writer recorded them finite (or recorded nothing)."""
    names = [t["fqn"] for t in manifest["tensors"]]
    flags = torch.tensor([_nonfinite_local(target[name]) for name in names], dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    nonfinite = [name for name, flag in zip(names, flags.tolist()) if flag]
    saved_nonfinite = {t["fqn"] for t in manifest["tensors"] if t.get("finite") is False}
    new = [name for name in nonfinite if name not in saved_nonfinite]
    if new:
        raise DrillFailed(
            f"{len(new)} tensor(s) hold NaN/Inf that {'were finite at save' if _has_flags(manifest) else 'the drill did not expect'}: "
            + ", ".join(new[:10])
        )
    return nonfinite


def check_lightning_state(blob: Any, *, trust: bool) -> dict[str, Any] | None:
    """The pickled rest of Lightning's checkpoint deserialises (allow-listed classes only) and has its loops."""
    if blob is None:
        return None  # not written by the Lightning strategy: nothing to check
    if not isinstance(blob, (bytes, bytearray)):
        raise DrillFailed(f"the Lightning state is a {type(blob).__name__}, expected pickled bytes")
    try:
        state = _loads_without_frameworks(bytes(blob), trust=trust)
    except Exception as err:
        raise DrillFailed(f"the Lightning state does not deserialise: {type(err).__name__}: {err}") from err
    missing = [key for key in ("global_step", "epoch", "loops") if key not in state]
    if missing:
        raise DrillFailed(f"the Lightning state lacks {missing}")
    return {"global_step": state["global_step"], "epoch": state["epoch"], "keys": sorted(map(str, state))}


class _Stand_in(dict):  # noqa: N801 - a stand-in type, named for what it is
    """Takes the place of an allow-listed class of a framework the drill has not imported (Lightning's
    AttributeDict, OmegaConf's containers): the drill needs the data and the allow-list check, not the class."""

    def __setstate__(self, state: Any) -> None:
        self["__state__"] = state

    def append(self, item: Any) -> None:
        self.setdefault("__items__", []).append(item)

    def extend(self, items: Any) -> None:
        self.setdefault("__items__", []).extend(items)


_NOT_IMPORTED = ("lightning", "lightning_fabric", "pytorch_lightning", "omegaconf")


class _StructuralUnpickler(safe_pickle.RestrictedUnpickler):
    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        if key in self._allowed and module.split(".")[0] in _NOT_IMPORTED and module not in sys.modules:
            return _Stand_in  # allowed, and not worth importing Lightning (~1.3 s of CPU) to rebuild
        return super().find_class(module, name)


def _loads_without_frameworks(data: bytes, *, trust: bool) -> dict[str, Any]:
    """The Lightning state under the resume's allow-list, with stand-ins for Lightning/OmegaConf classes;
    anything the stand-ins cannot take is unpickled for real (same allow-list)."""
    if not trust:
        try:
            return _StructuralUnpickler(io.BytesIO(data), safe_pickle.LIGHTNING_STATE_GLOBALS, torch_safe=True).load()
        except safe_pickle.BlockedGlobal:
            raise
        except Exception:  # a layout the stand-ins do not fit: the real classes decide
            pass
    return safe_pickle.loads(data, safe_pickle.LIGHTNING_STATE_GLOBALS, trust=trust)


def check_probe(spec: str, manifest: dict[str, Any], target: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """Run the probe on the restored model state; compare with the value recorded at save time."""
    saved = (manifest.get("extra") or {}).get(PROBE_EXTRA) or {}
    model_state = {}
    for fqn, value in target.items():
        if fqn.startswith(MODEL_PREFIX) and isinstance(value, torch.Tensor):
            full = value.full_tensor() if hasattr(value, "full_tensor") else value  # collective on every rank
            model_state[fqn[len(MODEL_PREFIX) :]] = full
    if dist.is_initialized() and dist.get_rank() != 0:
        return {"name": spec, "ran_on": "rank 0"}
    value = float(load_callable(spec)(model_state))
    expected = saved.get("value")
    report = {"name": spec, "value": value, "saved": expected, "tolerance": tolerance, "compared": expected is not None}
    if not math.isfinite(value):
        raise DrillFailed(f"probe {spec} gave {value!r} on the restored state")
    if expected is None:
        return report  # nothing recorded at save time (no probe configured then): the model rebuilt and ran
    if abs(value - float(expected)) > tolerance * max(1.0, abs(float(expected))):
        raise DrillFailed(
            f"probe {spec} gave {value!r} on the restored state, {expected!r} at save time (tolerance {tolerance})"
        )
    return report


def load_callable(spec: str) -> Callable[..., Any]:
    """`package.module:function` -> the function (the user's own code, named by the operator)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise DrillFailed(f"probe {spec!r} is not 'module:function'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # probes in the user's project (recipes.lm:probe) import from the cwd
    function = getattr(importlib.import_module(module_name), attr, None)
    if not callable(function):
        raise DrillFailed(f"probe {spec!r}: {module_name} has no callable {attr!r}")
    return function


def _nonfinite_local(value: torch.Tensor) -> int:
    local = value.to_local() if hasattr(value, "to_local") else value
    return int(is_finite(local) is False)  # one sum, no mask the tensor's size (the writer's own check)


def _has_flags(manifest: dict[str, Any]) -> bool:
    return any("finite" in t for t in manifest["tensors"])


def _sum_across_ranks(value: int) -> int:
    if not dist.is_initialized():
        return value
    total = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total.item())


def _gather_pids() -> list[int]:
    """Every drill rank's pid, in rank order (the record shows whether two drills ran in the same processes)."""
    if not dist.is_initialized():
        return [os.getpid()]
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(pids, torch.tensor([os.getpid()], dtype=torch.int64))
    return [int(pid.item()) for pid in pids]


def _mesh(world_size: int) -> Any:
    if world_size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DrillFailed(f"the manifest names an unknown dtype {name!r}")
    return dtype


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="one rank of a restore drill (started by lightning_shardckpt.policies.drills.runner)"
    )
    parser.add_argument("--checkpoint", required=True, help="the checkpoint directory (URL)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--out", required=True, help="rank 0 writes its outcome here as JSON")
    parser.add_argument(
        "--record-header", required=True, help="JSON the starter knows of the record; rank 0 completes and files it"
    )
    parser.add_argument("--spawned-at", type=float, required=True, help="wall time the parent started the ranks")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--probe", default=None, help="module:function taking the model state dict, returning a float")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--storage-options", default="", help="JSON for fsspec")
    parser.add_argument("--collective-timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--trust", action="store_true", help="unpickle any class the checkpoint names (trusted checkpoints only)"
    )
    parser.add_argument(
        "--safe-global",
        action="append",
        default=[],
        metavar="MODULE:QUALNAME",
        help="a class the run allowed with torch.serialization.add_safe_globals (repeatable)",
    )
    parser.add_argument(
        "--public-key",
        action="append",
        default=[],
        metavar="PEM",
        help="load only if one of these Ed25519 keys signed it and every file read matches the signed digests "
        "(PEM,not_after_step=N,not_after=TIME: within that window)",
    )
    parser.add_argument("--revoked-key", action="append", default=[], metavar="KEY", help="a key id or PEM refused")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
