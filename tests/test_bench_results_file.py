"""Every benchmark writes its JSON through ``bench/results_file.write_results``: one format, and the copy in ``$OUT``
that brings results back from the device machine (a script writing by hand left its numbers behind there)."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"

# Files a script writes that are not its results (so they must not be copied into $OUT), with the reason.
NOT_RESULTS = {
    "parallel_load.py": "each rank's numbers in a temporary folder, read back by rank 0 (which writes the results)",
}


def _hand_written_json(tree: ast.AST) -> list[int]:
    """Lines that write JSON without write_results: ``json.dump(obj, file)`` or ``x.write_text(json.dumps(...))``
    (printing ``json.dumps`` rows to the console is fine)."""
    def is_json(call, name):
        return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == name
                and isinstance(call.func.value, ast.Name) and call.func.value.id == "json")

    lines = []
    for node in ast.walk(tree):
        if is_json(node, "dump"):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("write_text", "write")
              and any(is_json(n, "dumps") for arg in node.args for n in ast.walk(arg))):
            lines.append(node.lineno)
    return lines


def test_no_benchmark_writes_json_by_hand():
    found = {}
    for script in sorted(BENCH.glob("*.py")):
        if script.name in ("results_file.py", *NOT_RESULTS):
            continue
        lines = _hand_written_json(ast.parse(script.read_text()))
        if lines:
            found[script.name] = lines
    assert not found, f"JSON written by hand (use results_file.write_results): {found}"


def test_the_exempt_files_still_exist_and_still_write_by_hand():
    """An exemption that no longer applies is removed, not left to hide a new hand-written results file."""
    for name in NOT_RESULTS:
        assert _hand_written_json(ast.parse((BENCH / name).read_text())), name


def test_write_results_writes_the_fields_and_a_copy_in_out(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("results_file", BENCH / "results_file.py")
    results_file = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results_file)
    res = {"device": "cpu", "rows": [{"a": 1, "b": [1.5, None]}], "complete": True}
    monkeypatch.delenv("OUT", raising=False)
    path = results_file.write_results(res, tmp_path / "deep" / "r.json")
    assert json.loads(path.read_text()) == res and not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    results_file.write_results([res], tmp_path / "deep" / "l.json")  # a list of rows (mxfp8_resident.py)
    assert json.loads((tmp_path / "out" / "l.json").read_text()) == [res]
    assert json.loads((tmp_path / "deep" / "l.json").read_text()) == [res]
