"""The commit protocol under failure, on real gloo ranks (DESIGN.md section 3, "failure points").

For every failure point a save is attempted after a committed one, and the test proves:
(a) the failed attempt is never visible as committed; (b) the previous committed checkpoint stays the
one `load_checkpoint(..., "latest")` picks, and it loads bit-exact; (c) the failed attempt's directory is
listed as uncommitted. The exception is the coordinator failing after the manifest: that checkpoint IS
committed and readers pick it although `latest` still names the previous one (a stale `latest`).

Ranks that raise keep the group usable, so one spawn runs every raising case in sequence. A rank that
really dies (`os._exit`) or hangs breaks the group, so each of those cases gets its own spawn.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from lightning_shardckpt import CheckpointNotFound, CheckpointSaver, SaveConfig, VerifyConfig, catalog, fsio, load_checkpoint
from lightning_shardckpt.layout import MANIFEST, shard_filename
from tests.helpers import training_state as ts
from tests.helpers.spawn import run_ranks

WORLD = 3
COORDINATOR = 0
RESULT_TIMEOUT_S = 60.0  # a save that has not finished by then has hung: reported, never waited on forever


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    """What to do at `point` on `rank`: raise, exit (the process dies) or hang (until the others finished)."""

    point: str
    rank: int
    action: str = "raise"  # raise | exit | hang | none (only the effect)
    effect: str | None = None  # corrupt_own_file | partial_manifest_tmp
    step: int = 0  # the attempt's step: effects find its directory by it
    markers: str | None = None  # hang: wait until every other rank left a marker file here


class FaultHook:
    """Picklable `fault_hook`: fires the armed fault once, when point and rank match."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.fault: Fault | None = None
        self.fired: list[tuple[str, int]] = []

    def arm(self, fault: Fault | None) -> None:
        self.fault = fault

    def __call__(self, point: str) -> None:
        fault, rank = self.fault, dist.get_rank()
        if fault is None or point != fault.point or rank != fault.rank:
            return
        self.fault = None  # one shot
        self.fired.append((point, rank))
        if fault.effect == "corrupt_own_file":
            _flip_one_byte(_attempt_dir(self.root, fault.step), shard_filename(rank))
        elif fault.effect == "partial_manifest_tmp":
            # what a coordinator dying inside the manifest write leaves behind: a half-written temp file
            directory = _attempt_dir(self.root, fault.step)
            with open(os.path.join(directory, f".{MANIFEST}.deadbeef.tmp"), "wb") as handle:
                handle.write(b'{"format_version": 1, "id": "')
        if fault.action == "exit":
            os._exit(1)
        if fault.action == "hang":
            _hang_until_others_finished(fault.markers, rank)
            os._exit(1)
        if fault.action == "raise":
            raise InjectedFault(f"injected fault at {point} on rank {rank}")


def _attempt_dir(root: str, step: int) -> str:
    (directory,) = glob.glob(os.path.join(root, f"step-{step:09d}-*"))
    return directory


def _flip_one_byte(directory: str, filename: str) -> None:
    path = os.path.join(directory, filename)
    with open(path, "r+b") as handle:
        middle = os.path.getsize(path) // 2
        handle.seek(middle)
        byte = handle.read(1)
        handle.seek(middle)
        handle.write(bytes([byte[0] ^ 0xFF]))


def _hang_until_others_finished(markers: str, rank: int) -> None:
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    others = [os.path.join(markers, f"done-{r}") for r in range(WORLD) if r != rank]
    while not all(os.path.exists(path) for path in others) and time.monotonic() < deadline:
        time.sleep(0.05)


def _summary(result, seconds: float) -> dict:
    return {
        "committed": result.committed,
        "error": None if result.error is None else str(result.error),
        "dirname": None if result.path is None else result.path.rstrip("/").rsplit("/", 1)[-1],
        "seconds": seconds,
    }


def _observe(root: str) -> dict:
    """The root as a reader sees it (read on the coordinator only)."""
    location = fsio.resolve(root)
    entries = catalog.list_checkpoints(location)
    return {
        "states": {entry.name: entry.state for entry in entries},
        "files": {entry.name: sorted(os.listdir(entry.path)) for entry in entries},
        "latest": catalog.find(location, "latest").name,
        "pointer": catalog.read_latest_pointer(location),
    }


