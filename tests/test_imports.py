"""Every module of the package imports under its installed name (pyproject's ``packages`` / ``package-dir``).

``runtime/`` and ``plugins/`` are installed as ``m3export.runtime`` / ``m3export.plugins``: they must reach the
rest of the package by that name (``from m3export.config import ...``), never by a relative import that climbs
out of their own directory, and nothing may be importable only as a generic top-level ``runtime`` or ``plugins``.
"""

from __future__ import annotations

import ast
import importlib
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_dir(package: str) -> Path:
    """Where setuptools takes ``package`` from: the longest ``package-dir`` prefix, then the dotted rest."""
    mapped = max((p for p in SETUP["package-dir"] if package == p or package.startswith(p + ".")), key=len)
    rest = package[len(mapped):].lstrip(".")
    return ROOT / SETUP["package-dir"][mapped] / Path(*rest.split(".")) if rest else ROOT / SETUP["package-dir"][mapped]


def _modules() -> dict[str, Path]:
    out = {}
    for package in SETUP["packages"]:
        for f in sorted(_package_dir(package).glob("*.py")):
            out[package if f.stem == "__init__" else f"{package}.{f.stem}"] = f
    return out


MODULES = _modules()


def test_every_source_file_is_packaged():
    packaged = {f.resolve() for f in _modules().values()}  # now, not at collection: files may appear meanwhile
    roots = {ROOT / d for d in SETUP["package-dir"].values()}
    on_disk = {f.resolve() for r in roots for f in r.rglob("*.py") if "__pycache__" not in f.parts}
    missing = sorted(str(f.relative_to(ROOT)) for f in on_disk - packaged)
    assert not missing, f"not in pyproject's [tool.setuptools] packages, so never installed: {missing}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports_under_its_installed_name(name):
    module = importlib.import_module(name)
    assert module.__name__ == name
    assert Path(module.__file__).resolve() == MODULES[name].resolve()
    assert not {"runtime", "plugins"} & set(sys.modules), "imported under a generic top-level name"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(("m3export.runtime", "m3export.plugins"))))
def test_relative_imports_stay_inside_their_directory(name):
    """A relative import out of runtime/ or plugins/ works only once installed; say ``m3export.`` instead."""
    package = name if MODULES[name].stem == "__init__" else name.rpartition(".")[0]
    depth = package.count(".")  # how many levels a relative import may climb before leaving m3export.runtime/.plugins
    tree = ast.parse(MODULES[name].read_text())
    climbing = [f"line {n.lineno}: from {'.' * n.level}{n.module or ''}" for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.level > depth]
    assert not climbing, f"{MODULES[name].relative_to(ROOT)}: {climbing}"


def test_the_source_tree_imports_without_an_installation():
    """The H200 machine runs the working tree on its own packages (``PYTHONPATH=.``): with no installation's
    finder, ``m3export.runtime`` and ``m3export.plugins`` still resolve to ``runtime/`` and ``plugins/``."""
    import subprocess

    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import m3export.runtime.engine, m3export.plugins.kernels\n"
        "print(m3export.runtime.__file__); print(m3export.plugins.kernels.__file__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(ROOT / "runtime" / "__init__.py"),
                                   str(ROOT / "plugins" / "kernels" / "__init__.py")]
