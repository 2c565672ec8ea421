"""A Triton model repository for M3 that Triton loads as is, and the way back from its parameters to an engine.

Layout (Triton's versioned layout, one Python-backend model in decoupled mode so it can stream)::

    REPO/NAME/config.pbtxt        inputs/outputs in Triton's vLLM-backend convention, parameters say what to load
    REPO/NAME/1/model.py          three lines: the implementation ships with m3export (m3export.serve.triton_model)
    REPO/NAME/1/artifact/         only with copy=True (or checkpoint/); otherwise config.pbtxt holds the
                                  absolute path, so multi-hundred-GB weights are never duplicated by default

Everything the model needs at load time is in ``config.pbtxt`` ``parameters``: ``source_kind`` (preset,
checkpoint or artifact), ``source`` (a preset name, an absolute path, or a path relative to the version
directory), ``backend`` and ``engine_args`` (JSON keyword arguments for the engine).
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..config import PRESETS
from ..dtypes import BY_NAME, KV_CACHE_DTYPES, MODEL_DTYPES
from ..errors import M3Error
from ..output_dir import check_replaceable, make_parent, os_errors_as, staging
from ..sources import ARTIFACT, BACKENDS, CHECKPOINT, MANIFEST, PRESET, default_backend, source_kind
from .protocol import INPUTS, OUTPUTS, TensorSpec

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class RepositoryError(M3Error):
    """The repository cannot be written as asked, or a written repository's parameters are unusable."""


@dataclass(frozen=True)
class Source:
    kind: str  # preset | checkpoint | artifact
    location: str  # preset name or resolved absolute path


def resolve_source(source: str, backend: str) -> Source:
    """What ``source`` is. Checkpoints and presets have no exported graphs, so only the torch backend runs them."""
    if backend not in BACKENDS:
        raise RepositoryError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    path, kind = Path(source), source_kind(source)
    if kind == ARTIFACT:
        from ..export.artifact import load_artifact

        load_artifact(path, verify_checksums=False)  # structure now, not hours of hashing
        return Source(ARTIFACT, str(path.resolve()))
    if kind == CHECKPOINT:
        if path.exists() and not path.is_dir():
            raise RepositoryError(f"{path}: expected an artifact or checkpoint directory, got a file")
        if not path.exists():
            raise RepositoryError(f"{source}: no such directory, and not a preset ({', '.join(PRESETS)})")
        if not (path / "config.json").is_file():
            raise RepositoryError(f"{path.resolve()}: neither an exported artifact ({MANIFEST}) nor a checkpoint "
                                  "(config.json)")
        path = path.resolve()
    if backend != "torch":
        raise RepositoryError(f"{source}: a {kind} runs on the torch backend only; export it first "
                              f"(m3export export) to serve it with {backend}")
    return Source(kind, str(path))


def _engine_parameters() -> set[str]:
    from ..runtime import Engine

    names = set()
    for fn in (Engine.__init__, Engine.from_checkpoint, Engine.from_artifact):
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                names.add(p.name)
    return names - {"self", "cls", "path", "path_or_preset", "backend", "tokenizer", "drafter"}


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings -> keyword arguments for the engine; VALUE is JSON when it parses as JSON."""
    allowed = _engine_parameters()
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RepositoryError(f"engine argument {item!r}: expected KEY=VALUE, e.g. max_model_len=8192")
        if key not in allowed:
            raise RepositoryError(f"engine argument {key!r} is not an engine parameter; known: "
                                  f"{', '.join(sorted(allowed))}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        if key == "dtype" and value not in MODEL_DTYPES:
            raise RepositoryError(f"engine argument dtype={value!r}: expected one of {', '.join(MODEL_DTYPES)}")
        if key == "kv_cache_dtype" and value not in KV_CACHE_DTYPES:
            raise RepositoryError(f"engine argument kv_cache_dtype={value!r}: expected one of "
                                  f"{', '.join(KV_CACHE_DTYPES)}")
        out[key] = value
    return out


def _tensor(spec: TensorSpec) -> str:
    dims = ", ".join(str(d) for d in spec.dims)
    optional = " optional: true" if spec.optional else ""
    return f'  {{ name: "{spec.name}" data_type: {spec.dtype} dims: [ {dims} ]{optional} }}'


def pbtxt_string(value: str) -> str:
    """``value`` as a protobuf text-format string literal. Non-ASCII characters stay UTF-8 as they are (JSON's
    ``\\uXXXX``, which tritonserver 2.51's parser does not decode, turned ``ärt`` into a path that does not
    exist); quotes, backslashes and control characters get the escapes every text-format parser reads."""
    out = []
    for ch in value:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\{ord(ch):03o}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def render_config(name: str, instances: int, parameters: dict[str, str]) -> str:
    params = ",\n".join(f'  {{ key: "{k}" value: {{ string_value: {pbtxt_string(v)} }} }}'
                        for k, v in parameters.items())
    return (
        f"# Written by m3export {__version__} (m3export triton-repo). Inputs and outputs follow Triton's vLLM\n"
        "# backend; decoupled mode lets one request receive many (streamed) responses.\n"
        f'name: "{name}"\n'
        'backend: "python"\n'
        "max_batch_size: 0\n"
        "model_transaction_policy { decoupled: true }\n"
        "input [\n" + ",\n".join(_tensor(s) for s in INPUTS) + "\n]\n"
        "output [\n" + ",\n".join(_tensor(s) for s in OUTPUTS) + "\n]\n"
        "# Each instance loads its own engine and batches its requests continuously.\n"
        f"instance_group [ {{ count: {instances} kind: KIND_MODEL }} ]\n"
        "parameters [\n" + params + "\n]\n"
    )


MODEL_PY = '''\
"""Triton Python-backend entry point written by m3export {version} (m3export triton-repo).

