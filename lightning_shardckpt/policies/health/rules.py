"""Health rules as configuration: which metric, on which slice, whose problem, what is normal, how long
out of range before it fires, and what is done about it (`conf/health/default.yaml` is the manual).

A rule is data, validated when it is built (before training starts): a typo in a metric, a slice the
metric has no values for, or a mitigation nobody registered is a ConfigError naming the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...engine.validate import did_you_mean, require_number, typed_options
from ...errors import ConfigError

# --- metrics, as health rules see them (policies/health/observe.py derives them from events) ---
# name -> (family, the slices it has values on, what one value is)
CHECKPOINT_PAUSE, COMMIT_COMPLETENESS, RESTORE = "pause_throughput", "commit_completeness", "restore"
RUN, RANK, CAUSE, ROOT = "run", "rank", "cause", "root"
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "pause_s": (CHECKPOINT_PAUSE, (RUN, ROOT), "seconds the training thread was blocked by one save (rank 0)"),
    "total_s": (CHECKPOINT_PAUSE, (RUN, ROOT), "seconds from the save request until it committed or failed"),
    "write_gbps": (
        CHECKPOINT_PAUSE,
        (RANK, RUN, ROOT),
        "GB/s one rank wrote its shard file at (RUN/ROOT: the slowest rank)",
    ),
    "skipped": (CHECKPOINT_PAUSE, (RUN, ROOT), "1 for a save skipped because the previous one was in flight, else 0"),
    "committed": (
        COMMIT_COMPLETENESS,
        (RUN, ROOT),
        "1 for an attempt that committed, 0 for one that failed (skips excluded)",
    ),
    "commit_ratio": (COMMIT_COMPLETENESS, (RUN, ROOT), "committed / (committed + failed) over the run so far"),
    "failed": (
        COMMIT_COMPLETENESS,
        (CAUSE, RUN, ROOT),
        "1 for a failed attempt, else 0; CAUSE slices by failure cause",
    ),
    "failed_dirs_left": (
        COMMIT_COMPLETENESS,
        (RUN, ROOT),
        "1 when a failed attempt's directory was left for `shardckpt gc`, else 0",
    ),
    "storage_retries": (COMMIT_COMPLETENESS, (RUN, ROOT), "transient storage errors retried during one save"),
    "drill_ok": (RESTORE, (RUN, ROOT), "1 for a drill that passed, 0 for one that failed (none if it never ran)"),
    "time_to_resume_s": (RESTORE, (RUN, ROOT), "seconds a restore drill took from process start to restored state"),
    "drill_lag_checkpoints": (
        RESTORE,
        (RUN, ROOT),
        "checkpoints committed since the newest drilled one, when a drill ends",
    ),
    "drill_lag_s": (
        RESTORE,
        (RUN, ROOT),
        "drills external: seconds the oldest checkpoint the follower has not drilled has waited (after commits)",
    ),
    "resume_s": (RESTORE, (RUN, ROOT), "seconds a real resume took to load its checkpoint"),
    "signature_skipped": (
        RESTORE,
        (RUN, ROOT),
        "checkpoints a resume's `latest`/`last-good` passed over because the signature policy refused them",
    ),
    # tiers (engine/tiers/replicate.py): one value per copy attempt to the durable tier
    "replication_ok": (
        COMMIT_COMPLETENESS,
        (RUN, ROOT),
        "1 for a copy committed on the durable tier, 0 for a failed attempt",
    ),
    "replication_lag_checkpoints": (
        COMMIT_COMPLETENESS,
        (RUN, ROOT),
        "fast-tier commits not yet on the durable tier, after a copy attempt",
    ),
    # peer copies of the fast tier (engine/tiers/peers.py): one value per checkpoint copied to peer nodes
    "peer_replication_ok": (
        COMMIT_COMPLETENESS,
        (RUN, ROOT),
        "1 for a checkpoint whose files all reached their peer nodes verified, 0 for a failed copy",
    ),
    "peer_replication_lag_checkpoints": (
        COMMIT_COMPLETENESS,
        (RUN, ROOT),
        "fast-tier commits without a complete peer copy yet, after a peer copy",
    ),
}
# the unit of one value of each metric, for axes and tables (`shardckpt health --plot`)
METRIC_UNITS: dict[str, str] = {
    "pause_s": "seconds",
    "total_s": "seconds",
    "write_gbps": "GB/s",
    "skipped": "skipped saves (0/1)",
    "committed": "commits (1 ok, 0 failed)",
    "commit_ratio": "committed share (0-1)",
    "failed": "failed saves (0/1)",
    "failed_dirs_left": "dirs left (0/1)",
    "storage_retries": "retries per save",
    "drill_ok": "drill passed (1) / failed (0)",
    "time_to_resume_s": "seconds",
    "drill_lag_checkpoints": "checkpoints",
    "drill_lag_s": "seconds",
    "resume_s": "seconds",
    "signature_skipped": "checkpoints refused",
    "replication_ok": "copy ok (1) / failed (0)",
    "replication_lag_checkpoints": "checkpoints",
    "peer_replication_ok": "peer copy ok (1) / failed (0)",
    "peer_replication_lag_checkpoints": "checkpoints",
}
SLICES = (RUN, RANK, CAUSE, ROOT)
SEVERITIES = ("info", "warning", "error", "critical")
BUILTIN_MITIGATIONS = ("alert", "lower_frequency", "skip_when_busy", "drill_now", "stop_training")
STATIC, LEARNED = "static", "learned"
LOWER_FREQUENCY_OPTIONS = (
    "factor",
    "max_factor",
)  # numbers policies/health/mitigations.py multiplies the save interval by
ABOVE, BELOW, BOTH = "above", "below", "both"


@dataclass(frozen=True, kw_only=True)
@typed_options("range")
class NormalRange:
    """What a normal value is: fixed bounds, or learned from the run itself.

    learned: after `warmup` in-range values, normal is median ± max(k·MAD, floor, relative_floor·|median|)
    of the last `window` values seen in range (values out of range never teach the baseline what normal
    is; the floors keep a quiet, steady run from alerting on noise). `direction`
    says which side is bad: a pause is bad only when long, throughput only when low. Static `min`/`max`
    also bound a learned range (a hard limit that holds during warm-up too).
    """

    kind: str = STATIC
    min: float | None = None
    max: float | None = None
    warmup: int = 10
    window: int = 50
    k: float = 5.0
    floor: float = 0.0  # the smallest half-width of a learned band, in the metric's unit
    relative_floor: float = 0.0  # the smallest half-width as a share of the median (0.5: ±50 %)
    direction: str = BOTH

    def __post_init__(self) -> None:
        if self.kind not in (STATIC, LEARNED):
            raise ConfigError(
                f"range.kind={self.kind!r} is unknown; use 'static' (min/max) or 'learned' (median ± k·MAD)"
            )
        # a NaN bound compares False with every value: the rule could never fire
        require_number("range.min", self.min, allow_none=True, none_means="no lower bound")
        require_number("range.max", self.max, allow_none=True, none_means="no upper bound")
        require_number("range.warmup", self.warmup, integer=True, at_least=1, hint="in-range values before learning")
        require_number("range.window", self.window, integer=True, at_least=2, hint="values the baseline remembers")
        require_number("range.k", self.k, above=0, hint="the band is median ± k·MAD")
        require_number("range.floor", self.floor, at_least=0, hint="in the metric's unit")
        require_number("range.relative_floor", self.relative_floor, at_least=0, hint="0.5: ±50 % of the median")
        if self.kind == STATIC and self.min is None and self.max is None:
            raise ConfigError("a static range needs min, max or both (e.g. range: {kind: static, max: 30})")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ConfigError(f"range.min={self.min} is above range.max={self.max}")
        if self.window < self.warmup:
            raise ConfigError(
                f"range needs warmup >= 1 and window >= max(2, warmup); got warmup={self.warmup}, window={self.window}"
            )
        if self.direction not in (ABOVE, BELOW, BOTH):
            raise ConfigError(
                f"range.direction={self.direction!r} is unknown; use 'above', 'below' or 'both' (the bad side)"
            )


@dataclass(frozen=True, kw_only=True)
@typed_options("persistence")
class Persistence:
    """How long a value stays out of range before the rule fires, and in range before it resolves."""

    fire_after: int = 3  # consecutive out-of-range evaluations
    fire_after_s: float | None = None  # or: out of range for this long (seconds), whichever comes first
    resolve_after: int = 3  # consecutive in-range evaluations

    def __post_init__(self) -> None:
        require_number("persistence.fire_after", self.fire_after, integer=True, at_least=1, hint="evaluations")
        require_number(
            "persistence.fire_after_s",
            self.fire_after_s,
            above=0,
            allow_none=True,
            none_means="count evaluations only",
            hint="seconds",
        )
        require_number("persistence.resolve_after", self.resolve_after, integer=True, at_least=1, hint="evaluations")


@dataclass(frozen=True, kw_only=True)
@typed_options("health_rule")
class HealthRule:
    """One watched metric with its contract: owner, slice, normal range, persistence, severity, mitigation."""

    name: str
    metric: str
    owner: str
    slice: str = RUN
    severity: str = "warning"
    range: NormalRange = field(default_factory=NormalRange)
    persistence: Persistence = field(default_factory=Persistence)
    mitigation: str = "alert"  # a registered name (see policies/health/mitigations.py) or "module:function"
    mitigation_options: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name or not all(ch.isalnum() or ch in "_-" for ch in self.name):
            raise ConfigError(
                f"health rule name {self.name!r} must be non-empty letters, digits, '_' or '-' (it names metrics and events)"
            )
        if self.metric not in METRICS:
            raise ConfigError(f"health rule {self.name!r}: metric {self.metric!r} is unknown; known: {sorted(METRICS)}")
        slices = METRICS[self.metric][1]
        if self.slice not in slices:
            raise ConfigError(
                f"health rule {self.name!r}: metric {self.metric!r} has no values per {self.slice!r}; use one of {list(slices)}"
            )
        if not self.owner or not str(self.owner).strip():
            raise ConfigError(
                f"health rule {self.name!r} has no owner; name the team or contact every alert should show"
            )
        if self.severity not in SEVERITIES:
            raise ConfigError(
                f"health rule {self.name!r}: severity {self.severity!r} is unknown; use one of {list(SEVERITIES)}"
            )
        # the name is checked against the registry where mitigations run (policies/health/mitigations.py), before
        # training starts; offline evaluation only reports it
        if not isinstance(self.mitigation, str) or not self.mitigation.strip():
            raise ConfigError(
                f"health rule {self.name!r} has no mitigation; use one of {list(BUILTIN_MITIGATIONS)} or 'module:function'"
            )
        if self.mitigation == "lower_frequency":
            for option in LOWER_FREQUENCY_OPTIONS:
                if option in self.mitigation_options:
                    require_number(
                        f"health rule {self.name!r}: mitigation_options.{option}",
                        self.mitigation_options[option],
                        at_least=1,
                        hint="a save-interval multiplier; 2 saves half as often",
                    )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
@typed_options("health")
class HealthConfig:
    """`ShardedCheckpoint(health=...)` / the `health` Hydra group."""

    rules: tuple[HealthRule, ...] = ()
    alert_every_s: float = 600.0  # one alert per rule and slice at most this often (W&B's own rate limit on top)

    @property
    def enabled(self) -> bool:
        return bool(self.rules)

    def __post_init__(self) -> None:
        names = [rule.name for rule in self.rules]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ConfigError(f"health rules {twice} are defined twice; rule names must be unique")
        require_number("health.alert_every_s", self.alert_every_s, at_least=0, hint="seconds")


def rule_from(value: Any) -> HealthRule:
    """A HealthRule from itself or a plain dict (YAML / JSON), nested blocks included."""
    if isinstance(value, HealthRule):
        return value
    value = _plain(value)
    if not isinstance(value, dict):
        raise ConfigError(f"a health rule must be a mapping with name, metric, owner, ...; got {value!r}")
    known = set(HealthRule.__dataclass_fields__)
    unknown = set(value) - known
    if unknown:
        raise ConfigError(
            f"health rule {value.get('name')!r}: unknown field(s) {sorted(unknown)}{did_you_mean(unknown, known)}; "
            f"known: {sorted(known)}"
        )
    blocks = {"range": NormalRange, "persistence": Persistence}
    converted = dict(value)
    for key, cls in blocks.items():
        if isinstance(converted.get(key), dict):
            fields = {f.name for f in dataclasses.fields(cls)}
            if set(converted[key]) - fields:
                raise ConfigError(
                    f"health rule {value.get('name')!r}: unknown {key} field(s) {sorted(set(converted[key]) - fields)}; "
                    f"known: {sorted(fields)}"
                )
    try:
        for key, cls in blocks.items():
            if isinstance(converted.get(key), dict):
                converted[key] = cls(**converted[key])
        return HealthRule(**converted)
    except TypeError as err:
        raise ConfigError(f"health rule {value.get('name')!r}: {err}") from err
    except ConfigError as err:
        if str(err).startswith("health rule "):
            raise
        raise ConfigError(f"health rule {value.get('name')!r}: {err}") from err


def health_config_from(value: Any) -> HealthConfig:
    """HealthConfig from None (no rules), itself, a dict with `rules`, a list of rules, or a YAML/JSON path."""
    if value is None:
        return HealthConfig()
    if isinstance(value, HealthConfig):
        return value
    if isinstance(value, (str, Path)):
        return load_rules_file(value)
    value = _plain(value)
    if isinstance(value, list):
        value = {"rules": value}
    if not isinstance(value, dict):
        raise ConfigError(
            f"health must be a mapping with `rules`, a list of rules or a rules file; got {type(value).__name__}"
        )
    unknown = set(value) - {"rules", "alert_every_s"}
    if unknown:
        known = ["alert_every_s", "rules"]
        raise ConfigError(f"unknown health option(s) {sorted(unknown)}{did_you_mean(unknown, known)}; known: {known}")
    rules = tuple(rule_from(rule) for rule in value.get("rules") or ())
    return HealthConfig(rules=rules, alert_every_s=value.get("alert_every_s", HealthConfig.alert_every_s))


def load_rules_file(path: str | Path) -> HealthConfig:
    """Rules from a YAML or JSON file: the `health` group's file itself, or a mapping with `rules`."""
    import yaml  # PyYAML ships with Hydra/OmegaConf

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"health rules file {path} does not exist; pass e.g. conf/health/default.yaml")
    document = yaml.safe_load(path.read_text()) or {}
    return health_config_from(document)


def _plain(value: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    return value
