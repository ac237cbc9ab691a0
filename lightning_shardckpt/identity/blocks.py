"""What a checkpoint came from: the config, data, model, code and run blocks of the manifest's `identity`.

Each function returns a JSON-serialisable dict (or None when there is nothing to record); all are cheap
enough to call at every fit start. `identity_diff.compare` compares a saved identity with the current one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import platform
import shlex
import subprocess
import sys
from typing import Any

import fsspec
import torch

from ..engine.collectives import rank_and_world
from ..engine.format.checksum import checksum
from ..engine.format.manifest import package_version
from ..errors import ConfigError

log = logging.getLogger(__name__)

DATA_SAMPLES = 16  # items (or files, half as many) read to fingerprint a dataset
MAX_LISTED_FILES = 256  # beyond this, the data block lists sampled files only (the names digest covers all)
SAMPLED_BYTES = 4096  # bytes read from the head and from the tail of each sampled file
GIT_TIMEOUT_S = 2.0  # a slow filesystem leaves the commit unknown rather than delaying the fit


def config_identity(config: Any, *, hyperparameters: Any = None) -> dict[str, Any] | None:
    """Resolved YAML (sorted keys) and a digest of the canonical JSON form of a DictConfig or dict."""
    if config is None and hyperparameters is None:
        return None
    plain = _jsonable(_config_container(config)) if config is not None else None
    return {
        "yaml": _to_yaml(plain),
        "digest": _digest(plain),
        "hyperparameters": _jsonable(_config_container(hyperparameters)) if hyperparameters is not None else None,
    }


def data_identity(
    dataset: Any = None,
    *,
    dataset_version: str | None = None,
    seed: int | None = None,
    epoch: int | None = None,
    samples_consumed: int | None = None,
    files: list[str | os.PathLike] | None = None,
) -> dict[str, Any]:
    """The dataset's declared version, or a cheap fingerprint of it, plus the order seed and position.

    Files (given, or a `files` / `paths` attribute of the dataset) are identified by their names, sizes
    and sampled head/tail bytes; a sized dataset by its length and up to 16 evenly spaced items.
    """
    if files is None and dataset is not None:
        found = getattr(dataset, "files", None)
        found = getattr(dataset, "paths", None) if found is None else found
        files = list(found) if isinstance(found, (list, tuple)) else None
    length = _length(dataset)
    block: dict[str, Any] = {
        "kind": "unknown",
        "class": _qualname(type(dataset)) if dataset is not None else None,
        "version": None if dataset_version is None else str(dataset_version),
        "fingerprint": None,
        "length": length,
        "file_count": None,
        "files": None,
        "seed": seed,
        "epoch": epoch,
        "samples_consumed": samples_consumed,
    }
    if dataset_version is not None:
        # declared wins: the owner of the data knows better than a sample of 16 items
        block.update(kind="declared", fingerprint=_digest({"version": str(dataset_version)}))
    elif files is not None:
        block.update(kind="files", **_files_fingerprint([os.fspath(f) for f in files]))
    elif length is not None:
        block.update(kind="items", fingerprint=_items_fingerprint(dataset, length))
    return block


def model_identity(module: torch.nn.Module) -> dict[str, Any]:
    """Class, global parameter count and a digest of (name, global shape, dtype) of its saved tensors.

    The same model gives the same block unsharded, under DDP or under FSDP2 on any number of ranks.
    """
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        module = module.module  # names without the wrapper's "module." prefix
    tensors: dict[str, list[Any]] = {}
    parameters = trainable = 0
    for name, param in module.named_parameters():
        shape = list(param.shape)  # a DTensor's shape is the global one: identical for 1 or 64 ranks
        tensors[name] = [shape, _dtype(param.dtype)]
        parameters += math.prod(shape)
        trainable += math.prod(shape) if param.requires_grad else 0
    for name, buffer in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf in module.get_submodule(owner)._non_persistent_buffers_set:
            continue  # not in the state dict, so not in the checkpoint
        tensors[name] = [list(buffer.shape), _dtype(buffer.dtype)]
    ordered = sorted(tensors.items())
    return {
        "class": _qualname(_model_class(module)),
        "parameters": parameters,
        "trainable_parameters": trainable,
        "digest": _digest([[name, *spec] for name, spec in ordered]),
        "tensors": dict(ordered),
    }


def code_identity(path: str | os.PathLike = ".") -> dict[str, Any]:
    """Git commit and dirty flag of `path` (None outside a repository), and package versions."""
    commit = _git(path, "rev-parse", "HEAD")
    status = _git(path, "status", "--porcelain", "--untracked-files=no") if commit is not None else None
    return {
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": _distribution_version("lightning") or _distribution_version("pytorch_lightning"),
            "lightning_shardckpt": package_version(),
        },
    }


def run_identity(
    *,
    world_size: int | None = None,
    device_type: str | None = None,
    mesh_shape: list[int] | None = None,
    num_hosts: int | None = None,
    argv: list[str] | None = None,
    wandb_run_id: str | None = None,
    wandb_url: str | None = None,
) -> dict[str, Any]:
    """Where and how this run was launched; defaults come from the process group and the environment."""
    world_size = rank_and_world()[1] if world_size is None else world_size
    argv = list(sys.argv if argv is None else argv)
    return {
        "world_size": world_size,
        "device_type": device_type or ("cuda" if torch.cuda.is_available() else "cpu"),
        "mesh_shape": None if mesh_shape is None else list(mesh_shape),
        "num_hosts": num_hosts if num_hosts is not None else _host_count(world_size),
        "argv": argv,
        "command": shlex.join(argv),
        "wandb": None if wandb_run_id is None and wandb_url is None else {"run_id": wandb_run_id, "url": wandb_url},
    }


# --- helpers ---
def _digest(value: Any) -> str:
    # canonical form: sorted keys, no whitespace; the same value gives the same digest in any process
    return checksum(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


def _config_container(config: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(config, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(config, resolve=True, enum_to_str=True)
        except OmegaConfBaseException as err:
            raise ConfigError(
                f"the config cannot be resolved for the checkpoint's identity: {err}; fix the interpolation"
            ) from err
    return dict(config) if hasattr(config, "keys") and not isinstance(config, dict) else config


def _to_yaml(plain: Any) -> str:
    if plain is None:
        return ""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_yaml(OmegaConf.create(plain), sort_keys=True)
    except (OmegaConfBaseException, ValueError):  # not a mapping or list (a bare value): JSON reads as well
        return json.dumps(plain, indent=2, sort_keys=True) + "\n"


def _jsonable(value: Any) -> Any:
    """`value` with every container made plain and every leaf JSON can't hold stringified."""
    if type(value).__module__.startswith("omegaconf"):  # a DictConfig inside Lightning's hparams
        value = _config_container(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # NaN / inf are not JSON
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:  # an IterableDataset without __len__
        return None


def _items_fingerprint(dataset: Any, length: int) -> str:
    count = min(DATA_SAMPLES, length)
    picks = sorted({i * length // count for i in range(count)}) if count else []  # evenly spaced, no RNG needed
    digests = []
    for index in picks:
        try:
            digests.append(checksum(_item_bytes(dataset[index])))
        except Exception as err:  # identity is a record, not a gate: a dataset that cannot be indexed still trains
            log.warning(
                "data identity: item %d of %s could not be read (%s); fingerprinting by length only",
                index,
                _qualname(type(dataset)),
                err,
            )
            return _digest({"length": length})
    return _digest({"length": length, "items": digests})


def _item_bytes(item: Any) -> bytes:
    if isinstance(item, torch.Tensor):
        tensor = item.detach().cpu().contiguous()
        return f"{tensor.dtype}{list(tensor.shape)}".encode() + tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    if type(item).__module__ == "numpy" and hasattr(item, "tobytes"):
        return f"{item.dtype}{list(getattr(item, 'shape', []))}".encode() + item.tobytes()
    if isinstance(item, dict):
        return (
            b"{"
            + b",".join(
                _item_bytes(k) + b":" + _item_bytes(v) for k, v in sorted(item.items(), key=lambda kv: repr(kv[0]))
            )
            + b"}"
        )
    if isinstance(item, (list, tuple)):
        return b"[" + b",".join(_item_bytes(v) for v in item) + b"]"
    if isinstance(item, (set, frozenset)):  # pickled set order depends on the process's hash seed
        return b"{" + b",".join(sorted(_item_bytes(v) for v in item)) + b"}"
    if item is None or isinstance(item, (str, bytes, int, float, bool)):
        return repr(item).encode()
    return pickle.dumps(item, protocol=4)


def _files_fingerprint(paths: list[str]) -> dict[str, Any]:
    paths = sorted(paths)
    count = min(DATA_SAMPLES // 2, len(paths))
    sampled = sorted({i * len(paths) // count for i in range(count)}) if count else []
    listed = range(len(paths)) if len(paths) <= MAX_LISTED_FILES else sampled
    entries, samples = [], []
    for i in listed:
        fs, path = fsspec.core.url_to_fs(paths[i])
        try:
            size = fs.size(path)
        except OSError:  # missing now: recorded as such, and the fingerprint changes
            size = None
        entries.append({"path": paths[i], "bytes": size})
        if i in sampled:
            samples.append(_sample_file(fs, path, size))
    # names relative to the common directory: the same files mounted elsewhere are the same data
    prefix = os.path.commonprefix(paths)
    prefix = prefix[: prefix.rfind("/") + 1]
    relative = [{"name": e["path"][len(prefix) :], "bytes": e["bytes"]} for e in entries]
    fingerprint = _digest({"names": _digest([p[len(prefix) :] for p in paths]), "files": relative, "samples": samples})
    return {"fingerprint": fingerprint, "file_count": len(paths), "files": entries}


def _sample_file(fs: Any, path: str, size: int | None) -> str | None:
    if size is None:
        return None
    try:
        with fs.open(path, "rb") as handle:
            head = handle.read(SAMPLED_BYTES)
            handle.seek(max(0, size - SAMPLED_BYTES))
            tail = handle.read(SAMPLED_BYTES)
    except OSError as err:  # unreadable now: the sizes still identify it
        log.warning("data identity: cannot read %s (%s)", path, err)
        return None
    return checksum(head + tail)


def _git(path: str | os.PathLike, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", os.fspath(path), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:  # no git, or a slow filesystem: the commit stays unknown
        log.debug("code identity: git %s failed: %s", " ".join(args), err)
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _distribution_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _host_count(world_size: int) -> int | None:
    for variable in ("GROUP_WORLD_SIZE", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):  # torchrun, then SLURM
        if os.environ.get(variable, "").isdigit():
            return int(os.environ[variable])
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return max(1, world_size // int(local))
    return 1 if world_size == 1 else None


def _model_class(module: torch.nn.Module) -> type:
    from torch.distributed.fsdp import FSDPModule

    cls: type = type(module)
    if isinstance(module, FSDPModule):  # fully_shard swaps in a generated subclass, "FSDP<Name>"
        cls = next(base for base in cls.__bases__ if not issubclass(base, FSDPModule))
    return cls


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.float32": the spelling the manifest's tensors use
