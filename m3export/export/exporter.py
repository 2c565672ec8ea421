"""``m3export export``: a checkpoint or preset -> an artifact directory (ONNX graphs, weights, manifest, tokenizer).

Everything is written into a hidden staging directory beside the output (``m3export.output_dir``) that is renamed
into place only once every file is complete and checked, so a failure (or Ctrl-C, or SIGTERM) never leaves a
half-written artifact where a runtime could find it, nor a weight copy nobody removes. ``--force`` never replaces
an output that is, contains or lies inside the source. Before a weight file is written its size is compared with
the free space. Nothing written depends on the time, the temporary path or the order of a hash map: the same
inputs give byte-identical files.
"""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
from pathlib import Path

import onnx
import torch
from tqdm.auto import tqdm

from ..checkpoint.loader import build_empty, open_checkpoint
from ..config import M3Config, preset
from ..dtypes import BY_NAME, MODEL_DTYPES, of_torch
from ..errors import ArtifactError
from ..model import M3ForCausalLM
from ..output_dir import check_free_space, check_replaceable, make_parent, os_errors_as, staging, staging_prefix
from ..preprocess.settings import FILES as PREPROCESSOR_FILES
from ..ops import DOMAIN, OPS, OPSET_VERSION
from ..ops import kv_fp8 as kv_fp8_format
from ..ops import mxfp8 as mx
from ..safetensors_io import nbytes, write_safetensors
from ..sources import is_preset
from .graphs import finalize, mtp_signature, step_signature, trace_mtp, trace_step
from .manifest import MANIFEST, Manifest, sha256_file, signature_of
from .schemas import ONNX_OPSET, register_schemas
from .vision_graph import VISION_FILE, VISION_SIGNATURE, trace_vision
from .weights import ParamEntry
from .zero_copy import check_referenced_finite, converted_value, resolve, shard_files
from .zero_copy import plan as zero_copy_plan

WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
# PREPROCESSOR_FILES are copied beside the graphs too: the servers preprocess images / video as they say
WEIGHT_FORMATS = ("mxfp8", "bf16")
AUTO = "auto"  # --dtype: in place, the checkpoint's own dtype; otherwise float32 (what ONNX Runtime's CPU EP runs)
IN_PLACE_STAGING = "m3export"  # in place, files are staged in ROOT/.m3export.partial-*


def load_source(source: str, dtype: torch.dtype, weights: str | None, progress: bool) -> M3ForCausalLM:
    """Preset or checkpoint -> model with the requested weight format (``None`` keeps the source's own)."""
    from .. import load_model

    if is_preset(source):
        return load_model(source, dtype=dtype, mxfp8=weights == "mxfp8", progress=progress)
    model = load_model(source, dtype=dtype, dequantize=weights == "bf16", progress=progress)
    if weights == "mxfp8" and not model.mxfp8:
        model = quantize_model(model)
    return model


def quantize_model(model: M3ForCausalLM) -> M3ForCausalLM:
    """A floating-point model -> the same model with MXFP8 weights wherever the MXFP8 layout has them."""
    dtype = model.model.embed_tokens.weight.dtype
    out = build_empty(model.config, dtype, "cpu", mxfp8=True, num_mtp_modules=len(model.mtp))
    src = model.state_dict()
    params = dict(out.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if p.dtype == torch.uint8:
                continue  # written with its fp8 weight
            if p.dtype == torch.float8_e4m3fn:
                q, s = mx.quantize(src[name])
                p.copy_(q)
                params[name + "_scale_inv"].copy_(s)
            else:
                p.copy_(src[name])
    return out.requires_grad_(False).eval()


def _tools() -> dict[str, str]:
    import onnx_ir
    import onnxscript

    from .. import __version__

    return {"m3export": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxscript": onnxscript.__version__, "onnx_ir": onnx_ir.__version__,
            "python": platform.python_version()}


def _tokenizer_files(source: str, cfg: M3Config, tmp: Path) -> None:
    """Copy the checkpoint's tokenizer (and preprocessor) files; a preset gets the byte-level tokenizer its config
    implies."""
    src = Path(source)
    if not is_preset(source):
        for name in (*TOKENIZER_FILES, *PREPROCESSOR_FILES):
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        return
    from ..tokenizer import byte_level_tokenizer, tokenizer_config

    try:
        tok = byte_level_tokenizer(cfg)
    except ValueError:
        return  # presets with a real-size vocabulary have no stand-in tokenizer
    (tmp / "tokenizer.json").write_text(tok.to_str())
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(cfg), indent=2, sort_keys=True))


