"""Every launch-parameter variant of the attention kernels against the references, as the defaults are.

``bench/attention.py --sweep`` times each kernel's ``DEFAULTS`` against the entries of its module's ``VARIANTS``
on the H200, so that the fastest can become the default with a one-line change; this file is what makes every
one of them safe to pick: the same paged batches as ``tests/test_kernels_attention.py`` (under
``TRITON_INTERPRET=1`` on CPU, compiled on a GPU), with each variant's settings passed through ``config=``.
Selections must equal the reference's exactly; attention must lie within that file's bound. Each case runs in the
mode the kernel gives it ("decode": fewer than two new tokens per sequence on average, else "prefill"), with the
device made to look like it has 16 multiprocessors so that selections and contexts are split and merged.

``num_warps`` and ``num_stages`` change how the compiled kernel is scheduled, not what it computes (and the
interpreter ignores them), so variants that differ from the defaults or from each other only there run once: the
interpreter is slow and CI's time is shared. Likewise for the key tile: the cases' index blocks hold at most 16 keys
here (or the key tile is forced to 16), so variants differing in ``block_n`` launch the same kernel on them and the
first of them runs.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.test_kernels_attention import (CASES, DEVICE, Paged, _assert_attention_close,  # sets TRITON_INTERPRET
                                          spy_launches)

from m3export.ops.attention import sparse_paged_attention_reference  # noqa: E402
from m3export.ops.indexer import lightning_indexer_reference, select_blocks  # noqa: E402
from m3export.plugins.kernels import _batch  # noqa: E402
from m3export.plugins.kernels import lightning_indexer as LI  # noqa: E402
from m3export.plugins.kernels import sparse_paged_attention as SPA  # noqa: E402
from m3export.plugins.kernels._tile_plan import tile_plan, tile_unions  # noqa: E402

# Blocks of 32 keys read in tiles of 16 (block_n forced to 16 below): two key tiles per block, so the "flat" and
# "union" loops step through (visit, key tile) pairs, as they do on the GPU (blocks of 128, tiles of 64).
SUB_TILE_CASE = ([70, 45], [5, 1], 16, 32, 2, 1, 0)
ATTENTION_CASES = {
    "decode": [("decode-one-token-seqs", torch.bfloat16)],
    "prefill": [("mixed-with-empty-seq", torch.float32), ("blocks-of-32", torch.bfloat16)],
}
INDEXER_CASES = ("decode-one-token-seqs", "many-blocks-top16")
# (fp8_dot changes only FP8 pools' dots, which these cases do not have: tests/test_indexer_tma_fold.py runs it.)
SCHEDULE_ONLY = ("num_warps", "num_stages", "fp8_dot", "fp8_widen")  # (the two FP8 ones: the same values)
# Settings the launcher accepts that no variant uses now: the "union" loop with one token per program.
UNLISTED = {"decode": {"union-decode": {**SPA.DEFAULTS["decode"], "loop": "union"}},
            "prefill": {"union-one-token": {**SPA.DEFAULTS["prefill"], "tile_tokens": 1, "loop": "union"}}}


def distinct(defaults: dict, variants: dict) -> list[str]:
    """Names of the variants that compute differently from the defaults and from every earlier variant."""
    seen = [{k: v for k, v in defaults.items() if k not in SCHEDULE_ONLY}]
    names = []
    for name, settings in variants.items():
        semantic = {k: v for k, v in settings.items() if k not in SCHEDULE_ONLY}
        if semantic not in seen:
            seen.append(semantic)
            names.append(name)
    return names


def describe(kernel: str, part: str, s: dict) -> str:
    """The name a variant with settings ``s`` must have: every setting, in the order of the modules' comments."""
    if kernel == "lightning_indexer" and part == "topk":
        return f"{s['method']}-w{s['num_warps']}" + (f"-g{s['group']}" if s["group"] else "") + (
            f"-long{s['long_warps']}" if s["long_warps"] else "") + ("-tiered" if s["tiers"] else "") + (
            f"-align{s['align']}" if s["align"] else "")
    if kernel == "lightning_indexer":
        words = ([s["loads"]] if s["loads"] != "gather" else []) + [f"n{s['block_n']}"]
        tail = [f"max{s['max_splits']}"] + ([f"min{s['min_split_tiles']}"] if s["min_split_tiles"] else []) + (
            ["fold"] if s["fold_topk"] else []) + ([s["fp8_dot"]] if s["fp8_dot"] != "bf16" else [])
    else:
        tiles = [f"t{s['tile_tokens'] or 'auto'}"] if part == "prefill" else []
        words = [s["loop"], *tiles, f"n{s['block_n']}"]
        tail = ([f"max{s['max_splits']}"] if s["max_splits"] else []) + (
            [s["fp8_widen"]] if s["fp8_widen"] != "bits" else [])
    return "-".join(words + [f"w{s['num_warps']}", f"s{s['num_stages']}", f"waves{s['waves']}"] + tail)


