"""The whole decode step of the ``mini`` model on the GPU: reference ops vs Triton kernels vs kernels + CUDA graphs.

``mini`` (real per-layer dims, 4 layers) with its experts raised to ``--experts`` (the release's 128), random
weights made on the GPU, bf16 activations, MXFP8 (default) or bf16 weights. K/V and index-key pools are filled with
random values and every sequence decodes one token at position ``context`` (no prefill needed for timing). For each
batch x context it reports the time of one ``TorchBackend.forward`` step:

* ``reference``: the custom ops' reference bodies (what the model ran before the kernels; eager, inside
  ``m3export.plugins.kernels.references()``);
* ``kernels``: the Triton kernels (``m3export.plugins.kernels.register``, as ``load_model`` does on CUDA; eager);
* ``graphs``: the same through ``GraphedTorchBackend`` (decode replayed from a CUDA graph per batch bucket); when
  a step cannot be captured (an op still synchronises with the host) the row says so;
* ``roofline``: bytes that must be read (every weight the step uses once, only the routed experts the batch
  touches, the embedding rows, K/V of dense layers over the whole context, index keys over the whole context and
  K/V of the selected blocks on sparse layers) over the device-to-device copy bandwidth measured in the same run.

Greedy tokens of the graph path are compared with the eager kernel path on the same inputs. Then one
``--prefill-tokens`` prompt (64k by default) is prefilled through the engine in chunks of ``--prefill-chunk`` tokens
(kernels registered; prefill runs eagerly) and its throughput reported in tokens/s. Last, with the model
freed, ``transformers``' own MiniMax M3 (``MiniMaxM3VLForCausalLM``, needs transformers >= 5.24; bf16 weights,
random, same config, SDPA attention) prefills ``context`` tokens and decodes with its cache, timed per token with
cuDNN SDPA disabled (``torch.backends.cuda.enable_cudnn_sdp(False)``) and enabled: with it on, transformers
re-plans attention at every new length.

  python bench/decode.py                                        # H200: table + bench/results/decode_h200.json
  python bench/decode.py --smoke                                # CPU script check (tiny model, interpreter)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import RESULTS, write_results  # noqa: E402  (bench/results_file.py)

SMOKE = False


def timed_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` (CUDA events; host timer in smoke mode)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if SMOKE:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    if SMOKE:
        return float("nan")
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = timed_ms(lambda: b.copy_(a), 20)
    return 2 * a.numel() / (ms * 1e-3)


def build_model(cfg, mxfp8: bool, device: str, dtype: torch.dtype):
    """Random weights generated on the device (seconds for tens of GB), MXFP8 quantised slice by slice."""
    from m3export.checkpoint.loader import build_empty
    from m3export.ops import mxfp8 as mx

    model = build_empty(cfg, dtype, device, mxfp8=mxfp8, num_mtp_modules=0)
    g = torch.Generator(device=device).manual_seed(0)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if p.dtype == torch.uint8:
                continue  # filled with its fp8 weight
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            std = 1.0 / math.sqrt(fan_in) if p.dim() > 1 else 0.02
            if p.dtype == torch.float8_e4m3fn:
                scale = params[name + "_scale_inv"]
                flat_w, flat_s = p.view(-1, *p.shape[-2:]), scale.view(-1, *scale.shape[-2:])
                for i in range(flat_w.shape[0]):  # one expert (or matrix) at a time bounds the fp32 temporaries
                    q, s = mx.quantize(torch.randn(p.shape[-2:], device=device, generator=g) * std)
                    flat_w[i].copy_(q)
                    flat_s[i].copy_(s)
            elif "correction_bias" in name:
                p.normal_(0.0, 0.01, generator=g)
            else:
                p.normal_(0.0, std, generator=g)
    return model.eval()


def decode_batch(batch: int, context: int, page: int, device):
    """B sequences, each with ``context`` tokens cached on its own pages, decoding the token at ``context``."""
    from m3export.model.batch import Batch

    pages = -(-(context + 1) // page)
    tables = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
    pos = torch.full((batch,), context, dtype=torch.int64, device=device)
    slots = tables[:, context // page].long() * page + context % page
    b = Batch(positions=pos, query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
              seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=device), block_tables=tables,
              slot_mapping=slots)
    return b, batch * pages


def param_family(name: str) -> str | None:
    """The kernel family of ``bench/decode_profile.py`` that reads this parameter in a decode step; None for
    parameters a text decode step never reads (MTP modules, the vision tower and its projector)."""
    if name.startswith(("mtp.", "vision_tower.", "multi_modal_projector.")):
        return None
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if ".mlp.gate." in name:
        return "MoE routing"
    if ".mlp.experts.w13" in name or ".mlp.shared_experts.gate_up_proj." in name:
        return "MoE gate-up"
    if ".mlp.experts.w2" in name or ".mlp.shared_experts.down_proj." in name:
        return "MoE down"
    if "norm" in name.rsplit(".", 2)[-2]:
        return "norms / rope / cache write"
    return "linear"


def fill_pool(pool: torch.Tensor, g: torch.Generator, fp8: bool = False) -> None:
    """Random contents for a cache pool (this script's and ``decode_profile.py``'s): N(0, 1) values in a 16/32-bit
    pool or as E4M3 codes in an FP8 one; an FP8 cache's scale pools (fp32, ``fp8``) get positive scales, so every
    row reads as finite values."""
    if pool.dtype == torch.float8_e4m3fn:
        pool.copy_(torch.randn(pool.shape, device=pool.device, generator=g).to(torch.float8_e4m3fn))
    elif pool.dtype.is_floating_point:
        pool.normal_(0.0, 1.0, generator=g)
        if fp8:  # the fp32 pools of an FP8 cache are its row scales
            pool.abs_().add_(0.5)
    else:
        raise ValueError(f"bench: cache pool of dtype {pool.dtype} has no filler")


def step_bytes_by_family(model, cfg, batch: int, context: int, elt: int, touched: dict[int, int]) -> dict[str, int]:
    """Bytes one decode step must read (see the module docstring), split by the kernel family that reads them."""
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        family = param_family(name)
        if family is None:
            continue
        size = p.numel() * p.element_size()
        if family == "embedding":
            size = batch * p.shape[-1] * p.element_size()
        elif ".mlp.experts." in name:
            layer = int(name.split(".")[2])
            size = size // cfg.num_local_experts * touched[layer]
        out[family] = out.get(family, 0) + size
    kv = cfg.num_key_value_heads * cfg.head_dim * 2 * elt
    selected = min(context + 1, cfg.index_topk_blocks * cfg.index_block_size)
    for i in range(cfg.num_hidden_layers):
        if cfg.is_sparse_layer(i):
            out["indexer scan"] = out.get("indexer scan", 0) + batch * (context + 1) * cfg.index_head_dim * elt
            out["sparse attention"] = out.get("sparse attention", 0) + batch * selected * kv
        else:
            out["dense attention"] = out.get("dense attention", 0) + batch * (context + 1) * kv
    return out


def step_bytes(model, cfg, batch: int, context: int, elt: int, touched: dict[int, int]) -> int:
    """Bytes one decode step must read (see the module docstring)."""
    return sum(step_bytes_by_family(model, cfg, batch, context, elt, touched).values())


def touched_experts(model, ids, batch) -> dict[int, int]:
    """Distinct routed experts per MoE layer for this step (forward pre-hooks run the device router)."""
    from m3export.model.mlp import MoE
    from m3export.plugins.kernels.moe_routing import route

    out, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MoE):
            def hook(mod, args, i=i):
                sel, _ = route(args[0], mod.gate.weight, mod.gate.e_score_correction_bias,
                               mod.cfg.num_experts_per_tok)
                out[i] = int(torch.unique(sel).numel())
            hooks.append(layer.mlp.register_forward_pre_hook(hook))
    return out, hooks


def transformers_model(cfg, device: str):
    """transformers' MiniMax M3 on the same config, random weights (bf16; fp32 in smoke mode), SDPA attention."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

    keys = set(MiniMaxM3VLTextConfig.__dataclass_fields__) | {"rope_parameters"}
    hf_cfg = MiniMaxM3VLTextConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k in keys})
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = MiniMaxM3VLForCausalLM(hf_cfg)
    model = model.to(torch.float32 if SMOKE else torch.bfloat16).to_empty(device=device)
    with torch.device(device):  # to_empty leaves the rotary buffers unset: build that module again
        model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg)
    g = torch.Generator(device=device).manual_seed(2)
    with torch.no_grad():
        for _, t in model.named_parameters():
            t.normal_(0.0, 0.02 if t.dim() < 2 else 1.0 / math.sqrt(t.shape[-1]), generator=g)
        for name, t in model.named_buffers():
            if "correction_bias" in name:
                t.normal_(0.0, 0.01, generator=g)
    return model.eval()


