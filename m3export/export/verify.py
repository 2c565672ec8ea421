"""``m3export verify``: run an artifact in ONNX Runtime next to the PyTorch model rebuilt from the same artifact.

The scenario is chosen from the artifact's config so that what can go wrong is exercised: two sequences long
enough that each token sees more blocks than the indexer keeps, prompts that cross pages, a shuffled block
table, a chunked prefill continued in a mixed batch with a decode, multi-token (verify-shaped) steps and plain
decodes. Both sides start from zeroed pools and process the same tokens (the reference's greedy choices), so
every output, every cache pool, every block selection and every greedy token can be compared step by step.
The MTP graphs get the reference's main-model hidden state, so each graph is judged on its own.

Selections are equal up to near-tie swaps that the artifact's dtype cannot resolve (``selection_ties``: a bound
from the dtype's unit roundoff, essentially exact for fp32). Each step runs ONNX Runtime first; the reference's
sparse attention then reads ONNX Runtime's selection in the rows accepted as near-ties (teacher forcing through
``M3ForCausalLM.step(choose_blocks=...)``), so one swap is judged once instead of moving that token's attention
output, and with it every later layer's cache rows, by O(1). Logits and caches then compare with the dtype's
tolerance.

Expert routing is read from ONNX Runtime: verify runs a copy of each graph whose MoE nodes' router inputs and
chosen expert ids are also outputs (``router_taps``; the artifact is not modified), checks the ids against ORT's
router arithmetic on those inputs (equal up to fp32 ties, else a failure), and forces the reference to ONNX
Runtime's experts for the tokens whose routing differs, counting them (``routing_ties``); the router inputs are
judged like any output, and no row is excused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..dtypes import BY_NAME
from ..model import M3ForCausalLM
from ..model.batch import Segment, build_batch
from ..model.media import place_rows
from ..ops import kv_fp8
from .artifact import Artifact, load_artifact, load_torch_model
from .manifest import KV_FP8
from .router_taps import tap_router_inputs
from .routing_ties import RoutingForcing, RoutingRecord
from .selection_ties import SelectionAgreement, SelectionJudge

TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


@dataclass
class Stat:
    """Worst error of one output over all steps; ``max_rel`` is max|ort - ref| / max|ref| of the worst step.

    Non-finite values are counted apart, on either side, and always fail: ``max`` drops NaN (``max(0.0, nan)`` is
    0.0), so folding them into the error would report a NaN output as a perfect match. A NaN in the reference
    means the model itself (its weights) is broken, which verify must say as loudly as a wrong graph.
    """

    max_abs: float = 0.0
    max_rel: float = 0.0
    nonfinite_got: int = 0
    nonfinite_ref: int = 0

    def update(self, got: torch.Tensor, ref: torch.Tensor) -> None:
        got, ref = got.double(), ref.double()
        if got.shape != ref.shape:
            self.max_abs = self.max_rel = float("inf")
            return
        bad_got, bad_ref = ~torch.isfinite(got), ~torch.isfinite(ref)
        self.nonfinite_got += int(bad_got.sum())
        self.nonfinite_ref += int(bad_ref.sum())
        finite = ~(bad_got | bad_ref)
        got, ref = got[finite], ref[finite]
        err = (got - ref).abs().max().item() if ref.numel() else 0.0
        scale = ref.abs().max().item() if ref.numel() else 0.0
        self.max_abs = max(self.max_abs, err)
        self.max_rel = max(self.max_rel, err / scale if scale > 0 else (0.0 if err == 0 else float("inf")))

    def ok(self, tolerance: float) -> bool:
        return self.max_rel <= tolerance and not (self.nonfinite_got or self.nonfinite_ref)

    def status(self, tolerance: float) -> str:
        if self.nonfinite_got or self.nonfinite_ref:
            return (f"MISMATCH: NaN/Inf in {self.nonfinite_got} ONNX Runtime value(s), {self.nonfinite_ref} "
                    "reference value(s)")
        return "ok" if self.ok(tolerance) else "MISMATCH"


@dataclass
class Agreement:
    same: int = 0
    total: int = 0
    near_ties: int = 0  # differing tokens whose reference logits are closer than the error; E4M3 codes one step apart

    def update(self, got: torch.Tensor, ref: torch.Tensor) -> None:
        if got.shape != ref.shape:
            self.total += max(got.numel(), ref.numel())
            return
        self.same += int((got == ref).sum())
        self.total += ref.numel()

    def update_greedy(self, got_logits: torch.Tensor, ref_logits: torch.Tensor) -> None:
        """Argmax agreement; a flip is a near-tie (not a failure) when the reference's margin between the two
        tokens is within twice the largest logit error, which 16-bit graphs meet and float32 ones essentially
        never do."""
        got, ref = got_logits.argmax(-1), ref_logits.argmax(-1)
        self.update(got, ref)
        if got.shape == ref.shape and ref.numel():
            err = (got_logits.double() - ref_logits.double()).abs().max()
            rows = torch.arange(ref.numel())
            margin = ref_logits[rows, ref].double() - ref_logits[rows, got].double()
            self.near_ties += int(((got != ref) & (margin <= 2 * err)).sum())

    def update_codes(self, got: torch.Tensor, ref: torch.Tensor) -> None:
        """E4M3 codes (uint8) of an FP8 pool against the reference's. The quantiser is byte-exact (the graph's
        encoder gives ``quantize_rows``' bytes for the same row: ``tests/test_kv_fp8_onnx.py``), but the rows
        themselves come out of the two runtimes' matmuls within fp32 rounding, so an element whose scaled value
        sits within that rounding of an E4M3 midpoint may round the other way: a near-tie, one code step apart
        (same sign and magnitude codes differing by one, or both within one step of zero). Anything else fails."""
        self.update(got, ref)
        if got.shape == ref.shape:
            g, r = got.to(torch.int16), ref.to(torch.int16)
            gm, rm = g & 0x7F, r & 0x7F
            step = ((g & 0x80) == (r & 0x80)) & ((gm - rm).abs() == 1) | (gm <= 1) & (rm <= 1)
            self.near_ties += int(((g != r) & step).sum())

    @property
    def exact(self) -> bool:
        return self.same == self.total

    @property
    def acceptable(self) -> bool:
        return self.same + self.near_ties == self.total

    def __str__(self) -> str:
        pct = 100.0 * self.same / self.total if self.total else 100.0
        ties = f", {self.near_ties} near-tie flips" if self.near_ties else ""
        return f"{pct:6.2f}% ({self.same}/{self.total}{ties})"


@dataclass
class Report:
    tolerance: float
    steps: int = 0
    outputs: dict[str, Stat] = field(default_factory=dict)
    selections: dict[str, SelectionAgreement] = field(default_factory=dict)
    cache_codes: dict[str, Agreement] = field(default_factory=dict)  # FP8 pools: the written rows' E4M3 codes
    greedy: dict[str, Agreement] = field(default_factory=dict)
    routing: RoutingRecord = field(default_factory=RoutingRecord)  # routing differences forced, fp32 ties
    pools_in_place: int = 0
    exercised: int = 0  # tokens that saw more blocks than the indexer keeps
    tokens: int = 0

    @property
    def passed(self) -> bool:
        return (all(s.ok(self.tolerance) for s in self.outputs.values()) and self.routing.ok
                and all(a.acceptable for a in (*self.selections.values(), *self.greedy.values(),
                                               *self.cache_codes.values())))

    def lines(self) -> list[str]:
        out = [f"{'output':34s} {'max abs':>10s} {'max rel':>10s}  status"]
        for name, s in self.outputs.items():
            out.append(f"{name:34s} {s.max_abs:10.3e} {s.max_rel:10.3e}  {s.status(self.tolerance)}")
        for name, a in self.selections.items():
            out.append(f"{name:34s} block selection agreement {a}  {'ok' if a.acceptable else 'MISMATCH'}")
            out.extend(f"  not a near-tie: {e}" for e in a.examples)
        for name, a in self.cache_codes.items():
            out.append(f"{name:34s} E4M3 code agreement       {a}  {'ok' if a.acceptable else 'MISMATCH'}")
        for name, a in self.greedy.items():
            out.append(f"{name:34s} greedy token agreement    {a}  {'ok' if a.acceptable else 'MISMATCH'}")
        out.extend(self.routing.lines())
        out.append(f"block selection exercised on {self.exercised} of {self.tokens} tokens "
                   "(more visible blocks than top-k)")
        out.append(f"in-place cache writes: {self.pools_in_place} pools bound as input and output, buffers kept")
        out.append(f"{self.steps} steps, tolerance max rel <= {self.tolerance:g}: "
                   f"{'PASSED' if self.passed else 'FAILED'}")
        return out


def scenario(cfg, page_size: int, decode_steps: int) -> tuple[list[int], list[list[int]]]:
    """Prompt lengths of two sequences, and per step how many new tokens each processes (0: not scheduled):
    a chunked prefill, its continuation mixed with a decode, then decodes and 3-token (verify-shaped) steps."""
    bs, k = cfg.index_block_size, cfg.index_topk_blocks
    long = max((k + 2) * bs + 3, page_size + 3)  # more visible blocks than top-k, and past one page
    prompts = [long, long - bs - 1]
    steps = [[long - 5, prompts[1]], [5, 1]]
    steps += [[1, 3] if i % 2 else [1, 1] for i in range(decode_steps)]
    return prompts, steps


def _media_rows(num_tokens: int, hidden: int, dtype: torch.dtype, gen: torch.Generator, first: bool):
    """A vision-language step graph's media inputs: in the first (prefill) step every third token's embedding is
    replaced by a random row (what placed image tokens look like to the graph), in later steps none."""
    rows = torch.arange(1, num_tokens, 3) if first else torch.zeros(0, dtype=torch.int64)
    return rows, torch.randn(rows.numel(), hidden, generator=gen).to(dtype)


class _Pages:
    """A shuffled page assignment, so block tables are never the identity."""

    def __init__(self, lengths: list[int], page_size: int, seed: int = 0):
        need = [-(-n // page_size) for n in lengths]
        self.num_pages = sum(need) + 2
        perm = torch.randperm(self.num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables, i = [], 0
        for n in need:
            self.tables.append(perm[i:i + n])
            i += n


class _Comparison:
    """Accumulates one report from (ONNX Runtime numpy output, PyTorch tensor) pairs."""

    def __init__(self, report: Report, dtype: str, cfg):
        self.report, self.dtype = report, BY_NAME[dtype]
        self.judge = SelectionJudge(cfg, dtype)

    def close(self, name: str, got: np.ndarray, ref: torch.Tensor) -> None:
        self.report.outputs.setdefault(name, Stat()).update(self.dtype.to_torch(got).float(), ref.float())

    def router_inputs(self, graph: str, taps, got: dict[str, np.ndarray], forcing: RoutingForcing) -> None:
        """ONNX Runtime's router inputs of every MoE layer of ``graph`` against the reference's, as one output."""
        for tap in taps:
            self.close(f"{graph}:router inputs (MoE layers)", got[tap.output], forcing.inputs[tap.module])

    def pool(self, name: str, got: np.ndarray, ref: torch.Tensor, slots: torch.Tensor) -> None:
        """A cache pool after the step. FP8 pools (uint8 E4M3 codes in the graph, float8 in the reference): the
        codes of the rows this step wrote (``slots``; each row counted once), equal up to near-ties
        (``Agreement.update_codes``); their scale pools are float32 outputs compared whole, like any pool."""
        if ref.dtype != kv_fp8.FP8:
            self.close(name, got, ref)
            return

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, *t.shape[2:])[slots]

        codes = self.report.cache_codes.setdefault(name, Agreement())
        codes.update_codes(rows(torch.from_numpy(got)), rows(ref.view(torch.uint8)))

    def teacher(self, name: str, got: np.ndarray, batch, step: int):
        """The ``ChooseBlocks`` hook of one sparse layer: compares ONNX Runtime's selection ``got`` with the
        reference's own and returns what the reference's attention reads: ONNX Runtime's rows where they are
        equal or near-tie swaps, the reference's own where they mismatch (reported)."""
        got_t = torch.from_numpy(got)

        def choose(own, index_q, index_k_pool, index_k_scale):
            agreement = self.report.selections.setdefault(name, SelectionAgreement())
            accepted = self.judge(agreement, got_t, own, index_q, index_k_pool, index_k_scale, batch,
                                  where=f"step {step}, ")
            if got_t.shape != own.shape:
                return own
            return torch.where(accepted[..., None], got_t.to(own.dtype), own)

        return choose

    def greedy(self, name: str, got: np.ndarray, ref: torch.Tensor) -> None:
        self.report.greedy.setdefault(name, Agreement()).update_greedy(torch.from_numpy(got), ref.float())


