"""The LightningIndexer bodies rank more than ``functions.CHUNK`` blocks in chunks, with exactly one ``TopK``'s
selection: the same ids, ties to the lower block id, -1 where nothing ranks.

Why: ONNX Runtime's CUDA ``TopK`` leaves its bitonic path for a radix select several times slower above 256
entries along the axis (the H200 at 32k context: ~31 us per layer against ~6.5 at 4k), so the bodies take each
chunk's top k and then the top k of those candidates (``functions._chunked_topk``). Exactness rests on the tie
rule across chunks, so the blocks here are ranked among many exact ties: integer keys of d = 1 (exact in fp32 and
float64), rare top values spread over every chunk, a head whose scores are all equal, forced blocks at +inf, and
tokens that see only a few of the ~1000 blocks (-1 slots). The selections must equal the reference's and a numpy
stable-sort oracle's, under ONNX's ``TopK`` and under the two other ``TopK`` behaviours the bodies must survive
(ties to the higher id: TensorRT; lowest() padding: ORT's CUDA bitonic path).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from m3export.export import functions
from m3export.export.onnx_builder import Builder
from m3export.export.schemas import ONNX_OPSET
from m3export.ops import conformance as conf
from m3export.ops.indexer import lightning_indexer_reference
from tests.onnx_body_values import run_every_value
from tests.test_indexer_tie_order import tie_reversing_topk
from tests.test_topk_padding import lowest_padded_topk

CHUNK = functions.CHUNK
ATTRS = dict(block_size=4, topk_blocks=16, local_blocks=2, init_blocks=3)
PAGE = 4
# (context lengths, new tokens): a general step with a decode at 4000 (1000 blocks: 4 chunks of 250), a verify
# step, a 24-token prefill from scratch (tokens seeing 1-6 blocks) and a 3-token chunk at 1030; a decode-only step
# whose tables are 1102 pages wide (the decode body's L: 1102 blocks, 5 chunks of 221) with a 3-token sequence.
GENERAL = ([4000, 2500, 24, 1030], [1, 4, 24, 3])
DECODE = ([4400, 1100, 3], [1, 1, 1])
HEADS = 3  # q = +1 (rare top keys), -1 (block max -min: mostly 0, a sea of ties), 0 (every visible block ties)


def tied_batch(ctx: list[int], new: list[int], seed: int) -> list[torch.Tensor]:
    """Inputs of a LightningIndexer step (fp32) whose block scores are small integers with many exact ties."""
    gen = torch.Generator().manual_seed(seed)
    b = conf.PagedBatch(ctx, new, PAGE, gen)
    pool = b.pool(1)  # NaN on pages no sequence owns (never visible)
    # key levels 0..7 with P(v) ~ 2^-v: each level's blocks are spread over every chunk, the top ones rare
    weights = torch.tensor([2.0 ** -v for v in range(8)])
    levels = torch.multinomial(weights, pool.numel(), replacement=True, generator=gen).view_as(pool).float()
    keys = torch.where(pool.isnan(), pool, levels)
    q = torch.tensor([1.0, -1.0, 0.0]).view(1, HEADS, 1).expand(b.num_tokens, HEADS, 1).contiguous()
    return [q, keys, *b.args]


def stable_sort_oracle(inputs: list[torch.Tensor], attrs: dict) -> np.ndarray:
    """Selections by the definition, in float64 numpy: each token's visible keys, block maxima, forced blocks at
    +inf, a stable descending sort (ties to the lower id), -1 where the block is not visible."""
    q, pool, tables, qsl, _seq_lens, positions = (t.numpy() for t in inputs)
    bs, k = attrs["block_size"], attrs["topk_blocks"]
    local, init = attrs["local_blocks"], attrs["init_blocks"]
    t_count, h, _ = q.shape
    out = np.full((t_count, h, k), -1, dtype=np.int64)
    for s in range(len(qsl) - 1):
        for t in range(qsl[s], qsl[s + 1]):
            pos = int(positions[t])
            j = np.arange(pos + 1)
            keys = pool[tables[s, j // PAGE], j % PAGE].astype(np.float64)  # [pos + 1, D]
            scores = keys @ q[t].astype(np.float64).T  # [pos + 1, H]
            nb = pos // bs + 1
            padded = np.full((nb * bs, h), -np.inf)
            padded[:pos + 1] = scores
            block = padded.reshape(nb, bs, h).max(axis=1).T  # [H, nb]
            ids = np.arange(nb)
            own = pos // bs
            block[:, (ids > own - local) | (ids < init)] = np.inf  # every block here is visible (ids <= own)
            order = np.argsort(-block, axis=-1, kind="stable")[:, :k]
            out[t, :, :order.shape[1]] = order
    return out


def has_chunk_crossing_ties(inputs: list[torch.Tensor], attrs: dict, want: np.ndarray) -> bool:
    """Some (token, head) selects two non-forced blocks of equal score more than CHUNK ids apart (so in different
    chunks: every chunk is at most CHUNK wide) and leaves out a block of its last slot's score (a boundary tie
    the lower-id rule decides)."""
    q, pool, tables, qsl, _s, positions = (t.numpy() for t in inputs)
    bs, local, init = attrs["block_size"], attrs["local_blocks"], attrs["init_blocks"]
    crossing = boundary = False
    for s in range(len(qsl) - 1):
        for t in range(qsl[s], qsl[s + 1]):
            pos = int(positions[t])
            j = np.arange(pos + 1)
            keys = pool[tables[s, j // PAGE], j % PAGE].astype(np.float64)
            nb = pos // bs + 1
            own = pos // bs
            padded = np.full((nb * bs, q.shape[1]), -np.inf)
            padded[:pos + 1] = keys @ q[t].astype(np.float64).T
            block = padded.reshape(nb, bs, -1).max(axis=1).T
            forced = (np.arange(nb) > own - local) | (np.arange(nb) < init)
            for h in range(q.shape[1]):
                sel = [i for i in want[t, h] if i >= 0 and not forced[i]]
                if len(sel) < 2:
                    continue
                vals = block[h, sel]
                for v in set(vals.tolist()):
                    same = [i for i, x in zip(sel, vals) if x == v]
                    crossing |= max(same) - min(same) > CHUNK
                left_out = np.setdiff1d(np.flatnonzero(~forced), sel)
                boundary |= bool((block[h, left_out] == vals[-1]).any())
    return crossing and boundary


TOPK_BEHAVIOURS = {"onnx": lambda fn: fn, "ties-to-higher-id": tie_reversing_topk,
                   "lowest-padding": lowest_padded_topk}


@pytest.mark.parametrize("behaviour", sorted(TOPK_BEHAVIOURS))
@pytest.mark.parametrize("form", ["general", "decode"])
def test_chunked_selection_equals_one_stable_sort(form, behaviour, monkeypatch):
    ctx, new = GENERAL if form == "general" else DECODE
    inputs = tied_batch(ctx, new, seed=16 if form == "general" else 17)
    want = stable_sort_oracle(inputs, ATTRS)
    reference = lightning_indexer_reference(*conf.upcast(inputs), *ATTRS.values())
    assert np.array_equal(reference.numpy(), want), "the reference and the numpy oracle disagree"
    assert (want < 0).any() and has_chunk_crossing_ties(inputs, ATTRS, want), "the batch lacks the ties it is for"
    rewrite = TOPK_BEHAVIOURS[behaviour]
    plain = functions.body
    monkeypatch.setattr(functions, "body", lambda op, kv_fp8=False, decode=None: rewrite(plain(op, kv_fp8, decode)))
    decode = functions.DecodeSizes(page_size=PAGE, kv_heads=1) if form == "decode" else None
    got = conf.run_onnx("LightningIndexer", inputs, ATTRS, torch.int32, decode=decode).numpy()
    bad = np.argwhere(got != want)
    assert not len(bad), f"{len(bad)} slots differ, e.g. (t, h, slot) {bad[:3].tolist()}: " \
                         f"{[got[tuple(i)] for i in bad[:3]]} against {[want[tuple(i)] for i in bad[:3]]}"


@pytest.mark.parametrize("form", ["general", "decode"])
def test_body_ranks_in_two_topk_stages(form):
    """Each body ranks blocks with two ``TopK`` nodes: the chunks' over a 4-D [T, H, C, w] reshape of the row,
    then the merge's over the C * top-k candidates."""
    fn = functions.body("LightningIndexer", decode=functions.DecodeSizes(PAGE, 1) if form == "decode" else None)
    made = {o: n for n in fn.node for o in n.output}
    topks = [n for n in fn.node if n.op_type == "TopK"]
    assert len(topks) == 2
    assert made[topks[0].input[0]].op_type == "Reshape" and made[topks[1].input[0]].op_type == "Reshape"
    assert made[made[topks[1].input[0]].input[0]] is topks[0], "the merge must rank the chunks' top-k values"


