"""Typed, validated engine options shared by Python callers and Hydra (`conf/` mirrors these fields).

Every dataclass is frozen and keyword-only; `@typed_options` refuses a bool/int/float field of the wrong type (a
string `"false"` is truthy), then `__post_init__` rejects a value that cannot work with a message naming the option,
the rule and the fix, before any training starts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigError
from .collectives import may_be_coordinator
from .format.signing import AcceptedKey, public_key_specs, revoked_key_ids
from .validate import did_you_mean, require_number, typed_options

VerifyMode = Literal["off", "sample", "full"]
WhenBusy = Literal["wait", "skip"]
OnError = Literal["log", "raise"]
# the API a saver was created through: its errors advise in that API's words (engine/ownership.py)
ENGINE, CHECKPOINTER, LIGHTNING, FABRIC = "engine", "checkpointer", "lightning", "fabric"
FRONT_DOORS = (ENGINE, CHECKPOINTER, LIGHTNING, FABRIC)


@dataclass(frozen=True, kw_only=True)
@typed_options("verify")
class VerifyConfig:
    """What each rank reads back before its checkpoint may commit."""

    mode: VerifyMode = "sample"
    fraction: float = 0.01  # share of the rank's bytes read back in "sample" mode
    min_chunks: int = 1  # at least this many pieces per rank are read back in "sample" mode (a block of a large chunk)
    seed: int | None = None  # fixes which chunks are sampled (tests); None: fresh randomness

    def __post_init__(self) -> None:
        if self.mode not in ("off", "sample", "full"):
            raise ConfigError(f"verify.mode={self.mode!r} is unknown; use 'off', 'sample' or 'full'")
        require_number("verify.fraction", self.fraction, at_least=0, at_most=1, hint="0.01 reads back 1% of each shard")
        require_number("verify.min_chunks", self.min_chunks, integer=True, at_least=0)
        require_number("verify.seed", self.seed, integer=True, allow_none=True, none_means="fresh randomness")


WRITERS = ("thread",)  # SaveConfig.writer


@dataclass(frozen=True, kw_only=True)
@typed_options("save.sign")
class SignConfig:
    """Where the coordinator's Ed25519 signing key comes from (docs/howto/signing.md). One source, or none: off.

    Only a reference to the key is configured (a path, an environment variable's name, a callable): the key itself
    never enters a manifest, a config dump or a logger. Signing also records each file's SHA-256. A key_path or
    key_env is loaded once when the config is built, on the process that can be rank 0: a missing file, a public
    key or a key that is not Ed25519 is refused before training, not at each commit in the background.
    """

    key_path: str | None = None  # a PEM private key file, read by rank 0 at each commit
    key_env: str | None = None  # the name of an environment variable holding the PEM private key's text
    # a KMS-style callable, or 'module:function': f(manifest bytes) -> (signature, 32 raw public key bytes)
    signer: Any = None
    # each file's digest: blake3 (0.31 CPU-s per GiB here; the `blake3` package, in the `sign` extra) or sha256 (0.68;
    # the standard library)
    digest: str = "blake3"

    def __post_init__(self) -> None:
        if self.digest not in ("blake3", "sha256"):
            raise ConfigError(f"save.sign.digest={self.digest!r} is unknown; use 'blake3' (cheaper) or 'sha256'")
        if self.digest == "blake3" and self.enabled and importlib.util.find_spec("blake3") is None:
            raise ConfigError(
                "save.sign.digest='blake3' needs the `blake3` package: pip install 'lightning_shardckpt[sign]', or set "
                "save.sign.digest=sha256"
            )
        given = [name for name in ("key_path", "key_env", "signer") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ConfigError(f"save.sign: give one key source, not {given}; key_path, key_env or signer")
        for name in ("key_path", "key_env"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"save.sign.{name}={value!r} must be a non-empty string, or null")
        if may_be_coordinator():  # only rank 0 signs, and only its node need hold the key
            from .format import signing  # `cryptography` is imported only where signing is on

            signing.check_key_source(self.key_path, self.key_env)

    @property
    def enabled(self) -> bool:
        return any(getattr(self, name) is not None for name in ("key_path", "key_env", "signer"))

    def __repr__(self) -> str:  # a signer object may hold credentials: name its kind only
        signer = None if self.signer is None else (self.signer if isinstance(self.signer, str) else "<callable>")
        return f"SignConfig(key_path={self.key_path!r}, key_env={self.key_env!r}, signer={signer!r}, digest={self.digest!r})"


@dataclass(frozen=True, kw_only=True)
@typed_options()
class SaveConfig:
    """How the engine writes and commits one checkpoint."""

    verify: VerifyConfig = field(default_factory=VerifyConfig)
    async_save: bool = True  # write/verify/commit on a background thread; False: the caller waits for the commit
    # copy parameters and optimizer state in the background while the next forward/backward runs; the training
    # thread waits only before the optimizer step (and copies buffers, counters and pickled state at once).
    # No effect when async_save is False (nothing is staged)
    overlap_staging: bool = True
    # where persist + verify + commit run: "thread", the saver's background thread (the one placement; "process",
    # a writer process per rank, was removed in wave 4: it measured no better and supported less)
    writer: str = "thread"
    max_in_flight: int = 1  # saves staged but not yet committed; each holds one host copy of the rank's state
    when_busy: WhenBusy = (
        "wait"  # a save requested while max_in_flight are running: "wait" (counted as pause) or "skip"
    )
    on_error: OnError = "log"  # a failed background save: "log" (training goes on) or "raise" at the next save/close
    teardown_timeout_s: float = 600.0  # close() waits at most this long for in-flight saves to commit
    collective_timeout_s: float = (
        600.0  # every checkpoint collective aborts after this; a dead rank cannot hang the save
    )
    parallelism: str = "unknown"  # recorded in the manifest's topology ("ddp", "fsdp", ...)
    write_events: bool = True  # one JSON event file per attempt under ROOT/events (coordinator only)
    storage_options: dict[str, Any] = field(default_factory=dict)  # passed to fsspec (endpoint, credentials)
    run_id: str | None = None  # recorded in every manifest and in ROOT/.owner.json; None: the saver generates one
    allow_shared_root: bool = (
        False  # True: write into a root another run owns (both runs' retention and `latest` then mix)
    )
    # write only what changed since the last save; unchanged chunks are references into the earlier checkpoint
    # that holds their bytes, recorded in each rank's part (engine/save/incremental.py, incremental_base.py,
    # docs/FORMAT.md §10.6; format_version=2: the manifest, §9). A new saver's first save is full. Off by default
    incremental: bool = False
    full_every_n: int = 10  # with incremental: every N-th save is full, so references reach back at most N-1 saves
    # each node writes its own root (a node-local tier, engine/tiers/config.py): the coordinator cannot see other nodes'
    # files, so it checks the sizes of those it sees; each rank's read-back vouches for its own
    node_local: bool = False
    # True: leave a failed save's directory for inspection (`shardckpt gc` removes it later);
    # False: the coordinator removes it once every rank saw the save fail
    keep_failed_attempts: bool = False
    # write each rank's shard file past the page cache (O_DIRECT) on local disks that take it, buffered elsewhere
    # (tmpfs, object stores): a third of the writing thread's CPU here, and no page-cache writeback competing with
    # training (engine/storage/direct_file.py). False: buffered writes, e.g. where O_DIRECT is slow (some NFS mounts)
    direct_io: bool = True
    # 4: per-rank parts beside the shards and a small manifest; each rank plans its own writes, the coordinator's
    # commit is O(ranks) (docs/FORMAT.md §10). 2: every chunk in the manifest, planned by DCP's collectives, which
    # readers of lightning_shardckpt before format v4 read; O(chunks) on the coordinator. Incremental saves write 3.
    # 5: as 4, the per-rank sizes and checksums in group tables of 128 ranks, each written by its group's lowest
    # rank: the manifest and rank 0's commit are O(ranks / 128 + 128) (FORMAT.md §10.5). Unsigned worlds of one
    # group write 4 (v5 gains nothing there); node-local saves write each table on its group's nodes (save/node_groups.py)
    format_version: int = 5
    # DCP's `.metadata` (what a plain `torch.distributed.checkpoint.load` reads) is written only for checkpoints of
    # at most this many chunks: building it is O(chunks) on the coordinator and every plain-DCP reader unpickles
    # it whole, the cost format v4 removes. 0: never; our own readers never need it (docs/FORMAT.md §10)
    dcp_metadata_max_chunks: int = 50_000
    # the API that creates the saver: "engine" (CheckpointSaver), "checkpointer" (Checkpointer) or "lightning"
    # (ShardedCheckpoint); front doors set it, so that an error's advice is in their words. Leave it as is
    front_door: str = ENGINE
    # sign each commit (Ed25519 over the manifest) and record each file's digest (every format, incremental saves
    # included: their references carry the digests the saves they borrow from recorded); off unless a key source is set
    sign: SignConfig = field(default_factory=SignConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.sign, SignConfig):
            raise ConfigError(f"sign={self.sign!r} must be a SignConfig (key_path, key_env or signer)")
        if self.front_door not in FRONT_DOORS:
            raise ConfigError(f"front_door={self.front_door!r} is unknown; use one of {', '.join(FRONT_DOORS)}")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not self.run_id.strip()):
            raise ConfigError(f"run_id={self.run_id!r} must be a non-empty string, or null to generate one")
        require_number(
            "collective_timeout_s",
            self.collective_timeout_s,
            above=0,
            hint="seconds; it bounds how long ranks wait for a dead peer",
        )
        if self.writer == "process":
            raise ConfigError(
                "writer='process' was removed: a writer process per rank measured no better loop time than the "
                "background thread on a busy host (0.35x vs 0.36x of Lightning's synchronous save) and could not "
                "save FSDP2 state, incremental saves or a preempted run's last save; remove the option (the write "
                "runs on the saver's background thread, writer='thread')"
            )
        if self.writer not in WRITERS:
            raise ConfigError(
                f"writer={self.writer!r} is unknown; use 'thread' (write on the saver's background thread)"
            )
        require_number("full_every_n", self.full_every_n, integer=True, at_least=1, hint="1: every save is full")
        if self.format_version not in (2, 4, 5):
            raise ConfigError(
                f"format_version={self.format_version!r} is not one this writer writes; use 5 (per-rank parts listed "
                "in group tables: a manifest and commit flat in ranks), 4 (per-rank parts, for readers older than "
                "format v5) or 2 (every chunk in the manifest, for readers older than format v4)"
            )
        require_number(
            "dcp_metadata_max_chunks",
            self.dcp_metadata_max_chunks,
            integer=True,
            at_least=0,
            hint="chunks; 0 never writes DCP's .metadata",
        )
        require_number(
            "max_in_flight",
            self.max_in_flight,
            integer=True,
            at_least=1,
            too_small="leaves no room for the save being written",
            hint="each in-flight save holds one host copy of the rank's state",
        )
        if self.when_busy not in ("wait", "skip"):
            raise ConfigError(f"when_busy={self.when_busy!r} is unknown; use 'wait' (block) or 'skip' (drop this save)")
        if self.on_error not in ("log", "raise"):
            raise ConfigError(f"on_error={self.on_error!r} is unknown; use 'log' (keep training) or 'raise'")
        require_number("teardown_timeout_s", self.teardown_timeout_s, at_least=0, hint="seconds")


DEFAULT_READ_THREADS = 4  # several range reads in flight: what an object store needs; a local disk is not hurt
DEFAULT_READ_AHEAD_BYTES = 256 * 2**20  # per rank, chunks read but not yet placed


@dataclass(frozen=True, kw_only=True)
@typed_options()
class LoadConfig:
    """How the engine reads a checkpoint back."""

    verify_checksums: bool = True  # checksum every byte read; turning it off saves ~0.1 s per GB
    # False: pickled objects in the checkpoint are unpickled only through allow-lists (safe_pickle.py), and a
    # class outside them is refused by name. True: only for checkpoints you trust; unpickling can run code
    trust_checkpoint: bool = False
    storage_options: dict[str, Any] = field(default_factory=dict)
    read_threads: int = (
        DEFAULT_READ_THREADS  # range reads in flight per rank; object stores gain most, each costs a connection
    )
    read_ahead_bytes: int = (
        DEFAULT_READ_AHEAD_BYTES  # per rank: chunks read but not yet placed (one larger chunk is read alone)
    )
    # True: load only checkpoints signed by one of `public_keys` whose files match the signed SHA-256 digests (each
    # rank reads the files it loads from once more to hash them); `latest`/`last-good` skip the others
    require_signature: bool = False
    # PEM public key files accepted (several: key rotation); an entry `{path, not_after_step, not_after}` accepts
    # that key only on checkpoints up to that step / created at or before that UTC time (a retired key)
    public_keys: tuple[str | AcceptedKey, ...] = ()
    # key ids (64 hex, or the 16 a refusal prints) or PEM public key files whose signatures are refused at every
    # step, even where public_keys still lists the key (a leaked key)
    revoked_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # a list from Hydra or a single path: kept as a tuple, so the frozen config stays hashable; a mapping entry
        # becomes an AcceptedKey, checked now (a not_after that is not a time is refused before training)
        object.__setattr__(self, "public_keys", public_key_specs(self.public_keys))
        object.__setattr__(self, "revoked_keys", public_key_specs(self.revoked_keys))
        revoked_key_ids(self.revoked_keys)  # a revoked key id that is not hex, a file that is no key: refused now
        if self.require_signature and not self.public_keys:
            raise ConfigError(
                "require_signature=true accepts no checkpoint without public_keys; give the PEM public key file(s) "
                "of the keys that sign your checkpoints"
            )
        require_number("read_threads", self.read_threads, integer=True, at_least=1, too_small="cannot read anything")
        require_number(
            "read_ahead_bytes",
            self.read_ahead_bytes,
            integer=True,
            at_least=1,
            too_small="holds no chunk",
            hint="a byte count, e.g. 268435456",
        )


def save_config_from(options: Any, **overrides: Any) -> SaveConfig:
    """SaveConfig from a SaveConfig, a dict or a Hydra DictConfig (nested `verify` included)."""
    if isinstance(options, SaveConfig):
        values = {name: getattr(options, name) for name in options.__dataclass_fields__}
    else:
        values = _plain(options or {})
        unknown = set(values) - set(SaveConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(
                f"unknown save option(s) {sorted(unknown)}{did_you_mean(unknown, SaveConfig.__dataclass_fields__)}; "
                f"known: {sorted(SaveConfig.__dataclass_fields__)}"
            )
        verify = values.get("verify")
        if verify is not None and not isinstance(verify, VerifyConfig):
            unknown = set(verify) - set(VerifyConfig.__dataclass_fields__)
            if unknown:
                raise ConfigError(
                    f"unknown save.verify option(s) {sorted(unknown)}"
                    f"{did_you_mean(unknown, VerifyConfig.__dataclass_fields__)}; "
                    f"known: {sorted(VerifyConfig.__dataclass_fields__)}"
                )
            values["verify"] = VerifyConfig(**verify)
        sign = values.get("sign")
        if sign is not None and not isinstance(sign, SignConfig):
            unknown = set(sign) - set(SignConfig.__dataclass_fields__)
            if unknown:
                raise ConfigError(
                    f"unknown save.sign option(s) {sorted(unknown)}"
                    f"{did_you_mean(unknown, SignConfig.__dataclass_fields__)}; known: {sorted(SignConfig.__dataclass_fields__)}"
                )
            values["sign"] = SignConfig(**sign)
        elif sign is None:
            values.pop("sign", None)
    values.update(overrides)
    return SaveConfig(**values)


def _plain(options: Any) -> dict[str, Any]:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(options, DictConfig):
            return OmegaConf.to_container(options, resolve=True)  # type: ignore[return-value]
    except ImportError:
        pass
    return dict(options)
