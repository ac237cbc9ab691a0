"""Restore drills: what turns a committed checkpoint into a known-good one.

`plugin.py` (TrainingDrills, DrillConfig) queues every N-th commit during training; `runner.py` runs one drill at a
time and files its verdict; `pool.py` keeps a warm process that forks the drill ranks; `worker.py` is one drill
rank (restore through the resume path, then the checks); `scratch.py` is a drill's local scratch directory (and the
removal of those a killed starter left); `trust.py` hands the run's trust to the drill ranks;
`follower.py` + `leases.py` are the drill service outside training (`shardckpt drill --follow`), and
`external.py` the run's view of it. Public names: DrillConfig (plugin.py), run_drill (runner.py).
"""
