"""`shardckpt export CKPT OUT`: take a checkpoint out of our format, one tensor at a time.

The global tensors (any world size, FSDP shards included) are read from local disk or an object store
with every byte checked against the manifest (engine/load/global_tensors.py) and written straight to the
artifact (ops/export_formats.py), so peak memory is about the largest tensor (twice with a dtype cast)
plus one read buffer, not the model. Objects (param_groups, Lightning's loops and hyperparameters) are
not exported: the artifact is tensors only, for inference and other tools.

    export_checkpoint("s3://bucket/run-7", "model.safetensors", ExportOptions(model_only=True, prefix="model."))

The artifact is written under a temporary name and renamed into place when complete: a crash never
leaves a truncated file under OUT. OUT is never inside a checkpoint root, and an existing OUT is
replaced only when asked (ops/export_target.py). Shards are replaced as a whole: the new shards go
under names the old export does not use, the index last (the switch), and the old shards are removed
only after it: a failure before the index leaves the old export whole and loadable.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..engine.format.names import join
from ..engine.load.global_tensors import GlobalTensorReader, TensorSpec
from ..engine.root import open_reference
from ..engine.storage import fsio
from ..engine.validate import typed_options
from ..errors import ConfigError
from . import export_signing, export_target
from .choices import EXPORT_DTYPES, SAFETENSORS
from .choices import EXPORT_FORMATS as FORMATS
from .export_formats import (
    SAFETENSORS_INDEX,
    SAFETENSORS_SUFFIX,
    Planned,
    TorchZipWriter,
    safetensors_header,
    safetensors_index,
    shard_names,
    shard_plan,
    tensor_bytes,
)
from .progress import progress

log = logging.getLogger(__name__)

MODEL_PREFIX = "model."  # ShardedStrategy's model tensors (docs/FORMAT.md §6): what --model-only keeps
DTYPES = dict(zip(EXPORT_DTYPES, (torch.bfloat16, torch.float16, torch.float32), strict=True))
TEMP_SUFFIX = ".partial-{token}"  # OUT + this while being written


@dataclass(frozen=True, kw_only=True)
@typed_options()
class ExportOptions:
    """What to export and how. `max_shard_size` (bytes, safetensors only) turns OUT into a directory of shards."""

    format: str = SAFETENSORS  # torch | safetensors
    max_shard_size: int | None = None
    model_only: bool = False  # only `model.*` tensors (no optimizer state)
    dtype: str | None = None  # bf16 | fp16 | fp32: cast floating tensors; None keeps each tensor's dtype (bit-exact)
    prefix: str | None = None  # stripped from the start of every name that has it, e.g. "model."
    progress: bool | None = None  # a progress bar; None: only when stderr is a terminal
    storage_options: dict[str, Any] = field(default_factory=dict)  # for the checkpoint's storage and OUT's
    replace: bool = False  # replace an existing OUT (a sharded one as a whole); without it an existing OUT is refused
    # an ECDSA (P-256/384/521) private key PEM: sign OUT into OUT.sig, OpenSSF model-signing's bundle
    # (ops/export_signing.py); None: no signature, nothing more written
    sign_key_path: str | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"export format={self.format!r}; use one of {FORMATS}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(
                f"export dtype={self.dtype!r}; use one of {sorted(DTYPES)}, or none to keep the saved dtypes"
            )
        if self.max_shard_size is not None and (self.max_shard_size < 1 or self.format != SAFETENSORS):
            raise ConfigError(f"max_shard_size={self.max_shard_size} needs format=safetensors and a size >= 1 byte")


@dataclass
class ExportResult:
    checkpoint: str
    out: str
    format: str
    files: list[str]
    tensors: int
    bytes_written: int
    bytes_read: int
    seconds: float
    signature: str | None = None  # with sign_key_path: OUT.sig, the model-signing bundle over `files`

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_checkpoint(
    checkpoint: str, out: str, options: ExportOptions | None = None, *, which: str = "latest"
) -> ExportResult:
    """Export a committed checkpoint (a directory, or a root with `which`) to OUT; see the module doc."""
    options = options or ExportOptions()
    started = time.perf_counter()
    # `checkpoint` a root, a checkpoint directory or ROOT/latest, as every entry point reads it (engine/root.py)
    location, entry = open_reference(which, checkpoint, options.storage_options)
    target = fsio.resolve(out, options.storage_options)
    sharded = options.format == SAFETENSORS and options.max_shard_size is not None
    export_target.check_outside_checkpoint_roots(target, target.path if sharded else _parent(target.path))
    export_target.refuse_existing(target, sharded=sharded, replace=options.replace)
    if options.sign_key_path is not None:  # a key that cannot sign is refused before anything is written
        export_signing.check_export_key(options.sign_key_path)
        export_signing.refuse_remote(target, out)
        export_signing.refuse_existing_signature(target.path, options.replace)
    with GlobalTensorReader(location, entry) as reader:
        plan, sources = export_plan(reader.specs, options)
        if not plan:
            raise ConfigError(
                f"{entry.path} holds no tensor to export" + (" under model." if options.model_only else "")
            )
        with progress(sum(item.nbytes for item in plan), "export", wanted=options.progress) as bar:

            def read_one(planned: Planned) -> torch.Tensor:
                # returned straight into a write: no name keeps it alive while the next one is read
                tensor = reader.read(sources[planned.key])
                bar.update(planned.nbytes)
                return tensor if tensor.dtype == planned.dtype else tensor.to(planned.dtype)

            files = _write(target, plan, read_one, options)
        result = ExportResult(
            join(location.url, entry.name),
            out,
            options.format,
            files,
            len(plan),
            sum(target.fs.size(path) for path in files),
            reader.bytes_read,
            time.perf_counter() - started,
        )
    if options.sign_key_path is not None:  # after the rename into place: the bundle lists the files as they lie
        result.signature = export_signing.sign_export(target.path, options.sign_key_path)
        result.seconds = time.perf_counter() - started
    log.info(
        "exported %s to %s: %d tensors, %d bytes in %.2fs",
        result.checkpoint,
        out,
        result.tensors,
        result.bytes_written,
        result.seconds,
    )
    return result


def export_plan(specs: dict[str, TensorSpec], options: ExportOptions) -> tuple[list[Planned], dict[str, str]]:
    """Output name, shape and dtype of every exported tensor (sorted by name), and each one's source fqn."""
    cast = DTYPES.get(options.dtype) if options.dtype else None
    plan: list[Planned] = []
    sources: dict[str, str] = {}
    for fqn, spec in specs.items():
        if options.model_only and not fqn.startswith(MODEL_PREFIX):
            continue
        key = fqn[len(options.prefix) :] if options.prefix and fqn.startswith(options.prefix) else fqn
        if key in sources:
            raise ConfigError(
                f"--prefix {options.prefix!r} maps {sources[key]!r} and {fqn!r} to one name {key!r}; "
                "export with --model-only or another prefix"
            )
        dtype = cast if cast is not None and spec.dtype.is_floating_point else spec.dtype
        plan.append(Planned(key, spec.shape, dtype))
        sources[key] = fqn
    plan.sort(key=lambda planned: planned.key)
    return plan, sources


