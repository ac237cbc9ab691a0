"""A rank really dies: SIGKILL in the middle of writing its shard of an asynchronous Lightning checkpoint.

4 gloo ranks train through Lightning (`ShardedStrategy`, FSDP2 and DDP) and save every 2 steps in the
background. The checkpoint of step 2 commits. While the checkpoint of step 4 is being written, rank 2
sends itself SIGKILL from the saver's fault hook at "mid_shard" (half its items written): no Python
cleanup, no exception, the kernel closes its sockets. The test proves:

- the step-4 attempt never commits: its directory is uncommitted (no manifest, no `.metadata`) for the
  catalog and for `shardckpt ls --json` (which gives it a positive age), and `latest` still names step 2;
- the survivors do not hang: each one's fit raises, its step-4 save fails, and it returns within the
  checkpoint collective timeout (plus slack), long before `run_ranks` would give up on it;
- a restart with `ckpt_path="latest"` on 4 ranks and on 3 ranks resumes from step 2, with model and
  AdamW state bit-exact to what training held right after step 2, trains on and commits steps 4 and 6;
  the killed attempt stays uncommitted beside the new step-4 checkpoint.

How gloo reacts (measured here, torch 2.13 CPU): a rank blocked on a pair with the dead peer raises at once
(~0.02-0.1 s) `RuntimeError: [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer` or
`[...pair.cc:537] Read error ...: Connection reset by peer`. A rank blocked on a *live* peer that already
left the collective (it failed on its own pair with the dead rank) is not told: it waits for the group's
timeout, `[.../unbound_buffer.cc:129] Timed out waiting 15000ms for send operation to complete` (or `:78 ...
recv operation`), after which the group's pairs are closed and the next collective on it fails at once with
`Application timeout caused pair closure`. Which case happens depends on where each rank is when the peer
dies; with max_in_flight=1 the training threads may all be waiting for the step-4 save's staging slot, and
then every survivor is released only by the coordinator's 15 s collective timeout.

Plus a cheap single-process check that `catalog.age_seconds` gives a failed directory a positive age.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_shardckpt import CheckpointSaver, SaveConfig, ShardedCheckpoint
from lightning_shardckpt.cli import main as cli
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format.names import DCP_METADATA, MANIFEST, shard_filename
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.lightning.trainer.strategy import ShardedDDPStrategy, ShardedFSDPStrategy
from tests.helpers import training_state as ts
from tests.helpers.lightning_run import CaptureAtStart, TinyData, TinyModule, _full, lightning_env
from tests.helpers.spawn import run_ranks

WORLD = 4
VICTIM = 2  # the rank that is killed
EVERY = 2  # a checkpoint every 2 optimizer steps
FIRST_STEP = 2  # commits
KILLED_STEP = 4  # rank 2 dies halfway through its shard of this one
RESUMED_MAX_STEPS = 6  # the restarts commit steps 4 and 6
COLLECTIVE_TIMEOUT_S = 15.0  # checkpoint group (ShardedCheckpoint(save=...))
PG_TIMEOUT_S = 20.0  # training group (run_ranks)
TEARDOWN_TIMEOUT_S = 30.0  # how long close() waits for the in-flight save on the way out
RUN_TIMEOUT_S = 120.0  # run_ranks' own limit: survivors must be back well before it


class KillAtMidShard:
    """Fault hook: on `rank`, at "mid_shard" of the `save_number`-th save, SIGKILL this process.

    Before dying it leaves a marker with the wall-clock time; at every "mid_shard" it leaves one too,
    which proves the rank had >= 2 items to write (the point fires only then).
    """

    def __init__(self, rank: int, save_number: int, markers: str) -> None:
        self.rank, self.save_number, self.markers = rank, save_number, markers
        self.saves = 0

    def __call__(self, point: str) -> None:
        if point == "before_write":
            self.saves += 1
        if point != "mid_shard" or dist.get_rank() != self.rank:
            return
        _marker(self.markers, f"mid_shard-save{self.saves}", {"at": time.time()})
        if self.saves == self.save_number:
            _marker(self.markers, "killed", {"at": time.time(), "save": self.saves})
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # not reached: SIGKILL cannot be caught


def _marker(directory: str, name: str, payload: dict) -> None:
    path = os.path.join(directory, name)
    with open(path, "w") as handle:
        json.dump(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())


class CaptureAtStep(pl.Callback):
    """The full model + optimizer state right after optimizer step `step` (all ranks: it is a collective).

    Checkpoint callbacks run after this one, so this is exactly the state the checkpoint of `step` snapshots.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.full: dict[str, torch.Tensor] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step and self.full is None:
            self.full = _full(pl_module, trainer.optimizers[0])


