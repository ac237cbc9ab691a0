"""A user's own class kept in a checkpoint's Lightning state: on no allow-list, importable by drill processes."""

from __future__ import annotations


class UserState:
    """What a LightningModule's `on_save_checkpoint` might add: plain data in a class of the user's."""

    def __init__(self, step: int) -> None:
        self.step = step
