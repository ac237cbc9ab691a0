"""CheckpointOptions: every user-facing option of the three front doors, once, with its type, default and doc.

ShardedCheckpoint takes every field (conf/checkpoint/default.yaml spells them as Hydra keys, one for one: a test keeps
the two equal); the Checkpointer and ShardedFabricStrategy take the fields a plain loop or Fabric has (`DoorKeywords`).
A door's signature is derived from the fields it takes, so `help()`, IDEs and LightningCLI (jsonargparse) still read
each option typed, with its default; a door's keywords are checked against it, so an unknown or misspelt option is
refused by name with the closest known one (`DoorKeywords.build`).

Each door also accepts a whole `options=CheckpointOptions(...)`; keywords given beside it replace its fields.

Types are checked when the options are built (`@typed_options`). The schedule and the load options are checked by
the configs they become (CallbackConfig, LoadConfig), so their messages name those configs' fields as before; the
nested blocks (save, drill, health, tiers) are converted to their configs here, once, so a bad block fails when
the door is built, before any rank trains.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..engine.config import LoadConfig, SaveConfig, save_config_from
from ..engine.tiers.config import TiersConfig, tiers_config_from
from ..engine.validate import did_you_mean, typed_options
from ..errors import ConfigError
from ..identity.diff import IdentityPolicy
from ..policies.config_blocks import options_from
from ..policies.drills.drills_plugin import DrillConfig, drill_config_from
from ..policies.health.rules import HealthConfig, health_config_from
from ..policies.plugin import Plugin
from .callback_options import CallbackConfig
from .preemption import DEFAULT_GRACE_S

Constructor = TypeVar("Constructor", bound=Callable[..., None])

# fields CallbackConfig (the save loop's schedule and retention) checks; CheckpointOptions.schedule() builds it
SCHEDULE_FIELDS = tuple(f.name for f in dataclasses.fields(CallbackConfig))
# the door's spelling -> LoadConfig's field; CheckpointOptions.load_config() builds it
LOAD_FIELDS = {
    "verify_on_load": "verify_checksums",
    "trust_checkpoint": "trust_checkpoint",
    "require_signature": "require_signature",
    "public_keys": "public_keys",
    "revoked_keys": "revoked_keys",
}


# "ShardedCheckpoint": the fields checked here (log_metrics, log_artifact) are the Trainer's (its loggers) only
@dataclass(frozen=True, kw_only=True)
@typed_options("ShardedCheckpoint", checked_by_parts=(*SCHEDULE_FIELDS, *LOAD_FIELDS))
class CheckpointOptions:
    """Every option of the front doors; its YAML spelling, with the trade-off of each: conf/checkpoint/default.yaml."""

    # --- when to save (CallbackConfig) ---
    every_n_train_steps: int | None = None  # save after every N optimizer steps; None: off
    every_n_minutes: float | None = None  # save after N minutes of training time; None: off
    save_on_epoch_end: bool = False  # also save at each epoch end
    save_on_fit_end: bool = True  # a final checkpoint when fit ends (skipped if that step is already saved)
    # SIGTERM / SIGUSR1: every rank saves the same step (blocking), then stops. None: the door's default (the
    # Trainer's: on; the Checkpointer's: off, as a plain loop's signal handlers are its own)
    save_on_preemption: bool | None = None
    # after a preemption signal, a process whose fit has not returned by then exits (status 128 + signal);
    # None: never. Below the scheduler's kill time, above the final save's duration
    preemption_grace_s: float | None = DEFAULT_GRACE_S
    # --- what to keep (CallbackConfig, the retention plug-in) ---
    keep_last: int | None = None  # committed checkpoints to keep, newest first; None keeps all
    keep_every_n_steps: int | None = None  # also keep every checkpoint whose step is a multiple of this
    # --- resume (LoadConfig) ---
    resume_required: bool = False  # "latest" with nothing committed: fail instead of starting fresh
    verify_on_load: bool = True  # checksum every byte read on resume (LoadConfig.verify_checksums)
    trust_checkpoint: bool = False  # true unpickles any class a checkpoint names: only for checkpoints you trust
    require_signature: bool = False  # resume only checkpoints signed by one of public_keys (docs/howto/signing.md)
    public_keys: Any = ()  # PEM public key files whose signatures resume accepts; a retired one as a windowed mapping
    revoked_keys: Any = ()  # key ids or PEM public key files refused at every step
    # --- the Trainer's loggers and the run's identity (ShardedCheckpoint only) ---
    log_metrics: bool = True  # checkpoint/* timings, sizes and counters to the Trainer's loggers
    log_artifact: bool = True  # each committed checkpoint to W&B as an artifact by reference
    dataset_version: str | None = None  # the data's version (e.g. "corpus-v3"); None: fingerprint the dataset
    identity_policy: IdentityPolicy = IdentityPolicy()  # on resume, what an identity difference does, per block
    # --- the engine and the plug-ins: a config, a dict or a Hydra block, converted to the config when built ---
    save: SaveConfig = SaveConfig()  # the save engine (async, verify, format, signing, storage options)
    drill: DrillConfig = DrillConfig()  # restore drills of committed checkpoints
    health: HealthConfig | dict[str, Any] | list[Any] | str | None = (
        HealthConfig()
    )  # health rules: a config, rules, or a rules file
    tiers: TiersConfig | None = None  # a fast and a durable tier; None: checkpoints live under the root
    plugins: list[Plugin] | None = None  # your own plug-ins (lightning_shardckpt.Plugin), after ours

    def __post_init__(self) -> None:
        # the blocks as their configs, once: every door reads the same validated values
        object.__setattr__(self, "save", save_config_from(self.save))
        object.__setattr__(self, "drill", drill_config_from(self.drill))
        object.__setattr__(self, "health", health_config_from(self.health))
        object.__setattr__(self, "tiers", tiers_config_from(self.tiers))
        object.__setattr__(
            self, "identity_policy", options_from(IdentityPolicy, self.identity_policy, "identity_policy block")
        )
        self.schedule()  # checked now, by the configs that own the rules
        load = self.load_config()
        # as the load reads them (a list from YAML is a tuple): equal options compare equal
        object.__setattr__(self, "public_keys", load.public_keys)
        object.__setattr__(self, "revoked_keys", load.revoked_keys)

    def schedule(self, **overrides: Any) -> CallbackConfig:
        """The save loop's schedule and retention; `overrides`: what a door decides itself (the Checkpointer's
        fit-end save follows `max_steps`)."""
        values = {name: getattr(self, name) for name in SCHEDULE_FIELDS}
        if values["save_on_preemption"] is None:  # left to a door that did not resolve it: no signal handlers
            values["save_on_preemption"] = False
        return CallbackConfig(**{**values, **overrides})

    def load_config(self) -> LoadConfig:
        return LoadConfig(**{ours: getattr(self, name) for name, ours in LOAD_FIELDS.items()})


@dataclass(frozen=True)
class DoorKeywords:
    """Which CheckpointOptions fields one door takes, under which names, with which of its own defaults."""

    door: str  # how messages name it: "Checkpointer"
    names: tuple[str, ...]  # the fields it takes, in its signature's order
    spellings: Mapping[str, str] = field(default_factory=dict)  # the door's keyword -> the field, where they differ
    # the door's default of a field whose default is None ("the door's default"): in its signature, and where
    # the keywords and `options` leave it None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    why_not: str = ""  # why the door takes no other field (said when a CheckpointOptions sets one)

    def keywords(self) -> dict[str, str]:
        """The door's keyword -> the field, in signature order."""
        back = {field_name: keyword for keyword, field_name in self.spellings.items()}
        return {back.get(name, name): name for name in self.names}

    def derive(self, constructor: Constructor) -> Constructor:
        """Decorate `__init__(self, <own parameters>, options=None, **given)`: its signature becomes its own
        parameters plus the fields it takes, keyword-only, typed, with their defaults (what help() and
        LightningCLI read); the options themselves stay here, once."""
        resolved = typing.get_type_hints(constructor)  # one kind of annotation throughout: types, not strings
        own = [
            p.replace(annotation=resolved.get(p.name, p.annotation))
            for p in inspect.signature(constructor).parameters.values()
            if p.kind is not p.VAR_KEYWORD
        ]
        hints = typing.get_type_hints(CheckpointOptions)
        fields = {f.name: f for f in dataclasses.fields(CheckpointOptions)}
        derived = [
            inspect.Parameter(
                keyword,
                inspect.Parameter.KEYWORD_ONLY,
                default=self.defaults.get(name, fields[name].default),
                annotation=hints[name],
            )
            for keyword, name in self.keywords().items()
        ]
        signature = inspect.signature(constructor).replace(parameters=[*own, *derived], return_annotation=None)
        constructor.__signature__ = signature  # type: ignore[attr-defined]
        return constructor

    def build(self, given: Mapping[str, Any], options: CheckpointOptions | None = None) -> CheckpointOptions:
        """The door's CheckpointOptions: `options` (else the defaults) with the keywords `given` replacing fields,
        and the door's own default where a field is left None. An unknown keyword is refused naming it and the
        closest option the door takes."""
        keywords = self.keywords()
        self.refuse_unknown(set(given) - set(keywords))
        values = {keywords[keyword]: value for keyword, value in given.items()}
        if options is None:
            options = CheckpointOptions(**values)
        elif not isinstance(options, CheckpointOptions):
            raise ConfigError(
                f"{self.door}(options=...) takes a lightning_shardckpt.CheckpointOptions, got {type(options).__name__}"
            )
        else:
            self._refuse_untaken(options)
            options = dataclasses.replace(options, **values) if values else options
        unset = {name: default for name, default in self.defaults.items() if getattr(options, name) is None}
        return dataclasses.replace(options, **unset) if unset else options

    def refuse_unknown(self, unknown: Iterable[str], also: Iterable[str] = ()) -> None:
        """One message for a keyword the door does not know, naming the closest of its options (or of `also`:
        what the door passes on, e.g. Fabric's strategy's own)."""
        first = sorted(unknown)[:1]
        if first:
            known = [*self.keywords(), *also]
            raise ConfigError(
                f"{self.door}({first[0]}=...): unknown option {first[0]!r}{did_you_mean(first, known)}; "
                f"{self.door}'s checkpoint options: {', '.join(self.keywords())} (docs/CONFIGURATION.md)"
            )

    def _refuse_untaken(self, options: CheckpointOptions) -> None:
        """A field the door does not take, set away from its default in `options`: said, never silently dropped."""
        plain = CheckpointOptions()
        taken = set(self.names)
        set_here = [
            f.name
            for f in dataclasses.fields(CheckpointOptions)
            if f.name not in taken and getattr(options, f.name) != getattr(plain, f.name)
        ]
        if set_here:
            raise ConfigError(f"{self.door} does not take CheckpointOptions.{set_here[0]}: {self.why_not}")


ALL_OPTIONS = tuple(f.name for f in dataclasses.fields(CheckpointOptions))
