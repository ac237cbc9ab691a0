"""The docs a newcomer walks hold together (issue 24, item 4).

Every relative markdown link in README.md and docs/**/*.md resolves to a file of the repository (relative
to the document that holds it), and a link's `#anchor` into a markdown file names one of its headings,
slugged as GitHub does. README.md stays short: the pitch, set-up, quickstart and a map of docs/.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), with an optional "title"; text may hold inline code
LINK = re.compile(r"!?\[(?:[^\]\n]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks: a `# comment` or `[x](y)` in a code block is code."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(document: Path) -> set[str]:
    """Every heading's slug; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(document.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def links(document: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in the document's prose."""
    out = []
    for number, line in _prose_lines(document.read_text()):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            out.append((number, match.group(1)))
    return out


def broken_links(document: Path, repo: Path = REPO) -> list[str]:
    """What is wrong with each relative link of `document`, one line each (empty: all resolve)."""
    problems = []
    for number, target in links(document):
        if target.startswith(EXTERNAL):
            continue
        where = f"{document.relative_to(repo)}:{number}: ({target})"
        path_part, _, anchor = target.partition("#")
        resolved = (document.parent / unquote(path_part)).resolve() if path_part else document.resolve()
        if not resolved.is_relative_to(repo.resolve()):
            problems.append(f"{where} points outside the repository")
            continue
        if not resolved.exists():
            problems.append(f"{where} names {resolved.relative_to(repo.resolve())}, which does not exist")
            continue
        if anchor:
            if resolved.suffix != ".md" or not resolved.is_file():
                problems.append(f"{where} has an anchor into a file that is not markdown")
            elif unquote(anchor).lower() not in anchors(resolved):
                problems.append(f"{where}: {resolved.name} has no heading whose anchor is #{anchor}")
    return problems


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(document: Path):
    assert broken_links(document) == []


def test_the_docs_have_links_to_check():
    """The checker sees the README's map of docs/ (a regex that matched nothing would pass every document)."""
    targets = {target for _, target in links(REPO / "README.md")}
    assert {"docs/ARCHITECTURE.md", "docs/GUARANTEES.md", "docs/howto/health.md"} <= targets, targets


def test_readme_stays_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
    )


def test_the_checker_reports_broken_links_and_anchors(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/page.md").write_text("# A page\n\n## `latest` and retention\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/page.md) [ok anchor](docs/page.md#latest-and-retention) [web](https://example.com/x)\n"
        "[missing](docs/nope.md) [bad anchor](docs/page.md#no-such-heading) [outside](../elsewhere/notes.md)\n"
        "```\n[in code](not/checked.md)\n```\n`[inline code](not/checked.md)`\n"
    )
    problems = broken_links(tmp_path / "README.md", repo=tmp_path)
    assert len(problems) == 3, problems
    assert "docs/nope.md" in problems[0] and "no-such-heading" in problems[1] and "outside" in problems[2]


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("`latest` and retention", "latest-and-retention"),
        ("5.2 Tier copies (`replicated_from`)", "52-tier-copies-replicated_from"),
        ("How-to: write a fast tier and a durable tier", "how-to-write-a-fast-tier-and-a-durable-tier"),
        ("Set-up: two commands", "set-up-two-commands"),
    ],
)
def test_github_slug(heading: str, slug: str):
    assert github_slug(heading) == slug
