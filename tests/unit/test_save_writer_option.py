"""SaveConfig.writer: "thread", the one placement; "process" (a writer process per rank, removed in wave 4) is refused
with the reason and the fix, and so is anything else."""

from __future__ import annotations

import pytest

from lightning_shardckpt import SaveConfig
from lightning_shardckpt.engine.config import save_config_from
from lightning_shardckpt.errors import ConfigError


def test_writer_defaults_to_the_background_thread():
    assert SaveConfig().writer == "thread"
    assert save_config_from({"writer": "thread"}).writer == "thread"  # a Hydra save block that spells it out


@pytest.mark.parametrize(
    "options, named",
    [
        ({"writer": "processes"}, "writer='processes' is unknown; use 'thread'"),
        ({"writer": "process"}, "writer='process' was removed"),
    ],
)
def test_writer_option_is_refused_with_the_reason_and_the_fix(options, named):
    with pytest.raises(ConfigError, match=named) as refused:
        save_config_from(options)
    assert "thread" in str(refused.value)
