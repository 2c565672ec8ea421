"""Block selections for timing sparse prefill: a model of what the indexer makes of a real prompt, and the worst case.

Sparse prefill tiles several consecutive tokens of a sequence and reads the union of their selections once per tile,
so its speed depends on how much neighbouring tokens' selections overlap. Both sources below are the indexer's own
output (``m3::lightning_indexer``'s kernel, or any callable with its signature) on index keys written for the
sequence alone, so the selections carry the kernel's forced local block and its top-k:

- ``random``: independent Gaussian index queries and keys. Neighbours share little beyond the forced local block:
  the worst case for tiles of several tokens (on the CPU reference at 16k, last 1024 tokens: adjacent tokens share
  18 % of their blocks; the union of 4 / 8 / 16 consecutive tokens' selections is 3.2 / 5.0 / 6.8 x top-k).
- ``model``: index keys and queries that drift along the prompt as the hidden states of running text do: each one
  a moving sum of white noise over one index block of tokens for keys (a block's keys share a direction, a topic)
  and half a block for queries (a query's interest moves over a few sentences), scaled to unit variance. The
  per-block maxima are then smooth in the query, so the top-k moves slowly, as selections of real prompts do
  (forced local block, slowly moving top-k). Same measurement: adjacent tokens share 87 % of their blocks; unions
  of 4 / 8 / 16 tokens are 1.32 / 1.59 / 2.0 x top-k (keys windowed over 256 tokens and queries over 256 give 93 %
  and 1.16 / 1.28 / 1.47; windows of 16 / 8 give 57 % and 2.1 / 3.2 / 4.9). This is a documented model, not a
  measurement of M3's trained indexer (no trained weights here); every bench row carries the measured overlap and
  union sizes of the selections it timed, so a row can be read against whatever real prompts turn out to give.

``selected_keys`` counts the work the op must do (each token's distinct usable selected blocks, causally: the keys it
attends), which is what FLOP rates are computed from, never the union a tiled kernel reads.
"""

from __future__ import annotations

import torch

SOURCES = ("random", "model")
UNION_TILES = (4, 8, 16)


def drifting(n: int, window: int, width: int, device, gen: torch.Generator | None = None) -> torch.Tensor:
    """[n, width] fp32 rows, each the sum of ``window`` consecutive white-noise rows over sqrt(window): unit
    variance, and rows i, j correlated by max(0, 1 - |i - j| / window)."""
    noise = torch.randn(n + window - 1, width, generator=gen, device=device)
    cs = torch.cat([torch.zeros_like(noise[:1]), noise.cumsum(0)])
    return (cs[window:] - cs[:-window]) / window**0.5


def index_inputs(source: str, n: int, heads: int, dim: int, page: int, device, seed: int, key_window: int,
                 query_window: int):
    """One sequence of ``n`` tokens: (index queries [n, heads, dim] bf16, index-key pool [pages, page, dim] bf16
    holding the sequence's keys in order, block table [1, pages] int32)."""
    if source not in SOURCES:
        raise ValueError(f"prefill selection source {source!r} is not one of {SOURCES}")
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = -(-n // page)
    if source == "random":
        keys = torch.randn(pages * page, dim, generator=gen, device=device)
        queries = torch.randn(n, heads * dim, generator=gen, device=device)
    else:
        keys = drifting(pages * page, key_window, dim, device, gen)
        queries = drifting(n, query_window, heads * dim, device, gen)
    pool = keys.view(pages, page, dim).to(torch.bfloat16)
    bt = torch.arange(pages, dtype=torch.int32, device=device).view(1, pages)
    return queries.view(n, heads, dim).to(torch.bfloat16), pool, bt


def prefill_selection(indexer, source: str, n: int, heads: int, dim: int, page: int, block_size: int, topk: int,
                      local: int, init: int, device, seed: int = 0, key_window: int | None = None,
                      query_window: int | None = None):
    """The indexer's selection [n, heads, topk] for a whole-prompt prefill of ``n`` tokens from ``source``, and the
    (query_start_loc, seq_lens, positions) it was made for. ``indexer`` has ``m3::lightning_indexer``'s signature.
    The model's windows default to one block (keys) and half a block (queries)."""
    iq, pool, bt = index_inputs(source, n, heads, dim, page, device, seed, key_window or block_size,
                                query_window or max(1, block_size // 2))
    qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
    sl = torch.tensor([n], dtype=torch.int32, device=device)
    pos = torch.arange(n, device=device)
    return indexer(iq, pool, bt, qsl, sl, pos, block_size, topk, local, init), (qsl, sl, pos)


def usable(sel: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T, H, K] bool: the entries the op attends: ids >= 0, not after the token's own block, first occurrence."""
    own = (positions // block_size).view(-1, 1, 1)
    ok = (sel >= 0) & (sel <= own)
    k = sel.shape[-1]
    earlier = torch.triu(torch.ones(k, k, dtype=torch.bool, device=sel.device), diagonal=1)  # [j, i]: j < i
    repeat = ((sel[..., :, None] == sel[..., None, :]) & earlier).any(-2)
    return ok & ~repeat


def selected_keys(sel: torch.Tensor, positions: torch.Tensor, block_size: int) -> int:
    """Keys the op must attend, summed over (token, KV head): each usable selected block's keys up to the token."""
    own_last = positions.view(-1, 1, 1)
    visible = (own_last - sel.long() * block_size + 1).clamp(0, block_size)
    return int(torch.where(usable(sel, positions, block_size), visible, 0).sum().item())


def overlap_stats(sel: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
                  tiles=UNION_TILES) -> dict:
    """How much neighbouring tokens share, from the selection itself: the fraction of a token's usable blocks that
    the previous token (same sequence) also selected, and for tiles of 4 / 8 / 16 consecutive tokens the mean
    number of distinct usable blocks a (tile, KV head) reads over top-k (what a union tile computes against what
    each token needs). Tokens within the sequences' first top-k blocks, where every visible block is selected, are
    left out; None where nothing is left."""
    from m3export.plugins.kernels._batch import query_tiles
    from m3export.plugins.kernels._tile_plan import tile_unions

    t, _, k = sel.shape
    sel = sel.to(torch.int32)
    use = usable(sel, positions, block_size)
    prev_has = (sel[1:, :, :, None] == sel[:-1, :, None, :]).any(-1) & use[1:]
    first = torch.zeros(t, dtype=torch.bool, device=sel.device)
    first[query_start_loc[:-1].long().clamp(max=max(t - 1, 0))] = True
    late = positions >= k * block_size  # past the blocks every token selects whole
    pair = (~first[1:] & late[1:])[:, None, None]
    pairs = (use[1:] & pair).sum().item()
    out = dict(adjacent_overlap=(prev_has & pair).sum().item() / pairs if pairs else None)
    for tokens in tiles:
        _, start, end, _ = query_tiles(query_start_loc, t, tokens)
        _, count = tile_unions(sel, positions, start, end, tokens, block_size)
        keep = (end > start) & late[start.long().clamp(max=max(t - 1, 0))]
        out[f"union_over_topk_t{tokens}"] = count[keep].float().mean().item() / k if keep.any() else None
    return out