def _check_graph(path: Path) -> None:
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise ArtifactError(f"{path.name}: exported graph fails onnx.checker ({e})") from e


def _prepare_out(out: Path, force: bool, source: str) -> None:
    make_parent(out, ArtifactError)
    if force:
        check_replaceable(out, [] if is_preset(source) else [source], ArtifactError)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ArtifactError(f"{out}: directory exists and is not empty (pass --force to replace it)")


def export_artifact(source: str, out: str | Path | None, dtype: str = AUTO, weights: str | None = None,
                    page_size: int = 16, force: bool = False, progress: bool = True, in_place: bool = False,
                    split_layers: int | None = None, flavour: str | None = None,
                    lower: tuple[str, ...] | None = None, kv_cache_dtype: str | None = None) -> Path:
    """Export ``source`` (checkpoint directory or preset name) to the artifact directory ``out``.

    From a checkpoint nothing is loaded: tensors stream one at a time into the artifact's weight file. With
    ``in_place`` the artifact *is* the checkpoint directory: graphs and manifest are added next to the shards and
    reference their bytes directly (zero copy); only tensors whose dtype must change are written.
    ``split_layers`` N also writes the model as parts of N layers each (``model.part{j}.onnx``), for builders
    that cannot take the whole graph; the manifest's ``parts`` says how they chain. ``flavour`` "tensorrt" also
    writes each graph's TensorRT flavour (``<graph>.trt.onnx``: m3 nodes as TensorRT plugin nodes, see
    ``tensorrt_flavour.py``), "ort-contrib" each graph lowered to ONNX Runtime's contrib kernels (``<graph>.ort.onnx``,
    ``lowering.py``, experimental; ``lower`` names the m3 ops it lowers, default ``lowering.DEFAULT``, e.g. the
    opt-in ``PagedAttention``), recorded under the manifest's ``flavours``. ``dtype`` ``"auto"`` is the
    checkpoint's own dtype in place (nothing converted that need not be) and float32 otherwise.
    ``kv_cache_dtype`` (``--kv-cache-dtype``): ``auto`` (None) or the model dtype's name, pools of the model dtype;
    ``fp8``, E4M3 pools carried as uint8 codes with an fp32 scale pool each (``docs/ops.md`` §1 and §9), the
    manifest's ``kv_cache_dtype`` then ``float8_e4m3fn``.
    """
    if dtype != AUTO and dtype not in MODEL_DTYPES:
        raise ArtifactError(f"--dtype must be one of {[AUTO, *MODEL_DTYPES]}, got {dtype!r}")
    if weights not in (None, *WEIGHT_FORMATS):
        raise ArtifactError(f"--weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ArtifactError(f"--page-size must be a positive integer, got {page_size!r}")
    if split_layers is not None and (not isinstance(split_layers, int) or split_layers < 1):
        raise ArtifactError(f"--split-layers must be a positive integer, got {split_layers!r}")
    register_schemas()
    if flavour not in (None, "tensorrt", "ort-contrib"):
        raise ArtifactError(f"--flavour must be 'tensorrt' or 'ort-contrib', got {flavour!r}")
    if lower is not None:
        from .lowering import LOWERABLE, exclusive_conflict, warn_rejected

        if flavour != "ort-contrib":
            raise ArtifactError("--lower applies to --flavour ort-contrib only")
        if not lower or set(lower) - set(LOWERABLE):
            raise ArtifactError(f"--lower takes m3 ops among {', '.join(LOWERABLE)}, got {','.join(lower)!r}")
        one_of = exclusive_conflict(lower)
        if one_of:
            raise ArtifactError(f"--lower takes at most one of {', '.join(one_of)} (they lower the same m3 nodes), "
                                f"got {','.join(lower)!r}")
        warn_rejected(tuple(lower))
    kv_fp8 = _kv_fp8(kv_cache_dtype, dtype, flavour, lower)
    opts = dict(dtype=dtype, weights=weights, page_size=page_size, progress=progress, split_layers=split_layers,
                flavour=flavour, lower=lower, kv_fp8=kv_fp8)
    if in_place:
        return _export_in_place(source, force, **opts)
    out = Path(out).absolute()
    _prepare_out(out, force, source)
    with os_errors_as(ArtifactError), staging(out.parent, out.name, ArtifactError) as tmp:
        _export_into(tmp, source, in_place=False, **opts)
        _replace(tmp, out)
    return out


def _kv_fp8(kv_cache_dtype: str | None, dtype: str, flavour: str | None, lower: tuple[str, ...] | None) -> bool:
    """``--kv-cache-dtype`` -> whether the graphs take FP8 (uint8 code + scale) pools. Otherwise the pools have the
    model dtype, so ``bf16`` needs ``--dtype bfloat16``; the flavours whose kernels read no FP8 cache refuse
    ``fp8`` here, before any work."""
    from ..dtypes import KV_CACHE_DTYPES

    if kv_cache_dtype not in (None, *KV_CACHE_DTYPES):
        raise ArtifactError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "bf16" and dtype != "bfloat16":
        raise ArtifactError(f"--kv-cache-dtype bf16: exported pools have the model dtype (--dtype {dtype}); export "
                            "with --dtype bfloat16 for a bf16 cache, or --kv-cache-dtype fp8 / auto")
    if kv_cache_dtype != "fp8":
        return False
    if flavour == "tensorrt":
        raise ArtifactError("--kv-cache-dtype fp8 with --flavour tensorrt: the TensorRT plugins read no FP8 cache; "
                            "export the TensorRT flavour with the model dtype's cache (--kv-cache-dtype auto)")
    if flavour == "ort-contrib" and "PagedAttention" in (lower or ()):
        raise ArtifactError("--kv-cache-dtype fp8 with --lower PagedAttention: com.microsoft.PagedAttention writes "
                            "and reads model-dtype pools, not E4M3 codes with scales; lower MoE / MXFP8Linear only")
    return True


def _export_in_place(source: str, force: bool, **opts) -> Path:
    """Write the artifact's files into the checkpoint directory; existing files are never modified.

    Files are produced in a hidden temporary folder and moved next to the shards only when all are complete;
    the graphs are checked (``onnx.checker``, full) in their final place, where their data references resolve.
    """
    root = Path(source).absolute()
    if not root.is_dir():
        raise ArtifactError(f"--in-place needs a checkpoint directory, got {source!r}")
    _check_in_place_names(root, [WEIGHTS_FILE, MANIFEST], force)  # the cheap refusals before hours of work
    with os_errors_as(ArtifactError), staging(root, IN_PLACE_STAGING, ArtifactError) as tmp:
        _export_into(tmp, str(root), in_place=True, **opts)
        # the manifest last: it is what makes the directory an artifact, so no kill mid-move leaves one that
        # lists graphs not moved yet (or an earlier export's graphs of the same size, unhashed at start-up)
        produced = sorted((p.name for p in tmp.iterdir()), key=lambda n: (n == MANIFEST, n))
        _check_in_place_names(root, produced, force)
        moved: list[Path] = []
        try:
            for name in produced:
                (tmp / name).replace(root / name)
                moved.append(root / name)
            for graph in json.loads((root / MANIFEST).read_text())["graphs"].values():
                _check_graph(root / graph["file"])
        except BaseException:
            for p in moved:
                p.unlink(missing_ok=True)
            raise
    return root


def _earlier_export_files(root: Path) -> set[str]:
    """What an earlier in-place export wrote into ``root``: its manifest and the files it lists with a full
    sha256 (graphs, converted weights). Linked shards are listed by header hash only: they belong to the
    checkpoint."""
    try:
        files = json.loads((root / MANIFEST).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        return set()
    if not isinstance(files, dict):
        return set()
    return {MANIFEST} | {n for n, meta in files.items() if isinstance(n, str) and "/" not in n
                         and isinstance(meta, dict) and "sha256" in meta and "header_sha256" not in meta}


def _check_in_place_names(root: Path, names: list[str], force: bool) -> None:
    """In place, a file of the checkpoint is never replaced, whatever ``force`` says; files of an earlier export
    are replaced only with ``force``."""
    present = [n for n in names if (root / n).exists() or (root / n).is_symlink()]
    ours = _earlier_export_files(root)
    theirs = [n for n in present if n not in ours]
    if theirs:
        raise ArtifactError(f"{root}: already holds {theirs}, which an in-place export would have to replace; "
                            "files of the checkpoint are never replaced (rename them, or export with --out DIR)")
    if present and not force:
        raise ArtifactError(f"{root}: already holds {present} from an earlier export; pass --force to replace them")


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished artifact into place; an old one at ``out`` is removed only after the swap (and put back
    if the swap fails)."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=staging_prefix(out.name), dir=out.parent))
        out.rename(old / "artifact")
    try:
        tmp.rename(out)
    except BaseException:
        if old is not None:
            (old / "artifact").rename(out)
            old.rmdir()
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _weights_from_model(tmp: Path, model: M3ForCausalLM, progress: bool) -> dict[str, ParamEntry]:
    """Presets (and MXFP8 exports of unquantised checkpoints): the weights exist only in memory; write them."""
    state = model.state_dict()
    check_free_space(tmp, sum(v.nbytes for v in state.values()), "the artifact's weight file", ArtifactError)
    written = write_safetensors(tmp / WEIGHTS_FILE, ((k, v.dtype, tuple(v.shape)) for k, v in state.items()),
                                state.__getitem__, progress)
    return {k: ParamEntry.whole(e) for k, e in written.items()}


def _weights_from_checkpoint(tmp: Path, ckpt, layout, meta: M3ForCausalLM, zero_copy: bool, progress: bool):
    """Checkpoints: nothing is loaded. With ``zero_copy`` pieces already in the graph's dtype are referenced where
    they are; every other piece is converted (or copied) one checkpoint tensor at a time."""
    wp = zero_copy_plan(ckpt, layout, meta, WEIGHTS_FILE, zero_copy)
    targets = {name: dt for name, dt, _ in wp.convert}
    check_free_space(tmp, sum(nbytes(dt, shape) for _, dt, shape in wp.convert),
                     f"{WEIGHTS_FILE} ({len(wp.convert)} converted tensors)", ArtifactError)
    written = write_safetensors(tmp / WEIGHTS_FILE, wp.convert, lambda n: converted_value(ckpt, n, targets[n]),
                                progress) if wp.convert else {}
    check_referenced_finite(ckpt, wp)
    return resolve(wp, written), shard_files(wp.shards)


def source_dtype(ckpt, layout) -> str:
    """The dtype a checkpoint stores its unquantised weights in (that of its embedding), as a model dtype name."""
    piece = layout.pieces("model.embed_tokens.weight")[0]
    name = ckpt.tensors[piece.name].dtype if piece.name in ckpt.tensors else None
    return name if name in MODEL_DTYPES else "bfloat16"


def _export_into(tmp: Path, source: str, dtype: str, weights: str | None, page_size: int,
                 progress: bool, in_place: bool, split_layers: int | None, flavour: str | None = None,
                 lower: tuple[str, ...] | None = None, kv_fp8: bool = False) -> None:
    opened = None if is_preset(source) else open_checkpoint(source)  # config and shards checked before any bar
    limit = (opened[1] if opened is not None else preset(source)).max_position_embeddings
    if page_size > limit:
        raise ArtifactError(f"--page-size {page_size} exceeds the model's max_position_embeddings ({limit}): "
                            "a page cannot hold more tokens than a sequence")
    with tqdm(total=5, desc="export", unit="step", disable=not progress) as steps:  # 4 + one per MTP graph
        steps.set_postfix_str("weights")
        if opened is not None and (weights != "mxfp8" or opened[4]):
            # every checkpoint export streams, except an MXFP8 export of an unquantised checkpoint (quantising)
            ckpt, cfg, layout, n_mtp, quantized = opened
            dtype = BY_NAME[source_dtype(ckpt, layout) if dtype == AUTO and in_place else
                            "float32" if dtype == AUTO else dtype].torch
            mxfp8 = quantized and weights != "bf16"
            meta = build_empty(cfg, dtype, "meta", mxfp8=mxfp8, num_mtp_modules=n_mtp)
            tensors, shards = _weights_from_checkpoint(tmp, ckpt, layout, meta, in_place, progress)
        elif in_place:
            raise ArtifactError(f"{source}: --in-place cannot quantise an unquantised checkpoint to MXFP8")
        else:
            dtype = BY_NAME["float32" if dtype == AUTO else dtype].torch
            model = load_source(source, dtype, weights, progress)
            cfg, mxfp8, n_mtp = model.config, model.mxfp8, len(model.mtp)
            tensors, shards = _weights_from_model(tmp, model, progress), {}
            del model  # the graphs are traced from a meta twin; the weights are on disk now
            meta = build_empty(cfg, dtype, "meta", mxfp8=mxfp8, num_mtp_modules=n_mtp)
        steps.total = 4 + n_mtp + (-(-cfg.num_hidden_layers // split_layers) if split_layers else 0)
        steps.update(2)

        buffers = {"rotary.inv_freq": meta.rotary._inv_freq()}  # the only buffer; tiny, computed, not stored
        plans = [("model", "model.onnx", lambda: trace_step(meta, page_size, kv_fp8=kv_fp8),
                  step_signature(meta, kv_fp8=kv_fp8).aliases)]
        parts = []
        if split_layers:
            for j, start in enumerate(range(0, cfg.num_hidden_layers, split_layers)):
                layers = range(start, min(start + split_layers, cfg.num_hidden_layers))
                parts.append({"graph": f"model.part{j}", "layers": [layers.start, layers.stop]})
                plans.append((f"model.part{j}", f"model.part{j}.onnx",
                              (lambda r=layers: trace_step(meta, page_size, r, kv_fp8)),
                              step_signature(meta, layers, kv_fp8).aliases))
        plans += [(f"mtp{k}", f"mtp{k}.onnx", (lambda k=k: trace_mtp(meta, k, page_size, kv_fp8)),
                   mtp_signature(kv_fp8).aliases) for k in range(n_mtp)]
        if cfg.vision is not None:  # the vision tower + projector, one media item per run
            plans.append(("vision", VISION_FILE, lambda: trace_vision(meta), VISION_SIGNATURE.aliases))
            steps.total += 1
        graphs = {}
        for key, file, trace, aliases in plans:
            steps.set_postfix_str(f"exporting {file}")
            proto = finalize(trace(), tensors, buffers, tmp, kv_fp8)
            (tmp / file).write_bytes(proto.SerializeToString(deterministic=True))
            if not in_place:  # in place, data references resolve only once the graph sits next to the shards
                _check_graph(tmp / file)
            graphs[key] = signature_of(proto, file, aliases)
            steps.update()

        flavours = {}
        if flavour == "tensorrt":  # bounded by the model's longest sequence, so any engine build can use it
            from .tensorrt_flavour import write_flavour_files

            flavours["tensorrt"] = write_flavour_files(tmp, graphs, cfg.max_position_embeddings)
        ops = ()
        if flavour == "ort-contrib":  # experimental: m3 nodes lowered to ONNX Runtime's contrib kernels
            from .lowering import DEFAULT, FLAVOUR, write_flavour_files as write_lowered

            ops = tuple(lower or DEFAULT)
            flavours[FLAVOUR] = write_lowered(tmp, graphs, ops, cfg)
        if not mxfp8:  # the decode-only step graphs (``decode_graph.py``; MXFP8 experts have no such form)
            from .decode_graph import MOE_FORMS, flavour_name, write_decode_graphs

            for form in MOE_FORMS:
                flavours[flavour_name(moe=form)] = write_decode_graphs(tmp, graphs, kv_fp8, moe=form)
            if flavour == "ort-contrib":  # and of the lowered graphs (com.microsoft nodes kept)
                lowered = flavours["ort-contrib"]
                from .decode_attention import PASS as DECODE_ATTENTION

                flavours[flavour_name(flavour)] = write_decode_graphs(
                    tmp, graphs, kv_fp8, of=lowered, decode_attention=DECODE_ATTENTION in ops)
        steps.set_postfix_str("manifest")
        if not in_place:  # in place, the checkpoint's own tokenizer files are already beside the graphs
            _tokenizer_files(source, cfg, tmp)
            # `polygraphy run model.onnx --onnxrt --data-loader-script polygraphy_loader.py` works in the artifact
            shutil.copyfile(Path(__file__).with_name("polygraphy_loader.py"), tmp / "polygraphy_loader.py")
        files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in sorted(tmp.iterdir())}
        files.update(shards)
        manifest = Manifest(
            config=cfg, dtype=of_torch(dtype).name, mxfp8=mxfp8, page_size=page_size,
            mtp_modules=n_mtp, source=_describe(source),
            kv_cache_dtype=of_torch(kv_fp8_format.FP8 if kv_fp8 else dtype).name,
            opset={"domain": DOMAIN, "version": OPSET_VERSION, "onnx_opset": ONNX_OPSET, "ops": dict(OPS)},
            graphs=graphs, tensors=tensors, files=files, tools=_tools(), parts=parts, flavours=flavours,
        )
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n")
        steps.update()


def _describe(source: str) -> str:
    if is_preset(source):
        return f"preset:{source}"
    return f"checkpoint:{Path(source).resolve()}"

