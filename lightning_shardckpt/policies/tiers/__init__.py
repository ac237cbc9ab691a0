"""Tiers: saves commit on a fast (node-local) tier, copies go verified to a durable tier and to peer nodes.

`checkpoint_tiers.py` (CheckpointTiers: this rank's view of both tiers, the replicators, per-tier retention,
degraded mode, the resume's tier pick and last-good); `plugin.py` (TiersPlugin, tiered_dirpath). The copies
themselves are the engine's (engine/tiers/).
"""
