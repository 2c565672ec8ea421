"""What the embedded model is trained on and measured by: next token, two MTP drafts, indexer distillation.

One forward, the runtime's own code path (``step`` then ``mtp_step`` per module on a contiguous paged batch):

* the main head predicts x_{t+1} from position t;
* MTP module k (the runtime drafts with module ``s % K`` at chain step s) sits at position t with token x_{t+1}
  and a hidden state standing for h_t, and predicts x_{t+2}. Module 0 gets the target's h_t. Module k > 0 gets,
  at drafting time, the previous module's output at t - 1 (so it predicts the token *three* after the target's
  last hidden state) while the context it attends to was written with the target's hidden states (the runtime's
  catch-up). Training feeds it the chained output on a random half of the positions and h_t on the rest, so
  both its queries and its context look like what drafting shows it; evaluation feeds only chained outputs.
* The lightning indexer's block choice has no gradient. Each indexer is distilled towards its attention: per
  KV head, the softmax over visible blocks of the indexer's block scores is pulled (KL) to the share of
  attention probability that the KV head's query heads put in each block under dense causal attention. The
  indexer reads a detached input, so this loss trains the indexer alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..model import Batch, M3ForCausalLM
from ..model.attention import Attention
from ..model.mlp import MoE
from ..model.rope import apply_rope
from ..ops.moe import route

PAGE = 16


@dataclass
class HeadStats:
    """Summed token loss (nats) and correct greedy predictions for one head (main, mtp0, mtp1, ...)."""

    loss: float = 0.0
    correct: int = 0
    count: int = 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        self.loss += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
        self.correct += int((logits.argmax(-1) == targets).sum())
        self.count += targets.numel()

    def as_dict(self) -> dict:
        mean = self.loss / max(self.count, 1)
        return {"loss": mean, "perplexity": float(torch.tensor(mean).exp()), "accuracy": self.correct / max(self.count, 1),
                "tokens": self.count}


@dataclass
class Forward:
    logits: list[torch.Tensor]  # per head [B*T, vocab]: main, then each MTP module
    targets: list[torch.Tensor]  # per head [B*T]
    indexer_kl: list[torch.Tensor] = field(default_factory=list)  # per sparse layer (main then MTP), scalar


def run_heads(model: M3ForCausalLM, tokens: torch.Tensor, chain_fraction: float = 1.0,
              generator: torch.Generator | None = None, distill_indexer: bool = False) -> Forward:
    """tokens [B, T + 2] (T a multiple of the index block size) -> logits and targets of every head."""
    bsz, length = tokens.shape
    t = length - 2
    dev = tokens.device
    batch = Batch.contiguous(bsz, t, PAGE, dev)
    pages = bsz * -(-t // PAGE)
    dtype = model.lm_head.weight.dtype
    captured: list[tuple[Attention, tuple]] = []
    hooks = []
    if distill_indexer:
        for m in model.modules():
            if isinstance(m, Attention) and m.indexer is not None:
                hooks.append(m.register_forward_pre_hook(lambda mod, args: captured.append((mod, args[:4]))))
    try:
        out = model.step(tokens[:, :t].reshape(-1), batch, model.allocate_caches(pages, PAGE, dtype, dev))
        logits, targets = [out.logits], [tokens[:, 1:t + 1].reshape(-1)]
        next_ids, mtp_targets = tokens[:, 1:t + 1].reshape(-1), tokens[:, 2:t + 2].reshape(-1)
        mtp_caches = model.allocate_caches(pages, PAGE, dtype, dev, layers="mtp")
        previous = None
        for k in range(len(model.mtp)):
            hidden = out.hidden
            if previous is not None:
                shifted = torch.cat([out.hidden.view(bsz, t, -1)[:, :1], previous.view(bsz, t, -1)[:, :-1]], 1)
                chained = torch.rand(bsz, t, 1, generator=generator, device=dev) < chain_fraction
                chained[:, 0] = False  # position 0 has no previous draft step
                hidden = torch.where(chained, shifted, out.hidden.view(bsz, t, -1)).reshape(bsz * t, -1)
            lg, previous, _, _ = model.mtp_step(k, next_ids, hidden, batch, mtp_caches[k])
            logits.append(lg)
            targets.append(mtp_targets)
    finally:
        for h in hooks:
            h.remove()
    kl = [indexer_distillation(mod, *args, bsz, t) for mod, args in captured]
    return Forward(logits, targets, kl)


def indexer_distillation(attn: Attention, x, cos, sin, batch: Batch, bsz: int, t: int) -> torch.Tensor:
    """KL(attention block mass || indexer block distribution), mean over (sequence, KV head, token)."""
    c, ix = attn.cfg, attn.indexer
    bs, hkv, group = c.index_block_size, attn.n_kv, attn.n_heads // attn.n_kv
    nb = t // bs
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    with torch.no_grad():
        n = x.shape[0]
        q = apply_rope(attn.q_norm(attn.q_proj(x).view(n, attn.n_heads, attn.head_dim)), cos, sin)
        k = apply_rope(attn.k_norm(attn.k_proj(x).view(n, hkv, attn.head_dim)), cos, sin)
        q = q.view(bsz, t, attn.n_heads, -1).transpose(1, 2).float()
        k = k.view(bsz, t, hkv, -1).transpose(1, 2).repeat_interleave(group, 1).float()
        p = torch.softmax((q @ k.transpose(-1, -2) * attn.scale).masked_fill(~causal, float("-inf")), -1)
        mass = p.view(bsz, hkv, group, t, nb, bs).sum((2, 5)) / group  # [B, Hkv, T, NB]
    iq, ik = ix.keys_and_queries(x.detach(), cos, sin)
    iq = iq.view(bsz, t, ix.n_heads, -1).transpose(1, 2).float()  # [B, H, T, D]
    ik = ik.view(bsz, 1, t, -1).float()
    scores = (iq @ ik.transpose(-1, -2)).masked_fill(~causal, float("-inf"))
    block = scores.view(bsz, ix.n_heads, t, nb, bs).amax(-1)  # a block after the query's own is all -inf
    visible = torch.isfinite(block)
    logq = torch.log_softmax(block, -1)
    terms = torch.where(visible & (mass > 0), mass * (mass.clamp_min(1e-12).log() - logq), torch.zeros_like(mass))
    return terms.sum(-1).mean()


class RouterBalancer:
    """Auxiliary-loss-free load balancing: after each step every MoE's ``e_score_correction_bias`` moves by
    ``rate`` towards under-used experts (sign of mean load minus the expert's load). The bias only picks experts,
    never weights them, so this steers load without changing what the model computes for a fixed choice."""

    def __init__(self, model: M3ForCausalLM, rate: float = 1e-3):
        self.rate = rate
        self.loads: dict[MoE, torch.Tensor] = {}
        self.hooks = [m.register_forward_pre_hook(self._count) for m in model.modules() if isinstance(m, MoE)]

    def _count(self, moe: MoE, args) -> None:
        if not moe.training:
            return  # evaluation batches (held-out text) must not steer routing
        with torch.no_grad():
            idx, _ = route(args[0], moe.gate.weight, moe.gate.e_score_correction_bias, moe.cfg.num_experts_per_tok)
            load = torch.bincount(idx.reshape(-1), minlength=moe.cfg.num_local_experts).float()
        self.loads[moe] = self.loads.get(moe, 0) + load

    def update(self) -> float:
        """Apply the bias step; returns the worst max/mean load ratio seen since the last update."""
        worst = 1.0
        with torch.no_grad():
            for moe, load in self.loads.items():
                moe.gate.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
                worst = max(worst, float(load.max() / load.mean().clamp_min(1e-9)))
        self.loads.clear()
        return worst

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


@torch.no_grad()
def evaluate(model: M3ForCausalLM, windows: torch.Tensor, batch_size: int = 8) -> dict:
    """Held-out metrics per head on ``windows`` [N, T + 2]: loss (nats/token), perplexity, greedy accuracy.
    MTP modules after the first are fed chained outputs everywhere, as when drafting."""
    names = ["main"] + [f"mtp{k}" for k in range(len(model.mtp))]
    stats = {n: HeadStats() for n in names}
    for i in range(0, len(windows), batch_size):
        fwd = run_heads(model, windows[i:i + batch_size], chain_fraction=1.0)
        for n, lg, tg in zip(names, fwd.logits, fwd.targets):
            stats[n].add(lg, tg)
    return {n: s.as_dict() for n, s in stats.items()}


# The small held-out slice that CI re-measures (tests/test_embedded_model.py) and training records: few enough
# tokens to evaluate in about a second on one CPU thread, drawn from many held-out files.
SLICE_WINDOWS, SLICE_CONTEXT = 6, 256


def heldout_slice(tokenizer) -> torch.Tensor:
    """[SLICE_WINDOWS, SLICE_CONTEXT + 2] token windows of the held-out stdlib files of this Python."""
    from ..corpus import encode_files, heldout_windows, stdlib_files

    ids = encode_files(tokenizer, [text for _, text in stdlib_files("heldout")])
    return torch.tensor(heldout_windows(ids, SLICE_CONTEXT + 2, SLICE_WINDOWS))


def slice_digest(windows: torch.Tensor) -> str:
    """Identifies the slice's exact tokens (another Python version's stdlib gives other held-out text)."""
    import hashlib

    return hashlib.sha256(windows.to(torch.int64).numpy().tobytes()).hexdigest()[:16]
