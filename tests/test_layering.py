"""Imports only go downward: every import inside ``pocketllm/`` names a package lower in the order below (the
order docs/architecture.md writes down), so no two packages import each other, directly or around a loop."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pocketllm"

# Bottom first. A module may import its own package and any package listed before it.
ORDER = [
    "errors",
    "cache_dir",
    "sampling_params",
    "config",
    "protocol",
    "outputs",
    "tokenizer",
    "request_builder",
    "step",
    "kernels",
    "distributed",
    "layers",
    "models",
    "loaders",
    "runner",
    "engine",
    "backends",
    "api",
    "scheduler_api",
    "server",
    "harness",
    "bench",
    "cli",
    "__main__",
    "__init__",
]
RANK = {name: i for i, name in enumerate(ORDER)}


def _unit(module: str) -> str:
    """The layer a dotted module name belongs to: ``pocketllm.engine.loop`` -> ``engine``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every ``pocketllm`` module ``path`` imports (at any depth: function bodies and TYPE_CHECKING too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return [(line, name) for line, name in found if name == "pocketllm" or name.startswith("pocketllm.")]


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_package_is_placed() -> None:
    units = {_unit(_module_name(p)) for p in _sources()}
    missing = sorted(units - set(RANK))
    assert not missing, f"packages missing from the layer order in this test and docs/architecture.md: {missing}"


def test_imports_only_go_down() -> None:
    upward = []
    for path in _sources():
        source = _unit(_module_name(path))
        for line, target in _imports(path):
            dest = _unit(target)
            if dest == "__init__" and source != "__init__":
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports the top-level package")
            elif dest != source and RANK[dest] > RANK[source]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({source}) imports {target} ({dest})")
    assert not upward, "imports that run up the stack:\n" + "\n".join(upward)


@pytest.mark.parametrize("names", [("step", "layers"), ("layers", "models"), ("runner", "engine")])
def test_order_matches_the_design(names: tuple[str, str]) -> None:
    lower, upper = names
    assert RANK[lower] < RANK[upper]
