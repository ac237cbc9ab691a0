"""The commit protocol simulated with 64 writers over memory:// — real protocol code, fake processes.

The same simulation runs once more, shorter (8 writers, 20 failures: each kind twice), against S3
(moto's server on loopback, through s3fs): the filesystem is a parameter, the invariants are the same,
plus one only S3 has: (d) no multipart upload is left pending except the ones the simulation abandoned
on purpose (a coordinator dying inside a multipart manifest create; on memory:// that is a half-written
temp file instead).

Each fake writer writes its shard with the real `ChunkFileWriter`, reads back with the real
`choose_chunks_to_verify` / `verify_chunks`, and reports real `WriteResult`s carrying `ChunkReceipt`s;
the coordinator is the real `Committer` with a real DCP `Metadata`. A seeded random schedule makes a
writer die (before writing, after half its file, after writing but before its receipt), makes storage
flip a byte the read-back samples, truncate or lose a file, or makes the coordinator die (before the
metadata, before / during / after the manifest). After every attempt the invariants are checked:
(a) nothing partial is visible as committed; (b) the previous committed checkpoint is still what
`catalog.find(…, "latest")` resolves to and every chunk of it verifies; (c) failed attempts are listed
as uncommitted (and cannot be picked by name).

A dead writer reaches the coordinator in one of four ways: the gather fails and the committer never
runs (what DCP does), or, adversarially, the committer runs anyway with that writer's receipts empty,
missing from the list, or only half there; the committer must refuse those with CommitFailed.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from dataclasses import dataclass, field

import pytest
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.config import VerifyConfig
from lightning_shardckpt.engine.format.checksum import checksum
from lightning_shardckpt.engine.format.names import MANIFEST, checkpoint_dirname, join, shard_filename
from lightning_shardckpt.engine.save.commit import CheckpointTarget, Committer
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.engine.storage.fsio import Location
from lightning_shardckpt.engine.storage.writer import (
    ChunkFileWriter,
    ChunkReceipt,
    choose_chunks_to_verify,
    verify_chunks,
)
from lightning_shardckpt.errors import CheckpointNotFound, CommitFailed, CorruptCheckpoint
from tests.helpers.backends import abandon_multipart_upload, abort_pending_uploads, pending_uploads

WRITERS = 64
WRITER_FAILURES = (
    "writer_dies_before_write",
    "writer_dies_mid_file",
    "writer_dies_before_receipt",
    "storage_flips_a_sampled_byte",
)
STORAGE_FAILURES = ("storage_truncates_a_file", "storage_loses_a_file")  # after the receipts, before the commit
COORDINATOR_FAILURES = {
    "coordinator_dies_before_metadata": "before_metadata",
    "coordinator_dies_before_manifest": "before_manifest",
    "coordinator_dies_during_manifest": "before_manifest",  # plus a half-written temp manifest
    "coordinator_dies_after_manifest": "after_manifest",
}
FAILURES = WRITER_FAILURES + STORAGE_FAILURES + tuple(COORDINATOR_FAILURES)
DELIVERIES = ("gather_fails", "empty_receipts", "dropped_from_results", "half_receipts")
MIN_TRIALS = 210
ATTEMPTS_PER_ROOT = 6  # a committed baseline, then these; each root is deleted afterwards
S3_WRITERS, S3_TRIALS = 8, 2 * len(FAILURES)  # the S3 run: every failure kind twice, in a shuffled order


class WriterDied(Exception):
    pass


class CoordinatorDied(Exception):
    pass


@dataclass
class Attempt:
    """One checkpoint attempt: what the writers were asked to write, and how it must end."""

    step: int
    checkpoint_id: str
    data: dict[str, bytes]  # fqn -> the bytes its writer wrote
    planned: list[list[MetadataIndex]]
    failure: str | None = None
    failing_writer: int | None = None
    delivery: str | None = None

    @property
    def dirname(self) -> str:
        return checkpoint_dirname(self.step, self.checkpoint_id)

    @property
    def must_commit(self) -> bool:
        # the manifest is the commit: a coordinator dying after it still leaves a committed checkpoint
        return self.failure in (None, "coordinator_dies_after_manifest")

    @property
    def moves_latest(self) -> bool:
        return self.failure is None


@dataclass
class World:
    """The model the invariants are checked against."""

    location: Location
    committed: list[Attempt] = field(default_factory=list)
    failed: list[Attempt] = field(default_factory=list)
    pointer: str | None = None
    violations: list[str] = field(default_factory=list)


class CoordinatorFault:
    """The Committer's fault_hook: the coordinator dies (raises) at `point`, maybe mid-manifest."""

    def __init__(self, point: str | None, location: Location, directory: str, partial_manifest: bool) -> None:
        self.point, self.location, self.directory, self.partial_manifest = point, location, directory, partial_manifest

    def __call__(self, point: str) -> None:
        if point != self.point:
            return
        if self.partial_manifest:
            partial = b'{"format_version": 1, "id"'
            if is_s3(self.location):
                # S3 has no temp files: a multipart create whose completion never came is invisible but pending
                abandon_multipart_upload(self.location, join(self.directory, MANIFEST), partial)
            else:
                # what a create-if-absent interrupted between temp write and link leaves behind
                self.location.fs.pipe_file(join(self.directory, f".{MANIFEST}.0123abcd.tmp"), partial)
        raise CoordinatorDied(point)


