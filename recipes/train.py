"""The main job: train the small character LM with sharded, asynchronous, atomically committed checkpoints.

    python recipes/train.py                                        # 2 CPU ranks, DDP, checkpoints under ./checkpoints/tinylm
    python recipes/train.py strategy=fsdp trainer.devices=4        # FSDP2
    python recipes/train.py trainer.devices=3 trainer.max_steps=80 resume=latest   # continue on another device count
    python recipes/train.py --cfg job                              # print the composed config and exit

Options live in conf/ (conf/train.yaml and its groups); every option there is commented. An unknown key is
refused with the closest known ones (recipes/overrides.py) instead of Hydra's "+key" hint; values that cannot
work are refused here before any rank starts, naming the option and the fix.
"""

from __future__ import annotations

import gc
import logging
import os
import shlex
import sys
from typing import Any

if __name__ == "__main__":  # the job's process (each rank runs this file), not a module importing it
    # No cyclic garbage collection while torch and Lightning load (`imports_done` turns it back on): each
    # collection would walk the growing heap of objects that live as long as the process, ~0.8 of a rank's
    # ~4 CPU-s of start-up.
    gc.disable()

# Before anything imports wandb: offline unless the user chose a mode. DDP ranks inherit the environment.
os.environ.setdefault("WANDB_MODE", "offline")

RECIPES_DIR = os.path.dirname(os.path.abspath(__file__))
if RECIPES_DIR not in sys.path:  # `python -m recipes.train` and Hydra's `_target_: lm.…` both need it
    sys.path.insert(0, RECIPES_DIR)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.errors import InstantiationException  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

PARALLELISMS = ("ddp", "fsdp")
SECRET_WORDS = ("secret", "token", "password", "passwd")
SECRET_KEYS = ("key",)  # s3fs's access key id; only inside a storage_options mapping
# Overrides the printed resume command sets itself.
RESUME_COMMAND_KEYS = ("trainer.devices", "trainer.max_steps", "resume", "checkpoint.dirpath")
# Hydra's documented switch: raise an error instead of printing it and exiting 1. `run` sets it until the task
# starts, so a command line Hydra refuses comes back to it as an exception (see `run`).
HYDRA_FULL_ERROR = "HYDRA_FULL_ERROR"
_composition: dict[str, Any] = {"set_full_error": False, "users_value": None, "task_started": False}


