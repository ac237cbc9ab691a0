"""Checkpoint tiers: a fast tier every save commits to, and an optional durable tier it is copied to.

A save commits on the fast tier (node-local disk or tmpfs: seconds) through the full commit protocol;
a background replicator (replicate.py) copies committed checkpoints, verified, to the durable tier
(S3: minutes) and commits them there on their own. Restore picks among both (tier_restore.py).

The fast tier's `dirpath` may contain `{node_rank}`: each node then writes its own directory, which
no other node can read (a resized or replaced cluster restores from the durable tier).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ...errors import ConfigError
from ..validate import did_you_mean, require_keep_last, require_number, typed_options

NODE_RANK = "{node_rank}"


@dataclass(frozen=True, kw_only=True)
@typed_options()
class PeersConfig:
    """Fast tier only: each rank's committed files are also copied to `factor - 1` peer ranks' node-local roots.

    Rank r's peers are r + k * jump (k = 1 .. factor-1, modulo the world size): with `jump` = ranks per node,
    every copy lands on another node, so losing one node loses no file. The copies travel over a gloo group
    of their own (no shared filesystem, no new transport), on a background thread (engine/tiers/peers.py).
    """

    factor: int = 2  # copies of each file, the owner's included (2: one peer copy)
    jump: int = 1  # ranks between a rank and its first peer: set it to the ranks per node
    # at resume, also read other nodes' roots this machine's disk holds (the `{node_rank}` template's siblings:
    # a survivor's root after the cluster shrank, or roots that happen to be shared); false: only the group
    scan_local_roots: bool = True

    def __post_init__(self) -> None:
        require_number("factor", self.factor, integer=True, at_least=2, hint="2 keeps one peer copy")
        require_number("jump", self.jump, integer=True, at_least=1, hint="set it to the ranks per node")

    def peers_of(self, rank: int, world_size: int) -> list[int]:
        """The ranks holding copies of `rank`'s files (never itself: a world too small for a peer has none)."""
        out = []
        for k in range(1, self.factor):
            peer = (rank + k * self.jump) % world_size
            if peer != rank and peer not in out:
                out.append(peer)
        return out


@dataclass(frozen=True, kw_only=True)
@typed_options()
class TierConfig:
    """One tier: where it lives, how often it receives a checkpoint, what it keeps."""

    dirpath: str  # local path or fsspec URL; may contain {node_rank} (node-local storage)
    every_n_checkpoints: int | None = (
        None  # durable tier: copy every N-th fast commit (None with every_minutes None: every one)
    )
    every_minutes: float | None = (
        None  # durable tier: copy the newest fast commit once N minutes passed since the last copy
    )
    keep_last: int | None = None  # committed checkpoints kept on this tier (None: all)
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec options of this tier (endpoint, credentials)
    # fast tier only: checkpoints newer than the newest durable copy it may hold beyond keep_last before
    # it drops the oldest of them anyway (counted as unreplicated_dropped): bounds the space a long outage costs
    max_unreplicated: int = 4
    peers: PeersConfig | None = None  # fast tier only: copies on peer nodes (None: no peer copies)

    def __post_init__(self) -> None:
        if not self.dirpath or not isinstance(self.dirpath, str):
            raise ConfigError(
                f"tier dirpath={self.dirpath!r} is empty; set a local directory or an fsspec URL such as s3://bucket/run"
            )
        stripped = self.dirpath.replace(NODE_RANK, "")
        if "{" in stripped or "}" in stripped:
            raise ConfigError(
                f"tier dirpath={self.dirpath!r} has a placeholder other than {NODE_RANK}; only the node rank is substituted"
            )
        require_number(
            "every_n_checkpoints",
            self.every_n_checkpoints,
            integer=True,
            at_least=1,
            allow_none=True,
            none_means="every one, unless every_minutes",
            hint="1 copies every checkpoint",
        )
        require_number(
            "every_minutes",
            self.every_minutes,
            above=0,
            allow_none=True,
            hint="30 copies at most every half hour",
        )
        if self.every_n_checkpoints is not None and self.every_minutes is not None:
            raise ConfigError("set every_n_checkpoints or every_minutes on a tier, not both")
        require_keep_last(self.keep_last)
        require_number("max_unreplicated", self.max_unreplicated, integer=True, at_least=0, hint="checkpoints")

    @property
    def node_local(self) -> bool:
        return NODE_RANK in self.dirpath

    def dirpath_for(self, node_rank: int) -> str:
        return self.dirpath.replace(NODE_RANK, str(node_rank))


