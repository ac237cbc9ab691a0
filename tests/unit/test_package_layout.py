"""The package's rooms and what each may import (lightning_shardckpt/*/__init__.py says the same in words).

Rules: every room and sub-room says in its `__init__` docstring what lives there; rooms import only
downward (ORDER, errors at the bottom, cli at the top); only lightning/ imports Lightning; nothing
imports cli/; no module import cycle; every module outside lightning/ (cli/ included: the command line
runs where Lightning is not installed) imports with Lightning absent.

Each checker takes a package directory, so each is also run on a tiny synthetic package holding one
violation, to show that it fails when it should.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lightning_shardckpt

PACKAGE = Path(lightning_shardckpt.__file__).parent
ORDER = ("errors", "engine", "identity", "policies", "training", "ops", "lightning", "cli")  # bottom to top
ADAPTER = "lightning"  # the one room that imports Lightning
FRONT_DOOR = "cli"  # the room nothing imports
TOP_LEVEL_FILES = ["__init__.py", "errors.py"]
LIGHTNING_DISTRIBUTIONS = ("lightning", "pytorch_lightning", "lightning_fabric")


# --- the scanner ---


def modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (packages by their __init__)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_names(package_dir: Path, path: Path) -> list[str]:
    """Absolute names one file imports, anywhere in it (module level, functions, TYPE_CHECKING blocks).

    Relative imports are resolved against the file's package; `from .x import y` yields `...x.y`, which
    names the module y when x is a package, else a name in the module x (`import_graph` resolves it to
    the most specific module).
    """
    module_parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
    if module_parts[-1] == "__init__":
        module_parts.pop()
    package_parts = module_parts if path.name == "__init__.py" else module_parts[:-1]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            names.extend(f"{stem}.{alias.name}" for alias in node.names)
    return names


def _own_module(known: dict[str, Path], name: str) -> str | None:
    """The most specific module of the package that `name` names (None outside the package)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, counting every import in the file.

    An import of `pkg.a.b` is an edge to `pkg.a.b` only, not to the packages `pkg` and `pkg.a` that
    Python initialises on the way: counting those would put every module on a cycle through the
    package's public __init__, which imports its own submodules.
    """
    known = modules(package_dir)
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        targets: set[str] = set()
        for name in imported_names(package_dir, path):
            if name.split(".")[0] != package_dir.name:
                continue
            target = _own_module(known, name)
            if target is not None and target != module and not module.startswith(f"{target}."):
                targets.add(target)
        graph[module] = targets
    return graph


def _room(package_dir: Path, module: str) -> str | None:
    """A module's room (errors counts as the bottom room); None for the package's public __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


# --- the checkers: each returns what breaks its rule, empty when the package keeps it ---


def missing_docstrings(package_dir: Path) -> list[str]:
    return [
        f"{path.relative_to(package_dir.parent)} must open with a docstring saying what lives there"
        for path in sorted(package_dir.rglob("__init__.py"))
        if not ast.get_docstring(ast.parse(path.read_text()))
    ]


def upward_imports(package_dir: Path) -> list[str]:
    offenders = []
    for module, targets in import_graph(package_dir).items():
        room = _room(package_dir, module)
        if room not in ORDER:
            continue  # the public __init__ stands above the rooms (rule: it never imports cli, below)
        for target in sorted(targets):
            target_room = _room(package_dir, target)
            if target_room in ORDER and ORDER.index(target_room) > ORDER.index(room):
                offenders.append(f"{module} ({room}) imports {target} ({target_room}), a room above it")
    return offenders


def lightning_imports_outside_adapter(package_dir: Path) -> list[str]:
    return [
        f"{module} imports {name}: only {package_dir.name}.{ADAPTER} may import Lightning"
        for module, path in modules(package_dir).items()
        if _room(package_dir, module) != ADAPTER
        for name in imported_names(package_dir, path)
        if name.split(".")[0] in LIGHTNING_DISTRIBUTIONS
    ]


def front_door_imports(package_dir: Path) -> list[str]:
    return [
        f"{module} imports {target}: nothing in the package may import {FRONT_DOOR}/"
        for module, targets in import_graph(package_dir).items()
        if _room(package_dir, module) != FRONT_DOOR
        for target in sorted(targets)
        if _room(package_dir, target) == FRONT_DOOR
    ]


def import_cycles(package_dir: Path) -> list[list[str]]:
    """Each cycle as a path of modules that ends where it starts (one per strongly connected group)."""
    graph = import_graph(package_dir)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative: the graph may be deep
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_cycle_within(graph, set(group)) for group in groups]


