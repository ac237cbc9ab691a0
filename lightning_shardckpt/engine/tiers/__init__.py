"""Checkpoint tiers: tier options, verified copies to the durable tier, which tier a resume reads."""
