"""Every documented command that continues a run actually trains (issue 9, item 12).

`trainer.max_steps` counts the whole run: a resume of a run that stopped at the default `max_steps`
restores the checkpoint and trains zero steps unless the command raises it. The recipe's printed
resume command is checked end to end in tests/e2e/test_train_recipe.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = (
    "README.md",
    *sorted(str(path.relative_to(REPO)) for path in (REPO / "docs").rglob("*.md")),  # the how-to guides
    "scripts/run_train.sh",
    "conf/train.yaml",
    "recipes/train.py",
)
COMMAND = re.compile(r"(?:\./scripts/run_train\.sh|python recipes/train\.py)(?:[ \t]+[\w.+~/${}:-]+=[^\s`#]*)+")


def default_max_steps() -> int:
    return yaml.safe_load((REPO / "conf/trainer/default.yaml").read_text())["max_steps"]


def resume_commands() -> list[tuple[str, str, int | None]]:
    """(document, command, stopped_at) for each command that continues a run: `resume=latest`, or
    `run_train.sh` with overrides (its default `resume=latest` continues checkpoints/<run_name>).
    `stopped_at` is the max_steps of the same document's earlier command for the same run_name (a
    how-to that makes its own small run first), None when the document makes none."""
    found = []
    for name in DOCUMENTS:
        text = (REPO / name).read_text().replace("\n", " ")  # a command may wrap inside backticks
        stopped_at: dict[str, int] = {}
        for match in COMMAND.finditer(text):
            command = match.group(0)
            run = re.search(r"\brun_name=(\S+)", command)
            steps = re.search(r"trainer\.max_steps=(\d+)", command)
            run_name = run.group(1) if run else None
            if "resume=latest" in command or command.startswith("./scripts/run_train.sh"):
                found.append((name, command, stopped_at.get(run_name) if run_name else None))
            if run_name and steps:
                stopped_at[run_name] = int(steps.group(1))
    return found


def test_every_documented_resume_command_raises_max_steps_past_the_finished_run():
    commands = resume_commands()
    assert any(doc == "README.md" and cmd.startswith("./scripts/run_train.sh") for doc, cmd, _ in commands), commands
    default = default_max_steps()
    for document, command, stopped_at in commands:
        bar = default if stopped_at is None else stopped_at
        steps = re.search(r"trainer\.max_steps=(\d+)", command)
        assert steps and int(steps.group(1)) > bar, (
            f"{document}: `{command}` resumes a run that stopped at max_steps={bar} and so trains zero steps; "
            f"add trainer.max_steps=<more than {bar}>"
        )
