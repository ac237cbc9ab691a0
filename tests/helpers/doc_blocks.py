"""The fenced code blocks of the README and the how-to guides, and which of them the docs test runs.

Rule (issue 27): every ```bash block in these documents runs as printed on a fresh clone, from the
repository root, inside the environment; tests/e2e/test_documented_commands.py runs them. A block that
cannot run there (SLURM, a GPU, several nodes, real AWS, the test suite itself) says why on the line
just before its fence:

    <!-- not run: needs SLURM -->
    ```bash

Output excerpts go in ```text blocks, which nothing runs. tests/unit/test_documented_blocks.py checks
that no shell block escapes this: no bare fences, no other shell dialect, no stray marker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPEN = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^`\s]*)[ \t]*$")
MARKER = re.compile(r"^\s*<!--\s*not run:(?P<reason>.*?)-->\s*$")
# The docs test links .venv to the environment running the suite: a run block that (re)installs it would
# reinstall the suite's own environment from a temporary copy. Such blocks are marked not run.
INSTALLS = re.compile(r"scripts/(run_train|run_tests|setup_env)\.sh|\bpip install\b")
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", "zsh", "shell-session", "terminal"}


@dataclass(frozen=True, kw_only=True)
class Block:
    document: str  # relative to the repository root
    index: int  # 1-based among the document's fenced blocks
    line: int  # 1-based line of the opening fence
    language: str  # "" for a bare fence
    body: str
    not_run: str | None  # the marker's reason ("" when the marker gives none); None: no marker


def documents(repo: Path = REPO) -> list[str]:
    """README.md, the operator API's page (its examples run like a how-to's) and every how-to guide, relative
    to the repository root."""
    howtos = sorted(str(p.relative_to(repo)) for p in (repo / "docs" / "howto").glob("*.md"))
    return ["README.md", "docs/API.md", *howtos]


def parse(text: str, document: str = "<text>") -> list[Block]:
    """Every fenced block, with the `not run` marker of the line just before its fence."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = OPEN.match(lines[i])
        if not match:
            i += 1
            continue
        indent, start = match.group("indent"), i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i == len(lines):
            raise ValueError(f"{document}:{start + 1}: a code fence that never closes")
        marker = MARKER.match(lines[start - 1]) if start else None
        blocks.append(
            Block(
                document=document,
                index=len(blocks) + 1,
                line=start + 1,
                language=match.group("lang").lower(),
                body="\n".join(body) + "\n",
                not_run=marker.group("reason").strip() if marker else None,
            )
        )
        i += 1
    return blocks


def blocks_of(document: str, repo: Path = REPO) -> list[Block]:
    return parse((repo / document).read_text(), document)


def runnable(blocks: list[Block]) -> list[Block]:
    """What the docs test runs, in order: the bash blocks without a `not run` marker."""
    return [block for block in blocks if block.language == "bash" and block.not_run is None]


def stray_markers(text: str) -> list[int]:
    """Lines of `not run` markers that are not right before a fence (they would mark nothing)."""
    lines = text.splitlines()
    return [
        n + 1
        for n, line in enumerate(lines)
        if MARKER.match(line) and not (n + 1 < len(lines) and OPEN.match(lines[n + 1]))
    ]
