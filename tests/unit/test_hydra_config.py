"""conf/: real Hydra composition of train.yaml with overrides, the recipe's validation, and the YAML's manual style."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, InstantiationException, MissingConfigException
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"


def load_train_module():
    """recipes/train.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("shardckpt_recipe_train", REPO / "recipes" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = load_train_module()


@pytest.fixture
def make_cfg(tmp_path, monkeypatch):
    """Compose conf/train.yaml the way `python recipes/train.py <overrides>` would, from `tmp_path` as cwd."""
    monkeypatch.chdir(tmp_path)

    def make(*overrides: str):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)  # lets ${hydra:runtime.cwd} resolve as in a real run
        return cfg

    yield make
    HydraConfig.instance().cfg = None


def job_config(cfg):
    """The config a job sees: without the `hydra` node that compose(return_hydra_config=True) adds."""
    cfg = cfg.copy()
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def test_default_config_trains_ddp_on_two_cpu_ranks_into_a_local_root(make_cfg, tmp_path):
    cfg = make_cfg()
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 2 and cfg.trainer.max_steps > 0
    assert cfg.strategy._target_ == "lightning_shardckpt.ShardedStrategy" and cfg.strategy.parallelism == "ddp"
    assert cfg.checkpoint._target_ == "lightning_shardckpt.ShardedCheckpoint"
    assert cfg.checkpoint.dirpath == f"{tmp_path}/checkpoints/tinylm"  # the embedded local default
    assert cfg.checkpoint.save.storage_options == {}
    assert cfg.logger._target_ == "lightning.pytorch.loggers.WandbLogger"
    assert cfg.logger.mode == "offline"  # train.py sets WANDB_MODE=offline unless the user set it
    assert cfg.resume == "latest" and isinstance(cfg.seed, int)  # re-running a job's command continues it
    assert cfg.model.seq_len == cfg.data.seq_len and cfg.model.decay_steps == cfg.trainer.max_steps
    assert cfg.hydra.job.chdir is False
    assert train.validate(cfg) == []


def test_fsdp_on_three_devices_resuming_latest(make_cfg):
    cfg = make_cfg("strategy=fsdp", "trainer.devices=3", "resume=latest")
    assert cfg.strategy.parallelism == "fsdp"
    assert cfg.strategy.data_parallel_size == 3 and cfg.strategy.tensor_parallel_size == 1
    assert cfg.trainer.devices == 3 and cfg.resume == "latest"
    assert train.validate(cfg) == []


def test_resume_accepts_a_step_an_id_or_a_path(make_cfg):
    assert make_cfg("resume=500").resume == 500
    assert make_cfg("resume=0f66c668eee9").resume == "0f66c668eee9"
    assert make_cfg("resume=/data/ckpt/run-7/step-000000500-0f66c668eee9").resume.endswith("0f66c668eee9")


