"""Checkpoint tiers: tier options, verified copies to the durable tier and to peer nodes (with the earlier files an
incremental checkpoint references: referenced_files.py), which tier a resume reads."""
