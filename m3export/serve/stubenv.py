"""The Python that runs Triton's Python-backend stub: this interpreter's packages, with numpy < 2 in front.

Three facts about the stub of tritonserver 2.51 (nvidia-pytriton 0.7.0), seen here, force this:

- it embeds CPython in isolated mode, so ``PYTHONPATH`` and ``PYTHONHOME`` are ignored; the interpreter finds
  its prefix from the first ``python3`` on ``PATH`` and honours a ``pyvenv.cfg`` beside it;
- its C++ side was built against numpy 1.x and misreads numpy 2 arrays: INT64 inputs arrive as ``[5, 5, 5]``
  for ``[5, 6, 7]``, outputs arrive empty, and a BYTES input kills the stub;
- it links ``libpython3.X.so``, so the server's ``LD_LIBRARY_PATH`` must name this interpreter's lib directory.

So we build a small venv (no pip, made once and cached): its site-packages holds numpy<2 and a ``.pth`` that
appends this interpreter's site directories after it (their own ``.pth`` files, editable installs included,
are processed too). With its ``bin/`` first on ``PATH`` the stub imports m3export, torch and the rest of this
environment, with a numpy its C++ understands.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import venv
from pathlib import Path

from ..errors import BackendUnavailable

NUMPY_SPEC = "numpy<2"


def cache_root() -> Path:
    """``M3EXPORT_CACHE`` or ``$XDG_CACHE_HOME/m3export`` (``~/.cache/m3export``)."""
    if os.environ.get("M3EXPORT_CACHE"):
        return Path(os.environ["M3EXPORT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "m3export"


def base_site_dirs() -> list[str]:
    """Where this interpreter finds packages: its site directories, plus the source tree m3export was imported
    from when that came from ``sys.path`` itself (``PYTHONPATH=.``) rather than from an installation."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    tree = Path(__file__).resolve().parents[2]
    on_path = {Path(p or ".").resolve() for p in sys.path}
    if tree in on_path and all(tree != Path(d).resolve() for d in dirs):
        dirs.append(str(tree))
    return [d for d in dirs if os.path.isdir(d)]


def _needs_numpy1() -> bool:
    import numpy

    return int(numpy.__version__.split(".")[0]) >= 2


def libpython_dir() -> Path:
    """The directory holding this interpreter's shared libpython, which the stub loads."""
    libdir = Path(sysconfig.get_config_var("LIBDIR") or "")
    name = sysconfig.get_config_var("LDLIBRARY") or ""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not (libdir / name).is_file():
        raise BackendUnavailable(
            f"Triton's Python stub needs a shared libpython{sys.version_info[0]}.{sys.version_info[1]}, and this "
            f"Python ({sys.executable}) was built without one; use a Python built with --enable-shared "
            "(pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared; python.org, conda and distro Pythons have it)")
    return libdir


PREPARE_COMMAND = "python -m m3export.serve.stubenv"


def _target(root: Path | None) -> tuple[Path, bool, list[str]]:
    numpy1 = _needs_numpy1()
    dirs = base_site_dirs()
    key = "\n".join([os.path.realpath(sys.executable), sys.version, NUMPY_SPEC if numpy1 else "", *dirs])
    ver = f"py{sys.version_info[0]}.{sys.version_info[1]}"
    target = (root or cache_root()) / "triton-stub-env" / f"{ver}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return target, numpy1, dirs


def stub_env(root: Path | None = None) -> Path:
    """The prepared venv for the stub; put ``<it>/bin`` first on ``PATH``.

    Serving never installs anything (it may run offline): the venv is made at install time by
    ``scripts/setup.sh`` or ``python -m m3export.serve.stubenv``, and a missing one is a clear error.
    """
    target, _, _ = _target(root)
    if (target / "pyvenv.cfg").is_file():
        return target
    raise BackendUnavailable(
        f"Triton's Python stub needs its environment ({target}), which is prepared once at install time "
        f"(it installs {NUMPY_SPEC} beside this environment): run `{PREPARE_COMMAND}`")


def prepare_stub_env(root: Path | None = None) -> Path:
    """Create the stub's venv (once; reused while this interpreter and its site directories stay the same)."""
    target, numpy1, dirs = _target(root)
    if (target / "pyvenv.cfg").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        venv.EnvBuilder(symlinks=True, with_pip=False).create(tmp)
        site_packages = tmp / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
        if numpy1:
            _install_numpy1(site_packages)
        lines = [f"import site; site.addsitedir({d!r})" for d in dirs]
        (site_packages / "m3export-base-env.pth").write_text("\n".join(lines) + "\n")
        try:
            tmp.rename(target)
        except OSError:  # another process finished first; its env is as good as ours
            if not (target / "pyvenv.cfg").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _install_numpy1(site_packages: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target", str(site_packages), NUMPY_SPEC]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise BackendUnavailable(
            f"Triton's Python stub (built against numpy 1.x) needs {NUMPY_SPEC} beside this environment's numpy 2, "
            f"and installing it failed:\n  {' '.join(cmd)}\n{tail}")


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog=PREPARE_COMMAND,
        description="Prepare the Python environment that tritonserver's Python-backend stub runs in (numpy<2 in "
                    "front of this environment's packages). Run once after installing; serving itself never "
                    "installs anything.",
        epilog=f"example: {PREPARE_COMMAND}   (cache: M3EXPORT_CACHE or ~/.cache/m3export)")
    parser.parse_args()
    print(f"stub environment ready: {prepare_stub_env()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
