"""A signature policy's skip is counted and watched, through Lightning on 2 spawned ranks: a signed run saves, an
attacker rewrites its newest checkpoint (values replaced, every checksum and digest recomputed), and the resume
with `require_signature` passes over it to the newest validly signed one. The skip reaches the Trainer's loggers
as `checkpoint/signature_skipped` (W&B offline), the resume event under ROOT/events/ names it, and the health rule
on `signature_skipped` fires at once with its owner, online and when `shardckpt health` replays the root."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import WandbLogger

from lightning_shardckpt import ShardedCheckpoint
from lightning_shardckpt.cli import main as cli
from lightning_shardckpt.engine import catalog, metrics
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.policies.health.health_plugin import HealthWatch
from tests.helpers.forgery import forge_tensor_values
from tests.helpers.health_rules import static_rule
from tests.helpers.lightning_run import TinyData, TinyModule, ddp_trainer, lightning_env
from tests.helpers.spawn import run_ranks
from tests.helpers.wandb_reader import find_run_file, read_run
from tests.unit.test_signing import make_key

OWNER = "security-oncall@example"
SIGNATURE_RULE = static_rule(
    "signature_refused",
    "signature_skipped",
    high=0,
    fire_after=1,
    resolve_after=1,
    slice="root",
    owner=OWNER,
    severity="critical",
    mitigation="alert",
)


def signed_fit(
    rank: int,
    world_size: int,
    root: str,
    workdir: str,
    max_steps: int,
    key_path: str,
    ckpt_path: Any,
    public_keys: list[str],
) -> dict:
    lightning_env(rank, world_size)
    checkpoint = ShardedCheckpoint(
        root,
        every_n_train_steps=2,
        keep_last=None,
        log_artifact=False,
        health={"rules": [SIGNATURE_RULE], "alert_every_s": 0},
        save={"sign": {"key_path": key_path}},
        require_signature=bool(public_keys),
        public_keys=public_keys,
    )
    logger = WandbLogger(project="signed", save_dir=workdir, offline=True)
    trainer = ddp_trainer(world_size, max_steps, [checkpoint], logger=logger)
    trainer.fit(TinyModule(parallelism="ddp"), datamodule=TinyData(), ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        logger.experiment.finish()  # flush the offline run file: a spawned rank exits without W&B's atexit hook
    resumed = trainer.strategy.last_load
    return {
        "resumed_step": resumed.step if resumed is not None else None,
        "transitions": [t.as_dict() for t in checkpoint.plugins.get(HealthWatch).transitions]
        if trainer.is_global_zero
        else None,
    }


def test_resume_passing_over_a_forged_checkpoint_logs_the_skip_and_fires_the_signature_rule(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    private, public, _ = make_key(tmp_path, "writer")
    run_ranks(signed_fit, 2, root, str(tmp_path / "wandb-1"), 4, private, None, [], timeout_s=240)
    location = fsio.resolve(root)
    newest = catalog.find(location, "latest")
    assert newest.step == 4
    forge_tensor_values(location, newest.path, "model.net.0.weight", 7.0)

    workdir = str(tmp_path / "wandb-2")
    results = run_ranks(signed_fit, 2, root, workdir, 6, private, "latest", [public], timeout_s=240)
    assert [r.value["resumed_step"] for r in results] == [2, 2]  # the newest validly signed checkpoint
    fired = [t for t in results[0].value["transitions"] if t["rule"] == "signature_refused"]
    assert [(t["transition"], t["key"], t["value"], t["owner"]) for t in fired] == [("fired", "root", 1.0, OWNER)]

    # the metric, as the Trainer's loggers got it (W&B offline): one checkpoint passed over
    run = read_run(find_run_file(workdir))
    assert [value for _, value in run.series("checkpoint/signature_skipped")] == [1.0]
    assert 1.0 in [value for _, value in run.series("health/signature_refused/firing")]
    assert "shardckpt health: signature_refused firing" in [alert["title"] for alert in run.alerts]

    # the resume event names what it passed over; the health event says who owns it
    events = metrics.read_events(location)
    resumes = [e for e in events if e.get("event") == "resume"]
    assert [(e["signature_skipped"], e["signature_skipped_names"]) for e in resumes] == [(1, [newest.name])]
    health = [e for e in events if e.get("event") == "health" and e["rule"] == "signature_refused"]
    assert [(e["transition"], e["owner"]) for e in health] == [("fired", OWNER)]

    # offline, the same rule over the same event files fires the same way
    capsys.readouterr()
    assert cli.main(["health", root]) == 1  # a rule fires
    assert "signature_refused" in capsys.readouterr().out
