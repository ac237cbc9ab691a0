"""The commit protocol under failure, on real gloo ranks (docs/GUARANTEES.md, "The format and the commit protocol").

Every test runs twice: on a local disk and on S3 (an `s3://` root on moto's server on loopback, which
the spawned ranks reach over HTTP with the `storage_options` they are given).

For every failure point a save is attempted after a committed one, and the test proves, on both:
(a) the failed attempt is never visible as committed; (b) the previous committed checkpoint stays the
one `load_checkpoint(..., "latest")` picks, and it loads bit-exact; (c) the failed attempt's directory is
listed as uncommitted (kept with `keep_failed_attempts=True` where every rank saw the failure, so its
evidence can be checked; where a rank died there is no common verdict and it stays anyway). The exception is
the coordinator failing after the manifest: that checkpoint IS
committed and readers pick it although `latest` still names the previous one (a stale `latest`).

What differs per backend, because the storage differs:
- a coordinator interrupted inside the manifest write: on a local disk it leaves the half-written temp
  file that `create_if_absent` would have linked into place. S3 has no temp files: the manifest is one
  conditional PUT, and a PUT whose body never finished (the coordinator died mid-request) stores
  nothing; a big manifest would be a multipart upload, and one never completed stays pending but
  invisible. The raising case leaves the pending multipart upload, the dying case dies mid-PUT; on S3
  the check is that no manifest object exists at all (and which uploads are pending);
- a rank failing after half its shard: on a local disk the half file stays; on S3 the upload is
  abandoned, so there is no object (and no pending multipart upload) for it;
- a flipped byte for the read-back check: in place on a local disk; read, modified and put back
  whole on S3 (objects are immutable);
- transient S3 errors (503s, a lost response) at the points our retry layer covers, spread over
  several ranks of one save: an S3-only case of the raising spawn whose save goes through the
  fault-injecting proxy, with botocore's own retries off so every error reaches our layer (the other
  saves go straight to moto: the proxy triples the time of every request).

Ranks that raise keep the group usable, so one spawn runs every raising case in sequence. A rank that
really dies (`os._exit`) or hangs breaks the group, so each of those cases gets its own spawn.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist

from lightning_shardckpt import CheckpointNotFound, CheckpointSaver, VerifyConfig, load_checkpoint
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format.names import COMMIT_RECORD, LATEST, MANIFEST, join, shard_filename
from lightning_shardckpt.engine.format.parts import part_filename
from lightning_shardckpt.engine.storage import retry
from tests.helpers import training_state as ts
from tests.helpers.backends import (
    NO_HTTP_RETRIES,
    S3,
    Backend,
    abandon_multipart_upload,
    abort_pending_uploads,
    fault_after,
    flip_one_byte,
    names,
    pending_uploads,
    start_put_and_never_finish,
)
from tests.helpers.checkpoints import dirname_regex, dirnames_at_step
from tests.helpers.spawn import run_ranks

WORLD = 3
COORDINATOR = 0
RESULT_TIMEOUT_S = 60.0  # a save that has not finished by then has hung: reported, never waited on forever
PARTIAL_TMP = f".{MANIFEST}.deadbeef.tmp"  # local: what an interrupted create_if_absent leaves behind
PARTIAL_MANIFEST = b'{"format_version": 1, "id": "' + b"0" * 200  # the first bytes of a manifest, never finished
FAST_RETRIES = retry.RetryPolicy(attempts=4, base_s=0.01, max_s=0.05)


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    """What to do at `point` on `rank`: raise, exit (the process dies) or hang (until the others finished)."""

    point: str
    rank: int
    action: str = "raise"  # raise | exit | hang | none (only the effect)
    effect: str | None = None  # corrupt_own_file | interrupted_manifest_write
    step: int = 0  # the attempt's step: effects find its directory by it
    markers: str | None = None  # hang: wait until every other rank left a marker file here


class FaultHook:
    """Picklable `fault_hook`: fires the armed fault once, when point and rank match."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
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
        location = self.backend.location()
        if fault.effect == "corrupt_own_file":
            flip_one_byte(location, join(_attempt_dir(self.backend, fault.step), shard_filename(rank)))
        elif fault.effect == "interrupted_manifest_write":
            directory = _attempt_dir(self.backend, fault.step)
            manifest = join(directory, MANIFEST)
            if not self.backend.is_s3:
                # the temp file create_if_absent writes, fsyncs and links into place, cut short
                location.fs.pipe_file(join(directory, PARTIAL_TMP), PARTIAL_MANIFEST)
            elif fault.action == "exit":
                # the conditional PUT is on the wire, half its body sent, when the process dies (os._exit
                # below): the kernel closes the socket and S3 drops the request
                endpoint = self.backend.storage_options["endpoint_url"]
                self._connection = start_put_and_never_finish(endpoint, manifest, PARTIAL_MANIFEST)
            else:
                # a multipart create (big manifests) whose completion never came: invisible, but pending
                abandon_multipart_upload(location, manifest, PARTIAL_MANIFEST)
        if fault.action == "exit":
            os._exit(1)
        if fault.action == "hang":
            _hang_until_others_finished(fault.markers, rank)
            os._exit(1)
        if fault.action == "raise":
            raise InjectedFault(f"injected fault at {point} on rank {rank}")


