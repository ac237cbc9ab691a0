"""Every command the README and the how-to guides show runs as printed (issue 27).

For each document, in a fresh copy of the repository (`git ls-files`, with `.venv` linked to the
environment running the tests), its ```bash blocks run in order in ONE `bash -e -o pipefail` process,
as a reader pasting them into one terminal would (a server started in one block is stopped in a later
one; `export`s carry over). Blocks marked `<!-- not run: REASON -->` are skipped (tests/helpers/doc_blocks.py;
tests/unit/test_documented_blocks.py checks that no shell block escapes both). A non-zero exit fails
with the document, the block and the tail of its output; so does a documented resume that trains
nothing. Documents share nothing: each has its own copy, checkpoints and outputs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers.doc_blocks import INSTALLS, REPO, Block, blocks_of, documents, runnable

pytestmark = pytest.mark.timeout(600)

DOCUMENTS = documents()
SCRIPT_TIMEOUT_S = 480
# Documents that start moto's server on its documented fixed port: one at a time on this machine, so two
# test runs (or two engineers) never race for the port.
PORT_LOCK = Path(tempfile.gettempdir()) / "shardckpt-docs-moto-port.lock"
NOTHING_TRAINED = "nothing trained:"  # the recipe's line when a resume's max_steps is already reached


def fresh_copy(destination: Path) -> Path:
    """The tracked files as they are in the working tree, and `.venv` -> the environment running us."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # tracked but deleted in the working tree: not part of this checkout
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    (destination / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    return destination


def script_of(blocks: list[Block], progress: Path) -> str:
    """One shell script: each block preceded by a line recording its index, so a failure names it."""
    parts = []
    for block in blocks:
        parts.append(f"echo {block.index} > {shlex.quote(str(progress))}\n")
        parts.append(block.body)
    parts.append(f"echo done > {shlex.quote(str(progress))}\n")
    return "".join(parts)


def environment(copy: Path) -> dict[str, str]:
    """A newcomer's shell with the environment activated: the copy's package, no cloud settings of ours."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("AWS_", "SHARDCKPT_", "PYTEST_", "VIRTUAL_ENV"))
    }
    env.update(
        PATH=f"{copy / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(copy / ".venv"),
        PYTHONPATH=str(copy),  # the copy's package, as `pip install -e .` in a fresh clone would import
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        PYTHONUNBUFFERED="1",
    )
    return env


@contextlib.contextmanager
def port_lock(needed: bool):
    if not needed:
        yield
        return
    with open(PORT_LOCK, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tail(path: Path, limit: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-limit:]


def needs_the_port(document: str) -> bool:
    return "moto.server" in "".join(block.body for block in runnable(blocks_of(document)))


# Under xdist the documents that need the port run one after another on one worker, instead of each holding a
# worker idle while it waits for the lock (which still keeps two test runs on this machine apart).
CASES = [
    pytest.param(document, marks=pytest.mark.xdist_group("docs-moto-port")) if needs_the_port(document) else document
    for document in DOCUMENTS
]


@pytest.mark.parametrize("document", CASES)
def test_every_bash_block_of_the_document_runs_as_printed(document, tmp_path):
    blocks = runnable(blocks_of(document))
    if not blocks:
        pytest.skip(f"{document} has no bash block to run")
    installing = [f"block {b.index} (line {b.line})" for b in blocks if INSTALLS.search(b.body)]
    if installing:  # before anything runs: .venv below is the suite's own environment
        pytest.fail(
            f"{document}: {', '.join(installing)} would reinstall the environment the tests run in; mark it not run"
        )
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout: the fresh copy is made of `git ls-files`")
    copy = fresh_copy(tmp_path / "repo")
    progress, stdout, stderr = tmp_path / "block", tmp_path / "stdout", tmp_path / "stderr"
    script = tmp_path / "doc.sh"
    script.write_text(script_of(blocks, progress))
    started = time.monotonic()
    with port_lock(needs_the_port(document)):
        with open(stdout, "w") as out, open(stderr, "w") as err:
            process = subprocess.Popen(
                ["bash", "-e", "-o", "pipefail", str(script)],
                cwd=copy,
                env=environment(copy),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group: whatever it left running is stopped below
            )
            try:
                code = process.wait(timeout=SCRIPT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
    elapsed = time.monotonic() - started
    print(f"{document}: {len(blocks)} block(s) in {elapsed:.1f}s")
    reached = progress.read_text().strip() if progress.exists() else "0"
    if code != 0 or reached != "done":
        block = next((b for b in blocks if str(b.index) == reached), None)
        where = f"the block at line {block.line}" if block else f"before its first block ({reached})"
        how = f"timed out after {SCRIPT_TIMEOUT_S}s" if code is None else f"exited {code}"
        pytest.fail(
            f"{document}: {where} {how}\n--- the block ---\n{block.body if block else ''}"
            f"--- stdout (tail) ---\n{tail(stdout)}\n--- stderr (tail) ---\n{tail(stderr)}"
        )
    output = stdout.read_text(errors="replace") + stderr.read_text(errors="replace")
    assert NOTHING_TRAINED not in output, (
        f"{document}: a documented training command trained nothing (its trainer.max_steps was already reached); "
        f"raise it\n{tail(stdout)}"
    )
