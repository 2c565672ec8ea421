"""Reading an exported artifact back: validated manifest, checked files, and the PyTorch model it describes.

``load_torch_model`` rebuilds ``M3ForCausalLM`` from the artifact's own weight file through the manifest's
tensor map, so one artifact runs on every backend (torch, ONNX Runtime, TensorRT) from the same bytes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.loader import build_empty
from ..dtypes import BY_NAME, MODEL_DTYPES
from ..errors import ArtifactError
from ..model import M3ForCausalLM
from ..safetensors_io import header_sha256, read_tensor, require_regular_file
from .manifest import KV_FP8, MANIFEST, SCALE_POOLS, GraphInfo, Manifest, sha256_file

QUANTIZED = {torch.float8_e4m3fn, torch.uint8}  # copied bit for bit, never converted


@dataclass
class Artifact:
    root: Path
    manifest: Manifest

    @property
    def config(self):
        return self.manifest.config

    @property
    def page_size(self) -> int:
        return self.manifest.page_size

    @property
    def graphs(self) -> dict[str, GraphInfo]:
        return self.manifest.graphs

    def path(self, graph: str) -> Path:
        if graph not in self.graphs:
            raise ArtifactError(f"{self.root}: no graph {graph!r} (has {sorted(self.graphs)})")
        return self.root / self.graphs[graph].file


def load_artifact(path: str | Path, verify_checksums: bool = True) -> Artifact:
    """Open an artifact directory; every problem is an ``ArtifactError`` naming the file or field."""
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(f"{root}: not an artifact directory (does not exist or is not a directory)")
    mpath = root / MANIFEST
    if not mpath.exists():
        raise ArtifactError(f"{root}: no {MANIFEST} (not an m3export artifact, or an interrupted export)")
    require_regular_file(mpath, ArtifactError)
    try:
        raw = json.loads(mpath.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{mpath}: not valid JSON ({e})") from None
    manifest = Manifest.from_json(raw, str(mpath))
    _check_tensor_map(manifest, mpath)
    _check_graph_signatures(manifest, mpath)

    referenced = {g.file for g in manifest.graphs.values()} | {
        pc.entry.file for e in manifest.tensors.values() for pc in e.pieces} | {
        r["file"] for graphs in manifest.flavours.values() for r in graphs.values()}  # flavour graphs are run too
    unlisted = sorted(referenced - set(manifest.files))
    if unlisted:
        raise ArtifactError(f"{mpath}: files {unlisted} are used but have no checksum entry")
    if "model" not in manifest.graphs:
        raise ArtifactError(f"{mpath}: no 'model' graph")
    for name, meta in sorted(manifest.files.items()):
        f = contained(root, name, mpath)
        if not f.exists():
            raise ArtifactError(f"{f}: listed in {MANIFEST} but missing")
        require_regular_file(f, ArtifactError)
        if not isinstance(meta, dict) or not ({"sha256", "header_sha256"} & set(meta)) or "bytes" not in meta:
            raise ArtifactError(f"{mpath}: files[{name!r}] needs 'bytes' and 'sha256' (or 'header_sha256')")
        if f.stat().st_size != meta["bytes"]:
            raise ArtifactError(f"{f}: {f.stat().st_size} bytes, manifest says {meta['bytes']} (truncated or replaced)")
        if "header_sha256" in meta:  # a linked checkpoint shard: its header always, its bytes when verifying
            if header_sha256(f, ArtifactError) != meta["header_sha256"]:
                raise ArtifactError(f"{f}: safetensors header differs from the one exported (shard replaced)")
            if verify_checksums and "sha256" in meta and sha256_file(f) != meta["sha256"]:
                raise ArtifactError(f"{f}: sha256 does not match {MANIFEST} (shard corrupted or modified)")
        elif verify_checksums and sha256_file(f) != meta["sha256"]:
            raise ArtifactError(f"{f}: sha256 does not match {MANIFEST} (file corrupted or modified)")
    for name, e in manifest.tensors.items():
        for pc in e.pieces:
            if pc.entry.offset + pc.entry.length > manifest.files[pc.entry.file]["bytes"]:
                raise ArtifactError(f"{mpath}: tensor {name!r} extends past the end of {pc.entry.file}")
    return Artifact(root, manifest)


def contained(root: Path, name: str, where: Path) -> Path:
    """``root / name`` for a file name read from a manifest, refusing any name that leaves the artifact: absolute,
    ``..``, or a symbolic link (of the file or of a directory on the way) resolving outside ``root``. A manifest
    is data, and data must not make a loader read, hash or run files of its choosing."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in Path(name).parts:
        raise ArtifactError(f"{where}: file name {name!r} is not inside the artifact directory")
    path = root / name
    real_root = root.resolve()
    if real_root not in path.resolve().parents:
        raise ArtifactError(f"{where}: {name!r} is a symbolic link leading outside the artifact directory "
                            f"({path.resolve()})")
    return path


