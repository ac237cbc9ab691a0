"""The Lightning adapter: ShardedStrategy, ShardedCheckpoint and what they need from Lightning.

The strategy saves and restores sharded state through the engine; the callback decides when to
save, what to keep, and records identity and data position; `data` and `sampler_injection` make
the data order resumable on a new world size; `lightning_state` carries Lightning's own checkpoint
entries; `staging_fence` blocks before the optimizer step for an overlapped staging copy;
`wandb_artifacts` logs checkpoints by reference.

The only room that imports Lightning. May import every other room.
"""