def test_s3_storage_reads_endpoint_credentials_and_region_from_the_environment(make_cfg, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_S3_BUCKET", "bucket-7")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    cfg = make_cfg("storage=s3")
    assert cfg.checkpoint.dirpath == "s3://bucket-7/checkpoints/tinylm"
    options = OmegaConf.to_container(cfg.checkpoint.save.storage_options, resolve=True)
    assert options == {
        "endpoint_url": "http://127.0.0.1:9000",
        "key": "AKIDEXAMPLE",
        "secret": "s3cr3t",
        "client_kwargs": {"region_name": "eu-west-3"},
    }


def test_s3_storage_without_environment_leaves_credentials_to_boto(make_cfg, monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    options = make_cfg("storage=s3").checkpoint.save.storage_options
    assert options.endpoint_url is None and options.key is None and options.secret is None


def test_credentials_are_redacted_from_the_run_config(make_cfg, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    run_config = train.redact(OmegaConf.to_container(job_config(make_cfg("storage=s3")), resolve=True))
    text = repr(run_config)
    assert "s3cr3t" not in text and "AKIDEXAMPLE" not in text
    assert run_config["storage"]["storage_options"]["secret"] == "<redacted>"
    assert run_config["checkpoint"]["save"]["storage_options"]["key"] == "<redacted>"
    assert run_config["checkpoint"]["every_n_train_steps"] == 10  # the rest is untouched


def test_unknown_option_is_rejected_naming_it(make_cfg):
    with pytest.raises(ConfigCompositionException, match="checkpoint.evry_n_train_steps"):
        make_cfg("checkpoint.evry_n_train_steps=5")
    with pytest.raises(MissingConfigException, match="strategy/tp"):
        make_cfg("strategy=tp")


@pytest.mark.parametrize(
    ("overrides", "named", "fix"),
    [
        (["strategy.parallelism=tp"], "strategy.parallelism='tp'", "strategy=fsdp"),
        (
            ["strategy=fsdp", "strategy.data_parallel_size=4"],
            "strategy.data_parallel_size=4",
            "strategy.data_parallel_size=2",
        ),
        (["trainer.devices=0"], "trainer.devices=0", ">= 1"),
        (["trainer.max_steps=0"], "trainer.max_steps=0", ">= 1"),
        (["resume=true"], "resume=True", "resume=latest"),
        (["model.seq_len=32"], "model.seq_len=32", "data.seq_len"),
    ],
)
def test_invalid_values_are_rejected_naming_option_and_fix(make_cfg, overrides, named, fix):
    problems = train.validate(make_cfg(*overrides))
    assert len(problems) == 1 and named in problems[0] and fix in problems[0], problems


def test_multirun_with_several_lightning_launched_ranks_is_refused(make_cfg, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    problems = train.validate(make_cfg(), multirun=True)
    assert problems and "--multirun" in problems[0] and "trainer.devices=2" in problems[0]
    assert train.validate(make_cfg("trainer.devices=1"), multirun=True) == []


def test_fresh_start_on_a_root_with_committed_checkpoints_is_refused(make_cfg, tmp_path):
    from tests.helpers.checkpoints import save_checkpoint

    root = str(tmp_path / "run")
    save_checkpoint(root, step=3)
    assert train.committed_steps(root, {}) == [3]
    with pytest.raises(train.InvalidConfig) as info:
        train.main.__wrapped__(make_cfg(f"checkpoint.dirpath={root}", "resume=null"))
    message = str(info.value)
    assert f"checkpoint.dirpath={root}" in message and "resume=latest" in message and "run_name=" in message


def test_fresh_start_over_this_nodes_fast_tier_with_checkpoints_is_refused(make_cfg, tmp_path, monkeypatch):
    """With tiers, the check looks at this node's fast root ({node_rank} from the launcher's environment)."""
    from tests.helpers.checkpoints import save_checkpoint

    monkeypatch.setenv("SHARDCKPT_LOCAL_ROOT", str(tmp_path / "local"))
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun's node rank
    node1 = tmp_path / "local" / "refuse" / "node1"
    save_checkpoint(str(node1), step=5)
    cfg = make_cfg("tiers=local+s3", "run_name=refuse", "tiers.durable.dirpath=memory://durable-refuse", "resume=null")
    with pytest.raises(train.InvalidConfig) as info:
        train.main.__wrapped__(cfg)
    message = str(info.value)
    assert f"tiers.fast.dirpath={node1}" in message and "latest step 5" in message and "{node_rank}" not in message


def test_invalid_model_options_name_the_option(make_cfg):
    from lm import CharLM

    with pytest.raises(InstantiationException, match=r"model\.d_model=64 is not divisible by model\.n_heads=5"):
        instantiate(make_cfg("model.n_heads=5").model, vocab_size=33)
    assert isinstance(instantiate(make_cfg().model, vocab_size=33), CharLM)


# --- the lead's API: the callback and strategy refuse what cannot work, before training ---


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("checkpoint.keep_last=0", "keep_last=0"),
        ("checkpoint.save.max_in_flight=0", "max_in_flight=0"),
        ("checkpoint.save.when_busy=drop", "when_busy='drop'"),
        ("checkpoint.save.verify.mode=most", "verify.mode='most'"),
        ("checkpoint.save.verify.fraction=2", "verify.fraction=2"),
    ],
)
def test_checkpoint_callback_rejects_invalid_values_naming_the_option(make_cfg, override, named):
    cfg = make_cfg(override)
    with pytest.raises(train.InvalidConfig) as info:
        train.build(cfg, run_config={})
    assert str(info.value).count(named) >= 1 and "checkpoint:" in str(info.value), str(info.value)


def test_default_groups_build_the_callback_and_both_strategies(make_cfg):
    from lightning_shardckpt import ShardedCheckpoint, ShardedStrategy

    cfg = make_cfg()
    callback = instantiate(cfg.checkpoint, _partial_=True)(run_config={"seed": 1})
    assert isinstance(callback, ShardedCheckpoint) and callback.dirpath == cfg.checkpoint.dirpath
    assert isinstance(instantiate(cfg.strategy), ShardedStrategy)
    fsdp = instantiate(make_cfg("strategy=fsdp").strategy)
    assert isinstance(fsdp, ShardedStrategy) and fsdp.parallelism == "fsdp"


def test_trust_checkpoint_is_off_by_default_and_an_override_reaches_the_callback(make_cfg):
    off = instantiate(make_cfg().checkpoint, _partial_=True)(run_config={})
    on = instantiate(make_cfg("checkpoint.trust_checkpoint=true").checkpoint, _partial_=True)(run_config={})
    assert (off.trust_checkpoint, on.trust_checkpoint) == (False, True)


# --- "configs read like a manual": every field commented, so conf/ is the reference ---

CONFIG_FILES = sorted(CONF.rglob("*.yaml"))
STRUCTURE_KEYS = {"defaults", "hydra", "run", "job"}  # structure, not options: documented by their children


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(CONF)))
def test_every_config_file_starts_with_its_command_and_comments_every_option(path):
    lines = path.read_text().splitlines()
    if lines[0].startswith("# @package "):  # Hydra reads a package header only as the file's first lines
        lines = lines[1:]
    assert lines[0].startswith("# ") and re.search(r"python recipes/\w+\.py", lines[0]), (
        f"{path.name} must start with the command that uses it"
    )
    undocumented = []
    for number, line in enumerate(lines, start=1):
        match = re.match(r"^\s*([A-Za-z_][\w.]*):", line)
        if not match or match[1] in STRUCTURE_KEYS or line.lstrip().startswith("#"):
            continue
        if "#" not in line:
            undocumented.append(f"{path.relative_to(CONF)}:{number}: {line.strip()}")
    assert not undocumented, "options without a comment (unit and trade-off):\n" + "\n".join(undocumented)


