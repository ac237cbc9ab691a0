"""No tracked file keeps a merge's conflict markers: a branch merged by hand once left one inside a docstring
(tests/helpers/counting_fs.py), where Python, ruff and every test read it as text."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPENERS = ("<<<<<<< ", ">>>>>>> ", "||||||| ")
SEPARATOR = "======="  # alone on a line; Markdown may underline a heading with it, so only code is checked for it
CODE = (".py", ".sh", ".yaml", ".yml", ".toml", ".cfg", ".ini")


def leftovers(path: Path) -> list[int]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (UnicodeDecodeError, OSError):  # binary or unreadable: not a text merge
        return []
    code = path.suffix in CODE
    return [
        number
        for number, line in enumerate(lines, 1)
        if line.startswith(OPENERS) or (code and line.rstrip() == SEPARATOR)
    ]


def test_no_tracked_file_keeps_a_conflict_marker():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.decode()
    found = {name: lines for name in filter(None, listed.split("\0")) if (lines := leftovers(REPO / name))}
    assert not found, f"conflict markers left by a merge (file: line numbers): {found}"


def test_a_separator_inside_a_docstring_is_found(tmp_path):
    planted = tmp_path / "module.py"
    planted.write_text('"""One line.\n=======\nThe other."""\n')
    assert leftovers(planted) == [2]
