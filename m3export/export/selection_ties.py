"""Block selections of two runtimes, equal up to near-ties that the artifact's dtype cannot resolve.

``m3export verify`` runs an artifact's graphs next to the PyTorch reference. Both compute the indexer's scores in
fp32 (``docs/ops.md`` §2), but from index queries and keys that each side produced with its own matmuls and rounded
to the artifact's dtype. In an fp32 artifact those differ by fp32 roundings and the selections are equal in
practice; in a 16-bit artifact they differ by a few units of 2^-8 (bfloat16) or 2^-11 (float16), so two blocks
whose scores are that close may come out in the other order, and a top-k keeps the other one. Such a row is a
*near-tie swap*, not a failure; every other difference is a mismatch.

The bound (per score, from the reference's own operands, in float64):

    beta = c(dtype, D) * A,   A = sum_d |q_d k_d|,   c = 2 rho + rho^2 + c32 (1 + rho)^2,   rho = 2 R u

- Each side's stored index query / key element is its layer's exact value up to at most R = ``ROUNDINGS``
  roundings to the artifact dtype (unit roundoff u; first order, relative to the element): the layer's input row
  (the residual stream the two sides carry, rounded once more per layer), the projection's output, the index
  norm's output and the rotation's output. The two sides round independently, so ORT's element differs from the
  reference's by at most rho = 2 R u of it: |q~_d - q_d| <= rho |q_d|, |k~_d - k_d| <= rho |k_d|.
- Then |sum q~k~ - sum qk| <= sum (|dq||k| + |q||dk| + |dq||dk|) <= (2 rho + rho^2) A, and ORT sums its D
  products in fp32 in some order: at most c32 sum |q~ k~| <= c32 (1 + rho)^2 A more, c32 the fp32 dot's factor of
  ``ops/index_score_bound.py`` (the conformance suite's own bound: IEEE for fp32 artifacts, the tensor-core bound
  otherwise, the wider).
  The reference's score here is float64 of its own operands, exact to 2^-53.
- A block's score is the max of its visible keys' scores; max is 1-Lipschitz in the largest change, so a block's
  bound is the largest of its keys' (the block max, like a ReLU, adds no error of its own).
- Selection: let M be the reference's block scores, M_k its k-th (smallest selected, unforced) score. If ORT keeps
  b where the reference keeps a (a, b in the symmetric difference, M_a >= M_k >= M_b), ORT saw M~_b >= M~_a, so
  M_a - M_b <= beta_a + beta_b; both lie on their side of M_k, hence every block c of the symmetric difference has
  |M_c - M_k| <= 2 max(beta over the symmetric difference). Blocks ORT keeps in another order satisfy
  M_next - M_prev <= beta_prev + beta_next. Those are the two conditions checked; forced blocks (own / local /
  initial) admit no difference at all, and -1 padding must be the same.

For fp32 (u = 2^-24) c is ~ (17 + D) 2^-24, so an fp32 artifact's selections stay exact in all but true ties; for
bfloat16 c ~ 0.064: bfloat16 operands carry 8 significant bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..dtypes import BY_NAME
from ..model.batch import Batch
from ..ops import index_score_bound, kv_fp8
from ..ops.conformance import block_scores64

ROUNDINGS = 4
"""Roundings to the artifact dtype in each side's index query / key element, counted from the layer's input row:
that row, the projection, the index norm, the rotation (see the module docstring)."""


def unit_roundoff(dtype: str) -> float:
    """u of a floating artifact dtype by name: half its machine epsilon (bfloat16 2^-8, float16 2^-11)."""
    return torch.finfo(BY_NAME[dtype].torch).eps / 2


def score_bound_factor(dtype: str, head_dim: int) -> float:
    """c of the module docstring: a score's bound is c times the sum of |q_d k_d| of its operands."""
    rho = 2 * ROUNDINGS * unit_roundoff(dtype)
    c32 = index_score_bound.dot_error_factor(head_dim, ieee_fp32=BY_NAME[dtype].torch == torch.float32)
    return 2 * rho + rho * rho + c32 * (1 + rho) ** 2


@dataclass
class SelectionAgreement:
    """Block ids of one selection output over all steps: ``same`` / ``total`` ids, ``near_ties`` (token, head)
    rows accepted as near-tie swaps, ``mismatched`` rows that are not, with up to three described."""

    same: int = 0
    total: int = 0
    near_ties: int = 0
    mismatched: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.same == self.total

    @property
    def acceptable(self) -> bool:
        return self.mismatched == 0

    def __str__(self) -> str:
        pct = 100.0 * self.same / self.total if self.total else 100.0
        ties = f", {self.near_ties} near-tie swaps" if self.near_ties else ""
        return f"{pct:6.2f}% ({self.same}/{self.total}{ties})"


