"""A local filesystem whose shard writes are slow or fail for chosen checkpoint steps: storage trouble on cue.

`scripted:///abs/root` with storage_options `{"slow_steps": [6, 8], "delay_s": 0.8, "fail_steps": [10]}`
is the local filesystem, except that opening a shard file (`*.distcp`) for writing inside a checkpoint
directory `step-<N>-<id>` sleeps `delay_s` when N is in `slow_steps` (a throttled disk or a congested
link) and raises `OSError(ENOSPC)` when N is in `fail_steps` (a full disk). Keyed by the checkpoint's
step, not by wall time, so a test knows exactly which saves were slow whatever the machine's speed.
Importing this module registers the protocol (spawned ranks import the test module that uses it).
"""

from __future__ import annotations

import errno
import os
import re
import time
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "scripted"
_STEP = re.compile(r"/step-(\d+)-[^/]+/[^/]+\.distcp$")


class ScriptedFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)

    def __init__(self, slow_steps: Any = (), delay_s: float = 0.0, fail_steps: Any = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slow_steps, self.fail_steps = {int(s) for s in slow_steps}, {int(s) for s in fail_steps}
        self.delay_s = float(delay_s)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        match = _STEP.search(self._strip_protocol(path)) if any(flag in mode for flag in "wxa") else None
        if match:
            step = int(match.group(1))
            if step in self.fail_steps:
                raise OSError(errno.ENOSPC, "No space left on device (scripted)", path)
            if step in self.slow_steps:
                time.sleep(self.delay_s)
        return super()._open(path, mode, block_size=block_size, **kwargs)


def scripted_url(path: str | os.PathLike) -> str:
    return f"{PROTOCOL}://{os.path.abspath(path)}"


fsspec.register_implementation(PROTOCOL, ScriptedFileSystem, clobber=True)