def test_no_topk_axis_exceeds_chunk_at_run_time():
    """The general body on ~1000 blocks (every value it computes read back): each ``TopK`` it runs has at most
    CHUNK entries along its axis, the chunks' one ranking 4 chunks."""
    inputs = tied_batch(*GENERAL, seed=16)
    model, values = run_every_value("LightningIndexer", inputs, ATTRS)
    shapes = [values[n.input[0]].shape for n in model.graph.node if n.op_type == "TopK"]
    assert len(shapes) == 2, shapes
    nb = -(-max(GENERAL[0]) // ATTRS["block_size"])
    assert nb > 3 * CHUNK and shapes[0][2] * shapes[0][3] >= nb and shapes[0][2] == 4, shapes
    assert all(s[-1] <= CHUNK for s in shapes), shapes


def chunked_topk_session() -> ort.InferenceSession:
    """``functions._chunked_topk`` alone as a model: row [T, H, n] float32, k (rank-0 int64) -> values, ids, W.
    Alone, because in the bodies ``_lowest_ids_first`` re-derives every id of a ranked value, which would hide a
    wrong chunk offset or merge here (its ids count only for NaN maxima and for a provider's own TopK)."""
    b = Builder("")
    n = b.Squeeze(b.Shape("row", start=2, end=3), b.const([0]))
    values, ids, _row, width = functions._chunked_topk(b, "row", n, "k")
    graph = helper.make_graph(
        b.nodes, "chunked_topk",
        [helper.make_tensor_value_info("row", TensorProto.FLOAT, ["T", "H", "n"]),
         helper.make_tensor_value_info("k", TensorProto.INT64, [])],
        [helper.make_tensor_value_info(values, TensorProto.FLOAT, ["T", "H", "k"]),
         helper.make_tensor_value_info(ids, TensorProto.INT64, ["T", "H", "k"]),
         helper.make_tensor_value_info(width, TensorProto.INT64, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("n, k", [(3, 16), (16, 16), (200, 16), (256, 16), (257, 16), (321, 16), (600, 16),
                                  (1100, 16), (513, 1), (700, 200), (300, 300), (1000, 300)])
def test_chunked_topk_equals_one_stable_sort(n, k):
    """Values and ids of the chunked top k equal a stable descending sort's of the row padded with NOTHING to
    max(n, k) columns: rows of 12 levels (exact ties at each), +inf and NOTHING runs, and every width case
    (fewer blocks than k, one chunk, chunks of <= CHUNK, k > CHUNK)."""
    gen = np.random.default_rng(n * 1000 + k)
    t, h = 3, 4
    # levels 0..11 with P(v) ~ 2^-v: the top k spans every chunk, with exact ties at each level
    p = 2.0 ** -np.arange(12)
    row = gen.choice(12, size=(t, h, n), p=p / p.sum()).astype(np.float32)
    row[0, 0] = functions.NOTHING  # a token seeing no block
    row[0, 1, ::7] = np.inf  # forced blocks spread over every chunk
    row[1, :, n // 2:] = functions.NOTHING  # a token seeing the first half
    row[2, 2] = 1.0  # one value: the k lowest ids
    (values, ids, width) = chunked_topk_session().run(None, {"row": row, "k": np.array(k, dtype=np.int64)})
    full = np.concatenate([row, np.full((t, h, max(n, k) - n), functions.NOTHING, np.float32)], axis=-1)
    order = np.argsort(-full.astype(np.float64), axis=-1, kind="stable")[..., :k]
    assert np.array_equal(ids, order), np.argwhere(ids != order)[:5].tolist()
    assert np.array_equal(values, np.take_along_axis(full, order, axis=-1))
    chunks = -(-max(n, k) // max(k, CHUNK))
    assert max(n, k) <= width < max(n, k) + (chunks if k <= CHUNK // 2 else max(k, CHUNK)), width


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs onnxruntime-gpu and a CUDA device")
@pytest.mark.parametrize("form", ["general", "decode"])
def test_chunked_selection_on_the_cuda_ep(form):
    """ORT's own CUDA ``TopK`` (bitonic on each chunk, lowest() padding) under both bodies: the oracle's ids."""
    ctx, new = GENERAL if form == "general" else DECODE
    inputs = tied_batch(ctx, new, seed=16 if form == "general" else 17)
    decode = functions.DecodeSizes(page_size=PAGE, kv_heads=1) if form == "decode" else None
    got = conf.run_onnx("LightningIndexer", inputs, ATTRS, torch.int32, decode=decode,
                        providers=[("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]).numpy()
    want = stable_sort_oracle(inputs, ATTRS)
    assert np.array_equal(got, want), np.argwhere(got != want)[:5].tolist()