def test_config_groups_exist_with_their_options():
    for group in ("trainer", "strategy", "checkpoint", "storage", "model", "data", "logger"):
        assert (CONF / group / "default.yaml").is_file(), group
    for group, option in (
        ("strategy", "ddp"),
        ("strategy", "fsdp"),
        ("storage", "local"),
        ("storage", "s3"),
        ("logger", "wandb"),
        ("logger", "csv"),
    ):
        assert (CONF / group / f"{option}.yaml").is_file(), f"{group}/{option}"


def test_tiers_single_is_the_default_and_builds_a_one_root_callback(make_cfg):
    cfg = make_cfg()
    assert cfg.tiers.fast is None and cfg.checkpoint.tiers.fast is None
    callback = instantiate(cfg.checkpoint, _partial_=True)(run_config={})
    assert callback.tiers_config is None and callback.dirpath == cfg.checkpoint.dirpath


def test_tiers_local_s3_preset_composes_a_node_local_fast_tier_and_an_s3_durable_tier(make_cfg, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_LOCAL_ROOT", "/local_nvme/ckpt")
    monkeypatch.setenv("SHARDCKPT_S3_BUCKET", "my-bucket")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    cfg = make_cfg("tiers=local+s3", "tiers.durable.keep_last=7")
    assert cfg.checkpoint.dirpath == "/local_nvme/ckpt/tinylm/node{node_rank}"
    assert cfg.checkpoint.tiers.durable.dirpath == "s3://my-bucket/checkpoints/tinylm"
    assert cfg.checkpoint.tiers.durable.storage_options.endpoint_url == "http://127.0.0.1:9000"
    callback = instantiate(cfg.checkpoint, _partial_=True)(run_config={})
    config = callback.tiers_config
    assert config.fast.node_local and config.fast.dirpath_for(1) == "/local_nvme/ckpt/tinylm/node1"
    assert config.durable.keep_last == 7 and config.durable.every_n_checkpoints == 1
    assert train.validate(cfg) == []
