"""bench/decode_profile.py's logic on the CPU: kernel families, gaps, the eager-to-replay scope alignment, the
parsing of device events (fake ones: this machine has no GPU), the bytes split, and one end-to-end run at tiny
sizes (host ops stand in for kernels; it measures nothing meaningful here)."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import decode  # noqa: E402  (bench/decode.py)
import decode_profile as dp  # noqa: E402  (bench/decode_profile.py)


def test_families_of_triton_kernels_by_name_and_of_the_rest_by_scope():
    assert dp.family("_index_scan") == "indexer scan"
    assert dp.family("_block_topk") == "top-k"
    # the dense kernel's name is a suffix of the sparse one's: each must keep its own family
    assert dp.family("_sparse_paged_attention") == "sparse attention"
    assert dp.family("_paged_attention") == "dense attention"
    assert dp.family("_gate_up_gemv", "layer/moe") == "MoE gate-up"
    assert dp.family("_down_gemv", "layer/moe") == "MoE down"
    assert dp.family("_combine", "layer/moe") == "MoE combine"
    assert dp.family("_route", "layer/moe") == "MoE routing"
    assert dp.family("_linear_gemv", "layer/attention.sparse/linear") == "linear"
    assert dp.family("_norm_rope", "layer/attention.dense") == "norms / rope / cache write"
    # the split-K merge finishes whichever attention it runs under
    assert dp.family("_merge", "layer/attention.sparse") == "sparse attention"
    assert dp.family("_merge", "layer/attention.dense") == "dense attention"
    # cuBLAS and PyTorch's kernels: by the innermost module
    gemv = "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>"
    assert dp.family(gemv, "lm_head") == "lm_head"
    assert dp.family(gemv, "layer/moe") == "MoE routing"
    sort = "void at::native::bitonicSortKVInPlace<2, -1, 16, 16, long, long>"
    assert dp.family(sort, "layer/moe") == "MoE routing"
    ew = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>"
    assert dp.family(ew, "layer") == "elementwise"
    assert dp.family(ew, "layer/norm") == "norms / rope / cache write"
    assert dp.family("Memcpy HtoD (Pinned -> Device)") == "copies"
    assert dp.family("Memset (Device)", "") == "copies"


def test_gaps_are_the_idle_time_between_the_first_start_and_the_last_end():
    ks = [dp.Kernel("a", 0.0, 10.0), dp.Kernel("b", 15.0, 20.0), dp.Kernel("c", 18.0, 25.0),
          dp.Kernel("d", 31.0, 32.0)]
    s = dp.step_summary(ks)
    assert s["launches"] == 4 and s["span_us"] == 32.0
    assert s["busy_us"] == 10.0 + 10.0 + 1.0  # b and c overlap: [15, 25)
    assert s["gaps_us"] == 5.0 + 6.0
    assert s["widest_gaps"][0] == dict(us=6.0, after="c", before="d")
    assert s["widest_gaps"][1] == dict(us=5.0, after="a", before="b")
    assert s["families"]["elementwise"]["us"] == 10 + 5 + 7 + 1 and s["families"]["elementwise"]["launches"] == 4
    assert s["families"]["elementwise"]["gap_before_us"] == 11.0
    # each gap is charged to the family of the kernel that ends it
    s = dp.step_summary([dp.Kernel("_index_scan", 0.0, 10.0), dp.Kernel("_block_topk", 12.0, 13.0),
                         dp.Kernel("_sparse_paged_attention", 16.0, 20.0)])
    assert [s["families"][f]["gap_before_us"] for f in ("indexer scan", "top-k", "sparse attention")] == [0, 2, 3]


def test_combined_steps_give_each_family_its_fraction_of_bandwidth():
    steps = [dp.step_summary([dp.Kernel("_index_scan", 0.0, 10.0), dp.Kernel("Memcpy DtoD", 12.0, 13.0)]),
             dp.step_summary([dp.Kernel("_index_scan", 0.0, 30.0), dp.Kernel("Memcpy DtoD", 31.0, 32.0)])]
    out = dp.combine_steps(steps, {"indexer scan": 4_000_000}, bandwidth=1e12)
    scan = out["families"]["indexer scan"]
    assert scan["us"] == 20.0 and scan["launches"] == 1.0
    assert scan["fraction_of_bandwidth"] == pytest.approx(4e6 / 20e-6 / 1e12)  # 0.2
    assert out["families"]["copies"]["fraction_of_bandwidth"] is None  # nothing that must be read
    assert out["gaps_us"] == (2.0 + 1.0) / 2 and out["launches"] == 2


def test_replayed_kernels_take_the_scopes_of_the_eager_launches():
    eager = [("k0", "layer/norm"), ("gemv", "layer/attention.dense/linear"), ("add", "layer"), ("gemv", "lm_head")]
    replayed = ["Memcpy HtoD", "k0", "gemv", "add", "gemv", "Memcpy DtoD"]
    assert dp.align_scopes(replayed, eager) == ["", "layer/norm", "layer/attention.dense/linear", "layer",
                                                "lm_head", ""]


def _evt(name, start, end, device="cpu", id=0, linked=0):
    dt = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=dt, time_range=SimpleNamespace(start=start, end=end), id=id,
                           linked_correlation_id=linked, cpu_parent=None)


def test_device_events_are_split_into_steps_and_linked_to_their_scopes():
    events = [
        _evt("decode_step_0", 0, 100), _evt("decode_step_1", 200, 300),
        _evt("decode_step_0", 5, 90, "cuda"),  # the profiler's device copy of a range: not a kernel
        _evt("m3scope:layer", 1, 50), _evt("m3scope:moe", 10, 40),
        _evt("m3::moe_mxfp8", 11, 39, id=7), _evt("aten::add", 45, 46, id=8),
        _evt("_gate_up_gemv", 60, 70, "cuda", linked=7), _evt("vectorized_elementwise_kernel", 71, 72, "cuda",
                                                              linked=8),
        _evt("_index_scan", 210, 220, "cuda", linked=99), _evt("late", 400, 410, "cuda"),
    ]
    assert dp.eager_launches(events) == [("_gate_up_gemv", "layer/moe"), ("vectorized_elementwise_kernel", "layer"),
                                         ("_index_scan", ""), ("late", "")]
    # a profiler without correlation links: the kernels each host op lists stand in
    unlinked = [_evt("m3scope:moe", 10, 40), _evt("m3::moe_mxfp8", 11, 39), _evt("aten::add", 45, 46),
                _evt("_gate_up_gemv", 60, 70, "cuda")]
    unlinked[1].kernels = [SimpleNamespace(name="_route"), SimpleNamespace(name="_gate_up_gemv")]
    unlinked[2].kernels = [SimpleNamespace(name="add_kernel")]
    assert dp.eager_launches(unlinked) == [("_route", "moe"), ("_gate_up_gemv", "moe"), ("add_kernel", "")]
    ranges = dp.step_ranges(events)
    assert ranges == [(0, 100), (200, 300)]
    steps = dp.device_kernels(events, ranges)
    assert [[k.name for k in s] for s in steps] == [["_gate_up_gemv", "vectorized_elementwise_kernel"],
                                                   ["_index_scan"]]


def test_bytes_split_by_family_cover_every_weight_once():
    from m3export.checkpoint.loader import build_empty
    from m3export.config import preset

    cfg = preset("tiny")
    model = build_empty(cfg, torch.bfloat16, "meta", mxfp8=True, num_mtp_modules=0)
    e = cfg.num_local_experts
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    # every expert touched and one embedding row per vocabulary entry: the weights' families hold every byte
    full = decode.step_bytes_by_family(model, cfg, cfg.vocab_size, 0, 2, {i: e for i in moe_layers})
    caches = {"indexer scan", "sparse attention", "dense attention"}
    assert sum(v for f, v in full.items() if f not in caches) == sum(
        p.numel() * p.element_size() for p in model.parameters())
    assert set(full) <= set(dp.FAMILIES)
    assert full["lm_head"] == cfg.vocab_size * cfg.hidden_size * 2
    assert full["MoE routing"] == len(moe_layers) * (e * cfg.hidden_size + e) * 4  # fp32 router and bias
    # one touched expert per layer at batch 2: the routed experts' share drops to 1 / E
    one = decode.step_bytes_by_family(model, cfg, 2, 0, 2, {i: 1 for i in moe_layers})
    w13 = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts.w13" in n)
    assert full["MoE gate-up"] - one["MoE gate-up"] == w13 - w13 // e
    assert one["embedding"] == 2 * cfg.hidden_size * 2


def _run(path, *args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(BENCH / "decode_profile.py"), "--device", "cpu", *args, "--json",
                          str(path)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> dict:
    """The model dtype's cache (``--kv-cache-dtype auto``, the default), two shapes, two steps: read by the FP8
    test too, as its 16/32-bit counterpart (a family's bytes are per step, whatever the number of steps)."""
    return _run(tmp_path_factory.mktemp("dp") / "dp.json", "--shapes", "1x40,2x9", "--steps", "2")


def test_cpu_run_writes_a_profile_per_shape(cpu_run):
    res = cpu_run
    assert [(r["batch"], r["context"]) for r in res["rows"]] == [(1, 40), (2, 9)]
    for r in res["rows"]:
        assert r["steps"] == 2 and r["launches"] > 0
        assert r["busy_us"] <= r["span_us"] and r["gaps_us"] == pytest.approx(r["span_us"] - r["busy_us"])
        fams = r["families"]
        assert list(fams) == [f for f in dp.FAMILIES if f in fams]
        # the tiny model's ops, each in its own family (the CPU runs one op where the GPU runs several kernels)
        assert fams["indexer scan"]["launches"] == 3 and fams["dense attention"]["launches"] == 1
        assert fams["linear"]["kernels"]["m3::mxfp8_linear"] > 0 and fams["lm_head"]["launches"] == 1
        assert sum(f["bytes"] or 0 for f in fams.values()) == r["bytes_needed"]


def test_fp8_cache_profile_counts_a_byte_and_a_scale_per_cached_element(tmp_path, cpu_run):
    """``--kv-cache-dtype fp8``: E4M3 pools (with fp32 row scales) filled and run; the cache families' bytes are
    those of one code plus a 4-byte scale per head_dim elements, not the model dtype's (``cpu_run``'s 1x40 row)."""
    r8 = _run(tmp_path / "dp8.json", "--shapes", "1x40", "--steps", "1", "--kv-cache-dtype", "fp8",
              "--max-model-len", "200")  # an engine wider than the context: the same bytes must be read
    r16 = cpu_run
    assert r8["kv_cache_dtype"] == "fp8" and r16["kv_cache_dtype"] == "auto"
    assert r8["max_model_len"] == 200 and r16["max_model_len"] is None
    assert (r8["rows"][0]["batch"], r8["rows"][0]["context"]) == (r16["rows"][0]["batch"], r16["rows"][0]["context"])
    f8, f16 = r8["rows"][0]["families"], r16["rows"][0]["families"]
    head_dim = 32  # the tiny preset's head_dim and index_head_dim; its model dtype is fp32 (4 bytes)
    assert f8["indexer scan"]["bytes"] == pytest.approx(f16["indexer scan"]["bytes"] * (1 + 4 / head_dim) / 4)
    assert f8["lm_head"]["bytes"] == f16["lm_head"]["bytes"]


def test_settings_are_checked_by_name_and_applied_only_inside_their_block(cpu_run):
    """``--settings NAME=JSON``: an unknown module, part or setting stops the run naming it (before any model is
    built); inside ``launch_defaults`` the module's DEFAULTS carry the entries the ops launch with, restored after;
    the default run labels its rows 'default'."""
    from m3export.plugins.kernels import lightning_indexer as li

    for bad, says in [("x", "expected NAME=JSON"), ("a={", "not JSON"), ('a={"nope": {}}', "no kernel module 'nope'"),
                      ('a={"lightning_indexer": {"topq": {}}}', "has no part 'topq'"),
                      ('a={"lightning_indexer": {"topk": {"warps": 8}}}',
                       "lightning_indexer: unknown topk settings ['warps']")]:
        with pytest.raises(SystemExit, match=re.escape(says)):
            dp.parse_settings([bad])
    over = dp.parse_settings(['w16={"lightning_indexer": {"topk": {"num_warps": 16, "group": 16}}}'])["w16"]
    before = dict(li.DEFAULTS["topk"])
    with dp.launch_defaults(over):
        assert li.DEFAULTS["topk"] == {**before, "num_warps": 16, "group": 16}
    assert li.DEFAULTS["topk"] == before
    assert {r["settings"] for r in cpu_run["rows"]} == {"default"} and cpu_run["settings"] == {"default": {}}


def test_attention_part_sums_the_batch_1_rows_per_settings():
    """The issue's last attention target reads the indexer scan + top-k + sparse attention of a batch-1 step at
    each context over the shortest; rows of other batches are left out, each settings on its own."""
    def row(settings, b, ctx, scan, topk, sparse):
        fams = {"indexer scan": {"us": scan, "bytes": ctx * 100}, "top-k": {"us": topk, "bytes": None},
                "sparse attention": {"us": sparse, "bytes": 7_000_000}, "lm_head": {"us": 500.0, "bytes": 10**9}}
        return {"settings": settings, "batch": b, "context": ctx, "families": fams}

    rows = [row("default", 1, 4096, 10.0, 5.0, 30.0), row("default", 1, 131072, 30.0, 20.0, 30.0),
            row("default", 8, 4096, 99.0, 99.0, 99.0), row("g16", 1, 131072, 30.0, 10.0, 30.0),
            row("g16", 1, 4096, 10.0, 5.0, 30.0)]
    part = dp.attention_part(rows, bandwidth=4e12)
    assert part["default"]["us"] == {4096: 45.0, 131072: 80.0}
    assert part["default"]["over_shortest"][131072] == pytest.approx(80.0 / 45.0)
    assert part["g16"]["over_shortest"] == {4096: 1.0, 131072: pytest.approx(70.0 / 45.0)}
    # the least ratio: the 4k part plus the longer context's extra index keys (the sparse attention's bytes, the
    # lm_head's and the batch-8 row's are not the difference) at 4 TB/s: 127k x 100 bytes = 3.175 us
    extra_us = (131072 - 4096) * 100 / 4e12 * 1e6
    assert part["default"]["least_over_shortest"] == {4096: 1.0, 131072: pytest.approx((45.0 + extra_us) / 45.0)}
    assert part["g16"]["least_over_shortest"] == part["default"]["least_over_shortest"]