def _write(target: fsio.Location, plan: list[Planned], read_one: Any, options: ExportOptions) -> list[str]:
    """Write the artifact(s) under temporary names, then move each into place; returns the final paths."""
    if options.format != SAFETENSORS:
        return [_write_file(target.fs, target.path, lambda handle: _torch_body(handle, plan, read_one))]
    shards = shard_plan(plan, options.max_shard_size)
    if options.max_shard_size is None:
        return [_write_file(target.fs, target.path, lambda handle: _safetensors_body(handle, plan, read_one))]
    return _write_shards(target, shards, read_one)


def _write_shards(target: fsio.Location, shards: list[list[Planned]], read_one: Any) -> list[str]:
    """Shards, then the index that makes them the export, then the previous export's shards removed.

    Until the index is in place OUT is the previous export, whole: new shards never take a name a file in
    OUT has, and a failure removes the new shards written so far.
    """
    fsio.makedirs(target.fs, target.path)
    old = export_target.previous_shards(target)
    names = shard_names(len(shards))
    if set(names) & export_target.present_names(target):  # Hugging Face readers go by the index's names
        token = secrets.token_hex(4)
        names = [name.removesuffix(SAFETENSORS_SUFFIX) + f"-{token}{SAFETENSORS_SUFFIX}" for name in names]
    paths: list[str] = []
    try:
        for part, name in zip(shards, names):
            paths.append(
                _write_file(
                    target.fs,
                    join(target.path, name),
                    lambda handle, part=part: _safetensors_body(handle, part, read_one),
                )
            )
        index = safetensors_index(shards, names)
        index_path = _write_file(target.fs, join(target.path, SAFETENSORS_INDEX), lambda handle: handle.write(index))
    except BaseException:
        for path in paths:  # not part of any export: the previous index does not name them
            target.fs.rm_file(path)
        raise
    for name in sorted(old - set(names)):  # the new index is in place: the old shards are no export's now
        try:
            target.fs.rm_file(join(target.path, name))
        except FileNotFoundError:
            pass
    return [*paths, index_path]


def _parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else ""


def _torch_body(handle: Any, plan: list[Planned], read_one: Any) -> None:
    writer = TorchZipWriter(handle, plan)
    try:
        for planned in plan:
            writer.write(planned.key, read_one(planned))
        writer.finish()
    finally:
        writer.discard()


def _safetensors_body(handle: Any, part: list[Planned], read_one: Any) -> None:
    handle.write(safetensors_header(part))
    for planned in part:
        handle.write(tensor_bytes(read_one(planned)))


def _write_file(fs: Any, path: str, body: Any) -> str:
    parent = _parent(path)
    if parent:
        fsio.makedirs(fs, parent)
    temporary = path + TEMP_SUFFIX.format(token=secrets.token_hex(4))
    try:
        with fs.open(temporary, "wb") as handle:
            body(handle)
        fs.mv(temporary, path)  # in place only when complete
    except BaseException:
        if fs.exists(temporary):
            fs.rm_file(temporary)
        raise
    return path
