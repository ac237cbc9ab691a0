"""tiers.fast.peers as configuration: parsed from dicts, refused where it cannot work, peers in other nodes."""

from __future__ import annotations

import pytest

from lightning_shardckpt.engine.tiers.config import PeersConfig, tiers_config_from
from lightning_shardckpt.errors import ConfigError
from lightning_shardckpt.policies.health.observe import observe
from lightning_shardckpt.policies.health.rules import health_config_from


def test_peers_parse_from_a_dict_and_place_each_copy_on_another_node():
    config = tiers_config_from({"fast": {"dirpath": "/nvme/node{node_rank}", "peers": {"factor": 2, "jump": 8}}})
    assert config.fast.peers == PeersConfig(factor=2, jump=8)
    # 2 nodes x 8 ranks: rank 3's copy on rank 11 (node 1), rank 11's on rank 3 (node 0)
    assert config.fast.peers.peers_of(3, 16) == [11] and config.fast.peers.peers_of(11, 16) == [3]
    assert PeersConfig(factor=3, jump=2).peers_of(0, 6) == [2, 4]
    assert PeersConfig(factor=2, jump=2).peers_of(1, 2) == []  # one node: no other failure domain, no copy


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ({"fast": {"dirpath": "/f/{node_rank}", "peers": {"factor": 1}}}, "factor"),
        ({"fast": {"dirpath": "/f/{node_rank}", "peers": {"jump": 0}}}, "jump"),
        ({"fast": {"dirpath": "/f/{node_rank}", "peers": {"fator": 2}}}, "unknown tiers.fast.peers option"),
        (
            {"fast": "/f/{node_rank}", "durable": {"dirpath": "s3://b/r", "peers": {"factor": 2}}},
            "tiers.durable.peers",
        ),
        ({"fast": {"dirpath": "/shared/ckpt", "peers": {"jump": 2}}}, "has no {node_rank}"),
    ],
)
def test_peer_options_that_cannot_work_are_refused_naming_the_option(tiers, message):
    with pytest.raises(ConfigError, match=message):
        tiers_config_from(tiers)


def test_each_peer_copy_is_an_event_health_rules_observe():
    event = {"event": "peer_replication", "outcome": "failed", "lag_checkpoints": 2, "step": 4, "run_id": "r"}
    seen = {(o.metric, o.value) for o in observe(event) if o.slice == "run"}
    assert seen == {("peer_replication_ok", 0.0), ("peer_replication_lag_checkpoints", 2.0)}
    rule = {"name": "peers", "metric": "peer_replication_lag_checkpoints", "owner": "infra", "range": {"max": 0}}
    assert health_config_from([rule]).rules[0].metric == "peer_replication_lag_checkpoints"