def _check_tensor_map(m: Manifest, where: Path) -> None:
    """The manifest's tensor map against the model its config describes, built on ``meta`` (nothing allocated):
    every parameter present once, with its shape and dtype. Done before any loader allocates memory, so an absurd
    config (hidden_size 1e9) or a tampered entry is one clear error, for every backend."""
    if m.dtype not in MODEL_DTYPES:
        raise ArtifactError(f"{where}: dtype {m.dtype!r} is not a model dtype ({', '.join(MODEL_DTYPES)})")
    if m.mtp_modules < 0:
        raise ArtifactError(f"{where}: mtp_modules must be >= 0, got {m.mtp_modules}")
    meta = build_empty(m.config, BY_NAME[m.dtype].torch, "meta", mxfp8=m.mxfp8, num_mtp_modules=m.mtp_modules)
    params = dict(meta.named_parameters())
    missing = sorted(set(params) - set(m.tensors))
    extra = sorted(set(m.tensors) - set(params))
    if missing or extra:
        raise ArtifactError(f"{where}: tensor map does not match the model (missing {missing[:5]}, "
                            f"unexpected {extra[:5]})")
    for name, p in params.items():
        entry = m.tensors[name]
        if tuple(entry.shape) != tuple(p.shape):
            raise ArtifactError(f"{where}: tensor {name!r} has shape {list(entry.shape)}, the config implies "
                                f"{list(p.shape)}")
        dtypes = {entry.dtype} | {pc.entry.dtype for pc in entry.pieces}
        if dtypes != {BY_NAME[entry.dtype].name} or BY_NAME[entry.dtype].torch != p.dtype:
            raise ArtifactError(f"{where}: tensor {name!r} is stored as {sorted(dtypes)}, the model has {p.dtype}")
        covered = 0
        for pc in entry.pieces:  # on meta: copy_ would broadcast a smaller piece silently, or leave rows unset
            try:
                target = tuple(p[pc.torch_index()].shape)
            except (IndexError, TypeError, ValueError):
                target = None
            else:
                covered += math.prod(target)
            if target != tuple(pc.entry.shape):
                raise ArtifactError(f"{where}: tensor {name!r}: piece {list(pc.index)} has shape "
                                    f"{list(pc.entry.shape)}, the parameter's slice there is "
                                    f"{'out of range' if target is None else list(target)}")
        if covered != p.numel():
            raise ArtifactError(f"{where}: tensor {name!r}: its pieces hold {covered} of its {p.numel()} elements")


def _check_graph_signatures(m: Manifest, where: Path) -> None:
    """The graph signatures against the config and page size the manifest states: a backend sizes its pools and
    reads logits from these, so a contradiction (page_size 8 over graphs built for 16) must not reach it. (The
    onnxruntime backend then checks the signatures against the graph files themselves.)"""
    cfg = m.config
    for k in range(m.mtp_modules):
        if f"mtp{k}" not in m.graphs:
            raise ArtifactError(f"{where}: mtp_modules is {m.mtp_modules} but there is no graph 'mtp{k}'")
    for gname, g in m.graphs.items():
        if gname == "vision":
            continue
        for t in (*g.inputs, *g.outputs):
            last = t.shape[-1] if t.shape else None
            if t.name == "logits" and last != cfg.vocab_size:
                raise ArtifactError(f"{where}: graph {gname!r} output logits has shape {list(t.shape)}, the config "
                                    f"says vocab_size {cfg.vocab_size}")
            if t.name in ("hidden", "hidden_out") and last != cfg.hidden_size:
                raise ArtifactError(f"{where}: graph {gname!r} {t.name} has shape {list(t.shape)}, the config says "
                                    f"hidden_size {cfg.hidden_size}")
            scale = t.name.split(".")[0].removesuffix("_out") in SCALE_POOLS
            if ("cache" in t.name or scale) and (len(t.shape) < 2 or t.shape[1] != m.page_size):
                raise ArtifactError(f"{where}: graph {gname!r} pool {t.name} has shape {list(t.shape)}, but "
                                    f"page_size is {m.page_size} (pools are [pages, page_size, ...])")
            want = "float32" if scale else "uint8" if m.cache_dtype == KV_FP8 else m.cache_dtype
            if ("cache" in t.name or scale and m.cache_dtype == KV_FP8) and t.dtype != want:
                raise ArtifactError(f"{where}: graph {gname!r} pool {t.name} is {t.dtype}, but kv_cache_dtype "
                                    f"{m.cache_dtype} pools are {want}")


def load_torch_model(path: str | Path | Artifact, device="cpu", dtype: torch.dtype | None = None
                     ) -> M3ForCausalLM:
    """The artifact's model in PyTorch, in the artifact's dtype unless ``dtype`` says otherwise.

    MXFP8 weights stay MXFP8; the router stays fp32 (as in every M3 model), whatever ``dtype``.
    """
    art = path if isinstance(path, Artifact) else load_artifact(path)
    m = art.manifest
    _check_tensor_map(m, art.root / MANIFEST)  # again: an Artifact may have been built by hand
    model = build_empty(m.config, dtype or BY_NAME[m.dtype].torch, device, mxfp8=m.mxfp8, num_mtp_modules=m.mtp_modules)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            entry = m.tensors[name]
            for piece in entry.pieces:
                value = read_tensor(art.root, name, piece.entry)
                if value.dtype != p.dtype and {value.dtype, p.dtype} & QUANTIZED:
                    raise ArtifactError(f"{art.root / piece.entry.file}: tensor {name!r} is {value.dtype}, "
                                        f"expected {p.dtype}")
                p[piece.torch_index()].copy_(value)
    return model.requires_grad_(False).eval()