class InvalidConfig(SystemExit):
    """A configuration that cannot work; exits with status 2 and a message naming option and fix."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(2)
        self.problems = problems

    def __str__(self) -> str:
        return "invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems)


def validate(cfg: DictConfig, *, multirun: bool = False) -> list[str]:
    """Problems that would otherwise surface minutes later on some rank; empty when the config can run."""
    problems: list[str] = []
    devices, num_nodes = cfg.trainer.devices, cfg.trainer.get("num_nodes", 1)
    if multirun and devices != 1 and "LOCAL_RANK" not in os.environ:
        # Lightning starts ranks 1..N-1 by re-running this command line, `--multirun` included: each of
        # them would run the whole sweep on its own. Externally launched ranks (torchrun, SLURM) are fine.
        problems.append(
            f"--multirun with trainer.devices={devices}: Lightning re-launches every rank with the whole sweep; "
            "run the jobs one at a time, or start the ranks with torchrun / SLURM"
        )
    if not (devices == "auto" or (isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1)):
        problems.append(f"trainer.devices={devices!r} must be an integer >= 1 (ranks on this node) or 'auto'")
    if not isinstance(cfg.trainer.max_steps, int) or cfg.trainer.max_steps < 1:
        problems.append(
            f"trainer.max_steps={cfg.trainer.max_steps!r} must be an integer >= 1 (total optimizer steps of the run)"
        )
    parallelism = cfg.strategy.get("parallelism")
    if parallelism not in PARALLELISMS:
        problems.append(f"strategy.parallelism={parallelism!r} is unknown; use strategy=ddp or strategy=fsdp")
    if parallelism == "fsdp" and isinstance(devices, int) and isinstance(num_nodes, int):
        dp, tp = cfg.strategy.get("data_parallel_size"), cfg.strategy.get("tensor_parallel_size", 1)
        if isinstance(dp, int) and isinstance(tp, int) and dp * tp != devices * num_nodes:
            problems.append(
                f"strategy.data_parallel_size={dp} × strategy.tensor_parallel_size={tp} must equal the world size "
                f"trainer.devices × trainer.num_nodes = {devices * num_nodes}; "
                f"set strategy.data_parallel_size={devices * num_nodes // max(tp, 1)}"
            )
    resume = cfg.get("resume")
    if isinstance(resume, bool) or (isinstance(resume, int) and resume < 0):
        problems.append(
            f"resume={resume!r} names no checkpoint; use resume=latest, last-good, a step (>= 0), a checkpoint id or a path"
        )
    elif resume is not None and not isinstance(resume, (int, str)):
        problems.append(f"resume={resume!r} must be null, latest, last-good, a step, a checkpoint id or a path")
    if cfg.model.seq_len != cfg.data.seq_len:
        problems.append(
            f"model.seq_len={cfg.model.seq_len} differs from data.seq_len={cfg.data.seq_len}; leave model.seq_len at ${{data.seq_len}}"
        )
    return problems


def committed_steps(dirpath: str, storage_options: dict[str, Any]) -> list[int]:
    """Steps of the committed checkpoints under `dirpath` ([] if none, or if it cannot be listed)."""
    try:
        from lightning_shardckpt import list_checkpoints

        return list_checkpoints(dirpath, storage_options=storage_options).all_steps()
    except Exception:  # noqa: BLE001 - an unreachable root is the callback's error to report, with its own message
        return []


def roots_to_check(cfg: DictConfig) -> list[tuple[str, str, dict[str, Any]]]:
    """(option, root, storage options) of every root a new run would write: checkpoint.dirpath, or with
    tiers this node's fast root (`{node_rank}` from the launcher's environment) and the durable root."""
    tiers = cfg.get("tiers") or {}
    fast, durable = tiers.get("fast"), tiers.get("durable")
    if not fast:
        return [
            (
                "checkpoint.dirpath",
                cfg.checkpoint.dirpath,
                OmegaConf.to_container(cfg.checkpoint.save.storage_options, resolve=True),
            )
        ]
    # torchrun sets GROUP_RANK, SLURM SLURM_NODEID, Lightning's own launcher NODE_RANK
    node_rank = next((os.environ[k] for k in ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID") if k in os.environ), "0")
    roots = [
        (
            "tiers.fast.dirpath",
            str(fast.dirpath).replace("{node_rank}", node_rank),
            _options(fast.get("storage_options")),
        )
    ]
    if durable:
        roots.append(("tiers.durable.dirpath", str(durable.dirpath), _options(durable.get("storage_options"))))
    return roots


def _options(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if node is not None else {}


def redact(value: Any, inside_storage_options: bool = False) -> Any:
    """The config with credentials replaced: it is written into every manifest and the W&B run."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            lowered = str(key).lower()
            secret = any(word in lowered for word in SECRET_WORDS) or (
                inside_storage_options and lowered in SECRET_KEYS
            )
            out[key] = (
                "<redacted>"
                if secret and item is not None
                else redact(item, inside_storage_options or key == "storage_options")
            )
        return out
    if isinstance(value, list):
        return [redact(item, inside_storage_options) for item in value]
    return value


def build(cfg: DictConfig, run_config: dict[str, Any]):
    """Data, model, strategy, callback, logger and trainer from the config; a constructor error names its group."""
    from lightning.pytorch.callbacks import Checkpoint

    def make(group: str, node: Any, **kwargs: Any) -> Any:
        try:
            return instantiate(node, **kwargs)
        except (InstantiationException, ValueError, TypeError) as err:
            raise InvalidConfig([problem_of(group, node, err)]) from err

    datamodule = make("data", cfg.data)
    model = make("model", cfg.model, vocab_size=datamodule.vocab_size)
    strategy = make("strategy", cfg.strategy)
    # _partial_, then the call: instantiate would otherwise recurse into run_config and build every
    # `_target_` it holds (the whole Trainer included) instead of passing it as data.
    make_callback = make("checkpoint", cfg.checkpoint, _partial_=True)
    try:
        callback = make_callback(run_config=run_config)
    except (ValueError, TypeError) as err:
        raise InvalidConfig([problem_of("checkpoint", cfg.checkpoint, err)]) from err
    logger = make("logger", cfg.logger) if cfg.get("logger") else False
    # A Lightning Checkpoint callback needs enable_checkpointing=True; anything else must keep Lightning
    # from adding its own ModelCheckpoint (a second, unsharded, synchronous save path).
    trainer = make(
        "trainer",
        cfg.trainer,
        strategy=strategy,
        callbacks=[callback],
        logger=logger,
        enable_checkpointing=isinstance(callback, Checkpoint),
    )
    return datamodule, model, callback, logger, trainer