def is_s3(location: Location) -> bool:
    return location.url.startswith("s3://")


def plan_attempt(rng: random.Random, step: int, writers: int = WRITERS) -> Attempt:
    data, planned = {}, []
    for writer in range(writers):
        keys = []
        for item in range(rng.randint(2, 4)):  # >= 2 chunks: "half its file" is a real split
            fqn = f"writer{writer:02d}.item{item}"
            data[fqn] = rng.randbytes(rng.randint(1, 96))
            keys.append(MetadataIndex(fqn))
        planned.append(keys)
    return Attempt(step=step, checkpoint_id=f"{rng.getrandbits(48):012x}", data=data, planned=planned)


def run_writer(
    fs, directory: str, writer: int, attempt: Attempt, policy: VerifyConfig, rng: random.Random
) -> list[WriteResult]:
    """One rank's part with the real storage code; raises WriterDied / CorruptCheckpoint when it fails."""
    failure = attempt.failure if attempt.failing_writer == writer else None
    if failure == "writer_dies_before_write":
        raise WriterDied(failure)
    relative = shard_filename(writer)
    path = join(directory, relative)
    keys = attempt.planned[writer]
    file = ChunkFileWriter(fs, path)
    for position, key in enumerate(keys):
        if failure == "writer_dies_mid_file" and position == len(keys) // 2:
            file.abort()  # half a file stays on storage
            raise WriterDied(failure)
        file.add_bytes(attempt.data[key.fqn])
    file_bytes = file.close()
    chosen = choose_chunks_to_verify([length for _, length, _ in file.chunks], policy, rng)
    if failure == "storage_flips_a_sampled_byte":
        offset, length, _ = file.chunks[rng.choice(chosen)]
        _flip_byte(fs, path, offset + rng.randrange(length))
    verify_chunks(fs, path, file.chunks, sorted(chosen), [key.fqn for key in keys])
    if failure == "storage_flips_a_sampled_byte":
        raise AssertionError("read-back did not catch a byte flipped inside a sampled chunk")
    if failure == "writer_dies_before_receipt":
        raise WriterDied(failure)
    return [
        WriteResult(
            index=key,
            size_in_bytes=length,
            storage_data=ChunkReceipt(relative, offset, length, digest, file_bytes, i in chosen),
        )
        for i, (key, (offset, length, digest)) in enumerate(zip(keys, file.chunks))
    ]


