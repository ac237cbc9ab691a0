"""Imported last by the tests' forkserver (tests/helpers/spawn.py's preload): `gc.freeze()` moves every object the
preload created (torch, Lightning, the package: a few hundred thousand) into the permanent generation, so a forked
rank's garbage collections no longer traverse them, nor write to their pages and copy them (the cyclic collector
was ~20 % of a 32-rank test's CPU: `perf record -a`, gc_collect_main and its visitors). Python's documentation of
`gc.freeze` recommends exactly this before fork() without exec()."""

import gc

gc.freeze()