def problem_of(group: str, node: Any, err: BaseException) -> str:
    """One line for a constructor's refusal: a `+key` it has no parameter for gets "did you mean"."""
    cause = err.__cause__ or err.__context__ if isinstance(err, InstantiationException) else err
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    try:
        import overrides  # recipes/overrides.py: only on this refusal path
        from hydra.utils import get_object

        suggestion = overrides.unexpected_argument(cause, get_object(target), group) if target else None
    except Exception:  # noqa: BLE001 - only a better message; the constructor's own follows
        suggestion = None
    return suggestion or f"{group}: {explain(err)}"


def explain(err: BaseException) -> str:
    """The constructor's own message (which names the option and the fix), without Hydra's wrapping."""
    if isinstance(err, InstantiationException) and (err.__cause__ or err.__context__) is not None:
        return str(err.__cause__ or err.__context__)
    return str(err)


def runnable(path: str) -> str:
    """`path` as a command runs from the launch directory: relative inside it (.venv/bin/python), else absolute."""
    relative = os.path.relpath(os.path.abspath(path), hydra.utils.get_original_cwd())
    return os.path.abspath(path) if relative.startswith("..") else relative


def shardckpt_program() -> str:
    """The environment's `shardckpt` (not whatever is on PATH, if anything: the venv may not be activated)."""
    script = os.path.join(os.path.dirname(sys.executable), "shardckpt")
    return runnable(script) if os.path.exists(script) else f"{runnable(sys.executable)} -m lightning_shardckpt.cli.main"


def resume_command(cfg: DictConfig, dirpath: str, reached_step: int) -> str:
    """The exact command that continues this run on a different device count, with this environment's
    interpreter and a max_steps past the step the run has reached (not past the one it was asked for)."""
    overrides = [
        o for o in HydraConfig.get().overrides.task if o.split("=", 1)[0].lstrip("+~") not in RESUME_COMMAND_KEYS
    ]
    if "model.decay_steps" not in {o.split("=", 1)[0].lstrip("+~") for o in overrides}:
        # it follows trainer.max_steps by default: pinned, so raising max_steps keeps this run's LR schedule
        # (the resumed run's config then differs only where the user changed it)
        overrides.append(f"model.decay_steps={cfg.model.decay_steps}")
    devices = cfg.trainer.devices
    new_devices = devices + 1 if isinstance(devices, int) else 2
    parts = [
        runnable(sys.executable),
        runnable(sys.argv[0]),
        *overrides,
        f"trainer.devices={new_devices}",
        f"trainer.max_steps={2 * max(cfg.trainer.max_steps, reached_step)}",
        "resume=latest",
        f"checkpoint.dirpath={dirpath}",
    ]
    return " ".join(shlex.quote(p) for p in parts)


def wandb_run_dir(logger: Any) -> str | None:
    from lightning.pytorch.loggers import WandbLogger

    if not isinstance(logger, WandbLogger):
        return None
    run = logger.experiment
    files_dir = getattr(run, "dir", None)  # <save_dir>/wandb/offline-run-<time>-<id>/files
    return os.path.dirname(files_dir) if files_dir else None


class JobFailed(SystemExit):
    """The library refused or failed with its own error (ShardCkptError): its message names the fix, so
    it is printed once, on rank 0, as one line; every rank exits 2. Hydra lets SystemExit through."""

    def __init__(self) -> None:
        super().__init__(2)


def debugging() -> bool:
    """A traceback is wanted: SHARDCKPT_DEBUG=1 in the environment, or Hydra's hydra.verbose."""
    return os.environ.get("SHARDCKPT_DEBUG", "") not in ("", "0") or bool(HydraConfig.get().verbose)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    _composition["task_started"] = True
    if _composition["set_full_error"]:  # `run`'s, not the user's: the task's own errors get Hydra's usual report,
        _restore_full_error()  # and the ranks Lightning starts from here inherit the user's setting
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_shardckpt.errors import ShardCkptError

    imports_done()
    try:
        train(cfg)
    except ShardCkptError as err:
        if debugging():
            raise  # Hydra prints the traceback (HYDRA_FULL_ERROR=1 for all of it)
        if rank_zero_only.rank == 0:  # every rank raised the same error: one line is enough
            message = " ".join(str(err).split())
            print(f"error: {message} ({type(err).__name__}; SHARDCKPT_DEBUG=1 for the traceback)", file=sys.stderr)
        raise JobFailed() from None


def imports_done() -> None:
    """After the imports: what they made goes to the permanent generation (later collections skip it) and the
    collector runs again. Once: a later job of a multirun (the collector is on by then) must not freeze the
    previous job's trainer and model, which would then never be collected."""
    if gc.isenabled():
        return
    gc.freeze()
    gc.enable()


