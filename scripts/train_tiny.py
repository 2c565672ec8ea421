#!/usr/bin/env python3
"""Train the embedded default: a small M3 (exactly the architecture m3export.model defines) on Python source.

Corpus: the Python standard library's own ``.py`` files (``m3export.corpus``; held out by file). Tokenizer: a
byte-level BPE trained on the training files with M3's control tokens (``m3export.tokenizer``). Model: one dense
layer, then lightning-indexer sparse layers whose 16-token index blocks make selection matter beyond 64 tokens
(top 4 blocks), sigmoid-routed MoE with a shared expert, SwiGLU-OAI, partial RoPE, and two MTP modules trained
jointly (``m3export.training.objective``). Seeded; the step count fixes the schedule, ``--minutes`` only stops
early (the last evaluated weights are kept in ``--work``; ``--package-only`` builds the output from them).

    python scripts/train_tiny.py                                   # ~35 min on 1 CPU thread
    python scripts/train_tiny.py --device cuda --threads 8          # the same run on a GPU
    python scripts/train_tiny.py --package-only                     # package --work's weights into --out

Writes ``--out`` (original-layout safetensors + config.json + tokenizer files + training.json) and the loss
curve ``docs/images/train_tiny_curve.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from m3export.checkpoint.writer import write_checkpoint  # noqa: E402
from m3export.config import DENSE_ATTN, SPARSE, M3Config  # noqa: E402
from m3export.corpus import encode_files, heldout_windows, stdlib_files  # noqa: E402
from m3export.model import M3ForCausalLM  # noqa: E402
from m3export.tokenizer import (BOS, CHAT_TEMPLATE, EOS, bpe_tokenizer_config,  # noqa: E402
                                train_bpe_tokenizer)
from m3export.training.objective import RouterBalancer, evaluate, run_heads  # noqa: E402

VOCAB = 2048
CONTEXT = 256


def model_config(tokenizer) -> M3Config:
    n_layers = 4
    return M3Config(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, rotary_dim=16, intermediate_size=64, shared_intermediate_size=64, dense_intermediate_size=256,
        num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.0,
        layer_types=[DENSE_ATTN] + [SPARSE] * (n_layers - 1), mlp_layer_types=["dense"] + ["sparse"] * (n_layers - 1),
        index_n_heads=2, index_head_dim=32, index_block_size=16, index_topk_blocks=4, index_local_blocks=1,
        index_init_blocks=0, num_mtp_modules=2, max_position_embeddings=4096, rope_theta=10000.0,
        bos_token_id=tokenizer.token_to_id(BOS), eos_token_id=[tokenizer.token_to_id(EOS)], pad_token_id=None,
    ).validate()


def initialise(model: M3ForCausalLM, seed: int) -> None:
    """Scaled normal init: 1/sqrt(fan_in) for projections in, shrunk by 1/sqrt(2 * depth) for projections back
    into the residual stream; norms start at identity (zero offsets) and routing biases at zero."""
    g = torch.Generator().manual_seed(seed)
    depth = model.config.num_hidden_layers + len(model.mtp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("e_score_correction_bias"):
                p.zero_()
                continue
            std = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
            if any(k in name for k in ("o_proj", "down_proj", "experts.w2")):
                std /= math.sqrt(2 * depth)
            if name == "lm_head.weight":
                std *= 0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)
    model.rotary.reset_parameters()


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def plot(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in log if "train_loss" in r]
    ev = [r for r in log if "heldout" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in train], [r["train_loss"] for r in train], lw=0.8, alpha=0.6, label="train (main)")
    for head in ("main", "mtp0", "mtp1"):
        ax.plot([r["step"] for r in ev], [r["heldout"][head]["loss"] for r in ev], marker="o", ms=3,
                label=f"held-out {head}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("m3export embedded model: Python stdlib, held out by file")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "m3export" / "embedded" / "code-tiny"))
    ap.add_argument("--work", default="/tmp/m3-train-tiny", help="tokenizer, weights after each eval, log")
    ap.add_argument("--steps", type=int, default=550)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--mtp-weight", type=float, default=0.5, help="loss weight of each MTP module")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-windows", type=int, default=16, help="held-out windows per periodic evaluation")
    ap.add_argument("--final-windows", type=int, default=128, help="held-out windows of the final evaluation")
    ap.add_argument("--minutes", type=float, default=35.0, help="stop early after this much wall time")
    ap.add_argument("--stop-at-step", type=int, default=None,
                    help="stop after this step with the --steps schedule unchanged (reproduces a run that "
                         "--minutes stopped: training.json records where)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads (1 is fastest on a shared 2-core machine: spinning OpenMP threads stall)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--package-only", action="store_true", help="package --work's last weights into --out")
    ap.add_argument("--curve", default=str(ROOT / "docs" / "images" / "train_tiny_curve.png"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)

    train_files, heldout_files = stdlib_files("train"), stdlib_files("heldout")
    tok_path = work / "tokenizer.json"
    if not tok_path.exists():
        train_bpe_tokenizer((text for _, text in train_files), VOCAB).save(str(tok_path))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    cfg = model_config(tok)
    eos = cfg.eos_token_id[0]
    held_ids = encode_files(tok, [text for _, text in heldout_files])
    windows = torch.tensor(heldout_windows(held_ids, CONTEXT + 2, args.final_windows), device=dev)

    model = M3ForCausalLM(cfg).to(dev)
    initialise(model, args.seed)
    log_path, weights_path = work / "log.jsonl", work / "weights.safetensors"
    log: list[dict] = []
    if not args.package_only:
        stream = torch.tensor([i for ids in encode_files(tok, [t for _, t in train_files]) for i in ids + [eos]])
        print(f"corpus: {len(train_files)} train files ({len(stream)} tokens), {len(heldout_files)} held-out files; "
              f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters", flush=True)
        decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2 and "embed" not in n]
        other = [p for n, p in model.named_parameters() if p.requires_grad and not (p.ndim >= 2 and "embed" not in n)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                                lr=args.lr, betas=(0.9, 0.95))
        balancer = RouterBalancer(model)
        g = torch.Generator().manual_seed(args.seed)
        start = time.time()
        log_path.write_text("")
        bar = tqdm(range(args.steps), desc="train", unit="step")
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
            offsets = torch.randint(0, len(stream) - CONTEXT - 2, (args.batch,), generator=g)
            tokens = torch.stack([stream[o:o + CONTEXT + 2] for o in offsets.tolist()]).to(dev)
            model.train()
            fwd = run_heads(model, tokens, chain_fraction=0.5, generator=g, distill_indexer=True)
            ce = [torch.nn.functional.cross_entropy(lg, tg) for lg, tg in zip(fwd.logits, fwd.targets)]
            kl = torch.stack(fwd.indexer_kl).mean()
            loss = ce[0] + args.mtp_weight * sum(ce[1:]) + kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            imbalance = balancer.update()
            rec = {"step": step + 1, "train_loss": ce[0].item(), "mtp_loss": [c.item() for c in ce[1:]],
                   "indexer_kl": kl.item(), "grad_norm": gnorm, "max_load_ratio": imbalance,
                   "lr": opt.param_groups[0]["lr"], "elapsed_s": time.time() - start}
            bar.set_postfix(loss=f"{rec['train_loss']:.3f}", mtp=f"{rec['mtp_loss'][0]:.2f}", kl=f"{float(kl):.3f}")
            out_of_time = time.time() - start > args.minutes * 60 or step + 1 == args.stop_at_step
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps or out_of_time:
                model.eval()
                rec["heldout"] = evaluate(model, windows[:args.eval_windows])
                save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                          str(weights_path))
                tqdm.write(f"step {step + 1}: held-out " + ", ".join(
                    f"{h} {m['loss']:.3f} ({m['accuracy']:.1%})" for h, m in rec["heldout"].items()))
            log.append(rec)
            with log_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            if out_of_time:
                tqdm.write(f"stopping at step {step + 1} of {args.steps} (--minutes / --stop-at-step)")
                break
        balancer.remove()
    else:
        log = [json.loads(line) for line in log_path.read_text().splitlines()]
    model.load_state_dict({k: v.to(dev) for k, v in load_file(str(weights_path)).items()})
    package(model, tok, cfg, windows, log, heldout_files, args)
    return 0


def package(model, tok, cfg, windows, log, heldout_files, args) -> None:
    """Final held-out evaluation (in the shipped precision), checkpoint + tokenizer files + training.json."""
    model.eval()
    with torch.no_grad():  # ship bf16: evaluate exactly the weights that ship
        for p in model.parameters():
            if p.dtype == torch.float32 and p.ndim >= 2:
                p.copy_(p.to(torch.bfloat16).float())
    final = evaluate(model, windows)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    write_checkpoint(out, cfg, layout="original", fmt="bf16", model=model.cpu(), with_tokenizer=False, progress=False)
    out.chmod(0o755)  # the writer's private temporary directory becomes package data that everyone reads
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(bpe_tokenizer_config(tok, CONTEXT * 16), indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id[0]}, indent=2) + "\n")
    recorded_slice = measure_slice(out, tok)
    train = [r for r in log if "train_loss" in r]
    summary = {
        "corpus": "Python standard library .py files (m3export.corpus), held out by file",
        "heldout_files": [rel for rel, _ in heldout_files],
        "context": CONTEXT, "eval_windows": len(windows), "heldout": final, "test_slice": recorded_slice,
        "steps": len(train), "schedule_steps": args.steps, "batch": args.batch, "seed": args.seed, "lr": args.lr, "mtp_weight": args.mtp_weight,
        "wall_time_s": train[-1]["elapsed_s"] if train else None, "device": args.device, "threads": args.threads,
        "tokens_seen": len(train) * args.batch * CONTEXT,
        "parameters": sum(p.numel() for p in model.parameters()),
        "curve": [{"step": r["step"], **{h: r["heldout"][h]["loss"] for h in r["heldout"]}}
                  for r in log if "heldout" in r],
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    if log:
        plot(log, Path(args.curve))
    print(json.dumps(final, indent=2))
    print("wrote", out, "|", ", ".join(f"{p.name} {p.stat().st_size / 1e6:.2f} MB" for p in sorted(out.iterdir())))


def measure_slice(out: Path, tok) -> dict:
    """What CI re-measures (tests/test_embedded_model.py), on the checkpoint as written and loaded: held-out
    slice metrics, and MTP acceptance through the runtime's speculative decoding (greedy, k = 2) on prompts made
    of each slice window's first SLICE_PROMPT tokens."""
    import m3export
    from m3export.runtime import Engine, SamplingParams
    from m3export.training.objective import heldout_slice, slice_digest

    windows = heldout_slice(tok)
    shipped = m3export.load_model(out, dtype=torch.float32, progress=False)
    metrics = evaluate(shipped, windows)
    engine = Engine.from_checkpoint(out, dtype=torch.float32, num_speculative_tokens=2, max_num_seqs=1)
    for w in windows:
        engine.generate([w[:SLICE_PROMPT].tolist()], SamplingParams(temperature=0, max_tokens=SLICE_NEW,
                                                                    ignore_eos=True))
    return {"digest": slice_digest(windows), "windows": list(windows.shape), "main": metrics["main"],
            "mtp0": metrics["mtp0"], "mtp1": metrics["mtp1"], "prompt_tokens": SLICE_PROMPT, "new_tokens": SLICE_NEW,
            "acceptance_length_k2_greedy": engine.stats.mean_acceptance_length}


SLICE_PROMPT, SLICE_NEW = 64, 24

if __name__ == "__main__":
    sys.exit(main())
