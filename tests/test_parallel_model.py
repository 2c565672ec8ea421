"""Tensor / expert parallelism of the model (``m3export.parallel``): 2 ranks on gloo against one process.

One spawn of two ranks runs every scenario (TP=2, and TP=2 with expert parallelism, on the ``tiny`` preset, the
embedded trained model and synthetic checkpoints in both layouts, BF16 and MXFP8) and writes each rank's outputs;
the tests compare them with the same steps run by the single-process ``load_model`` model here.

Tolerance of the logits (``LOGIT_RTOL``): the shards compute the same fp32 products; only the order of the sums
changes (a rank's partial sum of o_proj / down_proj / MoE, then the all-reduce). A reordered fp32 sum of K terms
differs by at most ~K * 2^-24 of the sum of |terms| (Higham, Accuracy and Stability, 4.2); with K <= 256 here and
a handful of such sums per layer over 4-5 layers, 1e-4 of the largest logit bounds it. A wrong slice, head or
expert is an O(1) difference.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import m3export
from m3export.checkpoint.writer import write_checkpoint
from m3export.config import ConfigError, preset
from m3export.embedded import default_model
from m3export.model.batch import Segment, build_batch
from m3export.parallel import ParallelConfig, load_model_shard, shard_of
from m3export.parallel.diagnostics import progress
from m3export.parallel.spawn import NVLINK_MULTICAST_OFF, run_ranks
from m3export.runtime.backends.torch_backend import TorchBackend
from m3export.safetensors_io import nbytes, read_header

from .vl_config import VISION

LOGIT_RTOL = 1e-4
DECODE_STEPS = 16
PAGE = 16
TP2 = ParallelConfig(2)
TP2_EP = ParallelConfig(2, expert_parallel=True)


def mx_tiny():
    """``tiny`` widened so that every rank's K slice holds whole 32-value MXFP8 blocks at TP=2."""
    return preset("tiny").replace(intermediate_size=64, shared_intermediate_size=64, dense_intermediate_size=128)