# --- ranks that raise: one spawn runs every case ---

RAISING_CASES = [
    # (name, fault, words the failed save's error must contain)
    ("rank_fails_before_write", Fault("before_write", rank=1), "injected fault at before_write on rank 1"),
    ("rank_fails_after_half_its_shard", Fault("mid_shard", rank=2), "injected fault at mid_shard on rank 2"),
    ("rank_fails_after_write_before_verify", Fault("after_write", rank=0), "injected fault at after_write on rank 0"),
    ("rank_fails_after_write_before_receipt", Fault("before_receipt", rank=1), "injected fault at before_receipt on rank 1"),
    ("readback_catches_a_flipped_byte", Fault("after_write", rank=2, action="none", effect="corrupt_own_file"),
     "read-back verification failed"),
    ("coordinator_fails_before_metadata", Fault("before_metadata", rank=0), "injected fault at before_metadata on rank 0"),
    ("coordinator_fails_during_manifest_write", Fault("before_manifest", rank=0, effect="partial_manifest_tmp"),
     "injected fault at before_manifest on rank 0"),
    # last: this one commits, so it changes which checkpoint is latest
    ("coordinator_fails_after_manifest", Fault("after_manifest", rank=0), "injected fault at after_manifest on rank 0"),
]


def raising_cases_worker(rank, world_size, root):
    model, optimizer = ts.build("fsdp", seed=1, world_size=world_size)
    hook = FaultHook(root)
    saver = CheckpointSaver(root, SaveConfig(verify=VerifyConfig(mode="full"), collective_timeout_s=10, parallelism="fsdp"),
                            fault_hook=hook)
    references = {}  # step -> full state (rank 0), for bit-exact comparison of what `latest` loads

    def save(step, fault):
        ts.train_steps(model, optimizer, steps=1, seed=step)  # every attempt saves different values
        references[step] = ts.full_state(model, optimizer)
        state = ts.sharded_state(model, optimizer)
        state["progress"] = {"global_step": step}
        hook.arm(None if fault is None else Fault(**{**fault.__dict__, "step": step}))
        fired_before = len(hook.fired)
        started = time.monotonic()
        result = saver.save(state, step=step).result(timeout=RESULT_TIMEOUT_S)
        hook.arm(None)
        return {**_summary(result, time.monotonic() - started), "fired": hook.fired[fired_before:]}

    def load_latest():
        fresh_model, fresh_optimizer = ts.build("fsdp", seed=99, world_size=world_size)
        state = ts.sharded_state(fresh_model, fresh_optimizer)
        state["progress"] = {"global_step": -1}
        loaded = load_checkpoint(state, root, "latest")
        ts.apply_state(fresh_model, fresh_optimizer, state)
        full = ts.full_state(fresh_model, fresh_optimizer)  # a collective: every rank takes part
        if rank != COORDINATOR:
            return None
        expected = references[loaded.step]
        mismatched = sorted(name for name in expected if name not in full or not torch.equal(expected[name], full[name]))
        return {"step": loaded.step, "progress": state["progress"], "mismatched": mismatched, "keys": len(expected)}

    baseline = save(1, None)
    records = []
    for number, (name, fault, _) in enumerate(RAISING_CASES):
        attempt = save(10 + number, fault)
        observed = _observe(root) if rank == COORDINATOR else None
        records.append({"case": name, "attempt": attempt, "observed": observed, "loaded": load_latest()})
    saver.close()
    return {"baseline": baseline, "records": records}