def run_attempt(world: World, attempt: Attempt, rng: random.Random) -> BaseException | None:
    """Run every writer and the coordinator; return how the commit was refused (None: committed or never tried)."""
    fs, root = world.location.fs, world.location.path
    directory = join(root, attempt.dirname)
    policy = VerifyConfig(mode=rng.choice(["sample", "full"]), fraction=rng.choice([0.0, 0.01, 0.3]))
    results: list[list[WriteResult] | None] = []
    for writer in range(len(attempt.planned)):
        try:
            results.append(run_writer(fs, directory, writer, attempt, policy, rng))
        except (WriterDied, CorruptCheckpoint):
            results.append(None)
        except AssertionError as err:
            world.violations.append(f"step {attempt.step}: {err}")
            results.append(None)

    if attempt.failure == "storage_truncates_a_file":
        path = join(directory, shard_filename(attempt.failing_writer))
        fs.pipe_file(path, fs.cat_file(path)[:-1])
    elif attempt.failure == "storage_loses_a_file":
        fs.rm_file(join(directory, shard_filename(attempt.failing_writer)))

    failed_writer = next((w for w, r in enumerate(results) if r is None), None)
    if failed_writer is not None:
        if attempt.delivery == "gather_fails":
            return None  # DCP's gather reports the failure; the committer never runs
        results = deliver_adversarially(attempt, results, failed_writer)

    point = COORDINATOR_FAILURES.get(attempt.failure)
    hook = CoordinatorFault(point, world.location, directory, attempt.failure == "coordinator_dies_during_manifest")
    topology = {"world_size": len(attempt.planned), "device_type": "cpu", "parallelism": "sim", "mesh_shape": None}
    target = CheckpointTarget(
        root=world.location,
        dirname=attempt.dirname,
        checkpoint_id=attempt.checkpoint_id,
        step=attempt.step,
        verify_mode=policy.mode,
        manifest_fields={"topology": topology},
    )
    metadata = Metadata(state_dict_metadata={fqn: BytesStorageMetadata() for fqn in attempt.data})
    try:
        Committer(target, fault_hook=hook)(metadata, results, attempt.planned)
    except CoordinatorDied as err:
        if point is None:
            world.violations.append(f"step {attempt.step}: coordinator died without a fault")
        return err
    except CommitFailed as err:
        if attempt.failure is None or point is not None:
            world.violations.append(f"step {attempt.step}: commit refused without reason ({attempt.failure}): {err}")
        return err
    except Exception as err:  # the committer must refuse with CommitFailed, never crash on bad receipts
        world.violations.append(
            f"step {attempt.step}: committer crashed on {attempt.failure}/{attempt.delivery}: {err!r}"
        )
        return err
    if point is not None or (attempt.failure is not None and attempt.failure not in COORDINATOR_FAILURES):
        world.violations.append(f"step {attempt.step}: committed although {attempt.failure} ({attempt.delivery})")
    return None