def verify_artifact(path: str | Path | Artifact, decode_steps: int = 4, tolerance: float | None = None,
                    providers: tuple[str, ...] = ("CPUExecutionProvider",), progress: bool = True,
                    hash_files: bool = True) -> Report:
    """Run the scenario on both sides and compare; the report says what matched and what did not. Every file's
    sha256 is checked first (linked checkpoint shards included) unless ``hash_files`` is false."""
    from m3export.plugins.onnxruntime.session import PagedSession  # packaged from plugins/

    art = path if isinstance(path, Artifact) else load_artifact(path, verify_checksums=hash_files)
    report = Report(TOLERANCE.get(art.manifest.dtype, 1e-4) if tolerance is None else tolerance)
    cmp = _Comparison(report, art.manifest.dtype, art.config)
    model: M3ForCausalLM = load_torch_model(art)

    sessions: list[PagedSession] = []
    taps = {}
    try:
        for graph in ["model", *(f"mtp{k}" for k in range(len(model.mtp)))]:  # the router inputs as outputs too
            tapped = tap_router_inputs(art, graph)
            taps[graph] = tapped.taps
            sessions.append(PagedSession(art.path(graph), tapped.graph, providers=providers, model=tapped.model))
        with RoutingForcing(model, report.routing) as forcing:
            _steps(art, model, sessions[0], sessions[1:], forcing, taps, report, cmp, decode_steps, progress)
    finally:  # before returning, while the CUDA runtime is up (PagedSession.close says why)
        for sess in sessions:
            sess.close()
    if "vision" in art.graphs:
        from .vision_graph import compare_vision

        report.outputs["vision:media_embeds"] = compare_vision(art, model, Stat(), providers)
    return report


