"""SaveConfig.writer: "thread" (default) or "process"; anything else is refused with the allowed values."""

from __future__ import annotations

import pytest

from lightning_shardckpt import SaveConfig
from lightning_shardckpt.engine.config import save_config_from
from lightning_shardckpt.errors import ConfigError


def test_writer_defaults_to_the_background_thread():
    assert SaveConfig().writer == "thread"


def test_writer_is_read_from_the_hydra_save_block():
    assert save_config_from({"writer": "process", "overlap_staging": True}).writer == "process"


@pytest.mark.parametrize(
    "options, named",
    [
        ({"writer": "processes"}, "writer='processes' is unknown"),
        ({"writer": "process", "async_save": False}, "writer='process' needs async_save=true"),
        ({"writer": "process", "incremental": True}, "incremental=false"),
    ],
)
def test_writer_option_is_validated_with_the_allowed_values(options, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        SaveConfig(**options)


def test_a_writer_process_for_an_fsdp_state_is_refused_when_the_callback_builds_its_config():
    """The callback builds its SaveConfig with the strategy's parallelism at setup, before the first step: an FSDP2
    state (DTensors) cannot cross to the writer process, so it is refused there, not at the first save."""
    with pytest.raises(ConfigError, match="set save.writer='thread'"):
        save_config_from({"writer": "process"}, parallelism="fsdp")
    assert save_config_from({"writer": "process"}, parallelism="ddp").writer == "process"