class _RecordsSaves:
    """Mixin for a ShardedStrategy: records every finished save of its savers on this rank (outcome, cause, time)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.save_records: list[dict[str, Any]] = []
        self.host.add_listener(self._record)

    def _record(self, record: Any) -> None:  # on the saver's background thread
        self.save_records.append(
            {"step": record.step, "outcome": record.outcome, "cause": record.cause, "at": time.time()}
        )


class RecordingDDPStrategy(_RecordsSaves, ShardedDDPStrategy):
    pass


class RecordingFSDPStrategy(_RecordsSaves, ShardedFSDPStrategy):
    pass


STRATEGIES = {"ddp": RecordingDDPStrategy, "fsdp": RecordingFSDPStrategy}


class ResumedFrom(pl.Callback):
    def __init__(self) -> None:
        self.resumed_from: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaded = trainer.strategy.last_load
        if loaded is not None:
            self.resumed_from = {"step": loaded.step, "name": loaded.path.rstrip("/").rsplit("/", 1)[-1]}


def run_on_rank(
    rank: int, world_size: int, parallelism: str, root: str, markers: str | None, max_steps: int, ckpt_path: Any
) -> dict:
    """One rank of a Lightning fit; `markers` set: rank 2 is SIGKILLed mid-shard in the second save."""
    lightning_env(rank, world_size)
    fault = KillAtMidShard(VICTIM, save_number=2, markers=markers) if markers is not None else None
    strategy = STRATEGIES[parallelism](fault_hook=fault)
    checkpoint = ShardedCheckpoint(
        root,
        every_n_train_steps=EVERY,
        log_artifact=False,
        save={"collective_timeout_s": COLLECTIVE_TIMEOUT_S, "teardown_timeout_s": TEARDOWN_TIMEOUT_S},
    )
    at_step, at_start, resumed = CaptureAtStep(FIRST_STEP), CaptureAtStart(), ResumedFrom()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        num_nodes=1,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=True,
        callbacks=[checkpoint, at_step, at_start, resumed],
    )
    error = None
    started = time.time()
    try:
        trainer.fit(TinyModule(parallelism=parallelism), datamodule=TinyData(), ckpt_path=ckpt_path)
    except Exception as err:  # what a survivor sees when a peer is killed
        error = {"type": type(err).__name__, "message": str(err)[:1500], "at": time.time()}
    return {
        "error": error,
        "started": started,
        "ended": time.time(),
        "global_step": trainer.global_step,
        "at_step": at_step.full,
        "at_start": at_start.at_start,
        "records": list(strategy.save_records),
        "resumed_from": resumed.resumed_from,
    }


def _ls_json(root: str) -> dict:
    """`shardckpt ls ROOT --json`, parsed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["ls", root, "--json"]) == 0
    return json.loads(out.getvalue())


# What a survivor's fit or save may fail with (see the module docstring): the dead peer's closed socket, or the
# group's timeout on a live peer that already left the collective, and afterwards the pairs that timeout closed.
GLOO_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Application timeout")
SLACK_S = 10.0  # scheduling on 2 shared cores


