"""``m3export build``: the artifact's graphs in their TensorRT flavour -> serialized engines + ``build.json``.

Everything up to ``builder.build_serialized_network`` is prepared by tested plain Python (flavour graphs,
profiles, plugin shape / kernel logic); this module only drives TensorRT. Without TensorRT it stops before
touching the output directory, with one ``BackendUnavailable`` line naming what to install.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ..errors import ArtifactError
from ..export.manifest import sha256_file
from .profiles import Limits, check_engine, engine_metadata, profiles_for  # noqa: F401  (check_engine: re-export)

BUILD_JSON = "build.json"



def _prepare_out(out: Path, artifact_root: Path, force: bool) -> None:
    out_r, art_r = out.resolve(), artifact_root.resolve()
    if out_r == art_r or out_r in art_r.parents or art_r in out_r.parents:
        raise ArtifactError(f"{out}: the engine directory must be outside the artifact {artifact_root} (and not "
                            "contain it)")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ArtifactError(f"{out}: directory exists and is not empty (pass --force to replace it)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _progress_monitor(trt):
    """TensorRT's IProgressMonitor printing one line per phase (build phases can take minutes on the real model)."""

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self._steps: dict[str, int] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            self._steps[phase_name] = num_steps
            print(f"  [{parent_phase + ' > ' if parent_phase else ''}{phase_name}] 0/{num_steps}", file=sys.stderr,
                  flush=True)

        def step_complete(self, phase_name, step):
            total = self._steps.get(phase_name, 0)
            if total and (step + 1 == total or (step + 1) % max(1, total // 10) == 0):
                print(f"  [{phase_name}] {step + 1}/{total}", file=sys.stderr, flush=True)
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            pass

    return Monitor()


def build_engines(artifact: str | Path, out: str | Path, max_num_tokens: int | None = None,
                  max_batch: int | None = None, max_model_len: int | None = None, num_pages: int | None = None,
                  timing_cache: str | Path | None = None, graphs: list[str] | None = None,
                  force: bool = False) -> Path:
    from m3export.runtime.backends.tensorrt_backend import require_tensorrt

    trt = require_tensorrt()  # first: without TensorRT nothing is read or written
    import torch

    from ..export.artifact import load_artifact
    from ..export.tensorrt_flavour import write_flavour
    from m3export.plugins.tensorrt import plugins

    if not torch.cuda.is_available():
        from ..errors import BackendUnavailable

        raise BackendUnavailable("building TensorRT engines needs an NVIDIA GPU (torch sees no CUDA device)")
    art = load_artifact(artifact, verify_checksums=False)
    limits = Limits.for_config(art.config, art.page_size, max_num_tokens, max_batch, max_model_len, num_pages)
    names = graphs or [g for g in art.graphs if g == "model" or g.startswith("mtp")]
    unknown = [g for g in names if g not in art.graphs]
    if unknown:
        raise ArtifactError(f"{artifact}: no graph {unknown} (has {sorted(art.graphs)})")
    out = Path(out)
    _prepare_out(out, art.root, force)
    registered = plugins.register()
    exported = art.manifest.flavours.get("tensorrt", {})
    if all(n in exported for n in names):  # written at export, bounded by max_position_embeddings >= max_model_len
        flavour = {n: exported[n] for n in names}
    else:  # beside the graphs, where their weights resolve
        flavour = write_flavour(art, limits.max_model_len, names)
    cache_path = Path(timing_cache) if timing_cache else out / "timing.cache"

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    cache_bytes = cache_path.read_bytes() if cache_path.is_file() else b""
    engines, profiles = {}, {}
    for name in names:
        print(f"building {name} ({flavour[name]['file']})", file=sys.stderr, flush=True)
        # the graph's dtypes, not TensorRT's choice (TensorRT 11 networks are strongly typed without the flag)
        typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        network = builder.create_network(0 if typed is None else 1 << int(typed))
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(art.root / flavour[name]["file"])):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise ArtifactError(f"{name}: TensorRT's ONNX parser failed: {errors}")
        config = builder.create_builder_config()
        cache = config.create_timing_cache(cache_bytes)
        config.set_timing_cache(cache, ignore_mismatch=False)
        config.progress_monitor = _progress_monitor(trt)
        shapes = profiles_for(art.graphs[name], limits)  # index i here is TensorRT's profile i
        for ranges in shapes:
            profile = builder.create_optimization_profile()
            for inp, (lo, opt, hi) in ranges.items():
                profile.set_shape(inp, lo, opt, hi)
            config.add_optimization_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise ArtifactError(f"{name}: TensorRT could not build the engine (see the log above)")
        file = f"{name}.engine"
        (out / file).write_bytes(bytes(serialized))
        cache_bytes = bytes(config.get_timing_cache().serialize())
        engines[name] = {"file": file, "sha256": sha256_file(out / file), "bytes": (out / file).stat().st_size}
        profiles[name] = shapes
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    cache_path.write_bytes(cache_bytes)
    from ..export.exporter import TOKENIZER_FILES

    copied = []  # the engine directory is a source of its own for generate / serve: tokenizer and chat template
    for f in TOKENIZER_FILES:
        if (art.root / f).is_file():
            shutil.copy2(art.root / f, out / f)
            copied.append(f)
    dev = torch.cuda.get_device_properties(0)
    meta = engine_metadata(trt.__version__, (dev.major, dev.minor), dev.name, limits, profiles, flavour, engines,
                           registered)
    meta["artifact"] = str(art.root.resolve())
    meta["timing_cache"] = str(cache_path)
    meta["tokenizer_files"] = copied
    (out / BUILD_JSON).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return out


def is_engine_dir(path: str | Path) -> bool:
    """Whether ``path`` is an engine directory (``m3export build``'s output) rather than an artifact."""
    return (Path(path) / BUILD_JSON).is_file()


def built_from(meta: dict, where: str | Path) -> str:
    """The artifact an engine directory was built from, as its ``build.json`` (``meta``) records it: the engines'
    graph signatures (inputs, pools and their dtypes) and the model's config are that artifact's."""
    if not isinstance(meta.get("artifact"), str):
        raise ArtifactError(f"{where}: build.json names no artifact (the engines' graph signatures and config)")
    return meta["artifact"]


def read_build(path: str | Path) -> dict:
    """``build.json`` of an engine directory, or ArtifactError naming what is missing."""
    p = Path(path) / BUILD_JSON
    if not p.is_file():
        raise ArtifactError(f"{path}: no {BUILD_JSON}: not an engine directory (build one with 'm3export build "
                            "ARTIFACT --out DIR')")
    try:
        return json.loads(p.read_text())
    except ValueError as e:
        raise ArtifactError(f"{p}: not valid JSON ({e})") from None
