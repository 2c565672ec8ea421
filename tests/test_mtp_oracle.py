"""An independent float64 oracle for one MTP module, written from the architecture, against ``model.mtp_step``
and the exported ``mtp0.onnx`` in ONNX Runtime.

The formula (no code of ``m3export.model`` or ``m3export.ops`` is used): for positions t = 0 .. n-1 of one
sequence with tokens x_0 .. x_n and the main model's final-normed hidden h_t,

    e_t = embed(x_{t+1}), zeroed at position 0
    z_t = eh_proj([enorm(e_t), hnorm(h_t)])                       (this concat order)
    a   = z + o_proj(sparse attention(input_layernorm(z)))       (QK norm, partial NeoX RoPE, lightning indexer)
    out = a + MoE(post_attention_layernorm(a))                   (sigmoid routing, bias for selection only)
    logits_t = lm_head(final_layernorm(out_t))

transformers ignores ``mtp.*`` weights, so nothing else checks this module's semantics: a swapped concat order or
a missing position-0 zeroing changes the MTP drafts but never a target token.
"""

from __future__ import annotations

import math

import pytest
import torch

from m3export.model import Batch

from .runtime_fixtures import tiny_model

D64 = torch.float64
N = 30  # positions: > top-k * block (3 * 4) so the indexer must choose in the tiny config


def rms(x, w, eps):
    """Gemma RMSNorm: the stored weight is an offset from one."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1 + w)


def rope(x, positions, rot, theta):
    """Partial NeoX RoPE on x [T, H, D]: pairs (i, i + rot/2) for i < rot/2 rotate, dims >= rot pass. Angles are
    formed in fp32 as the contract's graphs do (positions * fp32 inverse frequencies); the rotation is float64."""
    inv = (1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)))
    ang = (positions.float()[:, None] * inv[None]).double()
    c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    half = rot // 2
    out = x.clone()
    out[..., :half] = x[..., :half] * c - x[..., half:rot] * s
    out[..., half:rot] = x[..., half:rot] * c + x[..., :half] * s
    return out


def swiglu(gu, alpha, limit):
    i = gu.shape[-1] // 2
    g, u = gu[..., :i].clamp(max=limit), gu[..., i:].clamp(-limit, limit)
    return g / (1 + torch.exp(-alpha * g)) * (u + 1)