@pytest.mark.parametrize("parallelism", ["fsdp", "ddp"])
def test_sigkilled_rank_leaves_an_uncommitted_attempt_and_the_job_resumes_on_4_and_3_ranks(tmp_path, parallelism):
    root = str(tmp_path / "ckpt")
    markers = tmp_path / "markers"
    markers.mkdir()
    started = time.monotonic()
    outcomes = run_ranks(
        run_on_rank,
        WORLD,
        parallelism,
        root,
        str(markers),
        40,
        None,
        allow_failures=True,
        timeout_s=RUN_TIMEOUT_S,
        pg_timeout_s=PG_TIMEOUT_S,
    )
    returned_at = time.time()
    killed = json.loads((markers / "killed").read_text())
    survivors = [outcome for outcome in outcomes if outcome.rank != VICTIM]
    report: dict[str, Any] = {
        "parallelism": parallelism,
        "crashed_run_s": round(time.monotonic() - started, 1),
        "run_ranks_returned_after_kill_s": round(returned_at - killed["at"], 2),
        "survivors": {
            o.rank: o.error
            if not o.ok
            else {
                "fit_error": o.value["error"] and f"{o.value['error']['type']}: {o.value['error']['message'][:200]}",
                "fit_failed_after_kill_s": o.value["error"] and round(o.value["error"]["at"] - killed["at"], 2),
                "returned_after_kill_s": round(o.value["ended"] - killed["at"], 2),
                "global_step": o.value["global_step"],
                "saves": [
                    {**r, "at": round(r["at"] - killed["at"], 2), "cause": (r["cause"] or "")[-130:]}
                    for r in o.value["records"]
                ],
            }
            for o in survivors
        },
    }
    print("\nRANK KILLED REPORT (crash)", json.dumps(report, indent=1))  # shown with -s or on failure

    # rank 2 died of SIGKILL, mid-shard: it had >= 2 items to write in both saves (the point fired in both)
    assert sorted(os.listdir(markers)) == ["killed", "mid_shard-save1", "mid_shard-save2"]
    victim = outcomes[VICTIM]
    assert not victim.ok and victim.exitcode == -signal.SIGKILL, (victim.exitcode, victim.error)
    assert "died without reporting" in victim.error

    # survivors did not hang: their fit raised, their step-4 save failed, they returned, all within the timeout
    for outcome in survivors:
        assert outcome.ok, outcome.error  # the rank function returned (fit's exception is caught and reported)
        value = outcome.value
        error, by_step = value["error"], {r["step"]: r for r in value["records"]}
        assert error is not None, f"rank {outcome.rank} trained on as if nothing happened"
        assert error["type"] in ("RuntimeError", "DistBackendError"), error
        assert any(words in error["message"] for words in GLOO_ERRORS), error
        assert by_step[FIRST_STEP]["outcome"] == "committed"
        assert by_step[KILLED_STEP]["outcome"] == "failed", by_step
        assert f"step {KILLED_STEP} did not commit" in by_step[KILLED_STEP]["cause"]
        assert any(words in by_step[KILLED_STEP]["cause"] for words in GLOO_ERRORS), by_step[KILLED_STEP]
        assert all(r["outcome"] == "failed" for r in value["records"] if r["step"] > KILLED_STEP), value["records"]
        assert value["global_step"] >= KILLED_STEP and value["at_step"] is not None
        assert value["ended"] - killed["at"] < COLLECTIVE_TIMEOUT_S + SLACK_S, report["survivors"][outcome.rank]
    assert returned_at - killed["at"] < COLLECTIVE_TIMEOUT_S + SLACK_S

    # the attempt of step 4 is uncommitted; the step-2 checkpoint is still the only, and newest, committed one
    location = fsio.resolve(root)
    entries = catalog.list_checkpoints(location)
    before = {entry.name: entry.state for entry in entries}
    (first,) = [entry for entry in entries if entry.committed]
    (failed,) = [entry for entry in entries if entry.step == KILLED_STEP]
    assert first.step == FIRST_STEP
    assert failed.state == "uncommitted" and all(e.state == "uncommitted" for e in entries if e is not first), before
    files = {name: os.path.getsize(os.path.join(failed.path, name)) for name in sorted(os.listdir(failed.path))}
    report["failed_dir_files"] = files
    assert MANIFEST not in files and DCP_METADATA not in files, files
    assert shard_filename(VICTIM) in files, files  # rank 2 had opened its shard file when it died
    assert catalog.find(location, "latest").name == first.name
    assert catalog.read_latest_pointer(location) == first.name
    age = catalog.age_seconds(failed, location)
    assert isinstance(age, float) and age > 0
    listing = _ls_json(root)
    rows = {row["name"]: row for row in listing["checkpoints"]}
    assert {name: row["state"] for name, row in rows.items()} == before
    assert listing["latest"] == listing["latest_pointer"] == first.name
    assert rows[failed.name]["state"] == "uncommitted" and not rows[failed.name]["latest"]
    assert isinstance(rows[failed.name]["age_s"], float) and rows[failed.name]["age_s"] > 0
    assert rows[first.name]["state"] == "committed" and rows[first.name]["latest"]
    report["ls_failed_row"] = {key: rows[failed.name][key] for key in ("state", "age_s", "bytes")}

    # what training held right after step 2 (gathered on rank 0): what a resume must bring back
    expected = outcomes[0].value["at_step"]
    assert expected and any(name.startswith("optim.") for name in expected)

    # restart the job on 4 and on 3 ranks, each from its own copy of the root as the crash left it
    for world in (4, 3):
        restart_root = str(tmp_path / f"restart-{world}")
        shutil.copytree(root, restart_root)
        began = time.monotonic()
        resumed = run_ranks(
            run_on_rank,
            world,
            parallelism,
            restart_root,
            None,
            RESUMED_MAX_STEPS,
            "latest",
            timeout_s=RUN_TIMEOUT_S,
            pg_timeout_s=PG_TIMEOUT_S,
        )
        report[f"restart_{world}_s"] = round(time.monotonic() - began, 1)
        for outcome in resumed:
            value = outcome.value
            assert value["error"] is None, (outcome.rank, value["error"])
            assert value["resumed_from"] == {"step": FIRST_STEP, "name": first.name}, outcome.rank
            assert value["at_start"]["global_step"] == FIRST_STEP
            assert value["global_step"] == RESUMED_MAX_STEPS
            assert [(r["step"], r["outcome"]) for r in value["records"]] == [(4, "committed"), (6, "committed")]
        ts.assert_bit_exact(expected, resumed[0].value["at_start"]["full"])  # model + AdamW, onto `world` ranks
        restart_location = fsio.resolve(restart_root)
        after = {entry.name: (entry.step, entry.state) for entry in catalog.list_checkpoints(restart_location)}
        # what the crash left is unchanged (the killed attempt stays uncommitted); new: committed steps 4 and 6
        assert {name: state for name, (_, state) in after.items() if name in before} == before
        new = sorted(value for name, value in after.items() if name not in before)
        assert new == [(4, "committed"), (6, "committed")], after
        assert catalog.find(restart_location, "latest").step == RESUMED_MAX_STEPS
    print("RANK KILLED REPORT (dir, restarts)", json.dumps({k: v for k, v in report.items() if k != "survivors"}))


