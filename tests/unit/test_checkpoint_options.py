"""One option set behind the three doors and the YAML (issue 48 item 3): CheckpointOptions holds each option, its
type, default and doc once; ShardedCheckpoint, the Checkpointer and the Fabric strategy derive their signatures from
it and check their keywords against it; conf/checkpoint/default.yaml spells the same set, key for key."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
import yaml

from lightning_shardckpt import (
    Checkpointer,
    CheckpointOptions,
    ConfigError,
    SaveConfig,
    ShardedCheckpoint,
    ShardedFabricDDPStrategy,
    ShardedFabricFSDPStrategy,
)

REPO = Path(__file__).resolve().parents[2]
FIELDS = [f.name for f in dataclasses.fields(CheckpointOptions)]
# keys of the YAML that are not options: Hydra's own, and the root (every door's first argument, `dirpath` here)
NOT_OPTIONS = {"_target_", "_convert_", "dirpath"}


def test_every_checkpoint_option_is_a_key_of_the_hydra_config_and_every_key_an_option():
    keys = set(yaml.safe_load((REPO / "conf" / "checkpoint" / "default.yaml").read_text())) - NOT_OPTIONS
    assert sorted(set(FIELDS) - keys) == [], "CheckpointOptions fields missing from conf/checkpoint/default.yaml"
    assert sorted(keys - set(FIELDS)) == [], "conf/checkpoint/default.yaml keys that are no CheckpointOptions field"


@pytest.mark.parametrize(
    "door, misspelt, closest",
    [
        (lambda t, **kw: ShardedCheckpoint(str(t / "c"), **kw), "keep_lst", "keep_last"),
        (lambda t, **kw: ShardedCheckpoint(str(t / "c"), **kw), "every_n_train_step", "every_n_train_steps"),
        (lambda t, **kw: Checkpointer(str(t / "c"), **kw), "every_n_step", "every_n_steps"),
        (lambda t, **kw: Checkpointer(str(t / "c"), **kw), "trust_checkpoints", "trust_checkpoint"),
        (lambda t, **kw: ShardedFabricDDPStrategy(root=str(t / "c"), **kw), "keep_lst", "keep_last"),
        (lambda t, **kw: ShardedFabricFSDPStrategy(root=str(t / "c"), **kw), "keep_every_n_step", "keep_every_n_steps"),
    ],
    ids=["callback", "callback-schedule", "checkpointer", "checkpointer-load", "fabric-ddp", "fabric-fsdp"],
)
def test_a_misspelt_option_at_each_door_is_refused_in_one_message_naming_it_and_the_closest(
    tmp_path, door, misspelt, closest
):
    with pytest.raises(ConfigError) as refused:
        door(tmp_path, **{misspelt: 3})
    message = str(refused.value)
    assert f"unknown option {misspelt!r} (did you mean {closest!r}?)" in message, message
    assert len(message.splitlines()) == 1, message


def test_a_misspelt_option_from_hydra_is_refused_naming_the_closest(compose_checkpoint):
    with pytest.raises(Exception, match=r"unknown option 'keep_lst' \(did you mean 'keep_last'\?\)"):
        compose_checkpoint("+checkpoint.keep_lst=3")


@pytest.mark.parametrize("door", [ShardedCheckpoint, Checkpointer, ShardedFabricDDPStrategy._init_checkpointing])
def test_each_door_signature_is_derived_from_the_options_typed_with_their_defaults(door):
    hints = typing.get_type_hints(CheckpointOptions)
    defaults = CheckpointOptions()
    parameters = inspect.signature(door).parameters
    # the Checkpointer's and Fabric's `log_metrics` is their own (a callable given rank 0's metrics), not the option
    own = {"log_metrics"} if door is not ShardedCheckpoint else set()
    taken = [name for name in FIELDS if name in parameters and name not in own]
    assert {"keep_last", "keep_every_n_steps", "save", "drill", "health", "tiers", "plugins"} <= set(taken)
    for name in taken:
        parameter = parameters[name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.annotation == hints[name], name
        if name != "save_on_preemption":  # None in the options: each door's own default
            assert parameter.default == getattr(defaults, name), name
    assert parameters["options"].annotation == CheckpointOptions | None


def test_the_callback_takes_every_option_and_the_checkpointer_spells_the_step_schedule_its_own_way():
    assert [name for name in inspect.signature(ShardedCheckpoint).parameters if name in FIELDS] == FIELDS
    checkpointer = inspect.signature(Checkpointer).parameters
    assert "every_n_steps" in checkpointer and "every_n_train_steps" not in checkpointer
    assert checkpointer["save_on_preemption"].default is False
    assert inspect.signature(ShardedCheckpoint).parameters["save_on_preemption"].default is True


def test_a_door_default_fills_what_the_options_leave_to_the_door(tmp_path):
    # CheckpointOptions leaves save_on_preemption to the door: the Trainer's is on, a plain loop's opt-in
    options = CheckpointOptions(keep_last=2)
    assert options.save_on_preemption is None
    assert ShardedCheckpoint(str(tmp_path / "c"), options=options).options.save_on_preemption is True
    with Checkpointer(str(tmp_path / "p"), options=options) as ckpt:
        assert ckpt.options.save_on_preemption is False and ckpt.options.keep_last == 2
    assert ShardedCheckpoint(str(tmp_path / "c"), options=CheckpointOptions(save_on_preemption=False)).options == (
        ShardedCheckpoint(str(tmp_path / "c"), save_on_preemption=False).options
    )


def test_a_door_built_from_checkpoint_options_equals_one_built_from_the_same_keywords(tmp_path):
    options = CheckpointOptions(every_n_train_steps=5, keep_last=2, save={"async_save": False}, drill={"threads": 2})
    by_object = ShardedCheckpoint(str(tmp_path / "c"), options=options)
    by_keywords = ShardedCheckpoint(
        str(tmp_path / "c"), every_n_train_steps=5, keep_last=2, save={"async_save": False}, drill={"threads": 2}
    )
    assert by_object.options == by_keywords.options and by_object.save_options == by_keywords.save_options
    assert by_object.drill_options == by_keywords.drill_options
    assert options.save == SaveConfig(async_save=False)  # a block becomes its config when the options are built
    # a keyword beside `options` replaces that field
    assert ShardedCheckpoint(str(tmp_path / "c"), options=options, keep_last=7).options.keep_last == 7
    with Checkpointer(str(tmp_path / "p"), options=options, every_n_steps=3) as ckpt:
        assert ckpt.options.every_n_train_steps == 3 and ckpt.options.keep_last == 2
    fabric = ShardedFabricDDPStrategy(options=CheckpointOptions(keep_last=4, resume_required=True))
    assert fabric.options.keep_last == 4 and fabric.options.resume_required is True


@pytest.mark.parametrize(
    "door, option, why",
    [
        (lambda o: ShardedFabricDDPStrategy(options=o), {"every_n_train_steps": 10}, "fabric.save"),
        (lambda o: ShardedFabricDDPStrategy(options=o), {"trust_checkpoint": True}, "load="),
        (lambda o: Checkpointer(options=o), {"log_artifact": False}, "no Trainer loggers"),
    ],
)
def test_an_option_a_door_does_not_take_is_refused_never_dropped(door, option, why):
    with pytest.raises(ConfigError, match=rf"does not take CheckpointOptions.{next(iter(option))}: .*{why}"):
        door(CheckpointOptions(**option))


def test_a_string_boolean_in_checkpoint_options_is_refused_by_the_config_that_owns_the_rule():
    with pytest.raises(ConfigError, match=r"LoadConfig.trust_checkpoint='false' must be true or false"):
        CheckpointOptions(trust_checkpoint="false")
    with pytest.raises(ConfigError, match=r"CallbackConfig.save_on_fit_end='0' must be true or false"):
        CheckpointOptions(save_on_fit_end="0")
    with pytest.raises(ConfigError, match=r"ShardedCheckpoint.log_metrics='false' must be true or false"):
        CheckpointOptions(log_metrics="false")
