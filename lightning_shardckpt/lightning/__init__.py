"""The Lightning adapter: ShardedStrategy, ShardedCheckpoint and what they need from Lightning.

The strategy saves and restores sharded state through the engine; the callback decides when to
save and records identity and data position, running the policies (`..policies`: retention, health,
drills, tiers) as plug-ins; `sampler_injection` puts the resumable sampler (`..training.data`) into
Lightning's dataloaders; `lightning_state` carries Lightning's own checkpoint entries;
`wandb_artifacts` logs checkpoints by reference.

The only room that imports Lightning. May import every room below it; never `..cli`.
"""

from .fabric.strategy import register as register_fabric
from .trainer.strategy import register

register()  # Trainer(strategy="shardckpt_ddp" / "shardckpt_fsdp"), from whichever import loads the adapter first
register_fabric()  # Fabric(strategy="shardckpt_ddp" / "shardckpt_fsdp"): Fabric's own registry
