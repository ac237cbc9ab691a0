"""The plug-in contract as a plug-in's author meets it: a misspelt event or decision, or one the run cannot call, is
refused when the plug-in is registered (policies/plugin_check.py), and every decision Protocol is public and
documented with its signature (docs/ARCHITECTURE.md, "Write a plug-in")."""

from __future__ import annotations

import inspect

import pytest

import lightning_shardckpt
from lightning_shardckpt import Checkpointer, ConfigError, Plugin
from lightning_shardckpt.engine.tiers.config import TierConfig, TiersConfig
from lightning_shardckpt.policies.decisions import DECISIONS
from lightning_shardckpt.policies.drills.drills_plugin import DrillConfig
from lightning_shardckpt.policies.health.rules import HealthConfig
from lightning_shardckpt.policies.plugin import PluginList
from lightning_shardckpt.policies.plugin_check import signature_text
from lightning_shardckpt.training.callback_options import CallbackConfig
from lightning_shardckpt.training.checkpoint_setup import door_plugins
from tests.helpers.doc_blocks import REPO


class SparesMisspelt(Plugin):
    def spares(self, keep_last: int | None) -> set[str]:
        return {"step-000000002"}


class OnCommitMisspelt(Plugin):
    def on_comit(self, record: object) -> None:
        pass


class SpareWithoutItsArgument(Plugin):
    def spare(self) -> set[str]:
        return set()


class CloseWithoutFinished(Plugin):
    def close(self, context: object) -> None:
        pass


def test_a_misspelt_decision_is_refused_at_registration_naming_the_method_and_the_right_signature():
    with pytest.raises(ConfigError) as refused:
        PluginList([SparesMisspelt()])
    message = str(refused.value)
    assert "SparesMisspelt" in message and "'spares'" in message
    assert "spare(keep_last: int | None) -> set[str]" in message and "RetentionGuard" in message


def test_a_misspelt_event_is_refused_at_registration():
    with pytest.raises(ConfigError, match=r"'on_comit'.*did you mean on_commit\(record: CheckpointRecord\)"):
        PluginList([OnCommitMisspelt()])


def test_a_decision_the_run_cannot_call_is_refused_at_registration_with_its_signature():
    with pytest.raises(ConfigError, match=r"SpareWithoutItsArgument.spare\(\).* cannot be called .* spare\(keep_last"):
        PluginList([SpareWithoutItsArgument()])
    with pytest.raises(ConfigError, match=r"close\(context: PluginContext, \*, finished: bool\)"):
        PluginList([CloseWithoutFinished()])


def test_a_door_refuses_a_misspelt_plugin_before_training(tmp_path):
    with pytest.raises(ConfigError, match="did you mean spare"):
        Checkpointer(str(tmp_path / "run"), plugins=[SparesMisspelt()])


def test_every_plugin_of_the_package_passes_the_check_with_every_option_on(tmp_path):
    tiers = TiersConfig(fast=TierConfig(dirpath=str(tmp_path / "fast")), durable=TierConfig(dirpath=str(tmp_path)))
    plugins, _ = door_plugins(
        CallbackConfig(keep_last=2), tiers, DrillConfig(every_n_checkpoints=1), HealthConfig(), []
    )
    assert len(plugins.plugins) == 4  # tiers, retention, drills, health: each registered through the check


def test_every_decision_protocol_is_public_and_documented_with_its_signature():
    document = (REPO / "docs/ARCHITECTURE.md").read_text()
    for decision in DECISIONS:
        assert getattr(lightning_shardckpt, decision.__name__) is decision
        assert decision.__name__ in lightning_shardckpt.__all__
        ((name, method),) = [(n, v) for n, v in vars(decision).items() if not n.startswith("_") and callable(v)]
        assert f"`{decision.__name__}`: `{name}{signature_text(method)}`" in document, decision.__name__
    assert set(DECISIONS) == {
        value
        for value in vars(lightning_shardckpt.policies.decisions).values()
        if inspect.isclass(value) and getattr(value, "_is_protocol", False) and value.__module__.endswith("decisions")
    }
