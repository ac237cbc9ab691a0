"""No shell block in the README or a how-to escapes the docs test (issue 27).

tests/e2e/test_documented_commands.py runs every ```bash block of these documents unless the line just
before its fence says `<!-- not run: REASON -->`. These checks keep a new block from slipping past both:
a bare fence or another shell dialect would be skipped silently, a marker one line too far away marks
nothing, and a marker without a reason explains nothing.
"""

from __future__ import annotations

import pytest

from tests.e2e import test_documented_commands as docs_test
from tests.helpers.doc_blocks import (
    INSTALLS,
    REPO,
    SHELL_LANGUAGES,
    blocks_of,
    documents,
    parse,
    runnable,
    stray_markers,
)

DOCUMENTS = documents()


def test_the_docs_test_runs_the_readme_and_every_howto():
    assert docs_test.DOCUMENTS == DOCUMENTS
    assert "README.md" in DOCUMENTS and "docs/howto/resize.md" in DOCUMENTS


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_shell_block_is_run_by_the_docs_test_or_says_why_not(document):
    problems = []
    for block in blocks_of(document):
        where = f"{document}:{block.line}"
        if not block.language:
            problems.append(f"{where}: a bare ``` fence; tag it (bash: run by the docs test; text: output)")
        elif block.language in SHELL_LANGUAGES and block.language != "bash":
            problems.append(f"{where}: ```{block.language} is not run; write ```bash (or mark it not run)")
        if block.not_run is not None and block.language != "bash":
            problems.append(f"{where}: a `not run` marker before a ```{block.language} block, which nothing runs")
        if block.not_run == "":
            problems.append(f"{where}: `<!-- not run: -->` without a reason; say what it needs")
    problems += [
        f"{document}:{line}: a `not run` marker not on the line just before a fence"
        for line in stray_markers((REPO / document).read_text())
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_run_blocks_do_not_reinstall_the_environment(document):
    offending = [f"{document}:{b.line}" for b in runnable(blocks_of(document)) if INSTALLS.search(b.body)]
    assert not offending, f"these blocks (re)install the environment; mark them not run: {offending}"


def test_the_block_parser_sees_markers_indented_fences_and_bare_ones():
    text = (
        "intro\n"
        "<!-- not run: needs SLURM -->\n"
        "```bash\nsrun x\n```\n"
        "1. step\n\n"
        "   ```bash\n   shardckpt ls r\n   ```\n"
        "<!-- not run: -->\n"
        "\n"
        "```\nshardckpt ls\n```\n"
    )
    first, second, third = parse(text)
    assert (first.language, first.not_run, first.body) == ("bash", "needs SLURM", "srun x\n")
    assert (second.language, second.not_run, second.body, second.line) == ("bash", None, "shardckpt ls r\n", 8)
    assert (third.language, third.not_run) == ("", None)  # the marker two lines up marks nothing
    assert runnable([first, second, third]) == [second]
    assert stray_markers(text) == [11]
