"""LightningCLI (jsonargparse) sees ShardedStrategy and ShardedCheckpoint's options typed (issue 26).

The recipe's CLI (recipes/lightning_cli.py) is parsed in-process: `--print_config` shows the nested save,
drill, health and identity-policy fields with their defaults and the strategy's options; a misspelt nested
key is refused at parse time in one line naming it; where jsonargparse cannot check (health rules, an option
of the other parallelism) the project's own ConfigError names the key. The run itself: tests/e2e/test_lightning_cli.py.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.strategies import Strategy

from lightning_shardckpt import ConfigError, ShardedCheckpoint, ShardedDDPStrategy, ShardedFSDPStrategy, ShardedStrategy

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "recipes" / "lightning_cli.yaml"
sys.path.insert(0, str(REPO / "recipes"))
from lightning_cli import CLI  # noqa: E402  (the recipe's own CLI)
from lm import CharDataModule, CharLM  # noqa: E402


def parse(*args: str) -> tuple[CLI | None, int | None, str, str]:
    """(cli, exit code, stdout, stderr) of the recipe's CLI over recipes/lightning_cli.yaml, built but not run."""
    out, err = io.StringIO(), io.StringIO()
    cli, code, argv = None, None, sys.argv
    sys.argv = [str(REPO / "recipes" / "lightning_cli.py")]  # not pytest's: LightningCLI warns when both are given
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli = CLI(CharLM, CharDataModule, run=False, args=["--config", str(CONFIG), "--trainer.devices=1", *args])
        except SystemExit as exit_:
            code = exit_.code
        finally:
            sys.argv = argv
    return cli, code, out.getvalue(), err.getvalue()


def written(tmp_path: Path, text: str) -> str:
    path = tmp_path / "extra.yaml"
    path.write_text(text)
    return str(path)


def test_print_config_shows_every_nested_checkpoint_option_and_the_strategy_options():
    _, code, out, err = parse("--print_config")
    assert code == 0, err
    config = yaml.safe_load(out)
    checkpoint = config["checkpoint"]
    assert checkpoint["save"]["verify"] == {"mode": "sample", "fraction": 0.01, "min_chunks": 1, "seed": None}
    assert checkpoint["save"]["async_save"] is True and checkpoint["save"]["max_in_flight"] == 1
    assert checkpoint["save"]["when_busy"] == "wait" and checkpoint["save"]["storage_options"] == {}
    assert checkpoint["drill"]["tolerance"] == 1e-4 and checkpoint["drill"]["keep_last_drilled"] == 1
    assert checkpoint["drill"]["probe"] == "lm:probe"  # the recipe's value over the default
    assert checkpoint["health"] == {"rules": [], "alert_every_s": 600.0}
    assert checkpoint["identity_policy"]["model"] == "error" and checkpoint["tiers"] is None
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_shardckpt.ShardedStrategy"
    assert strategy["init_args"]["parallelism"] == "ddp"
    assert {"data_parallel_size", "tensor_parallel_size", "find_unused_parameters", "timeout"} <= set(
        strategy["init_args"]
    )


@pytest.mark.parametrize(
    "block, misspelt",
    [("save", "asyn_save"), ("drill", "every_n_checkpoint"), ("identity_policy", "modle")],
)
def test_a_misspelt_nested_key_is_refused_before_training_in_one_line_naming_it(tmp_path, block, misspelt):
    extra = written(tmp_path, f"checkpoint:\n  {block}:\n    {misspelt}: 1\n")
    cli, code, _, err = parse("--config", extra)
    assert cli is None and code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: Group 'checkpoint' does not accept option '{block}.{misspelt}'"], err


def test_a_value_of_the_wrong_kind_is_refused_naming_the_key():
    _, code, _, err = parse("--checkpoint.save.when_busy=later")
    assert code == 2
    assert 'Parser key "checkpoint.save.when_busy"' in err and "'wait', 'skip'" in err


def test_a_class_path_in_trainer_callbacks_is_checked_as_deeply(tmp_path):
    extra = written(
        tmp_path,
        "trainer:\n  callbacks:\n    - class_path: lightning_shardckpt.ShardedCheckpoint\n"
        "      init_args: {dirpath: /tmp/x, save: {asyn_save: false}}\n",
    )
    _, code, _, err = parse("--config", extra)
    assert code == 2 and "Group 'save' does not accept option 'asyn_save'" in err