def _attempt_dir(backend: Backend, step: int) -> str:
    location = backend.location()
    (name,) = dirnames_at_step(names(location, location.path), step)
    return join(location.path, name)


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


def _observe(backend: Backend, dirname: str) -> dict:
    """The root as a reader sees it (read on the coordinator only), through the fsspec filesystem."""
    location = backend.location()
    entries = catalog.list_checkpoints(location)
    return {
        "states": {entry.name: entry.state for entry in entries},
        "files": names(location, join(location.path, dirname)),  # the attempt's directory
        "latest": catalog.resolve_latest(location, entries).name,  # what find(…, "latest") picks
        "pointer": catalog.read_latest_pointer(location),
        "uploads": pending_uploads(location, location.path),  # S3: multipart uploads never completed
    }


# --- ranks that raise: one spawn runs every case ---

FAILS, COMMITS_LATEST_STALE, COMMITS = "fails", "commits, `latest` stale", "commits"


@dataclass(frozen=True)
class Case:
    name: str
    fault: Fault | None
    words: str | None  # what the failed save's error must contain
    outcome: str = FAILS


CASES = [
    Case("rank_fails_before_write", Fault("before_write", rank=1), "injected fault at before_write on rank 1"),
    Case("rank_fails_after_half_its_shard", Fault("mid_shard", rank=2), "injected fault at mid_shard on rank 2"),
    Case(
        "rank_fails_after_write_before_verify", Fault("after_write", rank=0), "injected fault at after_write on rank 0"
    ),
    Case(
        "rank_fails_after_write_before_receipt",
        Fault("before_receipt", rank=1),
        "injected fault at before_receipt on rank 1",
    ),
    Case(
        "readback_catches_a_flipped_byte",
        Fault("after_write", rank=2, action="none", effect="corrupt_own_file"),
        "read-back verification failed",
    ),
    Case(
        "coordinator_fails_before_metadata",
        Fault("before_metadata", rank=0),
        "injected fault at before_metadata on rank 0",
    ),
    Case(
        "coordinator_fails_during_manifest_write",
        Fault("before_manifest", rank=0, effect="interrupted_manifest_write"),
        "injected fault at before_manifest on rank 0",
    ),
    # this one commits, so it changes which checkpoint is latest: after every case that must not
    Case(
        "coordinator_fails_after_manifest",
        Fault("after_manifest", rank=0),
        "injected fault at after_manifest on rank 0",
        COMMITS_LATEST_STALE,
    ),
]
# S3 only: one 503 at each retried point of one save, on three ranks; the save must commit
TRANSIENT = Case("transient_s3_errors_on_every_rank_are_retried", None, None, COMMITS)