def deliver_adversarially(attempt: Attempt, results: list, failed_writer: int) -> list[list[WriteResult]]:
    """The committer is called anyway, with the dead writer's receipts damaged in one of three ways."""
    delivery = attempt.delivery
    if delivery == "half_receipts":
        # receipts for the first half of the planned chunks, as if sent before the rest was written
        keys = attempt.planned[failed_writer][: len(attempt.planned[failed_writer]) // 2]
        lengths = [len(attempt.data[key.fqn]) for key in keys]
        half, offset = [], 0
        for key, length in zip(keys, lengths):
            receipt = ChunkReceipt(
                shard_filename(failed_writer), offset, length, checksum(attempt.data[key.fqn]), sum(lengths), True
            )
            half.append(WriteResult(index=key, size_in_bytes=length, storage_data=receipt))
            offset += length
        return [half if r is None else r for r in results]
    if delivery == "dropped_from_results":
        return [r for r in results if r is not None]
    return [[] if r is None else r for r in results]


def check_invariants(world: World, attempt: Attempt) -> None:
    location, fail = world.location, world.violations.append
    where = f"step {attempt.step} ({attempt.failure}, writer {attempt.failing_writer}, {attempt.delivery})"
    entries = {entry.name: entry for entry in catalog.list_checkpoints(location)}

    # (a) exactly the attempts that reached their manifest are committed, each of them whole
    committed = {name for name, entry in entries.items() if entry.state == catalog.COMMITTED}
    expected = {a.dirname for a in world.committed}
    if committed != expected:
        fail(f"{where}: committed {sorted(committed)}, expected {sorted(expected)}")
    for name, entry in entries.items():
        if entry.state == catalog.CORRUPT:
            fail(f"{where}: {name} is corrupt: {entry.problem}")

    # (b) the newest committed one is what readers pick, and every chunk of it still verifies
    newest = world.committed[-1]
    # what find(…, "latest") picks, from the listing above (on S3 every listing costs a request per directory)
    picked = catalog.resolve_latest(location, list(entries.values()))
    if picked is None:
        fail(f"{where}: no latest")
        return
    if picked.name != newest.dirname:
        fail(f"{where}: latest resolved to {picked.name}, expected {newest.dirname}")
    problems = verify_committed(location, picked, newest)
    if problems:
        fail(f"{where}: {picked.name} does not verify: {problems[:3]}")
    if catalog.read_latest_pointer(location) != world.pointer:
        fail(f"{where}: `latest` names {catalog.read_latest_pointer(location)}, expected {world.pointer}")

    # (c) every failed attempt is listed, uncommitted, and cannot be picked by name
    for failed in world.failed:
        entry = entries.get(failed.dirname)
        if entry is None or entry.state != catalog.UNCOMMITTED:
            fail(f"{where}: failed attempt {failed.dirname} is {'missing' if entry is None else entry.state}")
    if attempt in world.failed:
        try:
            catalog.find(location, attempt.dirname)
            fail(f"{where}: failed attempt {attempt.dirname} can be picked by name")
        except CheckpointNotFound:
            pass


def verify_committed(location: Location, entry: catalog.CheckpointEntry, attempt: Attempt) -> list[str]:
    """Every object the manifest lists is on storage with its checksum and the bytes its writer wrote."""
    manifest, problems = entry.manifest, []
    if sorted(o["fqn"] for o in manifest["objects"]) != sorted(attempt.data) or manifest["tensors"]:
        problems.append("the manifest does not list exactly the planned objects")
    if len(manifest["files"]) != len(attempt.planned):
        problems.append(f"{len(manifest['files'])} files listed, {len(attempt.planned)} written")
    contents = {}
    for f in manifest["files"]:
        try:
            contents[f["path"]] = location.fs.cat_file(join(entry.path, f["path"]))
        except FileNotFoundError:
            contents[f["path"]] = b""
        if len(contents[f["path"]]) != f["bytes"]:
            problems.append(f"{f['path']}: {len(contents[f['path']])} bytes, manifest says {f['bytes']}")
    for obj in manifest["objects"]:
        data = contents.get(obj["file"], b"")[obj["offset"] : obj["offset"] + obj["length"]]
        if checksum(data) != obj["checksum"] or data != attempt.data.get(obj["fqn"]):
            problems.append(f"{obj['fqn']} in {obj['file']} does not match")
    return problems


def _forget(location: Location) -> None:
    """Drop a root at once. memory://: the store is process-global and `fs.rm` on it is quadratic."""
    fs, prefix = location.fs, location.path.rstrip("/")
    if is_s3(location):
        abort_pending_uploads(location, prefix)
        fs.rm(prefix, recursive=True)  # one listing, one batched delete
        return
    for key in [key for key in fs.store if key == prefix or key.startswith(prefix + "/")]:
        del fs.store[key]
    fs.pseudo_dirs[:] = [d for d in fs.pseudo_dirs if not (d == prefix or d.startswith(prefix + "/"))]


def _flip_byte(fs, path: str, position: int) -> None:
    data = bytearray(fs.cat_file(path))
    data[position] ^= 0xFF
    fs.pipe_file(path, bytes(data))


def simulate(
    root_url: str, storage_options: dict | None, rng: random.Random, *, writers: int, min_trials: int, draw_failure
) -> tuple[Counter, list[str]]:
    """Attempt checkpoints under fresh roots below `root_url` until `min_trials` failures were injected,
    checking the invariants after every attempt; return the failures injected and every violation."""
    trials: Counter = Counter()
    violations: list[str] = []
    rounds = 0
    while sum(trials.values()) < min_trials:
        world = World(location=fsio.resolve(f"{root_url}/root-{rounds}", storage_options))
        fsio.makedirs(world.location.fs, world.location.path)
        for step in range(ATTEMPTS_PER_ROOT + 1):
            attempt = plan_attempt(rng, step, writers)
            if step > 0 and rng.random() < 0.9:  # step 0 is the committed baseline; some later ones commit too
                attempt.failure = draw_failure(rng)
                attempt.failing_writer = rng.randrange(writers)
                attempt.delivery = rng.choice(DELIVERIES)
                trials[attempt.failure] += 1
            run_attempt(world, attempt, rng)
            if attempt.must_commit:
                world.committed.append(attempt)
            else:
                world.failed.append(attempt)
            if attempt.moves_latest:
                world.pointer = attempt.dirname
            check_invariants(world, attempt)
            if sum(trials.values()) >= min_trials:
                break
        # (d) S3: the only uploads left pending are the manifest creates the simulation abandoned on purpose
        if is_s3(world.location):
            abandoned = sorted(
                f"{a.dirname}/{MANIFEST}" for a in world.failed if a.failure == "coordinator_dies_during_manifest"
            )
            pending = pending_uploads(world.location, world.location.path)
            if pending != abandoned:
                world.violations.append(
                    f"round {rounds}: multipart uploads left pending {pending}, expected {abandoned}"
                )
        violations.extend(world.violations)
        _forget(world.location)
        rounds += 1
    return trials, violations


def test_64_writer_commit_protocol_keeps_its_invariants_under_random_failures():
    rng = random.Random(20240607)
    trials, violations = simulate(
        f"memory://commit-sim-{uuid.uuid4().hex}",
        None,
        rng,
        writers=WRITERS,
        min_trials=MIN_TRIALS,
        draw_failure=lambda rng: rng.choice(FAILURES),
    )

    assert not violations, f"{len(violations)} violation(s):\n" + "\n".join(violations[:20])
    assert sum(trials.values()) >= MIN_TRIALS
    assert set(trials) == set(FAILURES), f"failure kinds never drawn: {set(FAILURES) - set(trials)}"
    assert min(trials.values()) >= 10, trials


@pytest.mark.slow  # hundreds of S3 round trips: ~11 s alone on a quiet machine, the slowest unit test
def test_commit_protocol_keeps_its_invariants_on_s3(s3_root):
    """The same simulation against S3, shorter: 8 writers, every failure kind exactly twice."""
    rng = random.Random(20240608)
    deck = list(FAILURES) * (S3_TRIALS // len(FAILURES))
    rng.shuffle(deck)
    trials, violations = simulate(
        s3_root.url,
        s3_root.storage_options,
        rng,
        writers=S3_WRITERS,
        min_trials=S3_TRIALS,
        draw_failure=lambda rng: deck.pop(),
    )

    assert not violations, f"{len(violations)} violation(s):\n" + "\n".join(violations[:20])
    assert trials == Counter({failure: S3_TRIALS // len(FAILURES) for failure in FAILURES}), trials


@pytest.mark.parametrize(
    "delivery,reason",
    [
        ("empty_receipts", "rank 5 did not report"),
        ("dropped_from_results", f"{WRITERS - 1} ranks reported, {WRITERS} were planned"),
        ("half_receipts", "rank 5 did not report"),
    ],
)
def test_committer_refuses_a_dead_writers_damaged_receipts(delivery, reason):
    """The adversarial deliveries on their own: each one is refused with CommitFailed naming why."""
    location = fsio.resolve(f"memory://commit-sim-{uuid.uuid4().hex}")
    fsio.makedirs(location.fs, location.path)
    rng = random.Random(7)
    world = World(location=location)
    baseline = plan_attempt(rng, 0)
    run_attempt(world, baseline, rng)
    world.committed.append(baseline)
    world.pointer = baseline.dirname
    attempt = plan_attempt(rng, 1)
    attempt.failure, attempt.failing_writer, attempt.delivery = "writer_dies_before_receipt", 5, delivery
    refusal = run_attempt(world, attempt, rng)
    world.failed.append(attempt)
    check_invariants(world, attempt)
    _forget(location)
    assert not world.violations, world.violations
    assert isinstance(refusal, CommitFailed) and reason in str(refusal), refusal