def _cycle_within(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """One concrete cycle through a strongly connected group (breadth-first back to its first module)."""
    start = min(group)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def strategy_private_uses(files: list[Path], owner: Path) -> list[str]:
    """Reads or writes of a strategy's private attributes (`strategy._x`, `trainer.strategy._x`) and writes of
    its public ones (`strategy.x = ...`) outside `owner`, the strategy's own module: one contract, no reaching in."""
    found = []
    for path in files:
        if path.resolve() == owner.resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Attribute) or not _names_a_strategy(node.value):
                continue
            # `_target_` and dunders are not privates (a Hydra config's `strategy._target_`)
            private = node.attr.startswith("_") and not node.attr.endswith("_")
            if private or isinstance(node.ctx, ast.Store):
                found.append(f"{path}:{node.lineno}: strategy.{node.attr}")
    return found


def _names_a_strategy(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "strategy"


LIGHTNING_BLOCKED_IMPORTER = textwrap.dedent(
    """
    import importlib, sys
    package_dir, names = sys.argv[1], sys.argv[2:]
    sys.path.insert(0, str(__import__("pathlib").Path(package_dir).parent))
    for blocked in {blocked!r}:
        sys.modules[blocked] = None  # `import lightning` now raises ImportError, as if it were not installed
    # The package's public __init__ runs first, as it does for a user: it must itself import without Lightning.
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as err:
            print(f"{{name}} needs Lightning: {{err}}")
    """
)


def modules_needing_lightning(package_dir: Path) -> list[str]:
    """Modules outside the adapter that fail to import when Lightning is not installed (a subprocess)."""
    names = [
        module
        for module in modules(package_dir)
        if module != package_dir.name and _room(package_dir, module) != ADAPTER
    ]
    script = LIGHTNING_BLOCKED_IMPORTER.format(blocked=LIGHTNING_DISTRIBUTIONS)
    done = subprocess.run(
        [sys.executable, "-c", script, str(package_dir), *names],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=package_dir.parent,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.splitlines()


# --- the rules on the real package ---


def test_every_module_lives_in_a_room_except_the_public_api_and_errors():
    assert sorted(path.name for path in PACKAGE.glob("*.py")) == TOP_LEVEL_FILES
    rooms = sorted(path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists())
    assert rooms == sorted(set(ORDER) - {"errors"})


def test_every_room_and_sub_room_says_what_lives_there():
    assert missing_docstrings(PACKAGE) == []


def test_rooms_import_only_downward():
    assert upward_imports(PACKAGE) == []


def test_only_the_lightning_room_imports_lightning():
    assert lightning_imports_outside_adapter(PACKAGE) == []


def test_nothing_imports_the_command_line():
    assert front_door_imports(PACKAGE) == []


def test_no_import_cycle():
    cycles = import_cycles(PACKAGE)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


@pytest.mark.slow  # starts a Python process of its own
def test_every_module_outside_the_adapter_imports_without_lightning():
    assert modules_needing_lightning(PACKAGE) == []


def test_nothing_outside_the_strategy_reaches_into_it():
    repo = PACKAGE.parent
    files = [
        path for top in ("lightning_shardckpt", "tests", "benchmarks", "recipes") for path in (repo / top).rglob("*.py")
    ]
    assert strategy_private_uses(files, PACKAGE / "lightning" / "trainer" / "strategy.py") == []


def test_the_strategy_checker_finds_a_private_read_and_an_attribute_write(tmp_path):
    intruder = tmp_path / "intruder.py"
    intruder.write_text(
        "def f(trainer, strategy):\n    trainer.strategy._savers.get('x')\n    strategy.save_config = None\n"
    )
    found = strategy_private_uses([intruder], tmp_path / "strategy.py")
    assert sorted(line.split(": ")[1] for line in found) == ["strategy._savers", "strategy.save_config"], found


def test_the_import_scanner_sees_relative_imports_across_rooms():
    # The rules above are only as good as this resolution of `from ..x import y`.
    graph = import_graph(PACKAGE)
    saver = "lightning_shardckpt.engine.save.saver"
    assert "lightning_shardckpt.errors" in graph[saver]
    assert "lightning_shardckpt.engine.storage.fsio" in graph[saver]  # from ..storage import fsio
    assert "lightning_shardckpt.engine.save.persist" in graph[saver]  # from .persist import ...


# --- each checker fails on a package that breaks its rule ---


def _package(tmp_path: Path, files: dict[str, str], name: str = "pkg") -> Path:
    """A synthetic package: every room present with a docstring, plus `files` (path -> source)."""
    root = tmp_path / name
    (root / "__init__.py").parent.mkdir(parents=True)
    (root / "__init__.py").write_text('"""The public API."""\n')
    (root / "errors.py").write_text("class Oops(Exception):\n    pass\n")
    for room in ORDER[1:]:
        (root / room).mkdir()
        (root / room / "__init__.py").write_text(f'"""The {room} room."""\n')
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


@pytest.mark.slow  # starts a Python process of its own
def test_a_clean_synthetic_package_passes_every_checker(tmp_path):
    package = _package(
        tmp_path,
        {
            "engine/core.py": "from ..errors import Oops\n",
            "ops/tool.py": "from ..engine import core\nfrom ..engine.core import Oops\n",
            "lightning/adapter.py": "import lightning\nfrom ..ops.tool import core\n",
            "cli/main.py": "from ..ops import tool\n",  # the command line, too, runs without Lightning
        },
    )
    assert missing_docstrings(package) == []
    assert upward_imports(package) == []
    assert lightning_imports_outside_adapter(package) == []
    assert front_door_imports(package) == []
    assert import_cycles(package) == []
    assert modules_needing_lightning(package) == []


def test_the_docstring_checker_finds_a_sub_room_without_one(tmp_path):
    package = _package(tmp_path, {"engine/format/__init__.py": "X = 1\n"})
    assert missing_docstrings(package) == [
        "pkg/engine/format/__init__.py must open with a docstring saying what lives there"
    ]


def test_the_direction_checker_finds_an_upward_import_even_inside_a_function(tmp_path):
    package = _package(tmp_path, {"engine/core.py": "def f():\n    from ..policies import rules\n"})
    (package / "policies" / "rules.py").write_text("")
    assert upward_imports(package) == [
        "pkg.engine.core (engine) imports pkg.policies.rules (policies), a room above it"
    ]


def test_the_lightning_checker_finds_lightning_in_the_engine(tmp_path):
    package = _package(
        tmp_path,
        {"engine/core.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pytorch_lightning as pl\n"},
    )
    assert lightning_imports_outside_adapter(package) == [
        "pkg.engine.core imports pytorch_lightning: only pkg.lightning may import Lightning"
    ]


def test_the_front_door_checker_finds_an_import_of_cli_even_from_the_public_init(tmp_path):
    package = _package(tmp_path, {"cli/main.py": "", "ops/tool.py": "from ..cli import main\n"})
    (package / "__init__.py").write_text('"""The public API."""\nfrom .cli.main import *\n')
    assert front_door_imports(package) == [
        "pkg imports pkg.cli.main: nothing in the package may import cli/",
        "pkg.ops.tool imports pkg.cli.main: nothing in the package may import cli/",
    ]


def test_the_cycle_checker_names_a_cycle_held_by_a_late_import(tmp_path):
    package = _package(
        tmp_path,
        {
            "engine/a.py": "from . import b\n",
            "engine/b.py": "from .c import thing\n",
            "engine/c.py": "thing = 1\ndef late():\n    from .a import x\n",
        },
    )
    assert import_cycles(package) == [["pkg.engine.a", "pkg.engine.b", "pkg.engine.c", "pkg.engine.a"]]


@pytest.mark.slow  # starts a Python process of its own
def test_the_lightning_free_import_check_names_a_module_that_needs_lightning(tmp_path):
    # the runtime check catches what needs Lightning however it gets there (here: through the adapter)
    package = _package(
        tmp_path,
        {"lightning/adapter.py": "import lightning_fabric\n", "ops/tool.py": "from ..lightning import adapter\n"},
        name="pkg_needs_lightning",
    )
    found = modules_needing_lightning(package)
    assert [line.split(":")[0] for line in found] == ["pkg_needs_lightning.ops.tool needs Lightning"]


@pytest.mark.slow  # starts a Python process of its own
def test_without_lightning_the_adapter_names_say_how_to_get_them():
    code = (
        "import sys\n"
        f"for name in {LIGHTNING_DISTRIBUTIONS!r}:\n"
        "    sys.modules[name] = None\n"
        "import lightning_shardckpt\n"
        "assert lightning_shardckpt.CheckpointSaver is not None  # the engine's front door imports\n"
        "try:\n"
        "    lightning_shardckpt.ShardedCheckpoint\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "pip install" in done.stdout and "CheckpointSaver" in done.stdout
