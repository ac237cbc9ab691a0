"""What `shardckpt` exits with, in one place: every command returns one of these, and scripts branch on them.

A command that ran to the end returns OK or FOUND_PROBLEM; one that could not run (bad arguments, no such
checkpoint, unreachable storage, missing credentials, a rules file that does not parse, a check that
raised) returns CANNOT_RUN, as argparse itself does on bad usage. A code never means two things: cron
and CI read 1 as "a rule fires" / "a bad checkpoint was found", so a crash must never exit 1.
"""

from __future__ import annotations

OK = 0  # ran and found nothing wrong: verify sound, diff/compare identical, health quiet, drill passed, gc done
FOUND_PROBLEM = 1  # ran and found corrupt bytes, a difference, a firing rule, a failed drill or gc, a bad checkpoint
CANNOT_RUN = 2  # did not run: bad arguments, no such checkpoint, unreachable storage (the error line says which)

# command -> what FOUND_PROBLEM means for it (None: the command never returns it); shown in each `--help`
FOUND_PROBLEM_MEANS: dict[str, str | None] = {
    "ls": None,
    "inspect": None,
    "verify": "a file or tensor does not match its recorded checksum (each is named)",
    "diff": "the two checkpoints differ",
    "timeline": None,
    "gc": "a directory could not be removed",
    "drill": "the restore drill failed",
    "last-good": None,
    "health": "a rule fires",
    "bisect": "a bad checkpoint was found",
    "compare": "some tensors differ",
    "export": None,
}


def epilog(command: str) -> str:
    """The exit-code paragraph of `shardckpt COMMAND --help`."""
    found = FOUND_PROBLEM_MEANS[command]
    return "\n".join(
        [
            "exit codes:",
            f"  {OK}  ran to the end" + ("" if found is None else " and found nothing wrong"),
            f"  {FOUND_PROBLEM}  " + (found if found is not None else "(never returned by this command)"),
            f"  {CANNOT_RUN}  could not run: bad arguments, no such path, storage unreachable or credentials "
            "refused, a file that does not parse, an unexpected error (one line says which; SHARDCKPT_DEBUG=1 "
            "or --debug prints the traceback)",
        ]
    )