@pytest.mark.parametrize("module, part", [(SPA, "decode"), (SPA, "prefill"), (LI, "scan"), (LI, "topk")])
def test_every_variant_is_a_complete_setting_named_for_what_it_runs(module, part):
    """A variant names every key of DEFAULTS (no more), so changing DEFAULTS never changes what a variant runs;
    its name is derived from its settings, so the name cannot lie. No two variants run the same settings."""
    kernel = module.__name__.rsplit(".", 1)[-1]
    assert len(module.VARIANTS[part]) >= 4
    for name, settings in module.VARIANTS[part].items():
        assert set(settings) == set(module.DEFAULTS[part]), f"{kernel} {part} {name}: keys differ from DEFAULTS"
        assert name == describe(kernel, part, settings), f"{kernel} {part} {name} runs {settings}"
        if module is SPA:
            SPA.settings({part: settings}, part)  # a loop form the kernel has
    runs = [tuple(sorted(s.items(), key=str)) for s in module.VARIANTS[part].values()]
    assert len(set(runs)) == len(runs)


@pytest.fixture(autouse=True)
def _sixteen_sms(monkeypatch):
    monkeypatch.setattr(_batch, "num_sms", lambda device: 16)


def _paged(name):
    if name == "blocks-of-32":
        return Paged(*SUB_TILE_CASE[:3], seed=11), SUB_TILE_CASE[3:]
    ctx, new, page, *attrs = CASES[name]
    return Paged(ctx, new, page, zlib.crc32(name.encode())), tuple(attrs)


def _key_tile(name: str, settings: dict) -> int:
    """The key tile the launcher makes of a variant's ``block_n`` on case ``name``: at most the index block (at least
    16), and 16 where the test forces it. Every case here has blocks of 4 or forced 16-key tiles, so "n64" and
    "n128" run the same launch on them (on the GPU too)."""
    bs = SUB_TILE_CASE[3] if name == "blocks-of-32" else CASES[name][3]
    return 16 if name == "blocks-of-32" else min(settings["block_n"], max(16, 1 << (bs - 1).bit_length()))


def _attention_params():
    for mode, cases in ATTENTION_CASES.items():
        variants = {**SPA.VARIANTS[mode], **UNLISTED[mode]}
        for name, dtype in cases:
            launched = []  # a variant whose launch on this case an earlier one already ran is not run again
            for variant in distinct(SPA.DEFAULTS[mode], variants):
                settings = {k: v for k, v in variants[variant].items() if k not in SCHEDULE_ONLY}
                settings["block_n"] = _key_tile(name, settings)
                if settings not in launched:
                    launched.append(settings)
                    yield pytest.param(mode, variant, name, dtype, id=f"{mode}-{variant}-{name}")


