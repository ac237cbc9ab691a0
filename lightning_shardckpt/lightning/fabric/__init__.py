"""The Fabric front door: `Fabric(strategy=ShardedFabricStrategy(...))`, `fabric.save` / `fabric.load`.

`strategy.py` the strategies and their registration (on the door core of training/: the save loop, the saver
host, the one resume); `state.py` a Fabric state to and from DCP state; `sampler.py` the Fabric loop's resumable
sampler.
"""
