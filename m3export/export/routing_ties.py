"""Expert routing of two runtimes, decided from each side's own router inputs, the reference teacher-forced to ORT's.

``m3export verify`` runs an artifact's graphs next to the PyTorch reference. Which experts an MoE node chose, and
what decided it, are not graph outputs of the artifact: verify runs a copy of each graph whose MoE nodes' router
inputs ``x`` and chosen ids are also outputs (``router_taps``), and at every MoE layer of the reference (a forward
pre-hook, ``RoutingForcing``):

- the reference's routing is its op's own: ``ops.moe.route`` on the reference's x (the same function the op calls,
  so the same choice, bit for bit);
- ONNX Runtime's routing is recomputed from ORT's x and the router weight and bias ORT reads, in float64, top-k
  with exact ties to the lower id (as ``functions._moe`` ranks);
- where the copy also reads the expert ids ORT chose (``router_taps``: its MoE bodies' TopK result), those are
  ORT's routing, checked against the recomputation: a set that differs from the float64 top-k must be an fp32 tie
  resolved the other way (every expert it adds within the bound below of every one it drops), else ORT did not
  route by its own router's scores and verify fails;
- where the two expert sets differ, the token's routing truly differs (the two sides' x moved its scores across a
  swap). The reference is teacher-forced to ORT's experts for that token (a forward hook re-runs the MoE on those
  rows with ORT's set kept: ``_forced``; the weights come from the reference's own scores, renormalised over the
  set, as the op does), so its later rows stay comparable, and the difference is counted. Nothing is excused:
  every row is judged with the dtype's tolerance, and the router inputs themselves are judged as outputs.

ORT decides in fp32, not float64; the float64 recomputation is ORT's choice unless ORT's fp32 arithmetic could have
swapped two experts: ``m3export.ops.routing_bound`` derives how far each fp32 biased score may be from the float64
one (beta_e: the router MatMul's gamma_D A_e through the sigmoid's slope 1/4, the fp32 Sigmoid's own error, the
bias add's rounding; x ORT's router input, exact in fp32 at every artifact dtype; the CUDA EP with TF32 off: every
session this project opens says ``use_tf32=0``). The op conformance suite's near-tie rule applies the same bound.
ORT can have kept c where the float64 choice keeps a only if S_a - S_c <= beta_a + beta_c. Such a token is an
*fp32 tie* on ORT's side: counted and reported with its margin. With ORT's ids read, ORT's own choice settles it. Without them (a body the copy cannot tap), ORT's routing is taken
to be the float64 choice there too (the reference forced to it where its own differs): ORT's
real fp32 dot errors are far below the worst case gamma_D, about sqrt(D) u32 A_e, so the float64 choice is ORT's in
practice; where it was not, that token's later rows fail and the report's fp32 ties say where to look. Nothing is
excused for it either. The worst case is wide at real widths: at the ``mini`` preset's D = 6144 with its random
router about 18 % of routings are fp32 ties (measured on random inputs; at the tiny preset's D = 64 none).

An ORT MoE node that routes otherwise than its own router arithmetic says (a wrong TopK, a wrong bias) fails the
ids check; where the ids are not read it is no routing difference here, but its MoE output differs from the
reference's and the rows after it fail as they should. The verify-only graph copy adds only outputs (and one
Identity per tap); ORT runs the same nodes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from ..model.batch import Batch
from ..model.mlp import MoE
from ..ops.moe import route
from ..ops.routing_bound import fp32_score_bounds, swap_pairs
from .router_taps import RouterTap

@dataclass
class RoutingDifference:
    """One token routed to other experts by the two sides at one MoE layer (the reference was forced to ORT's)."""

    graph: str
    step: int
    token: int
    position: int
    layer: int
    reference: tuple[int, ...]
    runtime: tuple[int, ...]

    def __str__(self) -> str:
        return (f"{self.graph} step {self.step}, token {self.token} (position {self.position}), layer {self.layer}: "
                f"reference experts {list(self.reference)}, ONNX Runtime {list(self.runtime)}")


@dataclass
class Fp32Tie:
    """A token whose float64 routing from ORT's inputs is within ORT's fp32 bound of a swap (module docstring)."""

    graph: str
    step: int
    token: int
    layer: int
    experts: tuple[int, int]  # (kept, not kept): the closest pair
    gap: float
    bound: float

    def __str__(self) -> str:
        return (f"{self.graph} step {self.step}, token {self.token}, layer {self.layer}: experts {self.experts[0]} / "
                f"{self.experts[1]} differ by {self.gap:.3g}, ORT's fp32 routing resolves {self.bound:.3g}")


@dataclass
class RoutingRecord:
    """Routing compared over a run: ``routings`` (token, MoE layer) pairs compared, ``differences`` (the reference
    forced to ORT's experts), ``fp32_ties`` on ORT's side, and the closest ORT-side margin among the others
    (gap / bound). Where ORT's chosen ids are graph outputs (``read_ids`` routings): ``fp32_flips`` fp32 ties that
    ORT's fp32 resolved otherwise than float64 (allowed), ``inconsistent`` routings where ORT's ids are not its
    router's top-k even within the fp32 bound (a failure; up to three described in ``examples``)."""

    routings: int = 0
    differences: list[RoutingDifference] = field(default_factory=list)
    fp32_ties: list[Fp32Tie] = field(default_factory=list)
    closest: float = float("inf")
    closest_where: str = ""
    read_ids: int = 0
    fp32_flips: int = 0
    inconsistent: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.inconsistent == 0

    def lines(self) -> list[str]:
        n = len(self.differences)
        out = [f"expert routing from each side's router inputs: {n} of {self.routings} (token, MoE layer) routings "
               "differ" + ("; the reference took ONNX Runtime's experts there (teacher forcing), every row judged"
                           if n else "")]
        if n:
            per_layer = Counter((d.graph, d.layer) for d in self.differences)
            out.append("  per layer: " + ", ".join(f"{g} layer {layer}: {c}" for (g, layer), c in
                                                   sorted(per_layer.items())))
            out.extend(f"  {d}" for d in self.differences[:3])
        if self.read_ids:
            out.append(f"ONNX Runtime's own expert ids read on {self.read_ids} of {self.routings} routings: "
                       f"{self.inconsistent} not its router's top-k within the fp32 bound  "
                       f"{'ok' if self.ok else 'MISMATCH'}")
            out.extend(f"  not an fp32 tie: {e}" for e in self.examples)
        if self.fp32_ties:
            how = (f"ORT's fp32 chose otherwise than float64 in {self.fp32_flips}, the reference took ORT's choice"
                   if self.read_ids == self.routings else "the float64 choice taken; where ORT's fp32 took the "
                   "other, that token's later rows fail")
            out.append(f"ONNX Runtime fp32 routing ties: {len(self.fp32_ties)} of {self.routings} routings within "
                       f"the worst-case fp32 bound of a swap ({how})")
            out.extend(f"  {t}" for t in self.fp32_ties[:3])
        else:
            margin = (f"; closest margin {self.closest:.3g}x its bound ({self.closest_where})"
                      if self.closest < float("inf") else "")
            out.append(f"ONNX Runtime fp32 routing ties: none{margin}")
        return out


class RoutingForcing:
    """Hooks on every MoE module of a reference model: compare each token's routing with ORT's (from ORT's router
    inputs, ``begin``) and force the reference to ORT's experts where they differ (module docstring). ``inputs``
    holds the reference's router inputs of the current step, by module name, for verify to judge."""

    def __init__(self, model, record: RoutingRecord):
        self.record = record
        self._modules: dict[str, tuple[str, int]] = {}  # module name -> (graph, layer)
        self._hooks = []
        found = [(f"model.layers.{i}.mlp", "model", i, layer.mlp) for i, layer in enumerate(model.model.layers)]
        found += [(f"mtp.{k}.transformer_layer.mlp", f"mtp{k}", 0, mtp.transformer_layer.mlp)
                  for k, mtp in enumerate(model.mtp)]
        for name, graph, layer, module in found:
            if isinstance(module, MoE):
                if model.get_submodule(name) is not module:
                    raise RuntimeError(f"routing: {name} is not the module of {graph} layer {layer}")
                self._modules[name] = (graph, layer)
                self._hooks.append(module.register_forward_pre_hook(self._pre_hook(name)))
                self._hooks.append(module.register_forward_hook(self._hook(name)))
        self.graph: str | None = None
        self.inputs: dict[str, torch.Tensor] = {}

    def modules_of(self, graph: str) -> list[str]:
        return [m for m, (g, _) in self._modules.items() if g == graph]

    def begin(self, graph: str, batch: Batch, step: int, taps: list[RouterTap], got: dict[str, np.ndarray],
              to_torch) -> None:
        """A step of ``graph`` ("model", "mtp0", ...) on ``batch``: ``got`` ORT's outputs of that step (the
        ``taps``' router inputs among them, ``to_torch`` reads one as a tensor)."""
        want = sorted(self.modules_of(graph))
        if sorted(t.module for t in taps) != want:
            raise RuntimeError(f"routing: {graph}'s graph taps MoE modules {sorted(t.module for t in taps)}, the "
                               f"reference has {want}")
        self.graph, self.step, self.batch = graph, step, batch
        self._ort = {t.module: (to_torch(got[t.output]).double(), torch.from_numpy(t.weight),
                                torch.from_numpy(t.bias),
                                None if t.experts is None else torch.from_numpy(np.asarray(got[t.experts])))
                     for t in taps}
        self._forced: dict[str, dict[tuple[int, ...], list[int]]] = {}
        self.inputs = {}

    def _pre_hook(self, name: str):
        def hook(module: MoE, args) -> None:
            graph, layer = self._modules[name]
            if self.graph != graph:
                raise RuntimeError(f"routing: {graph} layer {layer} ran during a step of {self.graph}")
            self.inputs[name] = args[0].detach()
            self._compare(name, module, layer, args[0])
        return hook

    @torch.no_grad()
    def _compare(self, name: str, module: MoE, layer: int, x: torch.Tensor) -> None:
        k = module.cfg.num_experts_per_tok
        gate = module.gate
        own, _ = route(x, gate.weight, gate.e_score_correction_bias, k)  # the op's own choice
        x_ort, w, b, ids = self._ort[name]
        if x_ort.shape != x.shape:
            raise RuntimeError(f"routing: ONNX Runtime's router input of {name} is {list(x_ort.shape)}, the "
                               f"reference's {list(x.shape)}")
        self.record.routings += x.shape[0]
        scores = torch.sigmoid(x_ort @ w.t()) + b  # [T, E] float64
        beta = fp32_score_bounds(x_ort, w, b)
        kept, rest, gap, bound = swap_pairs(scores, beta, k)
        self._fp32_ties(layer, kept, rest, gap, bound)
        theirs = kept.sort(-1).values
        if ids is not None:  # ORT's own choice: checked against its router's arithmetic, then taken
            ids = ids.long().sort(-1).values
            self._check_ids(layer, ids, theirs, scores, beta)
            theirs = ids
        mine = own.cpu().sort(-1).values
        forced = self._forced[name] = {}
        positions = self.batch.positions
        for t in (theirs != mine).any(-1).nonzero().flatten().tolist():
            ids = tuple(theirs[t].tolist())
            forced.setdefault(ids, []).append(t)
            self.record.differences.append(RoutingDifference(self.graph, self.step, t, int(positions[t]), layer,
                                                             tuple(mine[t].tolist()), ids))

    def _check_ids(self, layer: int, ids: torch.Tensor, f64: torch.Tensor, scores: torch.Tensor,
                   beta: torch.Tensor) -> None:
        """ORT's chosen ids [T, k] (sorted) against the float64 top-k of its own router inputs: another set is an
        fp32 tie resolved the other way only if every expert it adds is within beta_a + beta_c of every one it
        drops (module docstring), else ORT did not route by its router's scores."""
        self.record.read_ids += ids.shape[0]
        e = scores.shape[1]
        for t in (ids != f64).any(-1).nonzero().flatten().tolist():
            got, want = ids[t].tolist(), f64[t].tolist()
            added, dropped = sorted(set(got) - set(want)), sorted(set(want) - set(got))
            why = None
            if len(set(got)) != len(got) or not all(0 <= c < e for c in got):
                why = "not distinct expert ids in range"
            else:
                for a in dropped:
                    for c in added:
                        gap, bound = float(scores[t, a] - scores[t, c]), float(beta[t, a] + beta[t, c])
                        if gap > bound:
                            why = (f"expert {c} kept over {a}, whose score is higher by {gap:.3g} (fp32 resolves "
                                   f"{bound:.3g})")
            if why is None:
                self.record.fp32_flips += 1
                continue
            self.record.inconsistent += 1
            if len(self.record.examples) < 3:
                self.record.examples.append(f"{self.graph} step {self.step}, token {t}, layer {layer}: ONNX Runtime "
                                            f"experts {got}, its router's top-k {want}: {why}")

    def _fp32_ties(self, layer, kept, rest, gap, bound) -> None:
        if rest.shape[1] == 0:
            return
        ratio = (gap / bound).flatten(1)
        closest, pair = ratio.min(-1)
        for t in range(kept.shape[0]):
            r = float(closest[t])
            a, c = divmod(int(pair[t]), rest.shape[1])
            if r > 1.0:
                if r < self.record.closest:
                    self.record.closest = r
                    self.record.closest_where = f"{self.graph} layer {layer}, step {self.step}, token {t}"
                continue
            self.record.fp32_ties.append(Fp32Tie(self.graph, self.step, t, layer, (int(kept[t, a]), int(rest[t, c])),
                                                 float(gap[t, a, c]), float(bound[t, a, c])))

    def _hook(self, name: str):
        def hook(module: MoE, args, output: torch.Tensor) -> torch.Tensor | None:
            forced = self._forced.get(name)
            if not forced:
                return None
            output = output.clone()
            for ids, rows in forced.items():
                output[rows] = _forced(module, args[0][rows], list(ids))
            return output
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> RoutingForcing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@torch.no_grad()
def _forced(module: MoE, x: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """The MoE module's output for rows x routed to ``experts`` (its own op, every dtype and weight format): the
    correction bias only ranks (``ops.moe.route``: the weights come from the unbiased scores, renormalised over the
    chosen), so raising the chosen experts' bias above every score (sigmoid scores lie in [0, 1]) makes the op keep
    exactly them, with the weights it would give them. The bias is restored before returning."""
    bias = module.gate.e_score_correction_bias
    saved = bias.detach().clone()
    lift = 2.0 + 2.0 * float(saved.max() - saved.min())
    try:
        bias.data[experts] += lift
        return module.forward(x)
    finally:
        bias.data.copy_(saved)
