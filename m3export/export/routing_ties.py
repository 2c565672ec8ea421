"""Expert routing of two runtimes, equal up to near ties that the artifact's dtype cannot resolve.

``m3export verify`` runs an artifact's graphs next to the PyTorch reference. Block selections are graph outputs, so
verify judges them and feeds the runtime's accepted near-tie swaps back into the reference (``selection_ties``).
The MoE routing is not a graph output: which experts ONNX Runtime chose cannot be read, let alone fed back. A token
whose routing margin is within what the two runtimes' roundings can move goes to another expert in one of them in
some runs, and from there its MoE output, and everything computed from it, differs by O(1), not by roundings. Such
a token is a *routing near tie*; its rows computed after the tie are excused from the comparison and counted. Every
other row keeps verify's tolerance.

How the artifact routes (``functions._moe``, the same arithmetic as the reference's ``ops.moe.route``): the MoE
input row x (the activation dtype) and the router weight W and correction bias b (fp32 in both runtimes: the same
stored numbers) are cast to fp32; ``logits = x W^T`` is an fp32 MatMul, ``s = Sigmoid(logits) + b`` fp32
elementwise, and TopK keeps the k largest s (exact ties to the lower id). So the router's own arithmetic is fp32
at any artifact dtype; what the dtype changes is x. The bound, per token and expert e, from the reference's own x
in float64 (D the hidden size, u the artifact dtype's unit roundoff, u32 = 2^-24 fp32's, eps32 = 2 u32):

    beta_e = delta_e / 4 + eps32 (2 + |b_e|)
    delta_e = lam (rho ||x o W_e||_2 + 2 sqrt(D) u32 (1 + rho) A_e),   A_e = sum_i |x_i W_ei|,   rho = 2 R u

- The input: x reaches the router through R = ``ROUTER_ROUNDINGS`` roundings to the artifact dtype counted from
  the layer's input row: that row (the residual stream the two sides carry), the attention output, the residual
  add and the post-attention norm's output. Each side's element is the exact value up to R roundings (first order,
  relative to the element) and the two sides round independently, so x~_i = x_i (1 + d_i), |d_i| <= rho. The
  logit moves by sum_i d_i x_i W_ei. In the worst case (every d_i at rho with the sign of x_i W_ei) that is rho A_e;
  with the d_i independent and of mean zero (the model of rounding errors of Higham and Mary, "A new approach to
  probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019), Hoeffding's inequality bounds it by
  lam rho ||x o W_e||_2 except with probability 2 exp(-lam^2 / 2) (5e-11 at ``LAMBDA`` = 7). The differences
  that earlier layers leave in the residual stream are taken to stay within those R roundings (the model
  ``selection_ties`` uses too); a run whose judged rows still fail shows where they do not.
- The dots: each runtime's fp32 D-term dot is within lam sqrt(D) u32 sum|x~_i W_ei| <= lam sqrt(D) u32 (1 + rho)
  A_e of the exact value except with probability about 2 D exp(-lam^2 / 2) (Higham and Mary's bound for inner
  products; 3e-7 at D = 6144), where the worst case is D eps32 A_e. Both runtimes' dots count (the reference
  decided with its own fp32 dot; the float64 value is what is judged here).
- The sigmoid's slope is at most 1/4, so a score moves by at most delta_e / 4, plus the fp32 roundings of the
  sigmoid (at most eps32, the value being below 1) and of the bias add (at most eps32 (1 + |b_e|) / 2) in each of
  the two runtimes: eps32 (2 + |b_e|) covers both.
- Routing: ORT can keep an expert c that the reference does not keep instead of one a it keeps only if its scores
  came out in the other order, S~_c >= S~_a, so S_a - S_c <= beta_a + beta_c. A token is a near tie when some kept
  a and some unkept c are that close (the k-th and the (k+1)-th biased scores are the closest such pair whenever the
  betas are equal; the pairwise test is the exact condition when they are not). The report gives the pair's gap
  and its bound.

Why the probabilistic form: the worst-case bound (rho A_e + 2 D eps32 A_e on a logit) grows like D while a logit's
spread grows like sqrt(D). On random routers at the ``mini`` preset's dims (D = 6144, 16 experts, top 4) it makes
63 % of the tokens of an fp32 artifact near ties, and every token of a bfloat16 one; the form above makes 5 % of
fp32 tokens ties there (0.05 % at the tiny preset's D = 64, where the tiny fp32 artifact's verify has none), and
still ~95 % of bfloat16 ones (65 % at D = 64): with R = 4 roundings of 2^-8, rho = 2^-5, and a bfloat16 router
input may move a logit by a fifth of its spread. That is what the input model allows (every element up to R
roundings off, independently); the real differences are smaller for most elements, so most of those tokens route
alike in practice, but nothing here tells which. The report counts the excused rows, how many of them really
differ beyond the tolerance, and says so when most of an output's rows were excused (such a run judges the dense
layers, the first MoE layer's inputs and the tokens that were not near ties, not the rest).

Which rows a tie at token t, layer L of a graph excuses (the runtimes may route t to other experts there):

- t's output of layer L differs, so t's cache rows of every later layer (L+1 on) differ, t's selections from
  layer L+1 on (its index query moved), and t's final hidden state and logits rows.
- Within the step, attention makes later tokens of t's sequence read t's layer-(L+1) keys, values and index key:
  every later token t' of that sequence has its selections and attention output from layer L+1 on changed, hence
  its cache rows from layer L+2 on and its final rows (when layer L+1 exists in that graph). Tokens of other
  sequences never read t's rows: they are judged as before, and so are t's and t''s rows before those layers.
- Across steps, every later token of t's sequence reads t's cache rows. Instead of excusing that sequence for the
  rest of the run, verify copies the runtime's excused cache rows into the reference's pools after the step (teacher
  forcing of the caches, as selections are forced): later steps then start from the same caches on both sides and
  are judged in full.
- The MTP graphs are fed the reference's main-model hidden state on both sides, so a tie in the main model does not
  reach them; a tie in an MTP module's own MoE (after its one layer's attention, whose cache rows are written
  before it) excuses that token's MTP logits and output rows only.
- Ties are looked for only in tokens whose MoE input at that layer is still the same on both sides.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..model.batch import Batch
from ..model.mlp import MoE
from ..ops.conformance import EPS32
from .selection_ties import unit_roundoff

ROUTER_ROUNDINGS = 4
"""Roundings to the artifact dtype in each side's router input element, counted from the layer's input row: that
row, the attention output, the residual add, the post-attention norm (see the module docstring)."""

LAMBDA = 7.0
"""Confidence of the probabilistic bounds (module docstring): a bound fails with probability about
2 exp(-LAMBDA^2 / 2) = 4.6e-11 per rounding sum (times D for an fp32 dot's)."""

U32 = EPS32 / 2  # fp32's unit roundoff

NEVER = 1 << 30  # a layer index past every graph's last: "not tainted"


def score_bounds(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dtype: str) -> torch.Tensor:
    """beta [T, E] of the module docstring for router inputs x [T, D], router weight [E, D] and correction bias
    [E] (all float64): how far each biased score s_e = sigmoid(x W_e) + b_e may be between the two runtimes."""
    rho = 2 * ROUTER_ROUNDINGS * unit_roundoff(dtype)
    norm2 = ((x * x) @ (weight * weight).t()).sqrt()  # ||x o W_e||_2
    abs_sum = x.abs() @ weight.abs().t()  # A_e
    delta = LAMBDA * (rho * norm2 + 2 * x.shape[-1] ** 0.5 * U32 * (1 + rho) * abs_sum)
    return delta / 4 + EPS32 * (2 + bias.abs())


@dataclass
class RoutingTie:
    """One token routed within the bound at one MoE layer: ``experts`` (kept, not kept) is its closest pair."""

    graph: str
    step: int
    token: int
    position: int
    layer: int
    experts: tuple[int, int]
    gap: float
    bound: float

    def __str__(self) -> str:
        return (f"{self.graph} step {self.step}, token {self.token} (position {self.position}), layer {self.layer}: "
                f"experts {self.experts[0]} / {self.experts[1]} differ by {self.gap:.3g}, the dtype resolves "
                f"{self.bound:.3g}")


@dataclass
class RoutingTies:
    """What verify excused for routing near ties: the ties, the rows excused per output (``excused[name]`` =
    [excused rows, rows, excused rows whose error is beyond the tolerance]), and the closest routing margin among
    the tokens judged (gap / bound, inf if none). The third count tells the excused rows that really differ (a
    routing that came out otherwise, or an error the excusal hides) from those that only could."""

    ties: list[RoutingTie] = field(default_factory=list)
    excused: dict[str, list[int]] = field(default_factory=dict)
    closest: float = float("inf")
    closest_where: str = ""

    def count(self, name: str, excused: int, rows: int, beyond: int = 0) -> None:
        entry = self.excused.setdefault(name, [0, 0, 0])
        entry[0] += excused
        entry[1] += rows
        entry[2] += beyond

    def lines(self) -> list[str]:
        if not self.ties:
            margin = (f"; closest margin {self.closest:.3g}x its bound ({self.closest_where})"
                      if self.closest < float("inf") else "")
            return [f"routing near ties: none{margin}"]
        per_layer = Counter((t.graph, t.layer) for t in self.ties)
        where = ", ".join(f"{g} layer {layer}: {n}" for (g, layer), n in sorted(per_layer.items()))
        out = [f"routing near ties: {len(self.ties)} tokens ({where}); their later rows excused"]
        out.extend(f"  {t}" for t in self.ties[:3])
        rows = ", ".join(f"{name} {e}/{n}" + (f" ({b} beyond the tolerance)" if b else "")
                         for name, (e, n, b) in self.excused.items() if e)
        out.append(f"  rows excused: {rows}")
        most = max((e / n for e, n, _ in self.excused.values() if n), default=0.0)
        if most > 0.5:
            out.append(f"  note: up to {100 * most:.0f} % of an output's rows excused: at this dtype the routing "
                       "of those rows is not resolved, and they are not judged")
        return out


class RoutingWatch:
    """Forward pre-hooks on every MoE module of a reference model that find routing near ties as the reference
    runs a step, and say which rows of that step they excuse (module docstring). ``begin`` before each graph's
    step; ``close`` (or ``with``) removes the hooks."""

    def __init__(self, model, dtype: str, record: RoutingTies):
        self.record = record
        self.dtype = dtype
        self.layers = {"model": len(model.model.layers)}
        self._hooks = []
        modules = [("model", i, layer.mlp) for i, layer in enumerate(model.model.layers)]
        for k, mtp in enumerate(model.mtp):
            self.layers[f"mtp{k}"] = 1
            modules.append((f"mtp{k}", 0, mtp.transformer_layer.mlp))
        for graph, layer, module in modules:
            if isinstance(module, MoE):
                self._hooks.append(module.register_forward_pre_hook(self._hook(graph, layer)))
        self.graph: str | None = None

    def begin(self, graph: str, batch: Batch, step: int) -> None:
        """A step of ``graph`` ("model", "mtp0", ...) on ``batch`` starts: nothing is tainted yet (earlier steps'
        excused cache rows have been copied from the runtime: ``cache_excused``)."""
        t = batch.positions.numel()
        self.graph, self.step, self.batch = graph, step, batch
        self.cache_from = torch.full((t,), NEVER, dtype=torch.long)  # first layer whose cache rows differ
        self.sel_from = torch.full((t,), NEVER, dtype=torch.long)  # first layer whose attention differs
        qsl = batch.query_start_loc.long().tolist()
        self.seq_end = torch.zeros(t, dtype=torch.long)  # where each token's sequence ends in the step
        for s, e in zip(qsl[:-1], qsl[1:]):
            self.seq_end[s:e] = e

    def cache_excused(self, layer: int) -> torch.Tensor:
        """[T] bool: the tokens whose cache rows of ``layer`` are excused (and forced from the runtime)."""
        return self.cache_from <= layer

    def selection_excused(self, layer: int) -> torch.Tensor:
        """[T] bool: the tokens whose selections at sparse layer ``layer`` are excused."""
        return self.sel_from <= layer

    def output_excused(self) -> torch.Tensor:
        """[T] bool: the tokens whose final rows (logits, hidden state) are excused."""
        return self.cache_from <= self.layers[self.graph]

    def _hook(self, graph: str, layer: int):
        def hook(module: MoE, args) -> None:
            if self.graph != graph:
                raise RuntimeError(f"routing watch: {graph} layer {layer} ran during a step of {self.graph}")
            self._judge(module, layer, args[0])
        return hook

    @torch.no_grad()
    def _judge(self, module: MoE, layer: int, x: torch.Tensor) -> None:
        k, e = module.cfg.num_experts_per_tok, module.gate.weight.shape[0]
        judged = (self.sel_from > layer).nonzero().flatten()
        if k >= e or judged.numel() == 0:
            return
        x = x[judged].detach().to("cpu", torch.float64)
        w = module.gate.weight.detach().to("cpu", torch.float64)
        bias = module.gate.e_score_correction_bias.detach().to("cpu", torch.float64)
        scores = torch.sigmoid(x @ w.t()) + bias  # [J, E]
        beta = score_bounds(x, w, bias, self.dtype)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        kept, rest = order[:, :k], order[:, k:]
        gap = scores.gather(1, kept)[:, :, None] - scores.gather(1, rest)[:, None, :]  # [J, k, E-k]
        bound = beta.gather(1, kept)[:, :, None] + beta.gather(1, rest)[:, None, :]
        ratio = (gap / bound).flatten(1)
        closest, pair = ratio.min(-1)
        positions = self.batch.positions
        for j in range(judged.numel()):
            t, r = int(judged[j]), float(closest[j])
            a, c = divmod(int(pair[j]), e - k)
            if r > 1.0:
                if r < self.record.closest:
                    self.record.closest = r
                    self.record.closest_where = f"{self.graph} layer {layer}, step {self.step}, token {t}"
                continue
            self.record.ties.append(RoutingTie(self.graph, self.step, t, int(positions[t]), layer,
                                               (int(kept[j, a]), int(rest[j, c])), float(gap[j, a, c]),
                                               float(bound[j, a, c])))
            end = int(self.seq_end[t])
            self.cache_from[t] = min(int(self.cache_from[t]), layer + 1)
            self.cache_from[t + 1:end] = self.cache_from[t + 1:end].clamp(max=layer + 2)
            self.sel_from[t:end] = self.sel_from[t:end].clamp(max=layer + 1)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> RoutingWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