# ---------------------------------------------------------------------------------------------- the step driver
def greedy(model, prompts: list[list[int]], steps: int, page: int = 4) -> dict[str, torch.Tensor]:
    """Prefill ``prompts`` as one mixed batch on paged caches, then ``steps`` greedy decode steps of all of them
    (the runtime's step API); one MTP draft step on the prefill. Logits and hidden states of every step."""
    device = model.lm_head.weight.device
    dtype = torch.float32
    need = [-(-(len(p) + steps + 1) // page) for p in prompts]
    tables = [list(range(sum(need[:b]), sum(need[:b + 1]))) for b in range(len(prompts))]
    caches = model.allocate_caches(sum(need), page, dtype, device)
    ids, batch = build_batch([Segment(tables[b], 0, p) for b, p in enumerate(prompts)], page, device)
    last = batch.query_start_loc[1:].long() - 1
    out = model.step(ids, batch, caches, last)
    caches = out.caches
    result = {"prefill_logits": out.logits, "prefill_hidden": out.hidden,
              "kv_cache_shape": torch.tensor(caches[-1][0].shape)}
    tokens = [out.logits.argmax(-1)]
    if len(model.mtp):
        nxt = [p[1:] + [int(tokens[0][b])] for b, p in enumerate(prompts)]
        mtp_cache = model.allocate_caches(sum(need), page, dtype, device, layers="mtp")[0]
        mids, _ = build_batch([Segment(tables[b], 0, n) for b, n in enumerate(nxt)], page, device)
        result["mtp_logits"] = model.mtp_step(0, mids, out.hidden, batch, mtp_cache, last)[0]
    if model.vision_tower is not None:  # the replicated tower: one image's text-space tokens
        v = model.config.vision
        g = torch.Generator().manual_seed(3)
        pixels = torch.randn(16, v.patch_dim, generator=g).to(device)
        result["image_tokens"] = model.encode_media(pixels, torch.tensor([[1, 4, 4]]))[0]
    decode = []
    for s in range(steps):
        segs = [Segment(tables[b], len(p) + s, [int(tokens[-1][b])]) for b, p in enumerate(prompts)]
        ids, batch = build_batch(segs, page, device)
        out = model.step(ids, batch, caches)
        caches = out.caches
        decode.append(out.logits)
        tokens.append(out.logits.argmax(-1))
    result["decode_logits"] = torch.stack(decode)
    result["tokens"] = torch.stack(tokens, dim=1)
    return {k: v.detach().float().cpu().contiguous() if v.is_floating_point() else v.cpu().contiguous()
            for k, v in result.items()}


def prompts_for(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# Scenarios: (name, source, parallel, prompt lengths, decode steps). Lengths exceed index_block_size *
# index_topk_blocks, so the indexer really selects (tiny: 4 * 3 = 12 tokens; the embedded model: 16 * 4 = 64).
PARALLEL = (("tp2", TP2), ("tp2ep", TP2_EP))


def model_scenarios() -> list[tuple]:
    return [(f"{model}-{tag}", source, par, lengths, DECODE_STEPS) for tag, par in PARALLEL
            for model, source, lengths in (("tiny", "tiny", (21, 13)), ("code", str(default_model()), (70, 37)))]


def checkpoint_scenarios(ckpts: dict[str, str]) -> list[tuple]:
    """Every checkpoint at TP=2 and TP=2+EP; names starting ``deq-`` load the MXFP8 one dequantised to fp32 (each
    slice of a weight dequantised with the matching slice of its scales)."""
    out = [(f"{name}-{tag}", path, par, (17,), 4) for tag, par in PARALLEL for name, path in ckpts.items()]
    return out + [(f"deq-original-mxfp8-{tag}", ckpts["original-mxfp8"], par, (17,), 4) for tag, par in PARALLEL]


def rank_worker(rank: int, world: int, out_dir: str, plan: list, device: str) -> None:
    """Each scenario on this rank: its shard, the greedy run, its load statistics."""
    stats, tensors = {}, {}
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    for name, source, (tp, ep), lengths, steps in plan:
        progress(f"{name}: loading")  # with M3EXPORT_DIAG_DIR: where a GPU run that hangs stopped
        model = load_model_shard(source, ParallelConfig(tp, ep), rank, device=dev, dequantize=name.startswith("deq-"))
        progress(f"{name}: stepping")
        with torch.inference_mode():
            res = greedy(model, prompts_for(model.config.vocab_size, tuple(lengths)), steps)
        progress(f"{name}: done")
        tensors.update({f"{name}/{k}": v for k, v in res.items()})
        stats[name] = {**model.load_stats.to_dict(), "kv_heads": model.config.num_key_value_heads,
                       "page_bytes": TorchBackend(model).page_bytes(PAGE)}
    for label, args in (("world", (ParallelConfig(4), rank)), ("rank", (TP2, 1 - rank))):
        try:  # a split that does not match the process group is refused before any read
            load_model_shard("tiny", *args)
            stats[f"mismatch-{label}"] = None
        except ValueError as e:  # ConfigError is a ValueError
            stats[f"mismatch-{label}"] = str(e)
    save_file(tensors, f"{out_dir}/rank{rank}.safetensors")
    Path(f"{out_dir}/rank{rank}.json").write_text(json.dumps(stats))


def run_plan(tmp: Path, scenarios: list[tuple], device: str = "cpu", backend: str = "gloo"):
    """One spawn of 2 ranks running ``scenarios``; each rank's outputs and load statistics."""
    plan = [(n, s, (p.tensor_parallel_size, p.expert_parallel), lens, steps) for n, s, p, lens, steps in scenarios]
    run_ranks(rank_worker, 2, str(tmp), plan, device, backend=backend)
    return ([load_file(tmp / f"rank{r}.safetensors") for r in range(2)],
            [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """Synthetic checkpoints: both layouts, BF16 and MXFP8 (the MXFP8 ones on ``mx_tiny``)."""
    root = tmp_path_factory.mktemp("parallel-ckpt")
    out = {}
    for layout in ("original", "hf"):
        for fmt, cfg in (("bf16", preset("tiny")), ("mxfp8", mx_tiny())):
            out[f"{layout}-{fmt}"] = str(write_checkpoint(root / f"{layout}-{fmt}", cfg, layout=layout, fmt=fmt,
                                                          progress=False, with_tokenizer=False))
    # one KV head for 2 ranks: it is replicated (the release's 4 KV heads at TP8 are the same case)
    out["kv1-bf16"] = str(write_checkpoint(root / "kv1", kv1_tiny(), progress=False, with_tokenizer=False))
    # a VL checkpoint: the vision tower and projector are replicated (read whole by every rank)
    out["vl-bf16"] = str(write_checkpoint(root / "vl", preset("tiny").replace(vision=VISION), progress=False,
                                          with_tokenizer=False))
    return out


def kv1_tiny():
    return preset("tiny").replace(num_key_value_heads=1, index_n_heads=1)


@pytest.fixture(scope="module")
def all_ranks(tmp_path_factory, ckpts):
    """The model and the checkpoint scenarios in one spawn (each spawn costs seconds of start-up on 2 ranks);
    their names are distinct, so every scenario's outputs and statistics keep their own keys."""
    scenarios = model_scenarios() + checkpoint_scenarios(ckpts)
    assert len({s[0] for s in scenarios}) == len(scenarios)
    return run_plan(tmp_path_factory.mktemp("parallel-ranks"), scenarios)


@pytest.fixture(scope="module")
def model_ranks(all_ranks):
    return all_ranks


@pytest.fixture(scope="module")
def ckpt_ranks(all_ranks):
    return all_ranks


def reference(source: str, lengths, steps: int, device="cpu", dequantize=False) -> dict[str, torch.Tensor]:
    model = m3export.load_model(source, device=device, progress=False, dequantize=dequantize)
    with torch.inference_mode():
        return greedy(model, prompts_for(model.config.vocab_size, lengths), steps)


def assert_matches_single(ranks: list[dict], name: str, ref: dict[str, torch.Tensor]) -> None:
    for key, want in ref.items():
        got0, got1 = ranks[0][f"{name}/{key}"], ranks[1][f"{name}/{key}"]
        if key == "kv_cache_shape":
            continue
        assert torch.equal(got0, got1), f"{name}/{key}: the two ranks disagree (collectives must give every rank " \
                                        "the same bits)"
        if key == "tokens":
            assert torch.equal(got0, want), f"{name}: greedy tokens differ from one process:\n{got0}\n{want}"
            continue
        scale = float(want.abs().max())
        err = float((got0 - want).abs().max())
        assert err <= LOGIT_RTOL * scale, f"{name}/{key}: max |diff| {err:.3e} > {LOGIT_RTOL} x {scale:.3e}"


# ---------------------------------------------------------------------------------------------- 2 ranks, gloo
@pytest.mark.parametrize("name", ["tiny-tp2", "tiny-tp2ep", "code-tp2", "code-tp2ep"])
def test_step_and_greedy_equal_single_process(model_ranks, name):
    ranks, _ = model_ranks
    _, source, _, lengths, steps = {s[0]: s for s in model_scenarios()}[name]
    ref = reference(source, lengths, steps)
    assert_matches_single(ranks, name, ref)
    assert ref["tokens"].shape[1] == DECODE_STEPS + 1


@pytest.mark.parametrize("name", ["original-bf16", "hf-bf16", "original-mxfp8", "hf-mxfp8", "kv1-bf16", "vl-bf16"])
@pytest.mark.parametrize("tag", ["tp2", "tp2ep"])
def test_sharded_checkpoint_equals_single_process(ckpt_ranks, ckpts, name, tag):
    ranks, stats = ckpt_ranks
    assert_matches_single(ranks, f"{name}-{tag}", reference(ckpts[name], (17,), 4))
    if name == "kv1-bf16":  # the one KV head on both ranks
        assert [s[f"{name}-{tag}"]["kv_heads"] for s in stats] == [1, 1]


def test_a_split_that_does_not_match_the_process_group_is_refused(ckpt_ranks):
    _, stats = ckpt_ranks
    for r in range(2):
        assert stats[r]["mismatch-world"] == ("tensor_parallel_size 4 but the process group has 2 ranks (world "
                                              "size must equal tensor_parallel_size: no data parallelism)")
        assert stats[r]["mismatch-rank"] == f"asked for rank {1 - r}'s shard in the process of rank {r}"


@pytest.mark.parametrize("tag", ["tp2", "tp2ep"])
def test_dequantised_shard_equals_single_process(ckpt_ranks, ckpts, tag):
    ranks, _ = ckpt_ranks
    assert_matches_single(ranks, f"deq-original-mxfp8-{tag}", reference(ckpts["original-mxfp8"], (17,), 4,
                                                                        dequantize=True))


def test_caches_hold_only_the_ranks_kv_heads(model_ranks):
    """The pools the step used, and what the torch backend sizes a page at: K and V of the rank's KV heads on
    every layer (MTP included), plus the replicated index keys on sparse layers; fp32 caches."""
    ranks, stats = model_ranks
    tiny = preset("tiny")
    kv_local = tiny.num_key_value_heads // 2
    layers = [tiny.is_sparse_layer(i) for i in range(tiny.num_hidden_layers)] + [True] * tiny.num_mtp_modules
    want = sum(PAGE * (2 * kv_local * tiny.head_dim + (tiny.index_head_dim if sparse else 0)) * 4 for sparse in layers)
    for r in range(2):
        pages, page, heads, dim = ranks[r]["tiny-tp2/kv_cache_shape"].tolist()
        assert (heads, dim) == (kv_local, tiny.head_dim)
        assert stats[r]["tiny-tp2"]["kv_heads"] == kv_local
        assert stats[r]["tiny-tp2"]["page_bytes"] == want


# Checkpoint tensors a rank reads a 1/tp slice of (or, expert parallel, 1/tp of the experts): named here from the
# checkpoint's own spelling, independently of m3export.parallel.sharding. The index-key projection
# (``self_attn.index_k_proj`` / ``self_attn.indexer.k_proj``) is the one shared head: read whole by every rank.
SPLIT = re.compile(r"(lm_head|q_proj|k_proj|v_proj|o_proj|index_q_proj|gate_proj|up_proj|down_proj|gate_up_proj|"
                   r"experts\.\d+\.w[123])\.weight(_scale_inv)?$|experts\.(gate_up_proj|down_proj)(_scale_inv)?$")
SHARED_INDEX_KEY = re.compile(r"self_attn\.(index_k_proj|indexer\.k_proj)\.")
VISION_TENSORS = re.compile(r"^(vision_tower|patch_merge_mlp|multi_modal_projector)\.")  # replicated too


@pytest.mark.parametrize("name", ["original-bf16", "hf-bf16", "original-mxfp8", "hf-mxfp8", "vl-bf16"])
@pytest.mark.parametrize("tag", ["tp2", "tp2ep"])
def test_each_rank_reads_only_its_slices(ckpt_ranks, ckpts, name, tag):
    _, stats = ckpt_ranks
    header = read_header(Path(ckpts[name]) / "model.safetensors")
    split = sum(nbytes(e.torch_dtype, e.shape) for n, e in header.items()
                if SPLIT.search(n) and not SHARED_INDEX_KEY.search(n) and not VISION_TENSORS.search(n))
    whole = sum(nbytes(e.torch_dtype, e.shape) for n, e in header.items()) - split
    assert split > 0.5 * (split + whole)  # the split tensors are most of the model: the check has teeth
    for r in range(2):
        assert stats[r][f"{name}-{tag}"]["bytes_read"] == split // 2 + whole, (r, split, whole)
        assert stats[r][f"{name}-{tag}"]["peak_rss_bytes"] >= stats[r][f"{name}-{tag}"]["anon_rss_bytes"] > 0


# ---------------------------------------------------------------------------------------------- one process
def test_one_rank_is_load_model():
    a = load_model_shard("tiny", ParallelConfig(1), 0)
    b = m3export.load_model("tiny", progress=False)
    ids = torch.arange(30).view(1, 30)
    with torch.inference_mode():
        assert torch.equal(a(ids), b(ids))
    assert type(a.lm_head) is torch.nn.Linear and a.config == b.config


def test_shards_partition_every_parameter():
    """For every parameter, the ranks' slices together are the whole tensor, each element once (KV heads
    replicated on tp / kv ranks: that many times); a rank's gate and up rows pair up."""
    for cfg, par in ((preset("tiny"), ParallelConfig(2)), (preset("tiny"), ParallelConfig(2, True)),
                     (mx_tiny().replace(num_attention_heads=8, num_key_value_heads=4, index_n_heads=4),
                      ParallelConfig(4)), (preset("tiny"), ParallelConfig(4, True)), (kv1_tiny(), ParallelConfig(2))):
        shapes = {n: tuple(p.shape) for n, p in _meta(cfg).named_parameters()}
        for name, shape in shapes.items():
            full = torch.arange(torch.Size(shape).numel()).view(shape)
            parts = [shard_of(name, cfg, par, r) for r in range(par.tensor_parallel_size)]
            if parts[0].replicated:
                assert all(p.replicated for p in parts), name
                continue
            seen = torch.cat([p.take(full).reshape(-1) for p in parts]).sort().values
            copies = seen.numel() // full.numel()  # > 1 only for KV heads replicated on tp / kv ranks
            assert copies == 1 or (copies * cfg.num_key_value_heads == par.tensor_parallel_size
                                   and re.search(r"[kv]_proj|index_q_proj", name)), name
            assert torch.equal(seen, full.reshape(-1).repeat_interleave(copies)), \
                f"{name}: slices do not cover the tensor evenly"
            if name.endswith(("gate_up_proj.weight", "experts.w13")) and not (par.expert_parallel and "w13" in name):
                dim = 0 if "gate_up" in name else 1
                half = shape[dim] // 2
                for r, p in enumerate(parts):
                    gate, up = p.take(full).chunk(2, dim=dim)
                    assert torch.equal(up - gate, torch.full_like(gate, half * full.stride(dim))), (name, r)


def _meta(cfg):
    with torch.device("meta"):
        return m3export.model.M3ForCausalLM(cfg)


def test_sizes_that_do_not_divide_are_one_clear_error():
    tiny = preset("tiny")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 3 does not divide num_attention_heads \(4\)"):
        ParallelConfig(3).validate(tiny)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 4 neither divides nor is a multiple of "
                                          r"num_key_value_heads \(6\)"):
        ParallelConfig(4).validate(tiny.replace(num_attention_heads=12, num_key_value_heads=6, index_n_heads=6))
    with pytest.raises(ConfigError, match=r"does not divide num_local_experts \(6\)"):
        ParallelConfig(4, True).validate(tiny.replace(num_attention_heads=8, num_key_value_heads=4,
                                                      index_n_heads=4, num_local_experts=6))
    with pytest.raises(ConfigError, match=r"dense_intermediate_size / tensor_parallel_size = 48 is not a multiple"):
        ParallelConfig(2).validate(tiny, mxfp8=True)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        ParallelConfig(0)
    ParallelConfig(2).validate(mx_tiny(), mxfp8=True)
    ParallelConfig(8, True).validate(preset("full"), mxfp8=True)  # the release at vLLM's TP8 + EP
    ParallelConfig(8).validate(preset("full"), mxfp8=True)


def test_spawn_helper_keeps_nvlink_multicast_off():
    assert NVLINK_MULTICAST_OFF == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                    "NVSHMEM_DISABLE_NVLS": "1"}


# ---------------------------------------------------------------------------------------------- 2 GPUs, NCCL
@pytest.mark.gpu
@pytest.mark.parametrize("which", ["models", "checkpoints"])
def test_two_gpus_nccl_equal_single_gpu(tmp_path, ckpts, which):
    """The same checks on 2 GPUs over NCCL (Triton kernels on each rank) against one GPU. Kernels sum in other
    orders than the references, so the bound is the same reduction-order one; tokens must still agree."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, {torch.cuda.device_count() if torch.cuda.is_available() else 0} visible")
    plan = model_scenarios() if which == "models" else checkpoint_scenarios(ckpts)
    ranks, stats = run_plan(tmp_path, plan, device="cuda", backend="nccl")
    for name, source, _, lengths, steps in plan:
        assert_matches_single(ranks, name, reference(source, lengths, steps, device="cuda:0",
                                                     dequantize=name.startswith("deq-")))
        print(name, "bytes read per rank:", [s[name]["bytes_read"] for s in stats],
              "peak host RSS per rank (MiB):", [s[name]["peak_rss_bytes"] >> 20 for s in stats])
