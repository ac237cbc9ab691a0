"""Collecting the suite stays cheap: every pytest-xdist worker collects every test module (imports it and the
helpers it imports), though only one worker runs each test. An optional heavy package imported at module level is
paid by all of them: transformers ~1.7 CPU-s, wandb ~0.6, model_signing ~0.4 a worker (issue 48: the suite's CPU).
Such a package is imported where it is used (a builder, a parser, a test), or looked up with `find_spec`."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# optional packages a few tests use, each costly to import
HEAVY = frozenset({"transformers", "wandb", "model_signing"})


def _module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, top-level package) of what the module imports when it is imported: its top-level statements and the
    branches of top-level ifs and trys, except `if TYPE_CHECKING:`; plus `pytest.importorskip(NAME)` there."""
    found: list[tuple[int, str]] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                pending += node.body
            pending += node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, (ast.Expr, ast.Assign)):
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "importorskip"
                    and call.args
                    and isinstance(call.args[0], ast.Constant)
                ):
                    found.append((node.lineno, str(call.args[0].value).split(".")[0]))
    return found


def test_no_test_module_or_helper_imports_an_optional_heavy_package_at_module_level():
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{line} imports {package}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, package in _module_level_imports(ast.parse(path.read_text(), str(path)))
        if package in HEAVY
    ]
    assert not offenders, "import these where they are used (every worker collects every module):\n" + "\n".join(
        offenders
    )
