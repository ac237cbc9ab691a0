"""Every numeric option is refused before training when it cannot work: NaN, infinite, out of range, a float
where a count is needed, a bool (Python's `True` is an int, no user's count), a string. The message names the
option and its value in one form (`NAME=VALUE ...; use RULE`), whichever door it came through: the engine's
configs, the callback's constructor, Hydra's conf/, or the `shardckpt` command line (exit 2 with usage)."""

from __future__ import annotations

import math

import pytest
from hydra.errors import InstantiationException

from lightning_shardckpt import ShardedCheckpoint
from lightning_shardckpt.engine.config import LoadConfig, SaveConfig, VerifyConfig
from lightning_shardckpt.engine.storage.retry import RetryPolicy
from lightning_shardckpt.errors import ConfigError
from lightning_shardckpt.policies.drills.runner import DrillOptions

NAN, INF = math.nan, math.inf

# what every option refuses, by kind; a range's own out-of-range value is added per option
NOT_A_NUMBER = [NAN, INF, -INF, "abc", True]
NOT_A_COUNT = [*NOT_A_NUMBER, 1.5]


def _rule(**fields):
    return {
        "name": "slow_save",
        "metric": "pause_s",
        "owner": "infra",
        "range": {"kind": "static", "max": 30.0},
        "mitigation": "lower_frequency",
        **fields,
    }


def _callback(tmp_path, **options):
    return ShardedCheckpoint(str(tmp_path / "ckpt"), **options)


def _range(**fields):
    return {"health": [_rule(range={"kind": "learned", "max": 30.0, **fields})]}


# (option as the message names it, its bad values, how the value reaches a constructor)
CASES = [
    # the callback's own options (training/callback_options.py CallbackConfig)
    ("keep_last", [*NOT_A_COUNT, 0, -1], lambda v, t: _callback(t, keep_last=v)),
    ("every_n_train_steps", [*NOT_A_COUNT, 0, -1], lambda v, t: _callback(t, every_n_train_steps=v)),
    ("every_n_minutes", [*NOT_A_NUMBER, 0, -1], lambda v, t: _callback(t, every_n_minutes=v)),
    ("keep_every_n_steps", [*NOT_A_COUNT, 0], lambda v, t: _callback(t, keep_every_n_steps=v)),
    # the save engine (engine/config.py)
    ("max_in_flight", [*NOT_A_COUNT, 0], lambda v, t: SaveConfig(max_in_flight=v)),
    ("full_every_n", [*NOT_A_COUNT, 0], lambda v, t: SaveConfig(full_every_n=v)),
    ("collective_timeout_s", [*NOT_A_NUMBER, 0, -1], lambda v, t: SaveConfig(collective_timeout_s=v)),
    ("teardown_timeout_s", [*NOT_A_NUMBER, -1], lambda v, t: SaveConfig(teardown_timeout_s=v)),
    ("verify.fraction", [*NOT_A_NUMBER, -1, 1.5], lambda v, t: _callback(t, save={"verify": {"fraction": v}})),
    ("verify.min_chunks", [*NOT_A_COUNT, -1], lambda v, t: VerifyConfig(min_chunks=v)),
    ("verify.seed", NOT_A_COUNT, lambda v, t: VerifyConfig(seed=v)),
    ("read_threads", [*NOT_A_COUNT, 0], lambda v, t: LoadConfig(read_threads=v)),
    ("read_ahead_bytes", [*NOT_A_COUNT, 0], lambda v, t: LoadConfig(read_ahead_bytes=v)),
    ("retry.attempts", [*NOT_A_COUNT, 0], lambda v, t: RetryPolicy(attempts=v)),
    ("retry.base_s", [*NOT_A_NUMBER, -1], lambda v, t: RetryPolicy(base_s=v)),
    # drills (policies/drills/drills_plugin.py DrillConfig, policies/drills/runner.py DrillOptions)
    ("drill.tolerance", [*NOT_A_NUMBER, -1], lambda v, t: _callback(t, drill={"tolerance": v})),
    ("drill.timeout_s", [*NOT_A_NUMBER, 0], lambda v, t: _callback(t, drill={"timeout_s": v})),
    ("drill.threads", [*NOT_A_COUNT, 0], lambda v, t: _callback(t, drill={"threads": v})),
    ("drill.world_size", [*NOT_A_COUNT, 0], lambda v, t: _callback(t, drill={"world_size": v})),
    ("drill.every_n_checkpoints", [*NOT_A_COUNT, 0], lambda v, t: _callback(t, drill={"every_n_checkpoints": v})),
    ("drill.keep_last_drilled", [*NOT_A_COUNT, -1], lambda v, t: _callback(t, drill={"keep_last_drilled": v})),
    ("drill.nice", [*NOT_A_COUNT, -1, 20], lambda v, t: DrillOptions(nice=v)),
    # memory kept between drills: never negative, never more than this host has (the message names it)
    ("drill.keep_memory_gib", [*NOT_A_NUMBER, -1, 2**20], lambda v, t: _callback(t, drill={"keep_memory_gib": v})),
    # health rules (policies/health/rules.py): range, persistence, the mitigation's factor
    ("range.max", NOT_A_NUMBER, lambda v, t: _callback(t, health=[_rule(range={"kind": "static", "max": v})])),
    ("range.min", NOT_A_NUMBER, lambda v, t: _callback(t, health=[_rule(range={"kind": "static", "min": v})])),
    ("range.k", [*NOT_A_NUMBER, 0, -1], lambda v, t: _callback(t, **_range(k=v))),
    ("range.floor", [*NOT_A_NUMBER, -1], lambda v, t: _callback(t, **_range(floor=v))),
    ("range.relative_floor", [*NOT_A_NUMBER, -1], lambda v, t: _callback(t, **_range(relative_floor=v))),
    ("range.warmup", [*NOT_A_COUNT, 0], lambda v, t: _callback(t, **_range(warmup=v))),
    ("range.window", [*NOT_A_COUNT, 1], lambda v, t: _callback(t, **_range(window=v, warmup=1))),
    (
        "persistence.fire_after_s",
        [*NOT_A_NUMBER, 0, -1],
        lambda v, t: _callback(t, health=[_rule(persistence={"fire_after_s": v})]),
    ),
    (
        "persistence.fire_after",
        [*NOT_A_COUNT, 0],
        lambda v, t: _callback(t, health=[_rule(persistence={"fire_after": v})]),
    ),
    (
        "persistence.resolve_after",
        [*NOT_A_COUNT, 0],
        lambda v, t: _callback(t, health=[_rule(persistence={"resolve_after": v})]),
    ),
    (
        "mitigation_options.factor",
        [*NOT_A_NUMBER, 0, 0.5, -1],
        lambda v, t: _callback(t, health=[_rule(mitigation_options={"factor": v})]),
    ),
    (
        "mitigation_options.max_factor",
        [*NOT_A_NUMBER, 0],
        lambda v, t: _callback(t, health=[_rule(mitigation_options={"max_factor": v})]),
    ),
    ("health.alert_every_s", [*NOT_A_NUMBER, -1], lambda v, t: _callback(t, health={"alert_every_s": v})),
    # tiers (engine/tiers/config.py)
    ("keep_last", [*NOT_A_COUNT, 0], lambda v, t: _callback(t, tiers={"fast": {"dirpath": str(t), "keep_last": v}})),
    (
        "max_unreplicated",
        [*NOT_A_COUNT, -1],
        lambda v, t: _callback(t, tiers={"fast": {"dirpath": str(t), "max_unreplicated": v}}),
    ),
    (
        "every_minutes",
        [*NOT_A_NUMBER, 0],
        lambda v, t: _callback(
            t, tiers={"fast": {"dirpath": str(t / "f")}, "durable": {"dirpath": str(t / "d"), "every_minutes": v}}
        ),
    ),
    (
        "flush_timeout_s",
        [*NOT_A_NUMBER, -1],
        lambda v, t: _callback(t, tiers={"fast": {"dirpath": str(t)}, "flush_timeout_s": v}),
    ),
]


