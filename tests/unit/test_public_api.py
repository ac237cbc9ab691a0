"""The public API (`lightning_shardckpt/__init__.py`): every name listed resolves, lazily, to the thing it names."""

from __future__ import annotations

import importlib

import lightning_shardckpt
from lightning_shardckpt import errors


def test_all_lists_every_lazily_imported_name_and_otherwise_only_errors_imported_eagerly():
    lazy = set(lightning_shardckpt.ENGINE_NAMES) | set(lightning_shardckpt.LIGHTNING_NAMES)
    assert lazy <= set(lightning_shardckpt.__all__)
    for name in set(lightning_shardckpt.__all__) - lazy:
        assert vars(lightning_shardckpt)[name] is getattr(errors, name), name
    assert len(set(lightning_shardckpt.__all__)) == len(lightning_shardckpt.__all__)


def test_every_public_name_resolves_to_the_object_its_module_defines():
    for name, module in {**lightning_shardckpt.ENGINE_NAMES, **lightning_shardckpt.LIGHTNING_NAMES}.items():
        defined = getattr(importlib.import_module(module, "lightning_shardckpt"), name)
        assert getattr(lightning_shardckpt, name) is defined, name


def test_importing_the_lightning_names_registers_the_strategy_names_with_lightning():
    from lightning.pytorch.strategies import StrategyRegistry

    lightning_shardckpt.ShardedStrategy  # noqa: B018 - the attribute access loads the adapter
    assert {"shardckpt_ddp", "shardckpt_fsdp"} <= set(StrategyRegistry)