def transformers_decode_ms(model, vocab: int, batch: int, context: int, reps: int, device: str, cudnn: bool
                           ) -> float:
    """Per-token decode time after a ``context``-token prefill, with cuDNN SDPA on or off."""
    if not SMOKE:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    try:
        with torch.no_grad():
            g = torch.Generator(device=device).manual_seed(4)
            ids = torch.randint(0, vocab, (batch, context), device=device, generator=g)
            out = model(input_ids=ids, use_cache=True)
            state = {"past": out.past_key_values, "next": out.logits[:, -1].argmax(-1, keepdim=True)}
            del out

            def one():
                o = model(input_ids=state["next"], past_key_values=state["past"], use_cache=True)
                state["past"], state["next"] = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)

            return timed_ms(one, reps)
    finally:
        if not SMOKE:
            torch.backends.cuda.enable_cudnn_sdp(True)


def main() -> int:
    global SMOKE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--weights", choices=["mxfp8", "bf16"], default="mxfp8")
    ap.add_argument("--shapes", default="1x4096,1x32768,1x131072,8x4096,8x32768,8x131072,64x4096,64x32768",
                    help="batch x context pairs")
    ap.add_argument("--reference-shapes", default="1x4096,1x32768,1x131072,8x4096",
                    help="where the (slow, memory-hungry) reference ops are timed too")
    ap.add_argument("--transformers-shapes", default="1x4096,8x4096",
                    help="batch x context pairs where transformers' own model is timed (its prefill is quadratic)")
    ap.add_argument("--prefill-tokens", type=int, default=65536)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=None,
                    help="tokens per cache page (default: the engine's, runtime.engine.default_page_size: 16 for "
                         "M3's index blocks of 128; the benchmark used 64 until 2026-12-02)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=str(RESULTS / "decode_h200.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, Triton interpreter")
    args = ap.parse_args()
    if args.smoke:
        SMOKE = True
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("bench/decode.py needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2

    from m3export.config import preset
    from m3export.runtime.engine import default_page_size
    from m3export.runtime.backends.cuda_graph import GraphedTorchBackend

    device = "cpu" if SMOKE else "cuda"
    cfg = preset("tiny" if SMOKE else "mini")
    if not SMOKE:
        cfg = dataclasses.replace(cfg, num_local_experts=args.experts).validate()
    dtype = torch.float32 if SMOKE else torch.bfloat16
    elt = torch.empty((), dtype=dtype).element_size()
    t0 = time.time()
    bw = copy_bandwidth()
    model = build_model(cfg, args.weights == "mxfp8", device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"copy {bw / 1e12:.2f} TB/s; model {weight_bytes / 1e9:.1f} GB built in {time.time() - t0:.0f} s",
          flush=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    ref_shapes = {tuple(int(v) for v in s.split("x")) for s in args.reference_shapes.split(",") if s}
    if SMOKE:
        shapes = [(1, 40), (3, 70)]
        ref_shapes = set(shapes)
    page = 4 if SMOKE else args.page_size or default_page_size(cfg)
    res = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
           "preset": "tiny" if SMOKE else "mini", "experts": cfg.num_local_experts, "weights": args.weights,
           "weight_bytes": weight_bytes, "copy_bandwidth_TBps": bw / 1e12, "page_size": page, "rows": []}
    g = torch.Generator(device=device).manual_seed(1)

    def fill_pools(be):
        for layer in be._caches:
            for pool in layer:
                fill_pool(pool, g, fp8=False)

    def setup(b, ctx, graphs: bool):
        g.manual_seed(1000 * b + ctx)  # the same pools and tokens for the reference and the kernels
        batch, pages = decode_batch(b, ctx, page, device)
        be = GraphedTorchBackend(model, use_graphs=graphs, max_model_len=ctx + 1)
        be.allocate(pages, page)
        fill_pools(be)
        ids = torch.randint(0, cfg.vocab_size, (b,), device=device, generator=g)
        return be, ids, batch, torch.arange(b, device=device)

    from m3export.plugins.kernels import references, register

    res["kernels_registered"] = register()
    print("kernels:", ", ".join(res["kernels_registered"]), flush=True)
    rows, ref_logits = {}, {}
    # (a) the reference ops on the same model, pools and tokens
    for b, ctx in shapes:
        row = rows.setdefault((b, ctx), dict(batch=b, context=ctx))
        if (b, ctx) in ref_shapes:
            try:
                with references():
                    be, ids, batch, li = setup(b, ctx, graphs=False)
                    ref_logits[(b, ctx)] = be.forward(ids, batch, li)[0].cpu()
                    row["reference_ms"] = timed_ms(lambda: be.forward(ids, batch, li), max(3, args.reps // 4))
            except torch.OutOfMemoryError:
                row["reference_ms"] = "out of memory"
            be = None
            if not SMOKE:
                torch.cuda.empty_cache()
    for b, ctx in shapes:
        row = rows[(b, ctx)]
        be, ids, batch, li = setup(b, ctx, graphs=False)
        counts, hooks = touched_experts(model, ids, b)
        be.forward(ids, batch, li)
        for h in hooks:
            h.remove()
        row["experts_touched"] = counts
        row["bytes_needed"] = step_bytes(model, cfg, b, ctx, elt, counts)
        row["roofline_ms"] = row["bytes_needed"] / bw * 1e3
        logits = be.forward(ids, batch, li)[0]
        if (b, ctx) in ref_logits:  # same pools and tokens: the kernels against the reference ops
            want = ref_logits[(b, ctx)]
            row["logits_rel_err_vs_reference"] = float((logits.cpu() - want).norm() / want.norm())
            row["greedy_equal_reference"] = bool(torch.equal(logits.argmax(-1).cpu(), want.argmax(-1)))
        row["kernels_ms"] = timed_ms(lambda: be.forward(ids, batch, li), args.reps)
        eager_tokens = be.forward(ids, batch, li)[0].argmax(-1)
        be.use_graphs = not SMOKE
        be.pad_eagerly = SMOKE  # the CPU has no graphs: the padded shapes run eagerly instead
        if not SMOKE:  # what the engine hands a graphed backend (its batch_device() is the host): a host batch and
            # logits rows, the token ids on the device (sampled there); the replay's own staging copy moves them
            batch, li = batch.to("cpu"), li.cpu()
        graph_tokens = be.forward(ids, batch, li)[0].argmax(-1)  # captures on first use
        row["graphs_captured"] = bool(be.replays) or SMOKE
        row["graphs_ms"] = timed_ms(lambda: be.forward(ids, batch, li), args.reps) if be.use_graphs or SMOKE \
            else None
        row["graph_tokens_equal_eager"] = bool(torch.equal(graph_tokens, eager_tokens))
        if isinstance(row.get("reference_ms"), float) and row["graphs_ms"]:
            row["speedup_vs_reference"] = row["reference_ms"] / row["graphs_ms"]
        if row["graphs_ms"]:
            row["x_roofline"] = row["graphs_ms"] / row["roofline_ms"]
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        be = None
        if not SMOKE:
            torch.cuda.empty_cache()

    # (c') one long prompt prefilled in chunks through the engine (bench/long_prefill.py measures several lengths)
    from long_prefill import warm_prefill

    n_prompt, chunk = (200, 64) if SMOKE else (args.prefill_tokens, args.prefill_chunk)
    try:
        # the prompt twice, as long_prefill.py does: the first compiles the prefill kernels for the power-of-two
        # buckets its growing context passes through (seconds, which the 8k rows of 2026-12-01 counted: 1698
        # tokens/s); the second, timed, measures steps, not compilation; the first's time is reported beside it
        res["prefill"] = warm_prefill(model, n_prompt, chunk, page, graphs=not SMOKE)
    except Exception as exc:  # out of memory or a kernel that does not take this shape: reported
        res["prefill"] = dict(tokens=n_prompt, chunk=chunk, error=f"{type(exc).__name__}: {exc}"[:300])
    print(json.dumps(res["prefill"]), flush=True)
    be = None

    # (d) transformers' own model on the same config, after ours is freed (it holds its own bf16 weights)
    hf_shapes = [tuple(int(v) for v in s.split("x")) for s in args.transformers_shapes.split(",") if s]
    if SMOKE:
        hf_shapes = [(1, 40)]
    model = None
    if not SMOKE:
        torch.cuda.empty_cache()
    res["transformers"] = []
    try:
        hf = transformers_model(cfg, device)
    except Exception as exc:  # transformers without MiniMax M3 (< 5.24), or out of memory: reported
        hf, res["transformers_error"] = None, f"{type(exc).__name__}: {exc}"[:300]
        print("transformers:", res["transformers_error"], flush=True)
    for b, ctx in hf_shapes if hf is not None else []:
        row = dict(batch=b, context=ctx)
        for label, cudnn in (("cudnn_sdp_off_ms", False), ("cudnn_sdp_on_ms", True)):
            try:
                row[label] = transformers_decode_ms(hf, cfg.vocab_size, b, ctx, max(3, args.reps // 4), device, cudnn)
            except Exception as exc:  # out of memory at this shape: reported
                row[label] = f"{type(exc).__name__}: {exc}"[:200]
            if not SMOKE:
                torch.cuda.empty_cache()
        ours = rows.get((b, ctx), {}).get("graphs_ms")
        if ours and isinstance(row["cudnn_sdp_off_ms"], float):
            row["graphs_speedup_vs_cudnn_off"] = row["cudnn_sdp_off_ms"] / ours
        res["transformers"].append(row)
        print(json.dumps(row), flush=True)

    write_results(res, args.json)
    print(f"\ndecode step, {res['preset']} with {cfg.num_local_experts} experts, {args.weights} weights; "
          f"copy {bw / 1e12:.2f} TB/s")
    print(f"{'batch':>5} {'context':>7} {'MB':>7} {'roof ms':>8} {'ref ms':>8} {'kern ms':>8} {'graph ms':>8} "
          f"{'x roof':>6} {'same':>5}")
    for r in res["rows"]:
        ref = r.get("reference_ms")
        ref = f"{ref:8.2f}" if isinstance(ref, float) else f"{str(ref or '-'):>8}"
        gms = f"{r['graphs_ms']:8.2f}" if r["graphs_ms"] else "   eager"
        print(f"{r['batch']:>5} {r['context']:>7} {r['bytes_needed'] / 1e6:>7.0f} {r['roofline_ms']:>8.3f} {ref} "
              f"{r['kernels_ms']:>8.2f} {gms} {r.get('x_roofline', float('nan')):>6.2f} "
              f"{str(r['graph_tokens_equal_eager']):>5}")
    p = res["prefill"]
    print(f"prefill of {p['tokens']} tokens in chunks of {p['chunk']}: "
          + (f"{p['seconds']:.2f} s, {p['tokens_per_s']:.0f} tokens/s (the same prompt the first time, its kernels "
             f"compiled: {p['first_seconds']:.2f} s)" if "seconds" in p else p["error"]))
    for r in res["transformers"]:
        fmt = lambda v: f"{v:.2f} ms" if isinstance(v, float) else str(v)  # noqa: E731
        print(f"transformers B{r['batch']} ctx {r['context']}: cuDNN SDPA off {fmt(r['cudnn_sdp_off_ms'])}, "
              f"on {fmt(r['cudnn_sdp_on_ms'])}; graphs speed-up {r.get('graphs_speedup_vs_cudnn_off', '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