@dataclass(frozen=True, kw_only=True)
@typed_options()
class TiersConfig:
    """The fast tier, the optional durable tier, and how replication between them behaves."""

    fast: TierConfig
    durable: TierConfig | None = None
    flush_timeout_s: float = 300.0  # at fit end / preemption: wait at most this long for pending copies to commit
    retry_backoff_s: float = 5.0  # first wait before retrying a failed copy; doubles up to retry_backoff_max_s
    retry_backoff_max_s: float = 120.0
    collective_timeout_s: float = (
        600.0  # replication collectives abort after this (a dead rank fails the copy, not training)
    )

    def __post_init__(self) -> None:
        if self.durable is not None:
            if self.durable.node_local:
                raise ConfigError(
                    f"durable dirpath={self.durable.dirpath!r} contains {NODE_RANK}; the durable tier must be one place "
                    "every node reaches (e.g. s3://bucket/run)"
                )
            if self.durable.peers is not None:
                raise ConfigError("tiers.durable.peers is set; peer copies are a fast-tier option (tiers.fast.peers)")
            if self.durable.dirpath.rstrip("/") == self.fast.dirpath.rstrip("/"):
                raise ConfigError(
                    f"fast and durable dirpath are both {self.fast.dirpath!r}; give the durable tier its own root"
                )
        if self.fast.peers is not None and not self.fast.node_local:
            raise ConfigError(
                f"tiers.fast.peers is set but tiers.fast.dirpath={self.fast.dirpath!r} has no {NODE_RANK}: peer copies "
                f"are for node-local fast roots; put {NODE_RANK} in the path, or drop peers on a shared filesystem"
            )
        if self.fast.every_n_checkpoints not in (None, 1) or self.fast.every_minutes is not None:
            raise ConfigError(
                "the fast tier receives every save; set the save cadence on the callback (every_n_train_steps), "
                "and every_n_checkpoints / every_minutes on the durable tier"
            )
        require_number("flush_timeout_s", self.flush_timeout_s, at_least=0, hint="seconds; 0: do not wait")
        require_number("retry_backoff_s", self.retry_backoff_s, above=0, hint="seconds")
        require_number("retry_backoff_max_s", self.retry_backoff_max_s, above=0, hint="seconds")
        require_number("collective_timeout_s", self.collective_timeout_s, above=0, hint="seconds")
        if self.retry_backoff_max_s < self.retry_backoff_s:
            raise ConfigError(
                f"retry_backoff_s={self.retry_backoff_s} must be > 0 and <= retry_backoff_max_s={self.retry_backoff_max_s}"
            )

    def backoff_s(self, failures: int) -> float:
        return min(self.retry_backoff_max_s, self.retry_backoff_s * 2.0 ** max(0, failures - 1))


def tiers_config_from(value: Any) -> TiersConfig | None:
    """TiersConfig from an instance, a dict or a Hydra DictConfig; None (or `fast: null`) means no tiers."""
    if value is None or isinstance(value, TiersConfig):
        return value
    value = _plain(value)
    if not value or value.get("fast") is None:
        return None
    known = {f.name for f in fields(TiersConfig)}
    unknown = set(value) - known
    if unknown:
        raise ConfigError(
            f"unknown tiers option(s) {sorted(unknown)}{did_you_mean(unknown, known)}; known: {sorted(known)}"
        )
    values = dict(value)
    values["fast"] = _tier(values["fast"], "fast")
    values["durable"] = _tier(values.get("durable"), "durable") if values.get("durable") is not None else None
    return TiersConfig(**values)


def _tier(value: Any, name: str) -> TierConfig:
    if isinstance(value, TierConfig):
        return value
    if isinstance(value, str):
        return TierConfig(dirpath=value)
    known = {f.name for f in fields(TierConfig)}
    unknown = set(value) - known
    if unknown:
        raise ConfigError(
            f"unknown tiers.{name} option(s) {sorted(unknown)}{did_you_mean(unknown, known)}; known: {sorted(known)}"
        )
    values = dict(value)
    values["storage_options"] = dict(values.get("storage_options") or {})
    if isinstance(values.get("peers"), dict):
        peers = values["peers"]
        unknown = set(peers) - {f.name for f in fields(PeersConfig)}
        if unknown:
            raise ConfigError(
                f"unknown tiers.{name}.peers option(s) {sorted(unknown)}; known: {sorted(f.name for f in fields(PeersConfig))}"
            )
        values["peers"] = PeersConfig(**peers)
    try:
        return TierConfig(**values)
    except ConfigError as err:  # which tier's option: both have keep_last
        raise ConfigError(f"tiers.{name}: {err}") from err


def _plain(value: Any) -> Any:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(value, DictConfig):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    return dict(value)
