"""Dependencies point one way: quire_cli -> router, engine_worker -> quire.

The shared contract (``quire``) imports neither application nor the command line, and never
torch; the router imports neither the engine nor the command line, and never torch (its image
has none); the engine does not import the router or the command line. Checked statically on
every module's syntax tree (imports inside functions and in ``python -c`` strings included), and
for the torch-free packages also by importing every module in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package -> the top-level packages it must never import
FORBIDDEN = {
    "quire": {"engine_worker", "router", "quire_cli", "torch", "transformers"},
    "router": {"engine_worker", "quire_cli", "torch", "transformers"},
    "engine_worker": {"router", "quire_cli"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _python_c_sources(tree: ast.AST):
    """The code strings that follow a ``"-c"`` in a list or call, e.g.
    ``[sys.executable, "-c", "import x"]``: imports the interpreter would not see otherwise."""
    for node in ast.walk(tree):
        items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else (
            node.args if isinstance(node, ast.Call) else [])
        for flag, code in zip(items, items[1:]):
            if (isinstance(flag, ast.Constant) and flag.value == "-c"
                    and isinstance(code, ast.Constant) and isinstance(code.value, str)):
                yield code.value


def imported_modules(source: str, module: str = "", is_package: bool = False) -> set[str]:
    """Every module an import statement anywhere in ``source`` names (absolute names)."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(_resolve(node, module, is_package))
    for code in _python_c_sources(tree):
        names |= imported_modules(code)
    return names


def violations(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        module = _module_name(path)
        for name in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            if name.split(".")[0] in FORBIDDEN[package]:
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


def test_the_checker_sees_imports_in_functions_relative_and_in_python_c_strings():
    source = ("import os\n"
              "def f():\n    from torch import nn\n"
              "from . import sibling\n"
              "from ..pool import Pool\n"
              "CMD = [sys.executable, '-c', 'import engine_worker.engine; print(1)']\n")
    assert imported_modules(source, "router.sub.mod") == {
        "os", "torch", "router.sub", "router.pool", "engine_worker.engine"}
    assert imported_modules("from . import x", "router.sub", is_package=True) == {"router.sub"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_lies_below_it(package):
    assert (ROOT / package).is_dir()
    assert violations(package) == []


@pytest.mark.parametrize("package", ["quire", "router"])
def test_importing_every_module_loads_no_torch_and_no_other_layer(package):
    forbidden = sorted(FORBIDDEN[package])
    code = (
        "import importlib, pkgutil, sys\n"
        f"import {package}\n"
        f"names = [m.name for m in pkgutil.walk_packages({package}.__path__, '{package}.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        f"loaded = sorted({{m.split('.')[0] for m in sys.modules}} & set({forbidden!r}))\n"
        "print(len(names), loaded)\n"
        "sys.exit(1 if loaded else 0)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert int(result.stdout.split()[0]) > 5  # the walk found the package's modules