class SelectionJudge:
    """Compares a runtime's selection with the reference's at one sparse layer and says which rows the reference
    may take over (equal ones and near-tie swaps)."""

    def __init__(self, cfg, dtype: str):
        self.block_size, self.local, self.init = cfg.index_block_size, cfg.index_local_blocks, cfg.index_init_blocks
        self.factor = score_bound_factor(dtype, cfg.index_head_dim)

    def __call__(self, agreement: SelectionAgreement, got: torch.Tensor, own: torch.Tensor, index_q: torch.Tensor,
                 index_k_pool: torch.Tensor, index_k_scale: torch.Tensor | None, batch: Batch,
                 where: str = "") -> torch.Tensor:
        """got / own [T, H, K] int32 (the runtime's, the reference's), the reference's index queries [T, H, D]
        and index-key pool (FP8 with its scale pool) -> accepted rows [T, H] bool; ``agreement`` updated."""
        if got.shape != own.shape:
            agreement.total += max(got.numel(), own.numel())
            agreement.mismatched += 1
            self._example(agreement, f"{where}shape {tuple(got.shape)}, reference {tuple(own.shape)}")
            return torch.zeros(own.shape[:2], dtype=torch.bool)
        got = got.to(own.device, own.dtype)
        agreement.same += int((got == own).sum())
        agreement.total += own.numel()
        differ = (got != own).any(-1)
        accepted = ~differ
        if not bool(differ.any()):
            return accepted
        rows = differ.nonzero().tolist()
        tokens = sorted({t for t, _ in rows})
        scores, beta = self._scores(tokens, index_q, index_k_pool, index_k_scale, batch)
        local_row = {t: j for j, t in enumerate(tokens)}
        positions = batch.positions.tolist()
        for t, h in rows:
            j = local_row[t]
            g, w = got[t, h].tolist(), own[t, h].tolist()
            why = self._why_not_near_tie(g, w, scores[j, h].tolist(), beta[j, h].tolist(), positions[t])
            if why is None:
                agreement.near_ties += 1
                accepted[t, h] = True
            else:
                agreement.mismatched += 1
                self._example(agreement, f"{where}token {t} (position {positions[t]}), head {h}: runtime {g}, "
                                         f"reference {w}: {why}")
        return accepted

    @staticmethod
    def _example(agreement: SelectionAgreement, text: str) -> None:
        if len(agreement.examples) < 3:
            agreement.examples.append(text)

    def _scores(self, tokens: list[int], index_q, pool, scale, batch: Batch):
        """float64 block scores M and bounds beta [len(tokens), H, NB] of the given tokens, from the reference's
        operands (``conformance.block_scores64`` on the sub-batch of those tokens)."""
        idx = torch.tensor(tokens, dtype=torch.long)
        qsl = batch.query_start_loc.long()
        counts = torch.stack([((idx >= s) & (idx < e)).sum() for s, e in zip(qsl[:-1], qsl[1:])])
        sub_qsl = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(batch.query_start_loc.dtype)
        pool = kv_fp8.read_pool("index_k_cache", pool, scale)
        keys = pool.double() if scale is None else kv_fp8.dequantize_rows(pool, scale, torch.float64)
        inputs = [index_q[idx].double(), keys, batch.block_tables, sub_qsl, batch.seq_lens, batch.positions[idx]]
        scores, abs_sum = block_scores64(inputs, {"block_size": self.block_size})
        return scores, self.factor * abs_sum

    def _why_not_near_tie(self, got: list[int], want: list[int], m: list[float], beta: list[float],
                          position: int) -> str | None:
        """None when ``got`` is ``want`` up to near-tie swaps (module docstring), else the reason it is not."""
        nb = len(m)
        ids = [c for c in got if c != -1]
        if len(set(ids)) != len(ids) or any(not 0 <= c < nb for c in ids) or got[len(ids):] != [-1] * (
                len(got) - len(ids)):
            return "not distinct in-range ids followed by -1 padding"
        if got.count(-1) != want.count(-1):
            return "a different number of selected blocks"
        own = position // self.block_size
        forced = [c for c in want if c != -1 and c <= own and (c > own - self.local or c < self.init)]
        if got[:len(forced)] != forced:
            return "forced (local / initial) blocks differ"
        g, w = ids[len(forced):], [c for c in want[len(forced):] if c != -1]
        swapped = sorted(set(g) ^ set(w))
        if any(c > own or c in forced or m[c] == float("-inf") for c in swapped):
            return "a block the token cannot see, or a forced one, among the scored"
        if swapped:
            kth = min(m[c] for c in w)
            lim = 2 * max(beta[c] for c in swapped)
            for c in swapped:
                if abs(m[c] - kth) > lim:
                    return (f"block {c} scores {m[c]:.6g}, {abs(m[c] - kth):.3g} from the reference's k-th "
                            f"{kth:.6g}; the dtype resolves {lim:.3g}")
        for a, b in zip(g, g[1:]):
            if m[b] - m[a] > beta[a] + beta[b]:
                return f"block {b} ({m[b]:.6g}) ranked after {a} ({m[a]:.6g}) by more than {beta[a] + beta[b]:.3g}"
        return None
