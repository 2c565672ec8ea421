"""Where a benchmark's results go: one JSON file (under ``bench/results/`` by default), and a copy in ``$OUT`` when
the script runs on the device machine, whose ``$OUT`` folder is what comes back from a run."""

from __future__ import annotations

import json
import os
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(res: dict | list, path: str | Path) -> Path:
    """Write ``res`` as indented JSON to ``path`` (folders made as needed), and to ``$OUT/<name>`` when ``$OUT``
    is set; returns ``path``. Every benchmark writes its JSON through this (``tests/test_bench_results_file.py``)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(res, indent=1)
    out.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(text)
    return out
