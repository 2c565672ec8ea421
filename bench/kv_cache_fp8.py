"""Accuracy of the FP8 (E4M3, per-row fp32 scale) cache against the model-dtype cache (``--kv-cache-dtype``).

For each prompt the same model runs twice, once with each cache:

* **greedy agreement**: N greedy tokens through the engine (torch backend) with each cache; reported: the
  fraction of prompts whose N tokens are identical, the mean length of the common prefix over N, and the
  position-wise token match;
* **logit error** (teacher-forced on prompt + the model-dtype cache's greedy tokens, one prefill step per cache,
  which writes and reads every row exactly as decoding would, since each row is quantised on its own): per
  compared position, max |fp8 - ref| over max |ref| (then the max and the mean over positions) and
  mean |fp8 - ref| over mean |ref|, at the last ``N + 1`` positions;
* **block-selection agreement**: per sparse layer, the fraction of (token, KV head) pairs whose selected block
  *sets* are equal, over the tokens that see more blocks than top-k (where the indexer chooses).

Prompts: held-out Python stdlib windows (``m3export.corpus``, never trained on) for a checkpoint with a tokenizer
(the embedded trained model makes greedy agreement meaningful); random token ids for presets (random weights).
On CUDA the ops run the Triton kernels (the fused cache write quantises); on the CPU their references.

  python bench/kv_cache_fp8.py --device cpu                                  # embedded code-tiny (trained)
  python bench/kv_cache_fp8.py --model tiny --device cpu                     # CPU check, random weights
  python bench/kv_cache_fp8.py --model mini --device cuda                    # H200, mini preset (random)
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import RESULTS, write_results  # noqa: E402  (bench/results_file.py)


def load(model_name: str, device: str, dtype: torch.dtype):
    """(model, a ``tokenizers.Tokenizer`` or None). ``mini`` is built on the device with random weights
    (bench/decode.py's generator: seconds, where the CPU preset generator would take minutes)."""
    import m3export
    from tokenizers import Tokenizer

    from m3export.config import preset

    if model_name == "mini":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from decode import build_model

        model = build_model(preset("mini"), False, device, dtype)
    else:
        model = m3export.load_model(model_name, device=device, dtype=dtype)
    if device.startswith("cuda"):
        from m3export.plugins.kernels import use_on

        use_on(device)
    file = Path(model_name) / "tokenizer.json"
    return model, Tokenizer.from_file(str(file)) if file.is_file() else None


def make_prompts(model, tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    if tokenizer is not None:
        from m3export.corpus import encode_files, heldout_windows, stdlib_files

        texts = [text for _, text in stdlib_files("heldout")]
        windows = heldout_windows(encode_files(tokenizer, texts), length, count)
        if len(windows) == count:
            return windows
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (count, length), generator=g).tolist()


def greedy(model, cache_dtype, prompts, n: int, page: int) -> list[list[int]]:
    from m3export.runtime import Engine
    from m3export.runtime.backends.torch_backend import TorchBackend

    longest = max(len(p) for p in prompts) + n
    eng = Engine(TorchBackend(model, cache_dtype), None, page_size=page,
                 num_pages=len(prompts) * -(-longest // page) + 1, max_model_len=longest, max_num_batched_tokens=4096)
    outs = eng.generate(prompts, [_params(n)] * len(prompts))
    return [o.token_ids for o in outs]


def _params(n):
    from m3export.runtime import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def teacher_forced(model, cache_dtype, ids: list[int], rows: int, page: int):
    """One prefill step over ``ids`` with a fresh cache of ``cache_dtype``: (logits of the last ``rows`` positions
    [rows, V] fp32, per sparse layer the selections [T, Hkv, K])."""
    from m3export.model.batch import Batch

    device = model.lm_head.weight.device
    t = len(ids)
    caches = model.allocate_caches(-(-t // page), page, cache_dtype, device)
    batch = Batch.contiguous(1, t, page, device)
    idx = torch.arange(t - rows, t, device=device)
    with torch.inference_mode():
        out = model.step(torch.tensor(ids, device=device), batch, caches, idx, inplace=True)
    return out.logits.float(), out.selections


def choosing_tokens(cfg, t: int) -> torch.Tensor:
    """Positions whose visible blocks outnumber top-k (the indexer must drop some)."""
    return torch.arange(t) // cfg.index_block_size + 1 > cfg.index_topk_blocks


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T, H, K] selections -> [T, H] whether each pair selected the same set of blocks (order, -1 ignored)."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def compare(model, cfg, cache, prompts, ref_tokens, ref_forced, layers, page: int, n: int) -> dict:
    """Greedy, logit and selection agreement of ``cache`` with the reference cache's runs."""
    tokens = greedy(model, cache, prompts, n, page)
    prefix, match = [], []
    for a, b in zip(ref_tokens, tokens):
        same = [x == y for x, y in zip(a, b)]
        prefix.append((same + [False]).index(False) / len(a))
        match.append(sum(same) / len(a))
    row_max, num, den = [], 0.0, 0.0
    agree = torch.zeros(len(layers), dtype=torch.float64)
    counted = 0
    for p, cont, (ref_logits, ref_sel) in zip(prompts, ref_tokens, ref_forced):
        ids = p + cont
        logits, sel = teacher_forced(model, cache, ids, len(cont) + 1, page)
        diff = (logits - ref_logits).abs()
        row_max.extend((diff.amax(-1) / ref_logits.abs().amax(-1)).tolist())
        num += diff.mean().item()
        den += ref_logits.abs().mean().item()
        choose = choosing_tokens(cfg, len(ids)).to(logits.device)
        if choose.any():
            for i, (a, b) in enumerate(zip(ref_sel, sel)):
                agree[i] += same_sets(a[choose], b[choose]).double().mean().item()
            counted += 1
    selection = (agree / max(counted, 1)).tolist()
    return {
        "logits": {"max_rel_max": max(row_max), "max_rel_mean": sum(row_max) / len(row_max), "mean_rel": num / den,
                   "positions": len(row_max)},
        "selection_agreement": {**dict(zip(map(str, layers), selection)),
                                "mean": sum(selection) / len(selection) if counted else float("nan"),
                                "prompts_where_the_indexer_chooses": counted},
        "greedy": {"identical_sequences": sum(m == 1.0 for m in match) / len(match),
                   "common_prefix_fraction": sum(prefix) / len(prefix), "token_match": sum(match) / len(match)},
    }


def main() -> int:
    from m3export.dtypes import BY_NAME
    from m3export.embedded import default_model
    from m3export.ops.kv_fp8 import FP8

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="preset (tiny, mini) or checkpoint directory "
                                                  "(default: the embedded trained code-tiny)")
    ap.add_argument("--preset", dest="model", help="same as --model with a preset name")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="model dtype (default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, help="tokens per prompt (default: 4096 on cuda, 320 on cpu)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--page-size", type=int, help="default: the index block size, at most 64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="output (default: bench/results/kv_cache_fp8_<model>_<device>.json)")
    args = ap.parse_args()
    command = "python bench/kv_cache_fp8.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    model_name = args.model or str(default_model())
    cuda = args.device.startswith("cuda")
    dtype = BY_NAME[args.dtype or ("bfloat16" if cuda else "float32")].torch
    length = args.prompt_len or (4096 if cuda else 320)
    torch.manual_seed(args.seed)

    t0 = time.perf_counter()
    model, tokenizer = load(model_name, args.device, dtype)
    cfg = model.config
    page = args.page_size or min(cfg.index_block_size, 64)
    prompts = make_prompts(model, tokenizer, args.prompts, length, args.seed)
    print(f"{model_name}: {cfg.num_hidden_layers} layers, {dtype}, {len(prompts)} prompts of {length} tokens, "
          f"{args.tokens} greedy tokens, page {page} (loaded in {time.perf_counter() - t0:.1f} s)", file=sys.stderr)

    ref_tokens = greedy(model, dtype, prompts, args.tokens, page)
    ref_forced = [teacher_forced(model, dtype, p + cont, len(cont) + 1, page) for p, cont in zip(prompts, ref_tokens)]
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_layer(i)]
    # fp8 against the model-dtype cache; with an fp32 model, the bf16 cache too, as a yardstick
    caches = {"fp8": FP8, **({"bf16": torch.bfloat16} if dtype == torch.float32 else {})}
    measured = {name: compare(model, cfg, cache, prompts, ref_tokens, ref_forced, layers, page, args.tokens)
                for name, cache in caches.items()}

    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "model": model_name, "device": args.device, "model_dtype": str(dtype).removeprefix("torch."),
        "fp8_cache": "E4M3, one fp32 scale per token per KV head (K, V) / per token (index keys)",
        "torch": torch.__version__, "prompts": len(prompts), "prompt_len": length, "greedy_tokens": args.tokens,
        "page_size": page, "index_block_size": cfg.index_block_size, "index_topk_blocks": cfg.index_topk_blocks,
        "against": f"the {str(dtype).removeprefix('torch.')} cache", **measured,
    }
    names = list(measured)
    print(f"\ncache vs the {res['model_dtype']} cache, {model_name} on {args.device}")
    print(f"{'metric':<50}" + "".join(f"{n:>10}" for n in names))
    table = [("logits: max |d| / max |ref|, worst position", ("logits", "max_rel_max")),
             ("logits: max |d| / max |ref|, mean over positions", ("logits", "max_rel_mean")),
             ("logits: mean |d| / mean |ref|", ("logits", "mean_rel")),
             *((f"selection sets equal, layer {i}", ("selection_agreement", str(i))) for i in layers),
             ("greedy: identical sequences", ("greedy", "identical_sequences")),
             (f"greedy: common prefix / {args.tokens}", ("greedy", "common_prefix_fraction")),
             ("greedy: tokens equal position-wise", ("greedy", "token_match"))]
    for label, (group, key) in table:
        print(f"{label:<50}" + "".join(f"{measured[n][group][key]:>10.4g}" for n in names))
    name = f"kv_cache_fp8_{Path(model_name).name}_{args.device.split(':')[0]}.json"
    out = Path(args.json) if args.json else RESULTS / name
    write_results(res, out)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
