"""The Trainer front door: ShardedStrategy (strategy.py, Lightning's overrides) and ShardedCheckpoint
(callback.py), with what they need from a Lightning run: its checkpoint dict (lightning_state in ..),
sampler injection and data position, preemption signals, run identity, the user's own state merged across
ranks (metrics, epoch aggregates, plateau steps), logging and W&B artifacts.
"""
