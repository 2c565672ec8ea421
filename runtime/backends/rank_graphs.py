"""Run a per-rank ONNX artifact (``m3export export --tensor-parallel-size N``) in ONNX Runtime, in one process.

Every rank's graphs run on the CPU execution provider, and this backend performs between them the collectives the
manifest names (``m3export/export/rank_export.py``): it keeps the residual stream, adds the sum over ranks of each
graph's ``partial`` (the all-reduce, summed in rank order as a ring all-reduce of two does), and concatenates
the ranks' vocabulary slices of the logits (the all-gather). It is the reference for what a multi-process
deployment of these graphs must do (one session set per device, ``torch.distributed`` between the runs), and
what ``tests/test_rank_export.py`` holds equal to the single-graph artifact, through the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from m3export.config import M3Config
from m3export.dtypes import BY_NAME
from m3export.errors import ArtifactError
from m3export.model.batch import Batch

from .base import Backend


class RankGraphsBackend(Backend):
    name = "onnxruntime-ranks"

    def __init__(self, path: str | Path):
        import onnxruntime as ort

        from m3export.export.rank_export import FORMAT, MANIFEST
        from m3export.export.schemas import register_schemas

        register_schemas()
        root = Path(path)
        try:
            self.manifest = m = json.loads((root / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{root / MANIFEST}: cannot read the per-rank manifest ({e})") from None
        if m.get("format") != FORMAT:
            raise ArtifactError(f"{root}: not a per-rank artifact (format {m.get('format')!r}, expected {FORMAT!r})")
        self.config = M3Config.from_dict(m["config"], source=f"{root / MANIFEST}: config")
        self.required_page_size = m["page_size"]
        self.segments = m["segments"]
        self.world = m["parallel"]["tensor_parallel_size"]
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.sessions = [{s["graph"]: ort.InferenceSession(str(root / r["graphs"][s["graph"]]), sess_options=options,
                                                           providers=["CPUExecutionProvider"])
                          for s in self.segments} for r in m["ranks"]]
        self.signatures = m["graphs"]
        self._pools: list[dict[str, np.ndarray]] | None = None

    @property
    def num_mtp_modules(self) -> int:
        return 0  # the MTP modules are not exported per rank

    def _pool_inputs(self, rank: int):
        """(name, dtype, shape after [pages, page]) of every pool input of rank ``rank``'s graphs."""
        for s in self.segments:
            sig = self.signatures[self.manifest["ranks"][rank]["graphs"][s["graph"]]]
            for t in sig["inputs"]:
                if t["name"].endswith("cache"):
                    yield f"{t['name']}.{s['layer']}", BY_NAME[t["dtype"]], tuple(t["shape"][2:])

    def page_bytes(self, page_size: int) -> int:
        return sum(page_size * int(np.prod(shape)) * dt.itemsize for r in range(self.world)
                   for _, dt, shape in self._pool_inputs(r))

    def allocate(self, num_pages: int, page_size: int) -> None:
        self._pools = [{name: np.zeros((num_pages, page_size, *shape), dtype=dt.storage)
                        for name, dt, shape in self._pool_inputs(r)} for r in range(self.world)]

    def forward(self, input_ids: torch.Tensor, batch: Batch, logits_indices: torch.Tensor):
        if self._pools is None:
            raise RuntimeError("RankGraphsBackend.forward before allocate()")
        feeds = batch.feeds()
        ids = input_ids.cpu().numpy()
        h = None
        logits = hidden = None
        for s in self.segments:
            outs = []
            for r in range(self.world):
                sess = self.sessions[r][s["graph"]]
                names = [i.name for i in sess.get_inputs()]
                feed = {}
                for n in names:
                    if n == "input_ids":
                        feed[n] = ids
                    elif n == "hidden_in":
                        feed[n] = h
                    elif n == "logits_indices":
                        feed[n] = logits_indices.cpu().numpy()
                    elif n in feeds:
                        feed[n] = feeds[n]
                    else:
                        feed[n] = self._pools[r][f"{n}.{s['layer']}"]
                got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
                for n, v in got.items():
                    if n.endswith("cache_out"):
                        self._pools[r][f"{n.removesuffix('_out')}.{s['layer']}"] = v
                outs.append(got)
            if s["graph"] == "head":  # all-gather of the vocabulary slices, in rank order
                logits = np.concatenate([o["logits"] for o in outs], axis=-1)
                hidden = outs[0]["hidden"]
                continue
            if "hidden" in outs[0]:
                h = outs[0]["hidden"]
            total = outs[0]["partial"]
            for o in outs[1:]:  # the all-reduce: summed in rank order
                total = total + o["partial"]
            h = h + total
        return torch.from_numpy(logits).float(), torch.from_numpy(hidden)

    def mtp_forward(self, module, input_ids, hidden, batch, logits_indices):
        raise ArtifactError("a per-rank artifact has no MTP graphs (they are not exported per rank)")
