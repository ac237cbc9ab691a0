"""Every boolean and number of every option is type-checked before it is used: a quoted YAML value or an environment
variable arrives as a string, and `"false"` is truthy (`trust_checkpoint="false"` ran an untrusted checkpoint's
pickle). The table is built by introspection (every options dataclass, every bool/int/float field, from the
annotations), so a field or class added later is covered, or this file says which class escaped the check."""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import InstantiationException

import lightning_shardckpt
from lightning_shardckpt import Checkpointer, LoadConfig, SaveConfig, ShardedCheckpoint, TierConfig, load_checkpoint
from lightning_shardckpt.engine.validate import OPTION_CLASSES, checked_fields
from lightning_shardckpt.errors import ConfigError
from lightning_shardckpt.lightning.fabric.strategy import ShardedFabricDDPStrategy
from tests.helpers.checkpoints import fresh_state, save_checkpoint

REPO = Path(__file__).resolve().parents[2]
STRINGS = ["false", "0", "1"]  # what a quoted YAML value or an environment variable holds

# dataclasses that validate themselves but are not options a user writes (their values come from the code)
NOT_OPTIONS = {
    "Location": "an fsspec location the code resolves from a path",
    "SignaturePolicy": "built from public key files by policy_of; LoadConfig holds the user's options",
}
# what a class needs besides the field under test (its required fields)
REQUIRED = {
    "HealthRule": {"name": "r", "metric": "pause_s", "owner": "infra"},
    "TierConfig": {"dirpath": "/tmp/never-written"},
    "TiersConfig": {"fast": TierConfig(dirpath="/tmp/never-written")},
}


def _every_module() -> None:
    for module in pkgutil.walk_packages(lightning_shardckpt.__path__, "lightning_shardckpt."):
        importlib.import_module(module.name)


def _package_dataclasses() -> set[type]:
    _every_module()
    return {
        value
        for name, module in list(sys.modules.items())
        if name.startswith("lightning_shardckpt")
        for value in vars(module).values()
        if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__.startswith(name)
    }


def test_every_options_dataclass_of_the_package_is_type_checked():
    # an options class validates itself (`__post_init__`, DESIGN.md §7) or is named for its job
    options = {
        cls
        for cls in _package_dataclasses()
        if "__post_init__" in vars(cls) or cls.__name__.endswith(("Config", "Options", "Policy"))
    }
    escaped = sorted(cls.__name__ for cls in options if cls not in OPTION_CLASSES and cls.__name__ not in NOT_OPTIONS)
    assert not escaped, f"options dataclasses without @typed_options: {escaped}"


def _field_cases() -> list:
    _every_module()
    return [
        pytest.param(cls, name, value, id=f"{cls.__name__}.{name}={value!r}")
        for cls in OPTION_CLASSES
        for name in checked_fields(cls)
        for value in STRINGS
    ]


@pytest.mark.parametrize("cls,name,value", _field_cases())
def test_a_string_in_a_boolean_or_numeric_option_is_refused_naming_the_field(cls, name, value):
    with pytest.raises(ConfigError) as refused:
        cls(**REQUIRED.get(cls.__name__, {}), **{name: value})
    message = str(refused.value)
    assert f".{name}={value!r}" in message and "; use " in message, message
    assert f"(YAML: {name}: " in message, message  # the spelling that works


def test_the_table_covers_the_options_the_issue_names():
    covered = {(cls.__name__, name) for cls in OPTION_CLASSES for name in checked_fields(cls)}
    named = {"trust_checkpoint", "verify_checksums"} | {
        "async_save",
        "allow_shared_root",
        "keep_failed_attempts",
        "direct_io",
    }
    assert {("LoadConfig", n) for n in ("trust_checkpoint", "verify_checksums")} <= covered
    assert {("SaveConfig", n) for n in named - {"trust_checkpoint", "verify_checksums"}} <= covered
    assert ("DrillOptions", "trust_checkpoint") in covered and ("CallbackConfig", "keep_last") in covered


@pytest.mark.parametrize("value", ["false", "0"])
def test_the_fix_is_named_the_boolean_the_user_meant(value):
    with pytest.raises(ConfigError) as refused:
        LoadConfig(trust_checkpoint=value)
    assert str(refused.value) == (
        f"LoadConfig.trust_checkpoint={value!r} must be true or false, not a string; use the boolean false "
        '(YAML: trust_checkpoint: false, not "false")'
    )


def test_real_booleans_integers_and_none_still_pass_and_a_bool_is_no_count():
    assert LoadConfig(trust_checkpoint=False, verify_checksums=True, read_threads=2).read_threads == 2
    assert SaveConfig(teardown_timeout_s=0, async_save=False).teardown_timeout_s == 0  # an int where a float goes
    for bad in (dict(trust_checkpoint=0), dict(read_threads=True), dict(read_threads=2.0)):
        with pytest.raises(ConfigError, match=f"LoadConfig.{next(iter(bad))}="):
            LoadConfig(**bad)


