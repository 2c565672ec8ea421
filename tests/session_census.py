"""Run a script in a subprocess and count the ``PagedSession``s it opened and left unclosed at interpreter exit.

An ONNX Runtime session on CUDA left to the interpreter's exit was destroyed after the CUDA runtime had shut down
and aborted a process whose work had succeeded (``plugins/onnxruntime/session.py``); scripts close every session
they open. The census wraps ``PagedSession.__init__`` in the child and prints one line from ``atexit`` (which runs
after the script's ``sys.exit``), so a test reads the counts from the child's stdout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CENSUS = """
import atexit, runpy, sys
from m3export.plugins.onnxruntime.session import PagedSession
opened, init = [], PagedSession.__init__
def counted(self, *args, **kwargs):
    init(self, *args, **kwargs)
    opened.append(self)
PagedSession.__init__ = counted
atexit.register(lambda: print(f"SESSIONS opened={len(opened)} unclosed={sum(not s.closed for s in opened)}"))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_with_census(script: Path, args: list[str], timeout: int) -> tuple[subprocess.CompletedProcess, int, int]:
    """``python script *args`` with the census; (the finished process, sessions opened, sessions left unclosed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    run = subprocess.run([sys.executable, "-c", _CENSUS, str(script), *args], capture_output=True, text=True,
                         timeout=timeout, env=env)
    found = re.findall(r"^SESSIONS opened=(\d+) unclosed=(\d+)$", run.stdout, re.M)
    assert found, f"{script.name}: no session census in its output\n" + run.stdout[-2000:] + run.stderr[-2000:]
    return run, int(found[-1][0]), int(found[-1][1])
