"""Walking nested state dicts (dicts, lists, tuples) without caring what else they hold."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def iter_tensors(state: Any) -> Iterator[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from iter_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from iter_tensors(value)