@pytest.mark.parametrize("mode, variant, name, dtype", list(_attention_params()))
def test_sparse_attention_variant_matches_reference(mode, variant, name, dtype):
    """fp32 cases take the indexer's selection, bf16 ones a hand-made one (any order, duplicates, -1, ids past the
    token's block), as in tests/test_kernels_attention.py."""
    paged, (bs, topk, local, init) = _paged(name)
    t = paged.tokens
    assert (t < 2 * paged.seq_lens.numel()) == (mode == "decode")  # the case runs the mode it is listed under
    hq, hkv, d = 4, 2, 32
    q = paged.randn(t, hq, d, dtype=dtype)
    k, v = paged.pool(hkv, d, dtype=dtype), paged.pool(hkv, d, dtype=dtype)
    if dtype == torch.float32:
        sel = lightning_indexer_reference(paged.randn(t, hkv, d), paged.pool(d), *paged.args("cpu"), bs, topk,
                                          local, init)
    else:
        own = (paged.positions // bs).to(torch.int32)
        noise = torch.randint(-1, (max(paged.seq_lens.tolist()) - 1) // bs + 3, (t, hkv, 4), generator=paged.gen,
                              dtype=torch.int32)
        sel = torch.cat([noise, own.view(t, 1, 1).expand(t, hkv, 1), noise[..., :1]], dim=-1)
    settings = dict({**SPA.VARIANTS[mode], **UNLISTED[mode]}[variant])  # complete: DEFAULTS plays no part
    if name == "blocks-of-32":
        settings["block_n"] = 16
    ref = sparse_paged_attention_reference(q, k, v, *paged.args("cpu"), sel, bs, d**-0.5)
    got = SPA.forward(*[x.to(DEVICE) for x in (q, k, v)], *paged.args(), sel.to(DEVICE), bs, d**-0.5,
                      config={mode: settings})
    _assert_attention_close(got, ref, v)


@pytest.mark.parametrize("mode, loop, name", [("decode", "flat", "decode-one-token-seqs"),
                                              ("prefill", "flat", "mixed-with-empty-seq"),
                                              ("prefill", "union", "mixed-with-empty-seq")])
def test_loop_forms_on_fp8_pools_match_the_fp8_reference(mode, loop, name):
    """The loop forms read FP8 pools as the default does (E4M3 bytes, per-row scales; the same attend_tile). fp32
    queries, so the comparison is as tight as tests/test_kernels_attention.py's fp32 bound (the E4M3 values and
    scales are exact in fp32; bf16 adds only the output and P roundings the other tests already bound)."""
    from m3export.ops.kv_fp8 import dequantize_rows, quantize_rows

    paged, (bs, topk, local, init) = _paged(name)
    hq, hkv, d, t = 4, 2, 32, paged.tokens
    q = paged.randn(t, hq, d)
    (k, ks), (v, vs) = quantize_rows(paged.pool(hkv, d)), quantize_rows(paged.pool(hkv, d))
    sel = lightning_indexer_reference(paged.randn(t, hkv, d), paged.pool(d), *paged.args("cpu"), bs, topk, local,
                                      init)
    ref = sparse_paged_attention_reference(q, k, v, *paged.args("cpu"), sel, bs, d**-0.5, ks, vs)
    settings = dict(loop=loop, **({"tile_tokens": 1 if loop == "flat" else 4} if mode == "prefill" else {}))
    got = SPA.forward(*[x.to(DEVICE) for x in (q, k, v)], *paged.args(), sel.to(DEVICE), bs, d**-0.5,
                      ks.to(DEVICE), vs.to(DEVICE), config={mode: settings})
    _assert_attention_close(got, ref, dequantize_rows(v, vs))


# Key tiles inside one page (16-key tiles of 16-key blocks on 16- or 32-key pages): the prefill launch's one-scalar
# page load per key tile, which every GPU prefill takes (blocks = pages = 128) but the CASES above (blocks of 4,
# tiles of 16) never do; decode (a page id per key) at the same sizes. A decode batch with a one-token sequence, and
# a mixed prefill batch (decode-like sequences, a one-token sequence, sequences crossing pages) whose odd tile tails
# leave 8-token tiles partly empty. The prefill batch is as few tokens as keep that (the "prefill" batch of
# tests/test_sparse_attention_fused_tma.py): tiles across a block and page boundary (positions 29-32 in tiles of 4,
# 25-32 in tiles of 8), a full 4-token tile inside one block, tails of 1, 3 and 7 tokens, tiles ending at their
# block's end (position 15) and inside one.
IN_PAGE_CASES = {"decode": ([50, 1, 33, 17], [1, 1, 1, 1]), "prefill": ([50, 1, 34, 16], [1, 1, 9, 7])}
IN_PAGE_LOOPS = {"decode": [{}],
                 "prefill": [{"loop": "flat", "tile_tokens": 1}, {"loop": "union", "tile_tokens": 4},
                             {"loop": "union", "tile_tokens": 8}]}


@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("mode, cfg", [(m, c) for m, cs in IN_PAGE_LOOPS.items() for c in cs],
                         ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items()) or "all")
