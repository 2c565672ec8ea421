"""Writing the flavour graphs of an artifact: the one owner for every flavour (``tensorrt_flavour.py``'s plugin
graphs, ``lowering.py``'s ONNX Runtime contrib graphs).

A flavour graph is a rewrite of one of the artifact's graphs that keeps its initializers as external data, so it
is written beside the graph it was made from (ONNX resolves external data relative to the graph file and refuses
links to it). Every flavour gets the same protections:

* the file lands atomically (written as ``.<file>.partial``, then renamed over the target): a failed write
  leaves neither a partial graph nor a temporary file, and is one error naming the file;
* a file of the artifact itself (``protected``: the manifest's files; always the graph it was made from) is never
  replaced, and any other existing file only where the caller says so (``replace``: an earlier build's flavour);
* the record names the flavour's file (a bare name in the directory, which ``load_artifact`` then requires to be
  a checksummed file of the artifact), its source graph and the external data files it reads, which must be the
  source's own (a rewrite that points its weights anywhere else is refused).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import onnx

from ..errors import ArtifactError

RECORD_KEYS = ("file", "source", "external_data")  # what every flavour's record holds; its own fields come after


def external_files(model: onnx.ModelProto) -> list[str]:
    """Files the graph's initializers point into (relative to the graph's directory)."""
    files = set()
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            files.update(e.value for e in t.external_data if e.key == "location")
    return sorted(files)


def write_flavour_graphs(directory: Path, graphs: dict, names: Iterable[str], flavour: str,
                         file_of: Callable[[str], str],
                         rewrite: Callable[[str, onnx.ModelProto], tuple[onnx.ModelProto, dict]],
                         protected: Collection[str] = frozenset(), replace: bool = False) -> dict:
    """For each graph ``name`` of ``names`` (``graphs``: name -> manifest ``GraphInfo``): load it from
    ``directory`` without its weights, ``rewrite(name, model)`` -> (flavour graph, record fields), and write the
    flavour graph as ``file_of(name)`` beside it. Returns the manifest's record of the flavour: per graph its
    ``file``, ``source``, ``external_data`` and the rewrite's fields."""
    directory = Path(directory)
    record = {}
    for name in names:
        src = directory / graphs[name].file
        try:
            model = onnx.load(str(src), load_external_data=False)
        except OSError as e:
            raise ArtifactError(f"{src}: cannot read graph {name!r} to write its {flavour} flavour "
                                f"({e.strerror or e})") from None
        flavoured, fields = rewrite(name, model)
        clash = sorted(set(fields) & set(RECORD_KEYS))
        if clash:
            raise ValueError(f"the {flavour} flavour's record fields {clash} are the writer's own")
        file = file_of(name)
        data = external_files(flavoured)
        foreign = sorted(set(data) - set(external_files(model)))
        if foreign:
            raise ArtifactError(f"{directory}: the {flavour} flavour of {src.name} reads external data {foreign}, "
                                f"which {src.name} does not: a flavour keeps its source's weights")
        write_graph(directory, file, flavoured, f"the {flavour} flavour of {src.name}",
                    protected={*protected, src.name}, replace=replace)
        record[name] = {"file": file, "source": src.name, "external_data": data, **fields}
    return record


def write_graph(directory: Path, file: str, model: onnx.ModelProto, what: str,
                protected: Collection[str] = frozenset(), replace: bool = False) -> Path:
    """Write ``model`` as ``directory / file`` atomically; ``protected`` files are never replaced, another
    existing file only with ``replace``. ``what`` names the graph in errors."""
    directory = Path(directory)
    if not file or Path(file).name != file or file.startswith("."):
        raise ArtifactError(f"{directory}: {what} must be a plain file name in the artifact, got {file!r}")
    target = directory / file
    if file in protected:
        raise ArtifactError(f"{directory}: {file} is a file of the artifact itself; not replacing it with {what}")
    if (target.exists() or target.is_symlink()) and not replace:
        raise ArtifactError(f"{directory}: {file} exists; not replacing it with {what} (remove it first)")
    tmp = directory / f".{file}.partial"
    try:
        tmp.write_bytes(model.SerializeToString(deterministic=True))
        tmp.replace(target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ArtifactError(f"{directory}: cannot write {what} as {file} ({e.strerror or e})") from None
    return target
