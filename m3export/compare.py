"""Backends side by side: the same paged steps through each, every output compared with the first backend's.

The steps: two sequences prefilled in one mixed batch (prompts of 11 and 6 tokens, pages shuffled), then decode
steps feeding every backend the reference's greedy tokens (so a divergence in one step does not change the inputs
of the next), then each MTP graph on the prefill positions with the reference's hidden states. Every backend
starts from its own zeroed pools. Errors use ``m3export.export.verify.Stat`` (the one place errors are measured:
max abs, max abs / max |reference|, non-finite values counted apart).

``ARTIFACT`` may be an engine directory of ``m3export build``: the tensorrt backend runs its engines, the others
the artifact its ``build.json`` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import M3Error
from .export.verify import TOLERANCE, Stat
from .model.batch import Segment, build_batch


@dataclass
class CompareReport:
    reference: str
    tolerance: float
    stats: dict[str, dict[str, Stat]] = field(default_factory=dict)  # backend -> output -> Stat
    greedy: dict[str, tuple[int, int]] = field(default_factory=dict)  # backend -> (agreeing, total) argmax rows
    unavailable: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.unavailable and all(s.ok(self.tolerance) for per in self.stats.values() for s in per.values())

    def lines(self) -> list[str]:
        out = [f"reference: {self.reference}; tolerance {self.tolerance:g} (max |err| / max |reference|)",
               f"{'backend':12} {'output':18} {'max abs':>10} {'max rel':>10}  status"]
        for backend, per in self.stats.items():
            for name, s in per.items():
                out.append(f"{backend:12} {name:18} {s.max_abs:10.3g} {s.max_rel:10.3g}  {s.status(self.tolerance)}")
            agree, total = self.greedy.get(backend, (0, 0))
            out.append(f"{backend:12} {'greedy tokens':18} {agree:>10}/{total:<10} agree")
        for backend, why in self.unavailable.items():
            out.append(f"{backend:12} unavailable: {why}")
        out.append("PASSED" if self.passed else "FAILED")
        return out


def _steps(vocab: int, page_size: int, decode_steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = (11, 6)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    need = -(-(max(lens) + decode_steps + 1) // page_size)
    order = (torch.randperm(2 * need, generator=g) + 1).tolist()  # page 0 never used for data
    pages = [order[:need], order[need:2 * need]]
    return prompts, pages, 2 * need + 1


def compare_backends(artifact: str | Path, backends: list[str], decode_steps: int = 3, device: str = "cpu",
                     tolerance: float | None = None, seed: int = 0) -> CompareReport:
    from .build.engine import built_from, is_engine_dir, read_build
    from .export.artifact import load_artifact
    from .runtime.backends import create_backend

    if len(backends) < 2:
        raise M3Error(f"--backends needs at least two backends to compare, got {backends}")
    if len(set(backends)) != len(backends):
        raise M3Error(f"--backends lists a backend twice: {backends}")
    sources = {}  # backend -> what it opens
    if is_engine_dir(artifact):  # an engine directory: the others run the artifact it was built from
        sources["tensorrt"] = artifact
        artifact = built_from(read_build(artifact), artifact)
    art = load_artifact(artifact, verify_checksums=False)
    cfg, page = art.config, art.page_size
    report = CompareReport(backends[0], tolerance if tolerance is not None else TOLERANCE.get(art.manifest.dtype,
                                                                                           1e-4))
    prompts, pages, num_pages = _steps(cfg.vocab_size, page, decode_steps, seed)

    runs: dict[str, list[tuple[str, torch.Tensor]]] = {}
    tokens: list[list[int]] | None = None  # the reference's greedy choices, fed to every backend
    ref_hidden = None
    for name in backends:
        try:
            be = create_backend(name, sources.get(name, artifact), device=device)
        except M3Error as e:
            if name == backends[0]:
                raise
            report.unavailable[name] = str(e)
            continue
        be.allocate(num_pages, page)
        outs: list[tuple[str, torch.Tensor]] = []
        segs = [Segment(pages[i], 0, prompts[i]) for i in range(2)]
        ids, batch = build_batch(segs, page, be.device)
        every = torch.arange(ids.shape[0], device=be.device)
        logits, hidden = be.forward(ids, batch, every)
        outs += [("logits", logits), ("hidden", hidden)]
        last = [len(prompts[0]) - 1, len(prompts[0]) + len(prompts[1]) - 1]
        choice = [int(logits[i].argmax()) for i in last] if tokens is None else tokens[0]
        chosen = [choice]
        pos = [len(p) for p in prompts]
        for step in range(decode_steps):
            cur = chosen[-1] if tokens is None else tokens[step]
            segs = [Segment(pages[i], pos[i], [cur[i]]) for i in range(2)]
            ids, batch = build_batch(segs, page, be.device)
            lg, hd = be.forward(ids, batch, torch.arange(2, device=be.device))
            outs += [("logits", lg), ("hidden", hd)]
            pos = [p + 1 for p in pos]
            chosen.append([int(lg[i].argmax()) for i in range(2)])
        for k in range(be.num_mtp_modules):
            segs = [Segment(pages[i], 0, prompts[i][1:] + [choice[i]]) for i in range(2)]
            ids, batch = build_batch(segs, page, be.device)
            h = (ref_hidden if ref_hidden is not None else hidden).to(be.device)
            ml, mh = be.mtp_forward(k, ids, h, batch, torch.arange(ids.shape[0], device=be.device))
            outs += [(f"mtp{k}.logits", ml), (f"mtp{k}.hidden_out", mh)]
        if tokens is None:
            tokens, ref_hidden = chosen, hidden.detach().cpu()
        runs[name] = [(n, t.detach().float().cpu()) for n, t in outs]

    ref = runs[backends[0]]
    for name in backends[1:]:
        if name not in runs:
            continue
        per: dict[str, Stat] = {}
        agree = total = 0
        got = runs[name]
        if [n for n, _ in got] != [n for n, _ in ref]:
            raise M3Error(f"{name}: produced outputs {[n for n, _ in got]}, the reference {[n for n, _ in ref]}")
        for (n, g), (_, r) in zip(got, ref):
            per.setdefault(n, Stat()).update(g, r)
            if n.endswith("logits") and g.shape == r.shape:
                agree += int((g.argmax(-1) == r.argmax(-1)).sum())
                total += r.shape[0]
        report.stats[name] = per
        report.greedy[name] = (agree, total)
    return report