# --- single process, cheap ---


class _RaiseAtMidShard:
    def __call__(self, point: str) -> None:
        if point == "mid_shard":
            raise OSError("injected: the writer died halfway through its shard")


def test_age_of_an_uncommitted_directory_is_positive_and_listed(tmp_path):
    root = str(tmp_path / "ckpt")
    # keep_failed_attempts: a raising rank's attempt would be removed at once; a crashed run's stays like this one
    saver = CheckpointSaver(root, SaveConfig(keep_failed_attempts=True), fault_hook=_RaiseAtMidShard())
    state = {f"t{i}": torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(4)}
    result = saver.save(state, step=7).result(timeout=60)
    saver.close()
    assert not result.committed and "halfway" in str(result.error)
    location = fsio.resolve(root)
    (entry,) = catalog.list_checkpoints(location)
    assert entry.state == "uncommitted" and entry.step == 7
    time.sleep(0.01)
    age = catalog.age_seconds(entry, location)
    assert isinstance(age, float) and 0 < age < 60

    # an attempt abandoned an hour ago: its age is the time since its newest file was written
    hour_ago = time.time() - 3600
    for name in os.listdir(entry.path):
        os.utime(os.path.join(entry.path, name), (hour_ago, hour_ago))
    assert 3600 <= catalog.age_seconds(entry, location) < 3600 + 60
    (row,) = _ls_json(root)["checkpoints"]
    assert row["state"] == "uncommitted" and not row["latest"] and 3600 <= row["age_s"] < 3600 + 60
