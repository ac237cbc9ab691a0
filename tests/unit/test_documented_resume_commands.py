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


def resume_commands() -> list[tuple[str, str]]:
    """(document, command) for each command that continues a run: `resume=latest`, or `run_train.sh`
    with overrides (its default `resume=latest` continues checkpoints/<run_name>)."""
    found = []
    for name in DOCUMENTS:
        text = (REPO / name).read_text().replace("\n", " ")  # a command may wrap inside backticks
        for match in COMMAND.finditer(text):
            command = match.group(0)
            if "resume=latest" in command or command.startswith("./scripts/run_train.sh"):
                found.append((name, command))
    return found


def test_every_documented_resume_command_raises_max_steps_past_the_finished_run():
    commands = resume_commands()
    assert any(doc == "README.md" and cmd.startswith("./scripts/run_train.sh") for doc, cmd in commands), commands
    default = default_max_steps()
    for document, command in commands:
        steps = re.search(r"trainer\.max_steps=(\d+)", command)
        assert steps and int(steps.group(1)) > default, (
            f"{document}: `{command}` resumes a run that stopped at max_steps={default} and so trains zero steps; "
            f"add trainer.max_steps=<more than {default}>"
        )