@torch.no_grad()
def mtp_oracle(cfg, w: dict[str, torch.Tensor], embed, lm_head, tokens: list[int], hidden: torch.Tensor):
    """Logits [n, vocab] and pre-norm outputs [n, H] of MTP module weights ``w`` (float64) at positions 0..n-1."""
    n, eps = len(tokens) - 1, cfg.rms_norm_eps
    pos = torch.arange(n)
    e = embed[torch.tensor(tokens[1:])].clone()
    e[0] = 0.0
    z = torch.cat([rms(e, w["enorm.weight"], eps), rms(hidden, w["hnorm.weight"], eps)], -1) @ w["eh_proj.weight"].T
    L = "transformer_layer."
    x = rms(z, w[L + "input_layernorm.weight"], eps)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    A = L + "self_attn."
    q = rope(rms((x @ w[A + "q_proj.weight"].T).view(n, hq, d), w[A + "q_norm.weight"], eps), pos, cfg.rotary_dim,
             cfg.rope_theta)
    k = rope(rms((x @ w[A + "k_proj.weight"].T).view(n, hkv, d), w[A + "k_norm.weight"], eps), pos, cfg.rotary_dim,
             cfg.rope_theta)
    v = (x @ w[A + "v_proj.weight"].T).view(n, hkv, d)
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    I = A + "indexer."
    iq = rope(rms((x @ w[I + "index_q_proj.weight"].T).view(n, ih, idim), w[I + "index_q_norm.weight"], eps), pos,
              cfg.rotary_dim, cfg.rope_theta)
    ik = rope(rms((x @ w[I + "index_k_proj.weight"].T).view(n, 1, idim), w[I + "index_k_norm.weight"], eps), pos,
              cfg.rotary_dim, cfg.rope_theta)[:, 0]
    bs, topk = cfg.index_block_size, cfg.index_topk_blocks
    local, init = cfg.index_local_blocks, cfg.index_init_blocks
    attn = torch.zeros(n, hq, d, dtype=D64)
    chose_some = False
    for t in range(n):
        nb = t // bs + 1
        for r in range(hkv):  # index head r chooses for KV group r
            score = {c: max(float(iq[t, r] @ ik[j]) for j in range(c * bs, min(t + 1, c * bs + bs)))
                     for c in range(nb)}
            forced = {c for c in range(nb) if c > nb - 1 - local or c < init}
            ranked = sorted(forced) + sorted(set(score) - forced, key=lambda c: (-score[c], c))
            chosen = set(ranked[:topk])
            chose_some |= len(chosen) < nb
            keys = [j for j in range(t + 1) if j // bs in chosen]
            for hh in range(r * hq // hkv, (r + 1) * hq // hkv):
                p = torch.softmax(torch.stack([q[t, hh] @ k[j, r] for j in keys]) / math.sqrt(d), 0)
                attn[t, hh] = sum(p[m] * v[j, r] for m, j in enumerate(keys))
    assert chose_some, "the sequence is too short for the indexer to choose"
    a = z + attn.reshape(n, -1) @ w[A + "o_proj.weight"].T
    y = rms(a, w[L + "post_attention_layernorm.weight"], eps)
    M = L + "mlp."
    rw, bias = w[M + "gate.weight"], w[M + "gate.e_score_correction_bias"]
    w13, w2 = w[M + "experts.w13"], w[M + "experts.w2"]
    moe = torch.zeros_like(a)
    for t in range(n):
        s = 1 / (1 + torch.exp(-(y[t] @ rw.T)))
        chosen = sorted(range(rw.shape[0]), key=lambda j: (-(s[j] + bias[j]).item(), j))[:cfg.num_experts_per_tok]
        total = sum(s[j] for j in chosen)
        for j in chosen:
            moe[t] += cfg.routed_scaling_factor * (s[j] / total) * (w2[j] @ swiglu(w13[j] @ y[t], cfg.swiglu_alpha,
                                                                                   cfg.swiglu_limit))
        moe[t] += w[M + "shared_experts.down_proj.weight"] @ swiglu(
            w[M + "shared_experts.gate_up_proj.weight"] @ y[t], cfg.swiglu_alpha, cfg.swiglu_limit)
    out = a + moe
    return rms(out, w["final_layernorm.weight"], eps) @ lm_head.T, out


def _batch(n: int, page: int) -> Batch:
    pos = torch.arange(n)
    pages = -(-n // page)
    return Batch(pos, torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                 torch.arange(pages, dtype=torch.int32)[None], pos.clone())


def _weights64(model) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in model.mtp[0].state_dict().items()}


def _tokens(seed: int) -> list[int]:
    return torch.randint(0, 256, (N + 1,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


def test_mtp_step_equals_the_architecture():
    model = tiny_model()
    tokens = _tokens(3)
    page = 4
    batch = _batch(N, page)
    with torch.no_grad():
        hidden = model.step(torch.tensor(tokens[:N]), batch, model.allocate_caches(N // page + 1, page, D64, "cpu")
                            ).hidden
        cache = model.allocate_caches(N // page + 1, page, D64, "cpu", layers="mtp")[0]
        logits, out, _, _ = model.mtp_step(0, torch.tensor(tokens[1:]), hidden, batch, cache)
    want_logits, want_out = mtp_oracle(model.config, _weights64(model), model.model.embed_tokens.weight.double(),
                                       model.lm_head.weight.double(), tokens, hidden.double())
    # float64 model against a float64 formula: only the RMSNorms (fp32 by contract) and the fp32 RoPE angles
    # round, ~1e-7 relative; 1e-5 leaves 100x, while a wrong concat order or a missing zeroing is O(1).
    assert _rel(logits, want_logits) < 1e-5
    assert _rel(out, want_out) < 1e-5


@pytest.mark.slow
def test_exported_mtp_graph_equals_the_architecture(tiny_artifact):  # noqa: F811
    """``mtp0.onnx`` in ONNX Runtime (fp32, pages of 16) against the same formula on the artifact's weights."""
    from m3export.export.artifact import load_artifact, load_torch_model
    from m3export.runtime import Engine

    art = load_artifact(tiny_artifact)
    model = load_torch_model(art)
    eng = Engine.from_artifact(tiny_artifact, backend="onnxruntime", num_pages=8)
    page = eng.page_size
    tokens = _tokens(4)
    batch = _batch(N, page)
    with torch.no_grad():
        _, hidden = eng.backend.forward(torch.tensor(tokens[:N]), batch, torch.arange(N))
        logits, out = eng.backend.mtp_forward(0, torch.tensor(tokens[1:]), hidden, batch, torch.arange(N))
    want_logits, want_out = mtp_oracle(model.config, _weights64(model), model.model.embed_tokens.weight.double(),
                                       model.lm_head.weight.double(), tokens, hidden.double())
    # fp32 graph against float64: rounding of ~1e-7 per op through one layer; measured ~1e-6. 2e-5 is 20x that and
    # far below the effect of a wrong concat order or a missing zeroing (O(1)).
    assert _rel(logits, want_logits) < 2e-5
    assert _rel(out, want_out) < 2e-5
