"""The `shardckpt` command answers at once and teaches itself: no torch before a command needs it, the
command list with no arguments, and examples in `--help` that run as printed.

Start-up time itself is measured by benchmarks/cli_startup.py (timings never go in tests); what is
tested here is the cause of a slow start: torch (or Lightning) imported while the parser is built or
while `ls` lists a local root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.cli import examples, exit_codes
from lightning_shardckpt.cli.main import build_parser
from tests.helpers.checkpoints import fresh_state, save_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def _heavy_modules_after(statement: str, cwd: Path | None = None) -> list[str]:
    done = _python(
        "import sys\n"
        f"{statement}\n"
        "print(sorted(m for m in ('torch', 'lightning', 'pytorch_lightning', 'matplotlib') if m in sys.modules))",
        cwd,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return eval(done.stdout.strip().splitlines()[-1])  # a list literal printed by the child


@pytest.mark.slow  # starts a Python process of its own
def test_building_the_parser_imports_neither_torch_nor_lightning():
    assert _heavy_modules_after("from lightning_shardckpt.cli.main import build_parser; build_parser()") == []


@pytest.mark.slow  # starts a Python process of its own
def test_importing_the_package_imports_nothing_heavy_until_a_name_is_used():
    assert _heavy_modules_after("import lightning_shardckpt") == []
    assert "torch" in _heavy_modules_after("import lightning_shardckpt; lightning_shardckpt.CheckpointSaver")


@pytest.mark.slow  # starts a Python process of its own
def test_ls_of_a_local_root_imports_no_torch(tmp_path):
    save_checkpoint(str(tmp_path / "root"), step=5)
    statement = (
        "from lightning_shardckpt.cli.main import main\n"
        f"assert main(['ls', {str(tmp_path / 'root')!r}]) == 0\n"
        f"assert main(['inspect', {str(tmp_path / 'root/latest')!r}]) == 0"
    )
    assert _heavy_modules_after(statement) == []


@pytest.mark.slow  # starts a Python process of its own, and the drill its warm pool
def test_drill_hands_the_restore_to_its_warm_pool_and_imports_no_torch_itself(tmp_path):
    """`shardckpt drill` (and each `--follow` follower) only lists, leases and records: torch is the pool's,
    which imports it once for every drill; the starter importing it too cost ~2 CPU-s a command."""
    root = str(tmp_path / "root")
    save_checkpoint(root, step=5)
    statement = (
        f"from lightning_shardckpt.cli.main import main\nassert main(['drill', {root!r}, '--world-size', '1']) == 0"
    )
    assert _heavy_modules_after(statement) == []
    assert list((tmp_path / "root" / "drills").glob("step-000000005-*--passed.json"))  # the pool did drill it


def test_the_public_operator_api_imports_no_torch(tmp_path):
    """A cron job or an evaluation job's loop that lists, resolves, inspects and follows a root starts at once."""
    root = str(tmp_path / "root")
    save_checkpoint(root, step=5)
    statement = (
        "import lightning_shardckpt as api\n"
        f"assert api.list_checkpoints({root!r}).latest_step() == 5\n"
        f"assert api.resolve_checkpoint({root!r}, 5).step == 5\n"
        f"assert api.read_manifest_summary({root!r}).step == 5\n"
        f"assert list(api.follow_checkpoints({root!r}, timeout_s=0)) == []"
    )
    assert _heavy_modules_after(statement) == []


def test_no_arguments_lists_every_command_and_exits_0(run_cli):
    code, out, _ = run_cli()
    assert code == exit_codes.OK
    commands = build_parser()._subparsers._group_actions[0].choices  # argparse keeps no public list
    description = out.split("positional arguments")[0]
    missing = [name for name in commands if f"shardckpt {name} " not in description]
    assert not missing, f"the command table at the top of `shardckpt --help` lacks {missing}"


def test_every_command_shows_examples_and_drill_its_defaults(run_cli):
    for name in exit_codes.FOUND_PROBLEM_MEANS:
        code, out, _ = run_cli(name, "--help")
        assert code == exit_codes.OK and "examples:" in out, name
    _, out, _ = run_cli("drill", "--help")
    words = " ".join(out.split())  # argparse wraps help text at the terminal's width
    assert "(default: 600.0)" in words and "(default: 0.0001)" in words


# Every example in one Python process, each through `main` as the `shardckpt` console script calls it (its exit
# code is what `main` returns): 15 interpreters that each imported torch cost ~40 CPU-seconds of the suite, for
# nothing the examples claim. The console script itself runs as printed in tests/e2e/test_documented_commands.py.
RUN_EXAMPLES = """
import json, shlex, sys
from lightning_shardckpt.cli.main import main
codes = []
for line in json.loads(sys.argv[1]):
    argv = shlex.split(line)
    assert argv[0] == "shardckpt", line
    print(f"{MARK}{line}", file=sys.stderr, flush=True)
    codes.append(main(argv[1:]))
    sys.stderr.flush()
print(json.dumps(codes))
"""
MARK = "==> example: "


