"""Where commands write (export, synth, triton-repo): one set of rules, so no writer loses data or leaves it behind.

- An output that would be replaced (``--force``) must not be, contain or sit inside one of the command's sources
  (a checkpoint, an artifact), and must not be or contain the working directory: replacing it would delete them.
- The output's parent directories are created (as ``mkdir -p``); a path that cannot be created or written is one
  clear error naming it, not a traceback.
- Files are produced in a hidden *staging* directory beside the output and renamed into place when complete.
  SIGTERM removes the staging directory as Ctrl-C does; after a SIGKILL (nothing can clean up then) the next
  write of the same output removes the staging directories whose process is gone. Their names carry the host and
  process id, so a live write, even one from another host on a shared file system, is never touched.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import M3Error

MARGIN = 64 << 20  # graphs, manifest and tokenizer files beside the weights
_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


def check_replaceable(out: Path, sources: Iterable[str | os.PathLike], error: type[M3Error]) -> None:
    """Refuse to replace ``out`` when that would delete a source (``out`` is it, contains it or lies inside it)
    or the working directory (``out`` is it or contains it)."""
    target = Path(out).resolve()
    for src in sources:
        s = Path(src).resolve()
        if target == s or target in s.parents:
            raise error(f"{out}: is or contains the source {src}; replacing it would delete the source "
                        "(choose another output directory)")
        if s in target.parents:
            raise error(f"{out}: lies inside the source {src}; replacing it would delete part of the source "
                        "(choose an output directory outside it)")
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise error(f"{out}: is or contains the current directory; refusing to replace it")


def make_parent(out: Path, error: type[M3Error]) -> None:
    """Create ``out``'s parent directories; an existing non-directory ``out`` or an uncreatable / unwritable parent
    is one clear error."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise error(f"{out}: exists and is not a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(f"{out.parent}: cannot create the output's parent directory ({e.strerror})") from None
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise error(f"{out.parent}: not writable, cannot create {out.name} there")


def _pattern(name: str) -> str:
    return f".{glob.escape(name)}.partial-*"


def staging_prefix(name: str) -> str:
    """The name prefix of this process's staging directories for ``name`` (what ``remove_stale`` recognises)."""
    return f".{name}.partial-{_HOST}-{os.getpid()}-"


def check_free_space(where: Path, needed: int, what: str, error: type[M3Error]) -> None:
    """Refuse before writing ``needed`` bytes into ``where``'s file system when it has less free space (plus a
    margin for the graphs and the manifest), instead of filling the disk and failing hours later."""
    free = shutil.disk_usage(where).free
    if needed + MARGIN > free:
        raise error(f"{where}: {what} needs {needed / 2**30:.2f} GiB but the file system has {free / 2**30:.2f} GiB "
                    "free (free some space, write elsewhere, or pick a --dtype that needs fewer conversions)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def remove_stale(parent: Path, name: str) -> list[Path]:
    """Remove staging directories for ``name`` in ``parent`` left by processes of this host that no longer run."""
    removed = []
    stale = re.compile(rf"\.{re.escape(name)}\.partial-{re.escape(_HOST)}-(\d+)-")
    for p in Path(parent).glob(_pattern(name)):
        m = stale.match(p.name)
        if m and not _alive(int(m.group(1))) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While the block runs, SIGTERM unwinds it like Ctrl-C (``finally`` / ``except`` clean-ups run), then the
    process exits with status 143. Only the main thread can own signal handlers; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        print("terminated", file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def staging(parent: Path, name: str, error: type[M3Error], mode: int = 0o755) -> Iterator[Path]:
    """A fresh hidden directory in ``parent`` to build ``name`` in (stale ones of earlier runs removed first).

    It is removed if the block raises (an error, Ctrl-C or SIGTERM); on success the block has renamed it into
    place, or whatever is left of it is removed.
    """
    remove_stale(parent, name)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=staging_prefix(name), dir=parent))
        tmp.chmod(mode)  # mkdtemp's 0700 would otherwise become the output's mode
    except OSError as e:
        raise error(f"{parent}: cannot write there ({e.strerror})") from None
    try:
        with terminate_as_interrupt():
            yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def os_errors_as(error: type[M3Error]):
    """A context manager turning an ``OSError`` (disk full, permission, a file where a directory should be) into
    ``error`` naming the path, so the command line prints one line."""
    return _OsErrors(error)


class _OsErrors(contextlib.AbstractContextManager):
    def __init__(self, error: type[M3Error]):
        self.error = error

    def __exit__(self, kind, exc, tb):
        if kind is not None and issubclass(kind, OSError):
            where = exc.filename if exc.filename is not None else "output"
            raise self.error(f"{where}: {exc.strerror or exc}") from None
        return False