def test_no_failure_point_of_a_raising_rank_exposes_a_partial_checkpoint_or_moves_latest(tmp_path):
    root = str(tmp_path / "ckpt")
    outcomes = run_ranks(raising_cases_worker, WORLD, root, timeout_s=150)
    baseline = outcomes[0].value["baseline"]
    assert baseline["committed"], baseline["error"]
    committed = {baseline["dirname"]}
    for number, (name, fault, words) in enumerate(RAISING_CASES):
        attempts = [o.value["records"][number]["attempt"] for o in outcomes]
        observed = outcomes[0].value["records"][number]["observed"]
        loaded = outcomes[0].value["records"][number]["loaded"]
        dirname = attempts[0]["dirname"]
        step = 10 + number
        # the fault fired exactly where it was aimed, and every rank saw the save fail with its cause
        # (after the manifest the checkpoint is committed whatever the ranks were told: storage is the truth)
        for rank, attempt in enumerate(attempts):
            assert attempt["fired"] == ([(fault.point, rank)] if rank == fault.rank else []), (name, rank, attempt)
            assert attempt["dirname"] == dirname
            if name != "coordinator_fails_after_manifest":
                assert not attempt["committed"], (name, rank)
                assert words in attempt["error"], (name, rank, attempt["error"])
        if name == "coordinator_fails_after_manifest":
            # the manifest exists, so the checkpoint is committed; `latest` was never updated (stale)
            committed.add(dirname)
            assert observed["states"][dirname] == "committed", name
            assert observed["pointer"] == baseline["dirname"], "latest should still name the previous checkpoint"
            assert observed["latest"] == dirname, "readers trust the manifests, not the stale pointer"
            assert loaded["step"] == step
        else:
            # (c) listed as uncommitted, (a) nothing new is committed, (b) the previous one is latest
            assert observed["states"][dirname] == "uncommitted", (name, observed["states"])
            assert MANIFEST not in observed["files"][dirname], name
            assert observed["latest"] == baseline["dirname"], name
            assert observed["pointer"] == baseline["dirname"], name
            assert loaded["step"] == 1, name
        assert {n for n, s in observed["states"].items() if s == "committed"} == committed, name
        attempted = {r["attempt"]["dirname"] for r in outcomes[0].value["records"][: number + 1]}
        assert set(observed["states"]) == {baseline["dirname"]} | attempted, name
        assert loaded["keys"] > 0 and loaded["mismatched"] == [], (name, loaded)
        assert loaded["progress"] == {"global_step": loaded["step"]}, name

    files = {r["case"]: r["observed"]["files"][r["attempt"]["dirname"]] for r in outcomes[0].value["records"]}
    # the partial evidence is there, and still nothing counts as committed
    assert shard_filename(2) in files["rank_fails_after_half_its_shard"], "rank 2 should have left half a shard file"
    assert ".metadata" not in files["coordinator_fails_before_metadata"]
    assert f".{MANIFEST}.deadbeef.tmp" in files["coordinator_fails_during_manifest_write"]


# --- a rank that really dies or hangs: one spawn per case ---