def raising_cases(backend_name: str) -> list[Case]:
    return CASES + ([TRANSIENT] if backend_name == S3 else [])


def step_of(number: int) -> int:
    return 10 + number


def raising_cases_worker(rank, world_size, backend, proxied):
    """`proxied`: the same S3 root reached through the fault proxy (the transient case's save), or None."""
    retry.set_policy(FAST_RETRIES)  # this rank's process: the transient case's retries take no time
    model, optimizer = ts.build("fsdp", seed=1, world_size=world_size)
    hook = FaultHook(backend)
    # keep_failed_attempts: each failure point's evidence (half files, temp manifests) stays to be checked;
    # by default the coordinator removes a failed attempt (tests/distributed/test_failed_attempt_cleanup.py)
    config = backend.save_config(
        verify=VerifyConfig(mode="full"), collective_timeout_s=10, parallelism="fsdp", keep_failed_attempts=True
    )
    saver = CheckpointSaver(backend.url, config, fault_hook=hook)
    references = {}  # step -> full state (rank 0), for bit-exact comparison of what `latest` loads

    def save(step, fault, saver=saver):
        ts.train_steps(model, optimizer, steps=1, seed=step)  # every attempt saves different values
        references[step] = ts.full_state(model, optimizer)
        state = ts.sharded_state(model, optimizer)
        state["progress"] = {"global_step": step}
        hook.arm(None if fault is None else Fault(**{**fault.__dict__, "step": step}))
        fired_before, retries_before = len(hook.fired), retry.counters.snapshot()
        started = time.monotonic()
        result = saver.save(state, step=step).result(timeout=RESULT_TIMEOUT_S)
        hook.arm(None)
        retries = {
            k: v - retries_before.get(k, 0)
            for k, v in retry.counters.snapshot().items()
            if v != retries_before.get(k, 0)
        }
        return {**_summary(result, time.monotonic() - started), "fired": hook.fired[fired_before:], "retries": retries}

    def load_latest():
        fresh_model, fresh_optimizer = ts.build("fsdp", seed=99, world_size=world_size)
        state = ts.sharded_state(fresh_model, fresh_optimizer)
        state["progress"] = {"global_step": -1}
        loaded = load_checkpoint(state, backend.url, "latest", config=backend.load_config())
        ts.apply_state(fresh_model, fresh_optimizer, state)
        full = ts.full_state(fresh_model, fresh_optimizer)  # a collective: every rank takes part
        if rank != COORDINATOR:
            return None
        expected = references[loaded.step]
        mismatched = sorted(
            name for name in expected if name not in full or not torch.equal(expected[name], full[name])
        )
        return {"step": loaded.step, "progress": state["progress"], "mismatched": mismatched, "keys": len(expected)}

    baseline = save(1, None)
    records = []
    for number, case in enumerate(raising_cases(backend.name)):
        if case is TRANSIENT:
            # only this save goes through the proxy (it is slow); a saver of the same run, on the same root
            # (saver.config carries the run id the first saver claimed the root for)
            through_proxy = CheckpointSaver(proxied.url, replace(saver.config, storage_options=proxied.storage_options))
            attempt = save(step_of(number), None, through_proxy)
            through_proxy.close()
        else:
            attempt = save(step_of(number), case.fault)
        observed = _observe(backend, attempt["dirname"]) if rank == COORDINATOR else None
        records.append({"case": case.name, "attempt": attempt, "observed": observed, "loaded": load_latest()})
    saver.close()
    return {"baseline": baseline, "records": records}