@pytest.mark.slow
def test_every_help_example_runs_as_printed_on_a_root_shaped_like_the_main_jobs(tmp_path):
    """Examples assume checkpoints/tinylm with steps 20, 30, 40 (what ./scripts/run_train.sh leaves) and
    the environment's bin/ on PATH; exit 0 or 1 (ran to the end), never 2 (could not run)."""
    saver = CheckpointSaver(str(tmp_path / examples.ROOT), SaveConfig(async_save=False, run_id="tinylm"))
    for step in (20, 30, 40):  # with save events, as a training run writes them: health reads them
        assert saver.save(fresh_state(seed=step), step=step).result(timeout=60).committed
    saver.close()
    shutil.copytree(REPO / "conf", tmp_path / "conf")  # from the repository root, as printed
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO))
    lines = [line for command_lines in examples.EXAMPLES.values() for line in command_lines]
    command = [sys.executable, "-c", f"MARK = {MARK!r}\n{RUN_EXAMPLES}", json.dumps(lines)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=280)
    assert done.returncode == 0, f"the examples' process exited {done.returncode}: {done.stderr[-3000:]}"
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    stderr_of = dict(part.split("\n", 1) if "\n" in part else (part, "") for part in done.stderr.split(MARK)[1:])
    command_of = {line: command for command, command_lines in examples.EXAMPLES.items() for line in command_lines}
    assert len(codes) == len(lines)
    for line, code in zip(lines, codes):
        assert code in (exit_codes.OK, exit_codes.FOUND_PROBLEM), (
            f"`{line}` ({command_of[line]}) exited {code}: {stderr_of.get(line, '')[-1500:]}"
        )


@pytest.fixture
def read_only_root(tmp_path):
    """A committed root seen through a read-only bind mount (a real EROFS, which root's permissions do not
    bypass); skipped where this sandbox may not mount."""
    source, mounted = tmp_path / "source", tmp_path / "read-only"
    mounted.mkdir()
    save_checkpoint(str(source / "root"), step=7)
    bind = subprocess.run(["mount", "--bind", str(source), str(mounted)], capture_output=True, text=True)
    if bind.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {bind.stderr.strip()}")
    try:
        remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(mounted)], capture_output=True, text=True)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {remount.stderr.strip()}")
        yield mounted / "root"
    finally:
        subprocess.run(["umount", str(mounted)], check=True)


def test_drill_of_a_read_only_root_fails_before_drilling_naming_the_records_directory_and_the_fix(
    read_only_root, run_cli
):
    code, out, err = run_cli("drill", read_only_root)
    assert code == exit_codes.CANNOT_RUN, (out, err)
    line = err.strip().splitlines()[-1]
    assert f"{read_only_root}/drills/" in line and "Read-only file system" in line
    assert "drill with write access to the root" in line
    assert "on 2 rank(s)" not in err  # refused before a rank started, not after minutes of drilling


@pytest.mark.slow  # starts a Python process of its own
def test_a_probe_in_the_current_directory_is_found_by_the_installed_command(tmp_path):
    """The console script's sys.path holds its bin/ directory, not the current one; the drill looks in the
    current directory as its ranks do, so `--probe recipes.lm:probe` works from the repository root."""
    (tmp_path / "my_probes.py").write_text("def probe(state):\n    return 0.0\n")
    statement = (
        "sys.path[:] = [p for p in sys.path if p not in ('', '.')]  # as the installed `shardckpt` script starts\n"
        "from lightning_shardckpt.cli.main import main\n"
        "code = main(['drill', 'nothing-here', '--probe', 'my_probes:probe'])\n"
        "assert code == 2"
    )
    done = _python(f"import sys\n{statement}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-1500:]
    assert "cannot be imported" not in done.stderr and "nothing-here" in done.stderr  # got past the probe check


def _stderr_on_a_terminal(argv: list[str]) -> tuple[int, str]:
    """Run `shardckpt ARGV` with stderr on a pseudo-terminal, as in an interactive shell; (exit code, stderr)."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))  # a 0x0 terminal shows no bar
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "lightning_shardckpt.cli.main", *argv]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    return process.wait(timeout=120), b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("command", ["verify", "compare"])
@pytest.mark.slow  # starts a Python process of its own
def test_long_commands_show_progress_on_a_terminal_and_stay_quiet_when_piped(tmp_path, command, run_cli):
    root = str(tmp_path / "root")
    save_checkpoint(root, step=1)
    save_checkpoint(root, step=2)
    argv = [command, f"{root}/latest"] if command == "verify" else [command, "--root", root, "1", "2"]
    code, shown = _stderr_on_a_terminal(argv)
    assert code in (exit_codes.OK, exit_codes.FOUND_PROBLEM)
    assert f"{command}:" in shown and "%|" in shown, shown
    _, _, piped = run_cli(*argv)  # captured: not a terminal
    assert f"{command}:" not in piped and "%|" not in piped
