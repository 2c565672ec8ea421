"""Polygraphy data loader shipped in every artifact: a valid paged step for ``model.onnx`` and each ``mtp{k}.onnx``.

The exporter copies this file, byte for byte, into the artifact as ``polygraphy_loader.py``, so that::

    polygraphy run model.onnx --onnxrt --data-loader-script polygraphy_loader.py
    polygraphy run mtp0.onnx --onnxrt --data-loader-script polygraphy_loader.py:load_mtp0

work out of the box in the artifact directory (float32 and float16 artifacts: ONNX Runtime's Python API takes
no bfloat16 arrays). It needs numpy only and reads the artifact's ``manifest.json`` beside it. The step is one a
runtime could send: two sequences prefilled together (the second one a chunk after cached tokens), on shuffled
pages, with zeroed pools just large enough and every symbolic dimension consistent.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
SEED = 0


def step_feeds(manifest: dict, graph: str, seed: int = SEED) -> dict[str, np.ndarray]:
    """One valid paged step for ``graph`` of the artifact described by ``manifest`` (its parsed JSON)."""
    rng = np.random.default_rng(seed)
    page, cfg = manifest["page_size"], manifest["config"]
    cached, new = [0, page + 1], [page + 3, 5]  # sequence 1 continues after page + 1 cached tokens
    lengths = [c + n for c, n in zip(cached, new)]
    need = [-(-n // page) for n in lengths]
    num_pages = sum(need) + 1
    perm = rng.permutation(num_pages)
    tables = np.zeros((len(lengths), max(need)), dtype=np.int32)
    i = 0
    for b, k in enumerate(need):
        tables[b, :k] = perm[i:i + k]
        i += k
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, new)]).astype(np.int64)
    seq_of = np.repeat(np.arange(len(new)), new)
    slots = tables[seq_of, positions // page].astype(np.int64) * page + positions % page
    t = len(positions)
    batch = {
        "input_ids": rng.integers(0, cfg["vocab_size"], t).astype(np.int64),
        "positions": positions,
        "query_start_loc": np.concatenate([[0], np.cumsum(new)]).astype(np.int32),
        "seq_lens": np.asarray(lengths, dtype=np.int32),
        "block_tables": tables,
        "slot_mapping": slots,
        "logits_indices": (np.cumsum(new) - 1).astype(np.int64),  # each sequence's last token
    }
    dims = {"T": t, "B": len(new), "B + 1": len(new) + 1, "N": len(new), "pages": num_pages, "max_pages": max(need),
            "M": 0}  # M: media rows of a vision-language step graph (none: a text step)
    feeds = {}
    for sig in manifest["graphs"][graph]["inputs"]:
        name, dtype = sig["name"], np.dtype(sig["dtype"])
        shape = [dims[d] if isinstance(d, str) else d for d in sig["shape"]]
        if name in batch:
            feeds[name] = batch[name]
        elif name == "hidden":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        else:  # a cache pool (the step writes its own rows before reading them) or the empty media inputs
            feeds[name] = np.zeros(shape, dtype=dtype)
        if list(feeds[name].shape) != shape:
            raise ValueError(f"{graph}: input {name} built as {list(feeds[name].shape)}, graph wants {sig['shape']}")
    return feeds


def _manifest() -> dict:
    return json.loads((Path(__file__).resolve().parent / MANIFEST).read_text())


def load_data():
    """Polygraphy's default entry point: feeds for ``model.onnx``."""
    yield step_feeds(_manifest(), "model")


def __getattr__(name: str):
    """``load_mtp0``, ``load_mtp1``, ...: feeds for ``mtp{k}.onnx``."""
    if name.startswith("load_mtp") and name[len("load_mtp"):].isdigit():
        graph = f"mtp{name[len('load_mtp'):]}"
        return lambda: iter([step_feeds(_manifest(), graph)])
    raise AttributeError(name)