def _install_transient_faults(proxy, step: int) -> list:
    """One transient error at each point of step `step`'s save that our retry layer covers, on 3 ranks."""
    directory = "/" + dirname_regex(step)
    readback = proxy.fail("GET", directory + r"/__2_0\.distcp$", times=1)  # rank 2 reads its shard back
    metadata = proxy.fail("PUT", directory + r"/\.metadata$", times=1)  # the coordinator's DCP metadata
    # the manifest lands but its answer is a 503: the retry meets 412 on its own object and must see it is ours
    manifest = proxy.fail("PUT", directory + r"/manifest\.json$", times=1, after_forward=True)
    latest = fault_after(manifest, "PUT", r"/latest$", times=1)  # `latest` has no step in its path: aim by order
    proxy.faults.append(latest)
    return [readback, metadata, manifest, latest]


def test_no_failure_point_of_a_raising_rank_exposes_a_partial_checkpoint_or_moves_latest(backend, request):
    cases = raising_cases(backend.name)
    proxy = proxied = transient = None
    if backend.is_s3:
        # the transient case's save goes through the fault proxy with botocore's retries off, so the
        # injected errors reach our retry layer and every request of it is recorded
        proxy = request.getfixturevalue("s3_fault_proxy")
        proxied = backend.with_options(endpoint_url=proxy.endpoint, **NO_HTTP_RETRIES)
        transient = _install_transient_faults(proxy, step_of(cases.index(TRANSIENT)))
    outcomes = run_ranks(raising_cases_worker, WORLD, backend, proxied, timeout_s=150)
    if backend.is_s3:  # the multipart upload the interrupted manifest create left: a lifecycle rule's job
        abort_pending_uploads(backend.location(), backend.location().path)

    baseline = outcomes[0].value["baseline"]
    assert baseline["committed"], baseline["error"]
    committed, pointer = [baseline["dirname"]], baseline["dirname"]
    for number, case in enumerate(cases):
        attempts = [o.value["records"][number]["attempt"] for o in outcomes]
        observed = outcomes[0].value["records"][number]["observed"]
        loaded = outcomes[0].value["records"][number]["loaded"]
        dirname = attempts[0]["dirname"]
        # the fault fired exactly where it was aimed, and every rank saw the save fail with its cause
        # (after the manifest the checkpoint is committed whatever the ranks were told: storage is the truth)
        for rank, attempt in enumerate(attempts):
            aimed = case.fault is not None and rank == case.fault.rank
            assert attempt["fired"] == ([(case.fault.point, rank)] if aimed else []), (case.name, rank, attempt)
            assert attempt["dirname"] == dirname
            if case.outcome == FAILS:
                assert not attempt["committed"], (case.name, rank)
                assert case.words in attempt["error"], (case.name, rank, attempt["error"])
            elif case.outcome == COMMITS:
                assert attempt["committed"], (case.name, rank, attempt["error"])
        if case.outcome == FAILS:
            # (c) listed as uncommitted, (a) nothing new is committed, (b) the previous one is latest
            assert observed["states"][dirname] == "uncommitted", (case.name, observed["states"])
            assert MANIFEST not in observed["files"], case.name
        else:
            # the manifest exists, so the checkpoint is committed; `latest` moved only if the coordinator lived
            committed.append(dirname)
            pointer = dirname if case.outcome == COMMITS else pointer
            assert observed["states"][dirname] == "committed", case.name
        assert observed["pointer"] == pointer, (case.name, "`latest` names the wrong checkpoint")
        assert observed["latest"] == committed[-1], (case.name, "readers trust the manifests, not the pointer")
        assert loaded["step"] == int(committed[-1].split("-")[1]), case.name
        assert {n for n, s in observed["states"].items() if s == "committed"} == set(committed), case.name
        attempted = {r["attempt"]["dirname"] for r in outcomes[0].value["records"][: number + 1]}
        assert set(observed["states"]) == {baseline["dirname"]} | attempted, case.name
        assert loaded["keys"] > 0 and loaded["mismatched"] == [], (case.name, loaded)
        assert loaded["progress"] == {"global_step": loaded["step"]}, case.name

    records = {r["case"]: r for r in outcomes[0].value["records"]}
    files = {name: r["observed"]["files"] for name, r in records.items()}
    uploads = {name: r["observed"]["uploads"] for name, r in records.items()}
    # the partial evidence is there, and still nothing counts as committed
    assert ".metadata" not in files["coordinator_fails_before_metadata"]
    interrupted = records["coordinator_fails_during_manifest_write"]["attempt"]["dirname"]
    if not backend.is_s3:
        assert shard_filename(2) in files["rank_fails_after_half_its_shard"], (
            "rank 2 should have left half a shard file"
        )
        assert PARTIAL_TMP in files["coordinator_fails_during_manifest_write"]
        return

    # S3: an abandoned shard upload leaves no object and no pending upload (the writer discarded it)
    assert shard_filename(2) not in files["rank_fails_after_half_its_shard"]
    assert shard_filename(0) in files["rank_fails_after_half_its_shard"]
    # the interrupted manifest create: no manifest object, only the pending upload; nothing else pending, ever
    assert files["coordinator_fails_during_manifest_write"] == [
        ".metadata",
        *(name for r in range(WORLD) for name in (shard_filename(r), part_filename(r))),
        COMMIT_RECORD,
    ]
    left_from = [case.name for case in cases].index("coordinator_fails_during_manifest_write")
    for number, case in enumerate(cases):
        expected = [f"{interrupted}/{MANIFEST}"] if number >= left_from else []
        assert uploads[case.name] == expected, (case.name, uploads[case.name])
    # the transient case: each injected error hit once, on the rank it was aimed at, and was retried there
    assert [fault.hits for fault in transient] == [1, 1, 1, 1]
    number = cases.index(TRANSIENT)
    retried = [o.value["records"][number]["attempt"]["retries"] for o in outcomes]
    assert retried[0] == {"retried.put": 2, "retried.create_if_absent": 1, "recovered.create_if_absent": 1}, retried[0]
    assert retried[1] == {} and retried[2] == {"retried.read_range": 1}, retried
    # its manifest: two conditional PUTs, the one whose answer was lost and the retry that met its own object
    dirname = records[TRANSIENT.name]["attempt"]["dirname"]
    puts = proxy.requests("PUT", rf"/{dirname}/manifest\.json$")
    assert [r.headers.get("if-none-match") for r in puts] == ["*", "*"] and puts[0].faulted