The implementation ships with the m3export package, so the Python that runs Triton's stub must import it (and,
for tritonserver 2.51's stub, have numpy < 2): `python -m m3export.serve.server REPO` prepares such a Python.
"""

try:
    from m3export.serve.triton_model import TritonPythonModel  # noqa: F401
except ImportError as e:
    import sys

    raise ImportError(f"m3export is not importable by Triton's Python stub ({{sys.executable}}): {{e}}; serve this "
                      "repository with `python -m m3export.serve.server`, or install m3export into that Python") from e
'''


def write_repository(source: str, out: str | Path, *, backend: str | None = None, instances: int = 1,
                     name: str = "m3", copy: bool = False, engine_args: dict[str, Any] | None = None,
                     force: bool = False) -> Path:
    """Write ``out/name`` (the repository may hold other models) and return that model directory.

    ``backend`` None picks what the source was built for (``sources.default_backend``: onnxruntime for an
    exported artifact, torch otherwise). ``force`` replaces ``out/name``, never when that is (or holds) the
    source being served or the current directory.
    """
    backend = backend or default_backend(source)
    if not _NAME.fullmatch(name):
        raise RepositoryError(f"model name {name!r}: use letters, digits, '_', '.' and '-' (it is a directory)")
    if instances < 1:
        raise RepositoryError(f"instances must be >= 1, got {instances}")
    src = resolve_source(source, backend)
    kv_cache_dtype = (engine_args or {}).get("kv_cache_dtype")
    if src.kind == ARTIFACT and backend != "torch" and kv_cache_dtype not in (None, "auto"):
        from ..runtime.backends import check_exported_cache_dtype

        # here, not when Triton loads the model: the graphs run with the cache dtype they were exported with
        # (``auto``, the default, is that dtype: an FP8 artifact is served with its FP8 cache)
        check_exported_cache_dtype(backend, src.location, kv_cache_dtype)
    if copy and src.kind == "preset":
        raise RepositoryError(f"{source} is a preset: there is nothing to copy (drop --copy)")
    repo = Path(out).resolve()
    model_dir = repo / name
    if model_dir.exists() and not force:
        raise RepositoryError(f"{model_dir} exists; remove it, choose another --name, or pass --force")
    if force:
        check_replaceable(model_dir, [] if src.kind == PRESET else [src.location], RepositoryError)
    make_parent(model_dir, RepositoryError)  # the repository directory, parents included

    with os_errors_as(RepositoryError), staging(repo, name, RepositoryError) as tmp:
        version_dir = tmp / "1"
        version_dir.mkdir()
        location = src.location
        if copy:
            _check_self_contained(Path(src.location))
            shutil.copytree(src.location, version_dir / src.kind)
            location = src.kind  # relative to the version directory
        parameters = {"source_kind": src.kind, "source": location, "backend": backend,
                      "engine_args": json.dumps(engine_args or {}, sort_keys=True)}
        (tmp / "config.pbtxt").write_text(render_config(name, instances, parameters), encoding="utf-8")
        (version_dir / "model.py").write_text(MODEL_PY.format(version=__version__))
        if model_dir.exists():
            shutil.rmtree(model_dir)
        tmp.rename(model_dir)
    return model_dir


def _check_self_contained(root: Path) -> None:
    """A copy is only valid if the artifact names no file outside its own directory."""
    manifest = root / MANIFEST
    if not manifest.is_file():
        return
    files = json.loads(manifest.read_text()).get("files", {})
    outside = [f for f in files if Path(f).is_absolute() or ".." in Path(f).parts]
    if outside:
        raise RepositoryError(f"{root}: the artifact uses files outside its directory ({outside[:3]}); a copy "
                              "would not find them, so reference it instead (--link)")


def load_engine(parameters: dict[str, str], version_dir: Path):
    """The engine a written repository describes (runs inside Triton's stub, in ``initialize``)."""
    from ..runtime import Engine

    missing = [k for k in ("source_kind", "source", "backend") if not parameters.get(k)]
    if missing:
        raise RepositoryError(f"config.pbtxt parameters lack {missing}; rewrite the model with m3export triton-repo")
    kind, location, backend = parameters["source_kind"], parameters["source"], parameters["backend"]
    kwargs = json.loads(parameters.get("engine_args") or "{}")
    if "dtype" in kwargs:
        kwargs["dtype"] = BY_NAME[kwargs["dtype"]].torch
    if kind == PRESET:
        return Engine.from_checkpoint(location, **kwargs)
    path = Path(location) if Path(location).is_absolute() else version_dir / location
    if not path.is_dir():
        raise RepositoryError(f"{path}: the {kind} this model serves is missing (moved or deleted?)")
    if kind not in (CHECKPOINT, ARTIFACT):
        raise RepositoryError(f"config.pbtxt: unknown source_kind {kind!r} (expected preset, checkpoint or "
                              "artifact)")
    # both read the directory's preprocessor_config.json / video_preprocessor_config.json into
    # engine.media_settings (m3export.serve.media.media_settings); a bad file stops the load naming file and field
    return Engine.from_checkpoint(path, **kwargs) if kind == CHECKPOINT else \
        Engine.from_artifact(path, backend=backend, **kwargs)
