"""Files sent between ranks over a gloo group, in bounded pieces, checked against the manifest as they arrive.

No shared filesystem and no new transport: the bytes travel as uint8 tensors over the checkpoint's own gloo
group (point-to-point). Both sides know every file's size from the manifest, so both cut the same pieces
and a failure on either side never desynchronises the stream: a sender that cannot read sends zeros (the
receiver's checksums then fail), a receiver that finds a bad range keeps draining the stream but writes
nothing. A received file appears under its name only once every range matched (written as `.part`, then
renamed): present means verified.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .verified_copy import PIECE_BYTES, Range, RangeCheck

log = logging.getLogger(__name__)

PART_SUFFIX = ".part"


@dataclass(frozen=True)
class Outgoing:
    """One file this rank sends: its path in this rank's view and its size."""

    fs: Any
    path: str
    size: int


@dataclass(frozen=True)
class Incoming:
    """One file this rank receives: where it lands, and the manifest's ranges it must match (None: unchecked,
    for the commit record and the manifest, which the catalog checks against each other when it reads them)."""

    fs: Any
    path: str
    size: int
    ranges: list[Range] | None


@dataclass
class Received:
    files: list[str] = field(default_factory=list)  # paths written (verified)
    bytes: int = 0
    problems: list[str] = field(default_factory=list)


def _pieces(size: int, piece_bytes: int) -> list[int]:
    return [min(piece_bytes, size - start) for start in range(0, size, piece_bytes)]


def exchange(
    outgoing: list[Outgoing],
    dst: int | None,
    incoming: list[Incoming],
    src: int | None,
    group: Any,
    piece_bytes: int = PIECE_BYTES,
) -> Received:
    """Send `outgoing` to rank `dst` while receiving `incoming` from rank `src` (either list may be empty).

    Every rank of a ring can call it at once (each sends to the next, receives from the previous): the send of
    a piece is asynchronous, so no rank waits on a peer that is itself waiting to send. Memory: two pieces.
    """
    import torch
    import torch.distributed as dist

    out_plan = [(index, length) for index, item in enumerate(outgoing) for length in _pieces(item.size, piece_bytes)]
    in_plan = [(index, length) for index, item in enumerate(incoming) for length in _pieces(item.size, piece_bytes)]
    received = Received()
    reader = _Reader(outgoing)
    writer = _Writer(incoming, received)
    for step in range(max(len(out_plan), len(in_plan))):
        work = None
        if step < len(out_plan):
            index, length = out_plan[step]
            piece = reader.read(index, length)
            work = dist.isend(torch.frombuffer(bytearray(piece), dtype=torch.uint8), dst, group=group)
        if step < len(in_plan):
            index, length = in_plan[step]
            buffer = torch.empty(length, dtype=torch.uint8)
            dist.recv(buffer, src, group=group)
            writer.write(index, buffer.numpy().data)  # ndarray.data: its memoryview (numpy types no Buffer for 3.10)
        if work is not None:
            work.wait()
    reader.close()
    writer.close_all()
    if reader.problems:
        received.problems.extend(reader.problems)
    return received


class _Reader:
    """Sequential reads of the outgoing files; a file that cannot be read yields zeros (and a problem)."""

    def __init__(self, files: list[Outgoing]) -> None:
        self.files = files
        self.problems: list[str] = []
        self._open: tuple[int, Any] | None = None

    def read(self, index: int, length: int) -> bytes:
        if self._open is None or self._open[0] != index:
            self.close()
            item = self.files[index]
            try:
                self._open = (index, item.fs.open(item.path, "rb"))
            except Exception as err:  # noqa: BLE001 - the receiver's checksums fail; the stream stays in step
                self.problems.append(f"cannot read {item.path}: {err}")
                self._open = (index, None)
        handle = self._open[1]
        data = b""
        if handle is not None:
            try:
                data = handle.read(length)
            except Exception as err:  # noqa: BLE001
                self.problems.append(f"cannot read {self.files[index].path}: {err}")
        return data + bytes(length - len(data))

    def close(self) -> None:
        if self._open is not None and self._open[1] is not None:
            self._open[1].close()
        self._open = None


class _Writer:
    """Each incoming file written as `.part`, checked range by range, renamed to its name when whole and good."""

    def __init__(self, files: list[Incoming], received: Received) -> None:
        self.files, self.received = files, received
        self._current: tuple[int, Any, RangeCheck | None] | None = None
        self._failed: set[int] = set()
        self._done: set[int] = set()

    def write(self, index: int, piece: memoryview) -> None:
        if self._current is None or self._current[0] != index:
            self._finish()
            item = self.files[index]
            try:
                item.fs.makedirs(item.path.rsplit("/", 1)[0], exist_ok=True)
                handle = item.fs.open(item.path + PART_SUFFIX, "wb")
            except Exception as err:  # noqa: BLE001 - drained, nothing written
                self._fail(index, f"cannot write {item.path}: {err}")
                handle = None
            try:  # a v4 shard's ranges come from its part, which landed just before it: looked up now
                ranges = item.ranges() if callable(item.ranges) else item.ranges
            except Exception as err:  # noqa: BLE001 - unverifiable: drained, nothing kept
                self._fail(index, f"cannot check {item.path}: {err}")
                ranges = None
            check = RangeCheck(item.path, ranges, item.size) if ranges is not None else None
            self._current = (index, handle, check)
        _, handle, check = self._current
        if index in self._failed:
            return
        try:
            if check is not None:
                check.feed(piece)
            handle.write(piece)
        except Exception as err:  # noqa: BLE001 - a damaged range: keep draining, write nothing more
            self._fail(index, str(err))

    def _fail(self, index: int, problem: str) -> None:
        self._failed.add(index)
        self.received.problems.append(problem)

    def _finish(self) -> None:
        if self._current is None:
            return
        index, handle, check = self._current
        self._current = None
        item = self.files[index]
        if handle is not None:
            handle.close()
        try:
            if index in self._failed:
                if item.fs.exists(item.path + PART_SUFFIX):
                    item.fs.rm(item.path + PART_SUFFIX)
                return
            if check is not None:
                check.finish()
            item.fs.mv(item.path + PART_SUFFIX, item.path)
            self._done.add(index)
            self.received.files.append(item.path)
            self.received.bytes += item.size
        except Exception as err:  # noqa: BLE001
            self._fail(index, str(err))

    def close_all(self) -> None:
        self._finish()
        for index, item in enumerate(self.files):  # zero-byte files have no pieces
            if item.size == 0 and index not in self._done and index not in self._failed:
                try:
                    item.fs.makedirs(item.path.rsplit("/", 1)[0], exist_ok=True)
                    item.fs.pipe_file(item.path, b"")
                    self.received.files.append(item.path)
                except Exception as err:  # noqa: BLE001
                    self._fail(index, str(err))