# --- a rank that really dies or hangs: one spawn per case ---


def _identical_tensors(fqn: str) -> bool:
    """The t<i> tensors are the same bytes on every rank (same seed): declared so, their writes are spread
    over the ranks and every rank has a shard to die in; `progress` is written from rank 0's copy."""
    return fqn.startswith("t")


def _plain_state(seed: int) -> dict:
    """Replicated plain tensors (spread over the ranks, see _identical_tensors); rebuilt in the test process."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(13, 7), (7,), (7, 5), (5,), (3, 3, 3), (11,), (2, 9), (17,)]
    state = {f"t{i}": torch.randn(*shape, generator=generator) for i, shape in enumerate(shapes)}
    state["progress"] = {"global_step": seed, "note": f"state-{seed}"}
    return state


def dying_rank_worker(rank, world_size, backend, fault, timeout_s):
    hook = FaultHook(backend)
    saver = CheckpointSaver(
        backend.url,
        backend.save_config(verify=VerifyConfig(mode="full"), collective_timeout_s=timeout_s),
        fault_hook=hook,
    )
    first = saver.save(_plain_state(1), step=1, identical=_identical_tensors).result(timeout=RESULT_TIMEOUT_S)
    assert first.committed, first.error
    hook.arm(Fault(**{**fault.__dict__, "step": 2}))
    started = time.monotonic()
    second = saver.save(_plain_state(2), step=2, identical=_identical_tensors).result(timeout=RESULT_TIMEOUT_S)
    summary = _summary(second, time.monotonic() - started)
    if fault.markers:
        open(os.path.join(fault.markers, f"done-{rank}"), "w").close()
    return {"first": first.path.rstrip("/").rsplit("/", 1)[-1], "second": summary}


def _load_plain_latest(backend: Backend) -> tuple[int, dict]:
    """Load `latest` in this (non-distributed) process into a state shaped like `_plain_state`."""
    state = {key: torch.full_like(value, float("nan")) for key, value in _plain_state(0).items() if key != "progress"}
    state["progress"] = {"global_step": -1, "note": ""}
    loaded = load_checkpoint(state, backend.url, "latest", config=backend.load_config())
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
    pytest.param(
        Fault("before_manifest", rank=0, action="exit", effect="interrupted_manifest_write"),
        1,
        id="coordinator_dies_during_manifest_write",
    ),
    pytest.param(Fault("after_manifest", rank=0, action="exit"), 2, id="coordinator_dies_after_manifest_latest_stale"),
]


@pytest.mark.parametrize("fault,latest_step", DEATHS)
def test_rank_dying_with_os_exit_fails_the_save_on_survivors_without_waiting_for_the_timeout(
    backend, fault, latest_step
):
    timeout_s = 10.0
    outcomes = run_ranks(dying_rank_worker, WORLD, backend, fault, timeout_s, allow_failures=True, timeout_s=90)

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
    location = backend.location()
    fs, root = location.fs, location.path
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
    if fault.effect == "interrupted_manifest_write":
        if backend.is_s3:
            # died mid-PUT: S3 dropped the request, there is no manifest object, not even a pending upload
            assert not fs.exists(join(root, attempt, MANIFEST))
            assert names(location, join(root, attempt)) == [
                ".metadata",
                *(name for r in range(WORLD) for name in (shard_filename(r), part_filename(r))),
                COMMIT_RECORD,
            ]
        else:
            assert PARTIAL_TMP in names(location, join(root, attempt))
    if fault.point == "mid_shard":
        # the dying rank's half file: on disk it stays; on S3 an upload that never closed leaves no object
        assert (shard_filename(fault.rank) in names(location, join(root, attempt))) == (not backend.is_s3)
    assert pending_uploads(location, root) == []
    # a `latest` that is missing, or names a directory that is not the newest committed, is only a hint
    newest = attempt if latest_step == 2 else previous
    latest_file = join(root, LATEST)
    for pointer in (attempt, previous, None):
        if pointer is None:
            fs.rm_file(latest_file)
        else:
            fs.pipe_file(latest_file, (pointer + "\n").encode())
        assert catalog.find(location, "latest").name == newest, pointer

    step, loaded = _load_plain_latest(backend)
    assert step == latest_step
    _assert_equal_states(_plain_state(latest_step), loaded)


def test_hung_rank_makes_survivors_abort_after_the_collective_timeout(backend, tmp_path):
    markers = tmp_path / "markers"  # coordination between the test's ranks, not checkpoint storage: local
    markers.mkdir()
    timeout_s = 4.0
    fault = Fault("before_receipt", rank=2, action="hang", markers=str(markers))
    outcomes = run_ranks(dying_rank_worker, WORLD, backend, fault, timeout_s, allow_failures=True, timeout_s=90)

    for outcome in outcomes[:2]:
        assert outcome.ok, outcome.error
        second = outcome.value["second"]
        assert not second["committed"]
        # the hung peer keeps its sockets open: only the group's timeout frees the others
        assert timeout_s * 0.9 <= second["seconds"] < timeout_s * 5, second
    previous, attempt = outcomes[0].value["first"], outcomes[0].value["second"]["dirname"]
    location = backend.location()
    states = {entry.name: entry.state for entry in catalog.list_checkpoints(location)}
    assert states == {previous: "committed", attempt: "uncommitted"}
    assert pending_uploads(location, location.path) == []
    step, loaded = _load_plain_latest(backend)
    assert step == 1
    _assert_equal_states(_plain_state(1), loaded)