def _steps(art: Artifact, model: M3ForCausalLM, main, mtps: list, forcing: RoutingForcing, taps: dict,
           report: Report, cmp: _Comparison, decode_steps: int, progress: bool) -> None:
    """The scenario through the step graph ``main`` and the MTP graphs ``mtps`` beside the model, ``forcing``
    routing the model as ONNX Runtime did (from the router inputs of ``taps``) as it runs."""
    cfg, page = art.config, art.page_size
    dtype = model.model.embed_tokens.weight.dtype
    prompts, steps = scenario(cfg, page, decode_steps)
    pages = _Pages([p + sum(s[b] for s in steps[2:]) + 1 for b, p in enumerate(prompts)], page)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in prompts]

    for sess in (main, *mtps):
        sess.allocate(pages.num_pages)
    pool_dtype = kv_fp8.FP8 if art.manifest.cache_dtype == KV_FP8 else dtype  # the reference's own FP8 cache
    caches = model.allocate_caches(pages.num_pages, page, pool_dtype, "cpu")
    mtp_caches = model.allocate_caches(pages.num_pages, page, pool_dtype, "cpu", layers="mtp")
    report.pools_in_place = sum(len(sess.pool_inputs) for sess in (main, *mtps))
    sparse = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_layer(i)]

    done = [0, 0]  # tokens of each sequence already in the caches
    greedy: list[int | None] = [None, None]  # the reference's choice after each sequence's last step
    with torch.no_grad():
        for step in tqdm(steps, desc="verify", unit="step", disable=not progress):
            for b, n in enumerate(step):  # past the prompt: the greedy token, then draft-like filler
                while len(tokens[b]) < done[b] + n:
                    fill = greedy[b] if greedy[b] is not None else int(torch.randint(0, cfg.vocab_size, (1,),
                                                                                     generator=gen))
                    tokens[b].append(fill)
                    greedy[b] = None
            ids, batch = build_batch([Segment(pages.tables[b], done[b], tokens[b][done[b]:done[b] + n])
                                      for b, n in enumerate(step) if n], page)
            every = torch.arange(ids.numel())
            report.tokens += ids.numel()
            report.exercised += int((batch.positions // cfg.index_block_size + 1 > cfg.index_topk_blocks).sum())

            media = _media_rows(ids.numel(), cfg.hidden_size, dtype, gen, first=report.steps == 0) \
                if any(t.name == "media_rows" for t in main.graph.inputs) else None
            embeds = None if media is None else place_rows(model.model.embed_tokens(ids), *media)
            extra = {} if media is None else {"media_rows": media[0], "media_embeds": media[1]}
            got = main.run(batch.feeds(input_ids=ids, logits_indices=every, **extra))
            forcing.begin("model", batch, report.steps, taps["model"], got, cmp.dtype.to_torch)
            hooks = {i: cmp.teacher(f"model:selection.{i}", got[f"selection.{i}"], batch, report.steps)
                     for i in sparse}
            ref = model.step(ids, batch, caches, every, inputs_embeds=embeds, choose_blocks=hooks.get)
            cmp.close("model:logits", got["logits"], ref.logits)
            cmp.close("model:hidden", got["hidden"], ref.hidden)
            cmp.router_inputs("model", taps["model"], got, forcing)
            cmp.greedy("model:logits", got["logits"], ref.logits)
            for name, pool in zip(main.pool_inputs, [p for layer in caches for p in layer]):
                cmp.pool(f"model:{name}", main.pools[name], pool, batch.slot_mapping)

            nxt = ref.logits.argmax(-1)
            active = [b for b, n in enumerate(step) if n]
            ends = (batch.query_start_loc[1:].long() - 1).tolist()
            shifted = torch.cat([ids[1:], ids[-1:]])  # x_{t+1}: the next known token, else the greedy one
            for b, end in zip(active, ends):
                after = done[b] + step[b]
                shifted[end] = tokens[b][after] if after < len(tokens[b]) else nxt[end]
            for k, (sess, cache) in enumerate(zip(mtps, mtp_caches)):
                out = sess.run({**batch.feeds(input_ids=shifted, logits_indices=every),
                                "hidden": cmp.dtype.to_numpy(ref.hidden)})
                forcing.begin(f"mtp{k}", batch, report.steps, taps[f"mtp{k}"], out, cmp.dtype.to_torch)
                logits, hidden_out, cache, _ = model.mtp_step(
                    k, shifted, ref.hidden, batch, cache, every,
                    choose_blocks=cmp.teacher(f"mtp{k}:selection", out["selection"], batch, report.steps))
                cmp.close(f"mtp{k}:logits", out["logits"], logits)
                cmp.close(f"mtp{k}:hidden_out", out["hidden_out"], hidden_out)
                cmp.router_inputs(f"mtp{k}", taps[f"mtp{k}"], out, forcing)
                cmp.greedy(f"mtp{k}:logits", out["logits"], logits)
                for name, pool in zip(sess.pool_inputs, cache):
                    cmp.pool(f"mtp{k}:{name}", sess.pools[name], pool, batch.slot_mapping)

            for b, end in zip(active, ends):
                done[b] += step[b]
                greedy[b] = int(nxt[end])
            report.steps += 1
