"""The Fabric front door: `Fabric(strategy=ShardedFabricStrategy(...))`, `fabric.save` / `fabric.load`.

`strategy.py` the strategies and their registration; `state.py` a Fabric state to and from DCP state;
`sources.py` which checkpoint a load opens; `sampler.py` the Fabric loop's resumable sampler.
"""
