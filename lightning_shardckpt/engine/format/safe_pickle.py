"""Unpickling what a checkpoint holds without running code from it.

A pickle names the globals it calls (`os.system`, any class's `__reduce__` target); an unpickler that
looks each name up freely runs whatever the file's author chose. Checkpoints come from storage that
others can write to, so every pickle we read goes through an allow-list here:

- `.metadata` (DCP's Metadata): DCP's metadata dataclasses, `_StorageInfo`, torch sizes, dtypes and
  layouts, and builtin containers. Its bytes are checked against the manifest's checksum first (v2),
  and every `_StorageInfo.relative_path` must name a file inside the checkpoint directory.
- the objects a checkpoint stores (and the Lightning blob): what torch's `weights_only` loader allows
  (tensors, containers, dtypes, plus `torch.serialization.add_safe_globals`), plus `extra_allowed`.

What the allowed calls of one pickle allocate or copy, together (a constructor asked for a size, a string
encoded, an object built from a state), is bounded by a small multiple of the pickle's size
(pickle_allowance.py): a real pickle carries its data, so more is a crafted one (`OversizedAllocation`),
refused before allocating. A `torch.save` record (an object, a tensor chunk) is read the same way, bounded by
the record's size, after a check that none of its zip entries unpacks to more than the record holds.

A blocked name raises `BlockedGlobal` naming `module.qualname`; callers turn it into an error that
names the checkpoint and the fix. `trust=True` (the user's explicit opt-in) unpickles without limits.
"""

from __future__ import annotations

import _compat_pickle
import io
import logging
import os
import pickle
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ...errors import CorruptCheckpoint, UntrustedCheckpoint
from ..storage.backends import backend_for
from .checksum import checksum
from .manifest_schema import is_reference, reference_problem
from .names import DCP_METADATA_FIELD as DCP_METADATA_FIELD
from .pickle_allowance import (
    QTENSOR,
    Allowance,
    BlockedGlobal,
    OversizedAllocation,
    charge_storages,
    guard_call,
    guard_class,
    is_sized_constructor,
)

__all__ = ["BlockedGlobal", "OversizedAllocation"]  # raised from here; defined beside the allowance

log = logging.getLogger(__name__)

# What DCP's `.metadata` of our checkpoints names (found by recording find_class on DDP and FSDP2 saves
# with optimizer states, bytes objects and RNG tensors), and the aliases older DCP versions pickled.
DCP_METADATA_GLOBALS = frozenset(
    {
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
        "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING",
        "torch.distributed._shard.metadata.ShardMetadata",
        "torch.Size",
        "torch.serialization._get_layout",
        "collections.OrderedDict",
        "builtins.set",
        "builtins.frozenset",
        "builtins.bytearray",
        "builtins.complex",
        "builtins.slice",
        "_codecs.encode",  # how protocol 2 pickles bytes
    }
)


# Plain `pickle.dumps` of a tensor stores its storage through `torch.storage._load_from_bytes`, which
# calls `torch.load(weights_only=False)`; this stand-in loads the same bytes with weights_only=True.
_STORAGE_FROM_BYTES = "torch.storage._load_from_bytes"


def _storage_from_bytes(data: bytes) -> Any:
    return load_torch_record(data)


_OWN_SIZE = -1  # RestrictedUnpickler's default size: the length of the BytesIO it reads


def _guarded(key: str, found: Any, allowance: Allowance, *, values_possible: bool) -> Any:
    """What `find_class` hands the unpickler for `key`: its calls and BUILDs charged to the pickle's allowance.

    `values_possible`: the pickle may hold an allowed builtin type as a value (a `defaultdict(set)` of the user's),
    so those types are handed out as themselves (a stand-in would be saved in their place next time); DCP's
    `.metadata` never does, so there every allowed call is charged."""
    if is_sized_constructor(key) or key == QTENSOR:
        return guard_call(key, found, allowance, copies=True)
    if isinstance(found, type):
        guarded = guard_class(key, found, allowance)
        if guarded is not found:
            return guarded
        if values_possible and key != "torch.Size":
            return found
    if not callable(found):
        return found
    return guard_call(key, found, allowance, copies=True)


class RestrictedUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` whose `find_class` resolves only allowed `module.qualname` names.

    `size` (bytes; by default the pickle's own length when the file is a BytesIO): what every allowed call of the
    pickle may allocate or copy, together, is bounded by a multiple of it (engine/format/pickle_allowance.py), so
    a 30-byte pickle cannot zero-fill gigabytes, nor a 49 KB one call `bytearray(49 KB)` thousands of times,
    before it is refused (`OversizedAllocation`). None lifts the bound.
    """

    def __init__(
        self,
        file: Any,
        allowed: frozenset[str] | set[str],
        *,
        torch_safe: bool = False,
        size: int | None = _OWN_SIZE,
        **kwargs: Any,
    ) -> None:
        super().__init__(file, **kwargs)
        self._allowed = allowed
        self._torch_safe = torch_safe
        if size == _OWN_SIZE:
            if not isinstance(file, io.BytesIO):
                raise ValueError("size: pass the pickle's size in bytes (or None) when the file is not a BytesIO")
            size = len(file.getbuffer())
        self._allowance = Allowance(size)

    def load(self) -> Any:
        found = getattr(self, "persistent_load", None)  # torch.load sets it between construction and load
        if found is not None:
            # pickle's documented per-instance hook, which typeshed declares as a method
            self.persistent_load = charge_storages(found, self._allowance)  # type: ignore[method-assign]
        try:
            return super().load()
        finally:
            self._allowance.restore_classes()

    def find_class(self, module: str, name: str) -> Any:
        # protocol 2 (torch.save's) names builtins as Python 2 did: `__builtin__.bytearray` is builtins.bytearray
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        key = f"{module}.{name}"
        if self._torch_safe and key == _STORAGE_FROM_BYTES:
            return guard_call(key, _storage_from_bytes, self._allowance, copies=True)
        if key in self._allowed or _is_torch_constant(module, name):
            found = super().find_class(module, name)
        elif self._torch_safe and (found := torch_safe_globals().get(key)) is not None:
            pass
        else:
            raise BlockedGlobal(key)
        return _guarded(key, found, self._allowance, values_possible=self._torch_safe)


# Classes the rest of a Lightning checkpoint (lightning/lightning_state.py) holds in normal use, named as
# strings so the engine imports no Lightning (restore drills in ops/ check the same blob), on top of what torch's weights_only
# loader allows (safe_pickle.torch_safe_globals): hyperparameters are an AttributeDict, and a model built
# by Hydra's `instantiate` keeps OmegaConf containers in them (recipes/train.py: `betas` is a ListConfig),
# whose metadata names builtin types. Each is data: unpickling it sets fields and calls nothing else.
LIGHTNING_STATE_GLOBALS = frozenset(
    {
        "lightning.fabric.utilities.data.AttributeDict",
        "lightning.pytorch.utilities.parsing.AttributeDict",
        "lightning_fabric.utilities.data.AttributeDict",
        "pytorch_lightning.utilities.parsing.AttributeDict",
        "omegaconf.dictconfig.DictConfig",
        "omegaconf.listconfig.ListConfig",
        "omegaconf.base.ContainerMetadata",
        "omegaconf.base.Metadata",
        "omegaconf.nodes.AnyNode",
        "omegaconf.nodes.StringNode",
        "omegaconf.nodes.IntegerNode",
        "omegaconf.nodes.FloatNode",
        "omegaconf.nodes.BooleanNode",
        "omegaconf.nodes.BytesNode",
        "omegaconf.nodes.PathNode",
        "typing.Any",
        "collections.defaultdict",
        "builtins.dict",
        "builtins.list",
        "builtins.tuple",
        "builtins.int",
        "builtins.float",
        "builtins.str",
        "builtins.bool",
        "builtins.bytes",
        "builtins.object",
        "builtins.frozenset",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "pathlib.PurePosixPath",
        "pathlib.PureWindowsPath",
    }
)


def _is_torch_constant(module: str, name: str) -> bool:
    """torch.float32, torch.strided, torch.contiguous_format: values, never callables that run code."""
    if module != "torch" or "." in name:
        return False
    value = getattr(torch, name, None)
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


def torch_safe_globals() -> dict[str, Any]:
    """What `torch.load(weights_only=True)` allows now, by `module.qualname`: its defaults plus the user's
    `torch.serialization.add_safe_globals` entries."""
    allowed: dict[str, Any] = {}
    try:
        from torch import _weights_only_unpickler as weights_only

        allowed.update(weights_only._get_allowed_globals())
    except (ImportError, AttributeError):  # another torch: the public list below still applies
        log.debug("torch._weights_only_unpickler has no _get_allowed_globals", exc_info=True)
    for entry in torch.serialization.get_safe_globals():
        value, name = entry if isinstance(entry, tuple) else (entry, None)
        allowed[name or f"{value.__module__}.{value.__qualname__}"] = value
    return allowed


def loads(data: bytes, allowed: Iterable[str] = (), *, trust: bool = False) -> Any:
    """Unpickle `data` allowing torch's weights_only globals plus `allowed`; raises BlockedGlobal."""
    if trust:
        return pickle.loads(data)
    return RestrictedUnpickler(io.BytesIO(data), frozenset(allowed), torch_safe=True).load()


ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip format (FORMAT.md §3)


def load_torch_record(data: bytes | memoryview, allowed: Iterable[str] = ()) -> Any:
    """What a `torch.save` record holds, unpickled through torch's weights_only globals plus `allowed`, with every
    allocation bounded by the record's size: no zip entry may unpack to more than the record holds (a deflated
    bomb), and the pickle's calls share one allowance of a multiple of the record's size. Raises BlockedGlobal
    (OversizedAllocation for a crafted size) or the reader's error for a record that is not one."""
    data = bytes(data)
    if data[:4] == ZIP_MAGIC:  # else torch's legacy format: pickles and raw storages, charged as they load
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        unpacked = sum(reader.get_record_size(name) for name in reader.get_all_records())
        if unpacked > len(data):
            raise OversizedAllocation("a torch.save record's zip entries", unpacked, len(data), 0, len(data))
    names = frozenset(allowed)
    size = len(data)

    class RecordUnpickler(RestrictedUnpickler):
        def __init__(self, file: Any, **kwargs: Any) -> None:
            super().__init__(file, names, torch_safe=True, size=size, **kwargs)

    # weights_only=False hands the unpickling to RecordUnpickler, which allows what weights_only would (and
    # `allowed`), and bounds it; torch's own weights_only unpickler bounds nothing
    module = type(pickle)("lightning_shardckpt_bounded_pickle")
    module.Unpickler = RecordUnpickler  # type: ignore[attr-defined]
    module.load = lambda file, **kwargs: RecordUnpickler(file, **kwargs).load()  # type: ignore[attr-defined]
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False, pickle_module=module)


def load_object_record(data: bytes | memoryview, fqn: str, where: str, *, trust: bool = False) -> None:
    """Check that an object record (`torch.save(obj)`, as DCP writes objects) names only safe globals and
    allocates within its size.

    DCP's planner then loads the same bytes with `weights_only=False`; after this check that runs nothing
    torch's weights_only loader would not, and allocates what this check allowed. Raises UntrustedCheckpoint
    naming the class (or the oversized call).
    """
    if trust:
        return
    try:
        load_torch_record(data)
    except OversizedAllocation as err:
        raise UntrustedCheckpoint(
            f"{where}: object {fqn!r}: {err.args[0]}. A real object's record carries its data, so this one is "
            "damaged or crafted; it was refused before allocating. Load an older checkpoint, or (only if you trust "
            "where it came from) load it with trust_checkpoint=True",
            blocked=err.name,
        ) from err
    except pickle.UnpicklingError as err:
        raise untrusted(where, f"object {fqn!r}", _blocked_name(err)) from err
    except (RuntimeError, ValueError, EOFError) as err:  # its checksum matched, yet it is not a torch.save record
        raise CorruptCheckpoint(
            f"{where}: object {fqn!r} is not a torch.save record ({type(err).__name__}: {str(err)[:200]}); the "
            "checkpoint was written by something else or crafted. Load an older checkpoint"
        ) from err


def untrusted(where: str, what: str, blocked: str) -> UntrustedCheckpoint:
    return UntrustedCheckpoint(
        f"{where}: {what} names {blocked}, which is not on the allow-list of what a checkpoint may hold; "
        f"unpickling it could run code from the checkpoint. If you trust where this checkpoint came from, "
        f"load it with trust_checkpoint=True; or allow just this class: "
        f"torch.serialization.add_safe_globals([{blocked}])",
        blocked=blocked,
    )


def _blocked_name(err: BaseException) -> str:
    """The global torch's weights_only loader refused, from its message ("GLOBAL a.b.C was not ...")."""
    if isinstance(err, BlockedGlobal):
        return err.name
    text = str(err)
    marker = "GLOBAL "
    if marker in text:
        return text.split(marker, 1)[1].split()[0]
    return text.splitlines()[0] if text else type(err).__name__


def load_dcp_metadata(
    data: bytes, where: str, *, expected: dict[str, Any] | None = None, trust: bool = False
) -> Metadata:
    """DCP's `.metadata` from its bytes, checked before and after unpickling.

    `expected` is the manifest's `dcp_metadata` record (v2: `checksum`, `bytes`); None (a v1 manifest)
    skips the byte check. Raises CorruptCheckpoint naming the problem: other bytes than committed, a
    global DCP metadata never holds, not a Metadata, or a storage path outside the directory.
    """
    if expected is not None:
        check_metadata_bytes(data, where, expected)
    try:
        if trust:
            metadata = pickle.loads(data)
        else:
            metadata = RestrictedUnpickler(io.BytesIO(data), DCP_METADATA_GLOBALS).load()
    except OversizedAllocation as err:
        raise CorruptCheckpoint(
            f"{where}: .metadata calls {err.args[0]}; DCP metadata never allocates by a size nor copies much, so the "
            "file is damaged or was crafted and was refused before allocating. Do not load it: load an older "
            "checkpoint or restore this one from a replica",
            problems=[{"file": ".metadata", "tensor": None, "expected": "DCP metadata classes", "actual": err.name}],
        ) from err
    except BlockedGlobal as err:
        raise CorruptCheckpoint(
            f"{where}: .metadata names {err.name}, which DCP metadata never holds; refusing to unpickle it "
            "(it could run code). The checkpoint is damaged or was crafted: do not load it. If you wrote it "
            "yourself with another DCP version, load it with trust_checkpoint=True",
            problems=[{"file": ".metadata", "tensor": None, "expected": "DCP metadata classes", "actual": err.name}],
        ) from err
    except Exception as err:  # truncated or garbled: not a pickle at all
        raise CorruptCheckpoint(
            f"{where}: .metadata does not unpickle ({type(err).__name__}: {err}); the checkpoint is damaged"
        ) from err
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise CorruptCheckpoint(
            f"{where}: .metadata holds a {type(metadata).__name__}, not DCP Metadata; the checkpoint is damaged"
        )
    for index, info in metadata.storage_data.items():
        path = getattr(info, "relative_path", None)
        # incremental checkpoints: a chunk in a sibling checkpoint's file (FORMAT.md §9)
        problem = reference_problem(path) if is_reference(path) else relative_path_problem(path)
        if problem:
            raise CorruptCheckpoint(
                f"{where}: .metadata places {getattr(index, 'fqn', index)!r} at {problem}; a checkpoint reads only "
                "its own files, so this one is corrupt (or crafted) and is not read",
                problems=[
                    {
                        "file": ".metadata",
                        "tensor": getattr(index, "fqn", None),
                        "expected": "a file in the directory",
                        "actual": getattr(info, "relative_path", None),
                    }
                ],
            )
    return metadata


def relative_path_problem(path: Any) -> str | None:
    """None for a file name inside a checkpoint directory; else what is wrong with `path`.

    Relative, `/`-separated, no `..` or `.` or empty part, no backslash, no drive or URL scheme.
    """
    if not isinstance(path, str) or not path:
        return f"path {path!r}, not a file name"
    parts = path.split("/")
    if (
        path.startswith("/")
        or "\\" in path
        or "\x00" in path
        or ":" in parts[0]
        or any(part in ("", ".", "..") for part in parts)
    ):
        return f"path {path!r}, outside the checkpoint directory"
    return None


def check_inside(fs: Any, directory: str, relative: str) -> None:
    """Raise CorruptCheckpoint unless `relative` names a file inside `directory`.

    Beyond the name rules, on local storage a symlink must not lead out of the directory: a crafted
    checkpoint could otherwise make a load read `/etc/passwd` as a shard.
    """
    if is_reference(relative):  # the one exception: a file of a sibling checkpoint of the same root
        problem = reference_problem(relative)
        base_dir = directory.rstrip("/").rsplit("/", 1)[0]  # the root: confined to it, one sibling deep
    else:
        problem = relative_path_problem(relative)
        base_dir = directory
    if problem is None and backend_for(fs).is_local:
        base = os.path.realpath(base_dir)
        target = os.path.realpath(os.path.join(directory, relative))
        if os.path.commonpath([base, target]) != base:
            problem = f"path {relative!r}, which resolves to {target}, outside the checkpoint directory"
    if problem:
        raise CorruptCheckpoint(
            f"{directory}: the checkpoint names {problem}; a checkpoint reads only its own files, so it is corrupt "
            "(or crafted) and is not read",
            problems=[{"file": relative, "tensor": None, "expected": "a file in the directory", "actual": relative}],
        )


def check_metadata_bytes(data: bytes, where: str, expected: Any) -> None:
    """Raise CorruptCheckpoint unless `data` is the `.metadata` the manifest's `dcp_metadata` recorded."""
    if not isinstance(expected, dict) or not isinstance(expected.get("checksum"), str):
        raise CorruptCheckpoint(
            f"{where}: the manifest's {DCP_METADATA_FIELD} is {expected!r}, not {{checksum, bytes}}; the manifest is damaged"
        )
    actual = checksum(data)
    if actual != expected.get("checksum") or len(data) != expected.get("bytes", len(data)):
        raise CorruptCheckpoint(
            f"{where}: .metadata has checksum {actual} ({len(data)} bytes), the manifest recorded "
            f"{expected.get('checksum')} ({expected.get('bytes')} bytes); it was altered after commit and is "
            "not unpickled. Restore it from a replica or load an older checkpoint",
            problems=[{"file": ".metadata", "tensor": None, "expected": expected.get("checksum"), "actual": actual}],
        )