@pytest.mark.parametrize(
    "option,value,build",
    [
        pytest.param(option, value, build, id=f"{option}={value!r}")
        for option, values, build in CASES
        for value in values
    ],
)
def test_a_numeric_option_that_cannot_work_is_refused_naming_it(option, value, build, tmp_path):
    with pytest.raises(ConfigError) as refused:
        build(value, tmp_path)
    assert f"{option}={value!r}" in str(refused.value), str(refused.value)
    assert "; use " in str(refused.value)  # one message form: the rule that would work follows


def test_sound_numbers_of_every_kind_are_still_accepted(tmp_path):
    callback = _callback(
        tmp_path,
        keep_last=2,
        every_n_minutes=0.5,
        save={"verify": {"fraction": 1, "min_chunks": 0}, "teardown_timeout_s": 0},
        drill={"tolerance": 0, "every_n_checkpoints": 1, "keep_last_drilled": 0},
        health=[_rule(mitigation_options={"factor": 1.5, "max_factor": 4})],
    )
    assert callback.options.keep_last == 2 and callback.drill_options.tolerance == 0


@pytest.mark.parametrize(
    "override,named",
    [
        ("checkpoint.keep_last=1.5", "keep_last=1.5"),
        ("checkpoint.keep_last=true", "keep_last=True"),
        ("checkpoint.every_n_train_steps=nan", "every_n_train_steps=nan"),
        ("checkpoint.every_n_minutes=inf", "every_n_minutes=inf"),
        ("checkpoint.drill.tolerance=nan", "drill.tolerance=nan"),
        ("checkpoint.drill.threads=abc", "drill.threads='abc'"),
        ("checkpoint.save.max_in_flight=-1", "max_in_flight=-1"),
        ("checkpoint.save.verify.fraction=nan", "verify.fraction=nan"),
    ],
)
def test_a_bad_number_from_hydra_is_refused_naming_the_option(compose_checkpoint, override, named):
    # recipes/train.py calls the partial itself, so the callback's own ConfigError reaches the user
    with pytest.raises((InstantiationException, ConfigError)) as refused:
        compose_checkpoint(override)
    assert named in str(refused.value)


def test_the_default_hydra_config_still_builds_the_callback(compose_checkpoint):
    assert compose_checkpoint().drill_options.tolerance == pytest.approx(1e-4)


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["drill", "{root}", "--tolerance", "nan"], "--tolerance"),
        (["drill", "{root}", "--tolerance", "-1"], "--tolerance"),
        (["drill", "{root}", "--timeout", "inf"], "--timeout"),
        (["drill", "{root}", "--threads", "1.5"], "--threads"),
        (["drill", "{root}", "--world-size", "0"], "--world-size"),
        (["drill", "{root}", "--keep-memory-gib", "-1"], "--keep-memory-gib"),
        (["gc", "{root}", "--grace-minutes", "nan"], "--grace-minutes"),
        (["timeline", "{root}", "--grace", "nan"], "--grace"),
        (["compare", "a", "b", "--top", "abc"], "--top"),
    ],
)
def test_a_bad_number_on_the_command_line_exits_2_with_usage(run_cli, tmp_path, argv, flag):
    code, out, err = run_cli(*[arg.format(root=tmp_path) for arg in argv])
    assert code == 2, (out, err)
    assert "usage:" in err and f"argument {flag}:" in err and f"{flag}=" in err, err