def train(cfg: DictConfig) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities import rank_zero_only

    # `lightning` adds its own console handler and still propagates to the root logger, where Hydra has
    # one too: every line would print twice. Hydra's handlers (console + the run's log file) keep them all.
    logging.getLogger("lightning").handlers.clear()

    from hydra.types import RunMode

    problems = validate(cfg, multirun=HydraConfig.get().mode == RunMode.MULTIRUN)
    if problems:
        raise InvalidConfig(problems)
    dirpath = cfg.checkpoint.dirpath
    if cfg.resume is None:
        for name, root, options in roots_to_check(cfg):
            steps = committed_steps(root, options)
            if steps:
                raise InvalidConfig(
                    [
                        f"{name}={root} already holds committed checkpoints (latest step {max(steps)}) and resume=null "
                        f"would start a second run on top of them; continue it with resume=latest, or start a new run with "
                        f"run_name=<new name> (or {name}=<empty location>)"
                    ]
                )

    pl.seed_everything(cfg.seed, workers=True)
    run_config = redact(OmegaConf.to_container(cfg, resolve=True))
    datamodule, model, callback, logger, trainer = build(cfg, run_config)
    if logger:
        logger.log_hyperparams(run_config)

    ckpt_path = None if cfg.resume is None else str(cfg.resume)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    resumed = trainer.strategy.last_load  # None when the fit started fresh
    started_at = int(resumed.manifest["step"]) if resumed is not None else 0

    if rank_zero_only.rank == 0:
        wandb_dir = wandb_run_dir(logger)
        root = callback.root  # this node's: a tiers template ({node_rank}) expanded
        if trainer.global_step == started_at:
            print(
                f"\nnothing trained: the run already stands at step {started_at} and trainer.max_steps="
                f"{cfg.trainer.max_steps}; raise trainer.max_steps to continue it (as in the command below)"
            )
        print(f"\ncheckpoints:      {root}   (list them: {shardckpt_program()} ls {shlex.quote(root)})")
        if wandb_dir:
            print(f"W&B offline run:  {wandb_dir}   (upload: wandb sync {shlex.quote(wandb_dir)})")
        elif logger:
            print(f"logs:             {logger.log_dir}")
        print(f"resume on another device count:\n  {resume_command(cfg, dirpath, trainer.global_step)}")
        if wandb_dir:
            logger.experiment.finish()  # flush the offline run now rather than at interpreter exit


def check_overrides(argv: list[str]) -> None:
    """Unknown keys on the command line, named with the closest known ones (Hydra would answer with its
    "+key" hint). Skipped with --config-path/--config-name: another config tree."""
    import overrides  # recipes/overrides.py: only when Hydra refused the command line

    if any(arg.startswith(("--config-path", "--config-name", "-cp", "-cn")) for arg in argv):
        return
    given = [arg for arg in argv if "=" in arg and not arg.startswith(("-", "+", "~", "hydra."))]
    problems = overrides.unknown_keys(os.path.join(os.path.dirname(RECIPES_DIR), "conf"), "train", given)
    if problems:
        raise InvalidConfig(problems)


def run(argv: list[str]) -> None:
    """Hydra's main; when Hydra refuses the command line before the task starts, unknown keys are named with
    "did you mean" (check_overrides), and anything else gets Hydra's own report.

    The check composes the config once more (~0.2 CPU-s, in every rank Lightning re-launches too), so it runs
    only on a refusal: HYDRA_FULL_ERROR, set here until the task starts, makes Hydra raise its composition error
    instead of printing it. A user's own HYDRA_FULL_ERROR=1 is left as it is (and their task errors raise)."""
    _composition["set_full_error"] = os.environ.get(HYDRA_FULL_ERROR) != "1"  # Hydra's test: exactly "1"
    if _composition["set_full_error"]:
        _composition["users_value"] = os.environ.get(HYDRA_FULL_ERROR)
        os.environ[HYDRA_FULL_ERROR] = "1"
    try:
        main()
    except Exception:
        if _composition["task_started"]:
            raise  # the user's HYDRA_FULL_ERROR=1: the task's error as Hydra would raise it
        check_overrides(argv)  # InvalidConfig naming the unknown keys
        if not _composition["set_full_error"]:
            raise
        _restore_full_error()
        main()  # not an unknown key: Hydra composes again and reports the error its own way (exits 1)


def _restore_full_error() -> None:
    if _composition["users_value"] is None:
        os.environ.pop(HYDRA_FULL_ERROR, None)
    else:
        os.environ[HYDRA_FULL_ERROR] = _composition["users_value"]


if __name__ == "__main__":
    try:
        run(sys.argv[1:])
    except InvalidConfig as err:
        print(err, file=sys.stderr)
        raise
