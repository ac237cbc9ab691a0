"""What `shardckpt` exits with, in one place: every command returns one of these, and scripts branch on them.

A command that ran to the end returns OK or FOUND_PROBLEM; one that could not run (bad arguments, no such
checkpoint, unreachable storage) returns CANNOT_RUN, as argparse itself does on bad usage.
"""

from __future__ import annotations

OK = 0  # ran and found nothing wrong: verify sound, diff/compare identical, health quiet, drill passed, gc done
FOUND_PROBLEM = 1  # ran and found corrupt bytes, a difference, a firing rule, a failed drill or gc, a bad checkpoint
CANNOT_RUN = 2  # did not run: bad arguments, no such checkpoint, unreachable storage (the error line says which)