def _plain_state(seed: int) -> dict:
    """Replicated plain tensors (DCP spreads their writes over the ranks); rebuilt in the test process."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(13, 7), (7,), (7, 5), (5,), (3, 3, 3), (11,), (2, 9), (17,)]
    state = {f"t{i}": torch.randn(*shape, generator=generator) for i, shape in enumerate(shapes)}
    state["progress"] = {"global_step": seed, "note": f"state-{seed}"}
    return state


def dying_rank_worker(rank, world_size, root, fault, timeout_s):
    hook = FaultHook(root)
    saver = CheckpointSaver(root, SaveConfig(verify=VerifyConfig(mode="full"), collective_timeout_s=timeout_s), fault_hook=hook)
    first = saver.save(_plain_state(1), step=1).result(timeout=RESULT_TIMEOUT_S)
    assert first.committed, first.error
    hook.arm(Fault(**{**fault.__dict__, "step": 2}))
    started = time.monotonic()
    second = saver.save(_plain_state(2), step=2).result(timeout=RESULT_TIMEOUT_S)
    summary = _summary(second, time.monotonic() - started)
    if fault.markers:
        open(os.path.join(fault.markers, f"done-{rank}"), "w").close()
    return {"first": first.path.rstrip("/").rsplit("/", 1)[-1], "second": summary}


def _load_plain_latest(root: str) -> tuple[int, dict]:
    """Load `latest` in this (non-distributed) process into a state shaped like `_plain_state`."""
    state = {key: torch.full_like(value, float("nan")) for key, value in _plain_state(0).items() if key != "progress"}
    state["progress"] = {"global_step": -1, "note": ""}
    loaded = load_checkpoint(state, root, "latest")
    return loaded.step, state


def _assert_equal_states(expected: dict, actual: dict) -> None:
    assert sorted(expected) == sorted(actual)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == actual[key].dtype and torch.equal(value, actual[key]), f"{key} differs"
        else:
            assert value == actual[key], key


DEATHS = [
    # (fault, the checkpoint `latest` must resolve to afterwards: 1 = previous, 2 = the attempt)
    pytest.param(Fault("mid_shard", rank=1, action="exit"), 1, id="rank_dies_after_half_its_shard"),
    pytest.param(Fault("before_manifest", rank=0, action="exit", effect="partial_manifest_tmp"), 1,
                 id="coordinator_dies_during_manifest_write"),
    pytest.param(Fault("after_manifest", rank=0, action="exit"), 2, id="coordinator_dies_after_manifest_latest_stale"),
]


@pytest.mark.parametrize("fault,latest_step", DEATHS)
def test_rank_dying_with_os_exit_fails_the_save_on_survivors_without_waiting_for_the_timeout(tmp_path, fault, latest_step):
    root = str(tmp_path / "ckpt")
    timeout_s = 10.0
    outcomes = run_ranks(dying_rank_worker, WORLD, root, fault, timeout_s, allow_failures=True, timeout_s=90)

    dead = outcomes[fault.rank]
    assert not dead.ok and dead.exitcode == 1, dead.error
    survivors = [o for o in outcomes if o.rank != fault.rank]
    for outcome in survivors:
        assert outcome.ok, outcome.error  # returned, not hung
        second = outcome.value["second"]
        assert not second["committed"]
        # gloo sees the peer's sockets close: survivors fail at once, well before the collective timeout
        assert second["seconds"] < timeout_s, second
        assert "Connection" in second["error"] or "closed" in second["error"], second["error"]

    previous = survivors[0].value["first"]
    attempt = survivors[0].value["second"]["dirname"]
    location = fsio.resolve(root)
    states = {entry.name: entry.state for entry in catalog.list_checkpoints(location)}
    assert catalog.read_latest_pointer(location) == previous  # the dead coordinator never moved it
    if latest_step == 1:
        assert states == {previous: "committed", attempt: "uncommitted"}
        with pytest.raises(CheckpointNotFound, match="uncommitted"):
            catalog.find(location, attempt)
    else:
        # stale `latest`: the manifest was written, so the attempt is committed and readers pick it
        assert states == {previous: "committed", attempt: "committed"}
        assert catalog.find(location, "latest").name == attempt
    if fault.effect == "partial_manifest_tmp":
        assert os.path.exists(os.path.join(root, attempt, f".{MANIFEST}.deadbeef.tmp"))
    # a `latest` that is missing, or names a directory that is not the newest committed, is only a hint
    newest = attempt if latest_step == 2 else previous
    for pointer in (attempt, previous, None):
        latest_file = os.path.join(root, "latest")
        if pointer is None:
            os.remove(latest_file)
        else:
            with open(latest_file, "w") as handle:
                handle.write(pointer + "\n")
        assert catalog.find(location, "latest").name == newest, pointer

    step, loaded = _load_plain_latest(root)
    assert step == latest_step
    _assert_equal_states(_plain_state(latest_step), loaded)


def test_hung_rank_makes_survivors_abort_after_the_collective_timeout(tmp_path):
    root = str(tmp_path / "ckpt")
    markers = tmp_path / "markers"
    markers.mkdir()
    timeout_s = 4.0
    fault = Fault("before_receipt", rank=2, action="hang", markers=str(markers))
    outcomes = run_ranks(dying_rank_worker, WORLD, root, fault, timeout_s, allow_failures=True, timeout_s=90)

    for outcome in outcomes[:2]:
        assert outcome.ok, outcome.error
        second = outcome.value["second"]
        assert not second["committed"]
        # the hung peer keeps its sockets open: only the group's timeout frees the others
        assert timeout_s * 0.9 <= second["seconds"] < timeout_s * 5, second
    previous, attempt = outcomes[0].value["first"], outcomes[0].value["second"]["dirname"]
    location = fsio.resolve(root)
    states = {entry.name: entry.state for entry in catalog.list_checkpoints(location)}
    assert states == {previous: "committed", attempt: "uncommitted"}
    step, loaded = _load_plain_latest(root)
    assert step == 1
    _assert_equal_states(_plain_state(1), loaded)
