"""The package's rooms and what each may import (lightning_shardckpt/*/__init__.py says the same in words)."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_shardckpt

PACKAGE = Path(lightning_shardckpt.__file__).parent
ROOMS = ("engine", "identity", "lightning", "ops")
LIGHTNING_DISTRIBUTIONS = ("lightning", "pytorch_lightning", "lightning_fabric")

# room -> rooms of ours it must never import (errors.py, at the top, is open to all)
FORBIDDEN_ROOMS = {
    "engine": {"identity", "lightning", "ops"},
    "identity": {"lightning", "ops"},
    "ops": {"lightning"},
    "lightning": set(),
}


def _imports(path: Path) -> list[str]:
    """Absolute module names imported by one file, relative imports resolved against its package."""
    module_parts = ["lightning_shardckpt", *path.relative_to(PACKAGE).with_suffix("").parts]
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
                # `from ..storage import fsio` may import the module lightning_shardckpt.engine.storage.fsio
                names.extend([stem] if node.module else [])
                names.extend(f"{stem}.{alias.name}" for alias in node.names)
            else:
                names.append(node.module or "")
    return names


def _modules_of(room: str) -> list[Path]:
    return sorted((PACKAGE / room).rglob("*.py"))


def _room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "lightning_shardckpt" and parts[1] in ROOMS else None


def test_every_module_lives_in_a_room_except_the_public_api_and_errors():
    top_level = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert top_level == ["__init__.py", "errors.py"]
    for room in ROOMS:
        init = PACKAGE / room / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), (
            f"{init} must open with a docstring saying what lives there"
        )


def test_the_engine_never_imports_lightning():
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in _modules_of("engine")
        for name in _imports(path)
        if name.split(".")[0] in LIGHTNING_DISTRIBUTIONS
    ]
    assert offenders == []


def test_only_the_lightning_room_imports_lightning():
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for room in ("engine", "identity", "ops")
        for path in _modules_of(room)
        for name in _imports(path)
        if name.split(".")[0] in LIGHTNING_DISTRIBUTIONS
    ]
    assert offenders == []


def test_rooms_import_only_downward():
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for room, forbidden in FORBIDDEN_ROOMS.items()
        for path in _modules_of(room)
        for name in _imports(path)
        if _room_of(name) in forbidden
    ]
    assert offenders == []


def test_the_import_scanner_sees_relative_imports_across_rooms(tmp_path):
    # The rule tests above are only as good as this resolution of `from ..x import y`.
    probe = PACKAGE / "engine" / "save" / "saver.py"
    names = _imports(probe)
    assert "lightning_shardckpt.errors" in names
    assert "lightning_shardckpt.engine.storage.fsio" in names  # from . import fsio, ...
    assert "lightning_shardckpt.engine.save.persist" in names