@pytest.mark.parametrize(
    "door,flag",
    [
        (lambda t, v: Checkpointer(str(t / "c"), trust_checkpoint=v), "LoadConfig.trust_checkpoint"),
        (lambda t, v: Checkpointer(str(t / "c"), verify_on_load=v), "LoadConfig.verify_checksums"),
        (lambda t, v: Checkpointer(str(t / "c"), restore_rng=v), "Checkpointer.restore_rng"),
        (lambda t, v: Checkpointer(str(t / "c"), max_steps=v), "Checkpointer.max_steps"),
        (lambda t, v: Checkpointer(str(t / "c"), save={"async_save": v}), "SaveConfig.async_save"),
        (lambda t, v: ShardedCheckpoint(str(t / "c"), trust_checkpoint=v), "LoadConfig.trust_checkpoint"),
        (lambda t, v: ShardedCheckpoint(str(t / "c"), log_artifact=v), "ShardedCheckpoint.log_artifact"),
        (lambda t, v: ShardedCheckpoint(str(t / "c"), log_metrics=v), "ShardedCheckpoint.log_metrics"),
        (lambda t, v: ShardedCheckpoint(str(t / "c"), save={"direct_io": v}), "SaveConfig.direct_io"),
        (lambda t, v: ShardedFabricDDPStrategy(load={"trust_checkpoint": v}), "LoadConfig.trust_checkpoint"),
        (lambda t, v: ShardedFabricDDPStrategy(restore_rng=v), "ShardedFabricStrategy.restore_rng"),
        (lambda t, v: ShardedFabricDDPStrategy(save={"allow_shared_root": v}), "SaveConfig.allow_shared_root"),
    ],
)
def test_every_door_refuses_a_string_flag_when_it_is_built(tmp_path, door, flag):
    with pytest.raises(ConfigError, match=f"{flag}='0'"):
        door(tmp_path, "0")


class MakesDirectory:
    """What an attacker pickles: unpickling it calls os.makedirs(path)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


def test_an_untrusted_checkpoint_loaded_with_trust_checkpoint_false_as_a_string_runs_nothing(tmp_path):
    root, marker = str(tmp_path / "ckpt"), tmp_path / "pwned"
    state = fresh_state()
    state["user"] = MakesDirectory(str(marker))
    save_checkpoint(root, state=state)
    target = fresh_state(seed=5)
    target["user"] = None
    with pytest.raises(ConfigError, match="trust_checkpoint='false'"):
        load_checkpoint(target, root, config=LoadConfig(trust_checkpoint="false"))
    with pytest.raises(ConfigError, match="trust_checkpoint='false'"):
        with Checkpointer(root, trust_checkpoint="false") as ckpt:
            ckpt.load(target)
    assert not marker.exists()


@pytest.mark.parametrize(
    "override,named",
    [
        ("checkpoint.trust_checkpoint='false'", "LoadConfig.trust_checkpoint='false'"),
        ("checkpoint.verify_on_load='0'", "LoadConfig.verify_checksums='0'"),
        ("checkpoint.save.async_save='false'", "SaveConfig.async_save='false'"),
        ("checkpoint.save.allow_shared_root='0'", "SaveConfig.allow_shared_root='0'"),
        ("checkpoint.save.keep_failed_attempts='false'", "SaveConfig.keep_failed_attempts='false'"),
        ("checkpoint.save.direct_io='false'", "SaveConfig.direct_io='false'"),
        ("checkpoint.drill.fallback_to_last_good='1'", "drill.fallback_to_last_good='1'"),
        ("checkpoint.log_artifact='false'", "ShardedCheckpoint.log_artifact='false'"),
    ],
)
def test_a_quoted_boolean_from_hydra_is_refused_before_training(compose_checkpoint, override, named):
    # recipes/train.py calls the partial itself, so the callback's own ConfigError reaches the user
    with pytest.raises((InstantiationException, ConfigError)) as refused:
        compose_checkpoint(override)
    assert named in str(refused.value)


def test_hydra_booleans_and_numbers_unquoted_still_build_the_callback(compose_checkpoint):
    callback = compose_checkpoint(
        "checkpoint.trust_checkpoint=false", "checkpoint.save.async_save=false", "checkpoint.keep_last=2"
    )
    assert callback.load_options.trust_checkpoint is False and callback.save_options.async_save is False


@pytest.mark.slow  # starts recipes/train.py
def test_the_training_recipe_refuses_a_quoted_trust_checkpoint_before_training(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", PYTHONPATH=str(REPO))
    command = [
        sys.executable,
        str(REPO / "recipes" / "train.py"),
        "checkpoint.trust_checkpoint='false'",  # what a quoted YAML value or an environment variable gives
        f"storage.root={tmp_path / 'runs'}",
        "trainer.devices=1",
        "trainer.max_steps=2",
        "checkpoint.every_n_train_steps=1",
    ]
    job = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert job.returncode == 2, (job.stdout[-2000:], job.stderr[-2000:])
    assert "LoadConfig.trust_checkpoint='false' must be true or false" in job.stderr, job.stderr[-2000:]
    assert not list((tmp_path / "runs").glob("*/step-*")), "a checkpoint was written: training ran"


@pytest.mark.slow  # starts recipes/drill.py
@pytest.mark.parametrize(
    "override,named",
    [
        ("follow='false'", "follow='false' must be true or false"),  # the recipe's own flag: it starts the service
        ("trust_checkpoint='false'", "drill.trust_checkpoint='false' must be true or false"),
    ],
)
def test_the_drill_recipe_refuses_a_quoted_boolean(tmp_path, override, named):
    env = dict(os.environ, PYTHONPATH=str(REPO), HYDRA_FULL_ERROR="1")
    command = [
        sys.executable,
        str(REPO / "recipes" / "drill.py"),
        override,
        f"root={tmp_path / 'root'}",
        "which=0",
        "interval_s=0.2",
        "exit_when_idle_s=0.5",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    job = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert job.returncode != 0 and named in job.stderr, (job.returncode, job.stdout[-1500:], job.stderr[-1500:])
