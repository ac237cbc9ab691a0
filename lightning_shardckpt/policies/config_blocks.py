"""Options blocks from what users write: an instance, None, a dict or a Hydra DictConfig."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

from ..engine.validate import did_you_mean
from ..errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Options = TypeVar("Options", bound="DataclassInstance")  # a config dataclass: its fields are the known keys


def options_from(cls: type[Options], value: Any, what: str) -> Options:
    """`cls` from an instance, None (its defaults), a dict or a Hydra DictConfig; unknown keys are a
    ConfigError naming the known ones (`what`: the option's name in messages, e.g. "drill")."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(value, DictConfig):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    known = {f.name for f in fields(cls)}
    unknown = set(value) - known
    if unknown:
        raise ConfigError(
            f"unknown {what} option(s) {sorted(unknown)}{did_you_mean(unknown, known)}; known: {sorted(known)}"
        )
    return cls(**value)