def test_health_rules_are_checked_by_the_projects_own_message():
    # jsonargparse cannot build a HealthRule (its default range is not valid alone): the dict reaches health_config_from
    rules = "{rules: [{name: slow, metric: pause_s, owner: me, rnage: {kind: static, max: 1}}]}"
    with pytest.raises(
        ConfigError, match=r"health rule 'slow': unknown field\(s\) \['rnage'\] \(did you mean 'range'\?\)"
    ):
        parse(f"--checkpoint.health={rules}")


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("save", {"asyn_save": False}, r"unknown save option\(s\) \['asyn_save'\] \(did you mean 'async_save'\?\)"),
        ("drill", {"every_n_checkpoint": 5}, r"\['every_n_checkpoint'\] \(did you mean 'every_n_checkpoints'\?\)"),
        ("identity_policy", {"modle": "warn"}, r"\['modle'\] \(did you mean 'model'\?\)"),
        (
            "tiers",
            {"fast": {"dirpath": "/tmp/f", "kep_last": 2}},
            r"tiers.fast option\(s\) \['kep_last'\] \(did you mean",
        ),
    ],
)
def test_python_and_hydra_dicts_still_work_and_a_misspelt_key_gets_a_suggestion(tmp_path, option, value, message):
    # what Hydra's conf/ passes (plain dicts): no jsonargparse in between, the constructor's own message
    assert ShardedCheckpoint(dirpath=str(tmp_path), save={"async_save": False}).save_options.async_save is False
    with pytest.raises(ConfigError, match=message):
        ShardedCheckpoint(dirpath=str(tmp_path), **{option: value})


def test_the_health_rules_file_of_the_hydra_recipe_loads_by_path():
    cli, code, _, err = parse(f"--checkpoint.health={REPO / 'conf' / 'health' / 'default.yaml'}")
    assert code is None, err
    callback = next(c for c in cli.trainer.callbacks if type(c).__name__ == "ShardedCheckpoint")
    assert "checkpoint_pause" in {rule.name for rule in callback.health_config.rules}


@pytest.mark.parametrize(
    "class_path, init_args, built",
    [
        ("lightning_shardckpt.ShardedStrategy", "{parallelism: ddp, find_unused_parameters: true}", ShardedDDPStrategy),
        ("lightning_shardckpt.ShardedStrategy", "{parallelism: fsdp, data_parallel_size: 1}", ShardedFSDPStrategy),
        ("lightning_shardckpt.ShardedDDPStrategy", "{static_graph: true}", ShardedDDPStrategy),
        ("lightning_shardckpt.ShardedFSDPStrategy", "{tensor_parallel_size: 1}", ShardedFSDPStrategy),
    ],
)
def test_each_strategy_class_path_builds_its_strategy(tmp_path, class_path, init_args, built):
    extra = written(tmp_path, f"trainer:\n  strategy:\n    class_path: {class_path}\n    init_args: {init_args}\n")
    cli, code, _, err = parse("--config", extra)
    assert code is None, err
    assert type(cli.trainer.strategy) is built


@pytest.mark.parametrize(
    "name, built", [("shardckpt_ddp", ShardedDDPStrategy), ("shardckpt_fsdp", ShardedFSDPStrategy)]
)
def test_the_registered_strategy_names_still_work_as_plain_strings(name, built):
    cli, code, _, err = parse(f"--trainer.strategy={name}")
    assert code is None, err
    assert type(cli.trainer.strategy) is built


def test_an_option_of_the_other_parallelism_is_refused_by_the_class_path_too():
    _, code, _, err = parse("--trainer.strategy.init_args.find_unused_parameter=true")
    assert code == 2 and "Option 'find_unused_parameter' is not accepted" in err  # misspelt: jsonargparse
    with pytest.raises(ValueError, match="data_parallel_size=2 applies to parallelism='fsdp' only"):
        parse("--trainer.strategy.init_args.data_parallel_size=2")  # valid for fsdp only: ours


def test_sharded_strategy_is_a_lightning_strategy_built_for_its_parallelism():
    ddp, fsdp = ShardedStrategy(parallelism="ddp"), ShardedStrategy("fsdp", data_parallel_size=2)
    assert type(ddp) is ShardedDDPStrategy and type(fsdp) is ShardedFSDPStrategy
    assert issubclass(ShardedStrategy, Strategy) and isinstance(ddp, ShardedStrategy)
    # LightningCLI passes every option, the other parallelism's at their defaults: ignored
    assert type(ShardedStrategy("ddp", data_parallel_size="auto", tensor_parallel_size="auto")) is ShardedDDPStrategy
    assert type(ShardedStrategy("fsdp", find_unused_parameters=False, start_method="popen")) is ShardedFSDPStrategy
    with pytest.raises(ConfigError, match="find_unused_parameters=True applies to parallelism='ddp' only"):
        ShardedStrategy("fsdp", find_unused_parameters=True)
    with pytest.raises(ConfigError, match=r"ShardedDDPStrategy\(parallelism='fsdp'\) is a 'ddp' strategy"):
        ShardedDDPStrategy(parallelism="fsdp")
    with pytest.raises(ConfigError, match="parallelism='zero' is unknown"):
        ShardedStrategy(parallelism="zero")


def test_help_lists_every_checkpoint_option_with_its_type():
    # the callback's signature is derived from CheckpointOptions: jsonargparse must still read each field typed
    import dataclasses

    from lightning_shardckpt import CheckpointOptions

    _, code, out, err = parse("--help")
    assert code == 0, err
    for option in dataclasses.fields(CheckpointOptions):
        assert f"--checkpoint.{option.name} " in out, option.name
    assert "--checkpoint.keep_last KEEP_LAST\n                        (type: int | null, default: null)" in out
    # None in CheckpointOptions (the door's default); the Trainer's door says its own: on
    assert (
        "--checkpoint.save_on_preemption {true,false,null}\n                        (type: bool | null, default: True)"
        in out
    )