def test_key_tiles_inside_pages_match_reference(mode, cfg, page):
    """bf16 on the indexer's selection (forced local and init blocks) with -1 entries, repeats and ids past the
    token's own block mixed in, as the kernel may be handed them."""
    ctx, new = IN_PAGE_CASES[mode]
    paged = Paged(ctx, new, page, seed=page + len(cfg))
    # 16 query heads per KV head, as M3, where a program holds one token (its 16 rows all real heads); 8 in tiles of
    # 4 or 8 tokens (32 or 64 rows, all real, fitted to shared memory as M3's): half the non-fused merge's programs
    hq = 32 if cfg.get("tile_tokens", 1) == 1 else 16
    t, hkv, d, bs = paged.tokens, 2, 32, 16
    assert (t < 2 * len(ctx)) == (mode == "decode")
    q = paged.randn(t, hq, d, dtype=torch.bfloat16)
    k, v = paged.pool(hkv, d, dtype=torch.bfloat16), paged.pool(hkv, d, dtype=torch.bfloat16)
    sel = lightning_indexer_reference(paged.randn(t, hkv, d), paged.pool(d), *paged.args("cpu"), bs, 3, 1, 1)
    noise = torch.randint(-1, max(ctx) // bs + 2, (t, hkv, 2), generator=paged.gen, dtype=torch.int32)
    sel = torch.cat([sel, noise, sel[..., :1]], dim=-1)
    ref = sparse_paged_attention_reference(q, k, v, *paged.args("cpu"), sel, bs, d**-0.5)
    got = SPA.forward(*[x.to(DEVICE) for x in (q, k, v)], *paged.args(), sel.to(DEVICE), bs, d**-0.5,
                      config={mode: {**cfg, "block_n": 16}})
    _assert_attention_close(got, ref, v)


def test_tile_unions_are_each_tiles_distinct_usable_blocks():
    """Against a set per (tile, KV head) built in Python: ids >= 0 and not after the selecting token's own block,
    each once, ascending; the count; padding after. The torch definition and the launch's kernel (``tile_plan``, its
    tiles from the sequences' starts, DEVICE) alike."""
    gen = torch.Generator().manual_seed(4)
    positions = torch.tensor([3, 4, 5, 6, 7, 20, 21])  # blocks of 4: own blocks 0, 1, 1, 1, 1, 5, 5
    sel = torch.randint(-1, 7, (7, 2, 3), generator=gen, dtype=torch.int32)
    start, end, tokens = torch.tensor([0, 4, 5, 7]), torch.tensor([4, 5, 7, 7]), 4  # the last tile is unused
    union, count = tile_unions(sel, positions, start.int(), end.int(), tokens, 4)
    qsl = torch.tensor([0, 4, 5, 7], dtype=torch.int32, device=DEVICE)  # three sequences: tiles [0, 4), [4, 5), [5, 7)
    *_, slots, k_union, k_count, _ = tile_plan(qsl, sel.to(DEVICE), positions.to(DEVICE), 7, tokens, 4, union=True,
                                               chosen=False)
    assert slots == 4 and torch.equal(k_union.cpu(), union) and torch.equal(k_count.cpu(), count)
    assert union.shape == (4, 2, tokens * 3) and count.shape == (4, 2)
    for s in range(4):
        for h in range(2):
            want = sorted({c for i in range(start[s], end[s]) for c in sel[i, h].tolist()
                           if 0 <= c <= positions[i] // 4})
            n = count[s, h].item()
            assert n == len(want) and union[s, h, :n].tolist() == want
            assert (union[s, h, n:] == torch.iinfo(torch.int32).max).all()
    assert count[3].eq(0).all() and count.sum() > 0


def _indexer_params():
    for part in ("scan", "topk"):
        for variant in distinct(LI.DEFAULTS[part], LI.VARIANTS[part]):
            for name in INDEXER_CASES + (("mixed-with-empty-seq", "verify-multi-token") if part == "topk" else ()):
                yield pytest.param(part, variant, name, id=f"{part}-{variant}-{name}")


@pytest.mark.parametrize("part, variant, name", list(_indexer_params()))
def test_indexer_variant_selects_exactly_as_reference(part, variant, name):
    paged, attrs = _paged(name)
    q, pool = paged.randn(paged.tokens, 2, 32), paged.pool(32)
    ref = lightning_indexer_reference(q, pool, *paged.args("cpu"), *attrs)
    got = LI.forward(q.to(DEVICE), pool.to(DEVICE), *paged.args(), *attrs,
                     config={part: LI.VARIANTS[part][variant]})
    assert torch.equal(got.cpu(), ref)


def test_settings_refuse_unknown_names():
    paged = Paged([9], [1], 4, seed=2)
    q, pool = paged.randn(1, 2, 16), paged.pool(16)
    with pytest.raises(ValueError, match="unknown scan settings.*'blok_n'"):
        LI.forward(q, pool, *paged.args("cpu"), 4, 2, 1, 0, config={"scan": {"blok_n": 32}})
    with pytest.raises(ValueError, match="topk method 'heap'"):
        LI.forward(q, pool, *paged.args("cpu"), 4, 2, 1, 0, config={"topk": {"method": "heap"}})
    with pytest.raises(ValueError, match="topk group 3 needs the 'bitonic' method and a power of two"):
        LI.forward(q, pool, *paged.args("cpu"), 4, 2, 1, 0, config={"topk": {"group": 3}})
    with pytest.raises(ValueError, match="topk group 4 needs"):
        LI.forward(q, pool, *paged.args("cpu"), 4, 2, 1, 0, config={"topk": {"group": 4, "method": "rounds"}})
    with pytest.raises(ValueError, match=r"unknown topk settings \['chunk'\]"):
        LI.forward(q, pool, *paged.args("cpu"), 4, 2, 1, 0, config={"topk": {"chunk": 256}})
    sel = torch.zeros(1, 2, 2, dtype=torch.int32)
    qa, k = paged.randn(1, 4, 16), paged.pool(2, 16)
    with pytest.raises(ValueError, match="loop 'spiral'"):
        SPA.forward(qa, k, k, *paged.args("cpu"), sel, 4, 0.25, config={"decode": {"loop": "spiral"}})
    with pytest.raises(ValueError, match="unknown decode settings.*'tile_tokens'"):
        SPA.forward(qa, k, k, *paged.args("cpu"), sel, 4, 0.25, config={"decode": {"tile_tokens": 2}})


@pytest.mark.parametrize("method, group", [("rounds", 0), ("bitonic", 0), ("bitonic", 2)])
def test_block_topk_orders_like_a_stable_descending_sort(method, group):
    """block_topk alone on hand-made block maxima full of exact ties, 0.0 next to -0.0, +-inf and NaN past each
    token's own block, against the reference's ``select_blocks`` (a stable descending sort): forced blocks (+inf)
    first, larger score first, the lower id among equals (0.0 == -0.0), -1 where only not-visible blocks are left."""
    gen = torch.Generator().manual_seed(7)
    t, h, nb, bs, topk, local, init = 6, 2, 21, 4, 8, 2, 1
    values = torch.tensor([-0.0, 0.0, 1.0, -1.0, 2.5, float("-inf"), float("inf")])
    scores = values[torch.randint(0, len(values), (t, h, nb), generator=gen)]
    positions = torch.tensor([0, 3, 13, 30, 64, 83])  # own blocks 0, 0, 3, 7, 16, 20
    visible = torch.arange(nb)[None, :] <= (positions // bs)[:, None]
    scores[~visible[:, None, :].expand(t, h, nb)] = float("nan")  # never read
    want = select_blocks(scores, positions, bs, topk, local, init)
    assert (want == -1).any() and (scores == 0).sum() > 20
    got = LI.block_topk(scores.to(DEVICE), positions.to(DEVICE), bs, topk, local, init,
                        config={"topk": {"method": method, "group": group}})
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("group", [4, 8])
def test_grouped_topk_on_long_rows_of_ties_orders_like_a_stable_sort(group):
    """The two-level top-k (setting ``group``) where it runs (rows of at least GROUPED_LEAST x group x top-k
    blocks): block maxima from four values, so every group's largest score is tied with many others and the
    groups' order rests on the lowest id; short rows beside the long one (own block 0, 9, 137), forced local /
    init blocks, -1 where fewer visible blocks than the top-k are left. Oracle: the reference's ``select_blocks``."""
    gen = torch.Generator().manual_seed(11)
    t, h, nb, bs, topk, local, init = 4, 2, 300, 2, 16, 2, 1
    values = torch.tensor([-0.0, 0.0, 1.0, 2.5])
    scores = values[torch.randint(0, len(values), (t, h, nb), generator=gen)]
    positions = torch.tensor([1, 19, 275, 599])  # own blocks 0, 9, 137, 299
    want = select_blocks(scores, positions, bs, topk, local, init)
    assert (want == -1).any() and 512 >= LI.GROUPED_LEAST * group * topk  # 300 blocks pad to 512: two levels
    got = LI.block_topk(scores.to(DEVICE), positions.to(DEVICE), bs, topk, local, init,
                        config={"topk": {"method": "bitonic", "group": group}})
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("group", [0, 4])
@pytest.mark.parametrize("local, init", [(0, 0), (1, 0), (3, 2)])
def test_tiered_topk_ranks_each_row_over_its_own_tier(monkeypatch, group, local, init):
    """Setting ``tiers``: each row is ranked over the smallest tier that holds its blocks before the local ones
    (tiers of 16, 32, ... 512 here: ``TIER_FIRST`` / ``TIER_STEP`` lowered so that the interpreter crosses six of
    them), and the local blocks are put among the picks. Rows on each side of every tier boundary in one launch
    of a 300-block table, scores of a few values (ties everywhere) with +inf among the ranked blocks (ranked
    before the local blocks when their ids are lower, which they always are), -0.0 beside 0.0, NaN past each own
    block (never read). Oracle: the reference's ``select_blocks``."""
    monkeypatch.setattr(LI, "TIER_FIRST", 16)
    monkeypatch.setattr(LI, "TIER_STEP", 2)
    launches = spy_launches(monkeypatch, LI, "_block_topk")
    gen = torch.Generator().manual_seed(13 + local)
    bs, topk, nb = 2, 8, 300
    blocks = [0, 1, 2, 15, 16, 17, 18, 31, 32, 33, 34, 63, 64, 65, 66, 127, 128, 129, 130, 255, 256, 257, 258, 299]
    positions = torch.tensor(blocks) * bs + torch.randint(0, bs, (len(blocks),), generator=gen)
    values = torch.tensor([-0.0, 0.0, 1.0, -1.0, 2.5, float("inf")])
    weights = torch.tensor([4.0, 4.0, 4.0, 4.0, 4.0, 1.0])
    scores = values[torch.multinomial(weights, len(blocks) * 2 * nb, replacement=True, generator=gen)]
    scores = scores.reshape(len(blocks), 2, nb)
    past = torch.arange(nb)[None, None, :] > (positions // bs)[:, None, None]
    scores[past.expand_as(scores)] = float("nan")
    want = select_blocks(scores, positions, bs, topk, local, init)
    got = LI.block_topk(scores.to(DEVICE), positions.to(DEVICE), bs, topk, local, init,
                        config={"topk": {"method": "bitonic", "group": group, "tiers": 1}})
    assert launches[-1]["TIERS"] == (16, 32, 64, 128, 256, 512)
    assert torch.equal(got.cpu(), want)
    monkeypatch.setattr(LI, "TIER_FIRST", 512)  # one tier, the padded table: the untiered launch
    got = LI.block_topk(scores.to(DEVICE), positions.to(DEVICE), bs, topk, local, init,
                        config={"topk": {"method": "bitonic", "group": group, "tiers": 1}})
    assert "TIERS" not in launches[-1] and torch.equal(got.cpu(), want)


def test_aligned_block_maxima_pass_a_rounded_count_and_keep_the_ids(monkeypatch):
    """Setting ``align``: the scan's block maxima rows start every 16 values (``block_maxima_buffer``) and the top-k
    takes the block count rounded up to 16 (what Triton specialises), reading nothing past each row's own block:
    the same ids as the reference. A contiguous table whose width is no multiple of 16 keeps its count."""
    launches = spy_launches(monkeypatch, LI, "_block_topk")
    gen = torch.Generator().manual_seed(17)
    bs, topk, local, init, nb = 2, 8, 1, 0, 37
    positions = torch.tensor([0, 9, 40, 73])  # own blocks 0, 4, 20, 36 (the last block of the table)
    values = torch.randint(-3, 4, (4, 2, nb), generator=gen).float()
    want = select_blocks(values, positions, bs, topk, local, init)
    scores = LI.block_maxima_buffer(4, 2, nb, DEVICE, 16)
    assert scores.shape == (4, 2, nb) and scores.stride()[:2] == (96, 48)
    scores.copy_(values)
    cfg = {"topk": {"align": 16}}
    got = LI.block_topk(scores, positions.to(DEVICE), bs, topk, local, init, config=cfg)
    assert launches[-1]["NB"] == 48 and torch.equal(got.cpu(), want)
    got = LI.block_topk(values.to(DEVICE), positions.to(DEVICE), bs, topk, local, init, config=cfg)
    assert launches[-1]["NB"] == nb and torch.equal(got.cpu(), want)
    with pytest.raises(ValueError, match="topk align 8 must be 0 or a multiple of 16"):
        LI.block_topk(values, positions, bs, topk, local, init, config={"topk": {"align": 8}})


def test_topk_tiers_end_with_the_padded_table():
    assert LI.topk_tiers(64, 16) == [64]
    assert LI.topk_tiers(2048, 16) == [64, 256, 1024, 2048]
    assert LI.topk_tiers(16384, 16) == [64, 256, 1024, 4096, 16384]
    assert LI.topk_tiers(1 << 20, 16) == [64, 256, 1024, 4096, 16384, 1 << 20]  # MAX_TIERS: the rest merged
    assert LI.topk_tiers(32, 32) == [32]


def test_long_rows_run_the_long_warps_setting(monkeypatch):
    """Rows padded to at least ``LONG_ROW`` blocks launch ``long_warps`` warps, shorter ones ``num_warps`` (the
    H200's choice at 128k; ``DEFAULTS["topk"]``), with the reference's ids (``select_blocks``) either way.
    LONG_ROW is lowered so that a 300-block row (padded to 512) is long: the interpreter ignores warps, so what is
    checked here is the launch each row length gets and that its ids stay the oracle's."""
    monkeypatch.setattr(LI, "LONG_ROW", 512)
    launches = spy_launches(monkeypatch, LI, "_block_topk")
    gen = torch.Generator().manual_seed(5)
    bs, topk, local, init = 2, 16, 1, 0
    for nb, warps in ((300, 8), (100, 4)):
        scores = torch.randint(-3, 4, (2, 2, nb), generator=gen).float()  # ties everywhere
        positions = torch.tensor([2 * nb - 1, nb])  # own blocks nb - 1 and nb / 2
        want = select_blocks(scores, positions, bs, topk, local, init)
        got = LI.block_topk(scores.to(DEVICE), positions.to(DEVICE), bs, topk, local, init,
                            config={"topk": {"num_warps": 4, "long_warps": 8}})
        assert launches[-1]["num_warps"] == warps
        assert torch.equal(got.cpu(), want)
