"""The TensorRT plugins without TensorRT: shape / type logic against the reference ops, the plugin kernels run with
exactly TensorRT's argument list (Triton interpreter) against the references, and the AOT compile for sm_90.

What needs ``import tensorrt`` (registration with ``tensorrt.plugin``, engine builds) skips with the reason; the
AOT artifacts are launched through the CUDA driver on the H200 by ``tests/test_tensorrt_plugins_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from m3export.ops import OPS
from m3export.ops import conformance as cf
from m3export.plugins.tensorrt import aot, shapes
from m3export.plugins.tensorrt.shapes import OP_PLUGINS, PluginShapeError, TensorInfo

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def _infos(tensors):
    from m3export.plugins.tensorrt.launch import tensor_infos

    return tensor_infos(tensors)


def _reference(op, inputs, attrs):
    return cf.reference_function(op)(*inputs, *attrs.values())


# FP8-cache cases pass scale pools the plugins do not take yet (the TensorRT flavour refuses such nodes)
CPU_CASES = [c for c in cf.CASES.values() if c.cpu and ("small" in c.tags or "adversarial" in c.tags)
             and not getattr(c, "fp8", False)]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_op_plugin_shapes_match_the_reference_outputs(case, dtype):
    inputs, attrs = case.inputs(dtype)
    want = _reference(case.op, inputs, attrs)
    (got,) = OP_PLUGINS[case.op].infer(_infos(inputs), attrs)
    assert got.shape == tuple(want.shape)
    assert got.dtype == _infos([want])[0].dtype


def _random_op_inputs(op: str, gen: torch.Generator):
    """Meta tensors of random legal shapes for ``op`` and its attributes (many more shapes than the cases)."""
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    dt = [torch.float32, torch.float16, torch.bfloat16][r(0, 2)]
    m = lambda *s, d=dt: torch.empty(s, dtype=d, device="meta")  # noqa: E731
    t, b, mp, pages, page = r(0, 40), r(1, 6), r(1, 9), r(1, 30), r(1, 64)
    paged = [m(b, mp, d=torch.int32), m(b + 1, d=torch.int32), m(b, d=torch.int32), m(t, d=torch.int64)]
    hkv, g, d = r(1, 4), r(1, 8), r(1, 128)
    if op == "LightningIndexer":
        bs, k = 2 ** r(0, 7), r(1, 16)
        return [m(t, hkv, d), m(pages, page, d), *paged], dict(block_size=bs, topk_blocks=k, local_blocks=r(0, 2),
                                                               init_blocks=r(0, 2))
    if op in ("PagedAttention", "SparsePagedAttention"):
        dv = r(1, 128)
        ins = [m(t, hkv * g, d), m(pages, page, hkv, d), m(pages, page, hkv, dv), *paged]
        if op == "PagedAttention":
            return ins, dict(scale=0.1)
        return ins + [m(t, hkv, r(1, 16), d=torch.int32)], dict(block_size=2 ** r(0, 7), scale=0.1)
    h, e, i, s = 32 * r(1, 4), r(1, 16), 32 * r(1, 3), 32 * r(1, 3)
    k = r(1, e)
    moe_attrs = dict(top_k=k, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)
    f8, u8 = torch.float8_e4m3fn, torch.uint8
    if op == "MoE":
        return [m(t, h), m(e, h, d=torch.float32), m(e, d=torch.float32), m(e, 2 * i, h), m(e, h, i), m(2 * s, h),
                m(h, s)], moe_attrs
    if op == "MoEMXFP8":
        return [m(t, h), m(e, h, d=torch.float32), m(e, d=torch.float32), m(e, 2 * i, h, d=f8),
                m(e, 2 * i, h // 32, d=u8), m(e, h, i, d=f8), m(e, h, i // 32, d=u8), m(2 * s, h, d=f8),
                m(2 * s, h // 32, d=u8), m(h, s, d=f8), m(h, s // 32, d=u8)], moe_attrs
    lead = tuple(r(0, 5) for _ in range(r(1, 3)))
    n, kk = r(1, 64), 32 * r(1, 4)
    return [m(*lead, kk), m(n, kk, d=f8), m(n, kk // 32, d=u8)], {}


@pytest.mark.parametrize("op", sorted(OPS))
def test_op_plugin_shapes_match_the_fake_ops_on_random_shapes(op):
    """200 random legal shapes per op through the torch ops' fake implementations (the export's shape contract)."""
    gen = torch.Generator().manual_seed(17)
    fn = getattr(torch.ops.m3, OPS[op].split("::")[1])
    for _ in range(200):
        inputs, attrs = _random_op_inputs(op, gen)
        want = fn(*inputs, *attrs.values())
        (got,) = OP_PLUGINS[op].infer(_infos(inputs), attrs)
        assert got.shape == tuple(want.shape), (op, [tuple(x.shape) for x in inputs], attrs)
        assert got.dtype == _infos([want])[0].dtype


def test_shape_functions_work_on_symbolic_dimensions():
    """TensorRT hands ShapeExprs, not ints: only + - * // may be used on them (a stand-in records the formula)."""

    Sym = shapes.Symbol

    t, b, mp = Sym("T"), Sym("B"), Sym("MP")
    paged = [TensorInfo((b, mp), "int32"), TensorInfo((b + 1,), "int32"), TensorInfo((b,), "int32"),
             TensorInfo((t,), "int64")]
    (sel,) = OP_PLUGINS["LightningIndexer"].infer(
        [TensorInfo((t, 4, 128), "bfloat16"), TensorInfo((Sym("P"), 16, 128), "bfloat16"), *paged],
        dict(block_size=128, topk_blocks=16, local_blocks=1, init_blocks=0))
    assert sel.shape[0] is t and sel.shape[1:] == (4, 16) and sel.dtype == "int32"
    (scores,) = shapes.STEP_PLUGINS["LightningIndexerScan"].infer(
        [TensorInfo((t, 4, 128), "bfloat16"), TensorInfo((Sym("P"), 16, 128), "bfloat16"), paged[0], paged[1],
         paged[3]], dict(block_size=128))
    assert scores.shape[2].text == "((((MP*16)+128)-1)//128)"  # ceil(max_pages * page / block)


@pytest.mark.parametrize("op, index, bad, match", [
    ("PagedAttention", 0, TensorInfo((3, 4, 16), "int32"), "input q is int32"),
    ("PagedAttention", 1, TensorInfo((9, 8, 2, 16), "float16"), "input k_cache is float16"),
    ("PagedAttention", 0, TensorInfo((3, 5, 16), "float32"), "5 query heads are not a multiple of 2"),
    ("PagedAttention", 6, TensorInfo((3,), "int32"), "input positions is int32"),
    ("LightningIndexer", 0, TensorInfo((3, 2), "float32"), "input index_q has rank 2"),
    ("SparsePagedAttention", 7, TensorInfo((37, 3, 4), "int32"), "block_idx groups and KV heads differ"),
])
def test_bad_inputs_are_named(op, index, bad, match):
    case = next(c for c in CPU_CASES if c.op == op)
    inputs, attrs = case.inputs(torch.float32)
    infos = _infos(inputs)
    infos[index] = bad
    with pytest.raises(PluginShapeError, match=match):
        OP_PLUGINS[op].infer(infos, attrs)


def test_mxfp8_shapes_are_checked():
    x, w, s = TensorInfo((4, 96), "bfloat16"), TensorInfo((48, 96), "float8_e4m3fn"), TensorInfo((48, 3), "uint8")
    assert OP_PLUGINS["MXFP8Linear"].infer([x, w, s], {})[0] == TensorInfo((4, 48), "bfloat16")
    with pytest.raises(PluginShapeError, match="weight_scale shape"):
        OP_PLUGINS["MXFP8Linear"].infer([x, w, TensorInfo((48, 2), "uint8")], {})
    with pytest.raises(PluginShapeError, match="input weight is bfloat16"):
        OP_PLUGINS["MXFP8Linear"].infer([x, TensorInfo((48, 96), "bfloat16"), s], {})


# ------------------------------------------------------------------ the plugin kernels with TensorRT's arguments
def _plugin_runs(op, inputs, attrs):
    """Run ``op`` as its TensorRT plugin node(s) would: each AOT kernel launched with TensorRT's argument list."""
    from m3export.plugins.tensorrt.steps import run_plugin_steps

    return run_plugin_steps(op, inputs, attrs)


# (case, tactic): every plugin kernel, the adversarial batches, and each tactic that changes the launch (context
# splits of the indexer scan, the linear tiles) once; the interpreter takes seconds per case.
KERNEL_CASES = [("PagedAttention/decode-batch", 0), ("PagedAttention/nan-tails-empty-shared-batch", 0),
                ("SparsePagedAttention/decode-batch-random", 0), ("SparsePagedAttention/verify-multi-token-indexer", 0),
                ("LightningIndexer/decode-batch", 0), ("LightningIndexer/decode-batch", 2),
                ("LightningIndexer/score-ties-no-forced", 1), ("LightningIndexer/forced-beyond-topk", 0),
                ("LightningIndexer/nan-tails-empty-shared-batch", 0), ("MXFP8Linear/rows7", 0),
                ("MXFP8Linear/rows7", 1), ("MXFP8Linear/e4m3-edge-codes", 2), ("MoE/top1-1tok", 0),
                ("MoE/routing-ties", 0), ("MoE/top2-9tok", 0), ("MoEMXFP8/e4m3-edge-codes", 0)]


@pytest.mark.skipif(not INTERPRET, reason="needs triton and TRITON_INTERPRET=1 (set by tests/conftest.py without CUDA)")
@pytest.mark.parametrize("case_id, tactic", KERNEL_CASES)
def test_plugin_kernels_with_tensorrt_arguments_match_the_reference(case_id, tactic):
    """The wrappers launched with (inputs, int32 extras, outputs) only, under the Triton interpreter, in fp32:
    judged by the conformance suite's rules (selections exact up to reported fp32 near-ties)."""
    case = cf.CASES[case_id]
    inputs, attrs = case.inputs(torch.float32)
    got = _plugin_runs(case.op, inputs, dict(attrs, _tactic=tactic))
    verdict = cf.compare(case, torch.float32, got, inputs, attrs)
    assert verdict.ok, verdict


@pytest.mark.skipif(not INTERPRET, reason="needs triton and TRITON_INTERPRET=1 (set by tests/conftest.py without CUDA)")
@pytest.mark.parametrize("local,init", [(1, 0), (3, 2)])
def test_plugin_topk_ranks_rows_over_their_own_tier_as_the_reference(local, init):
    """The TensorRT top-k is planned for max_blocks (the whole max_model_len) with the torch launcher's settings
    (``lightning_indexer.topk_launch``): 1100 blocks pad to 2048, tiers 64 / 256 / 1024 / 2048, the grouped
    two-level sort from 512. Rows ending in every tier and on both sides of its bounds, block maxima drawn from a
    few values (ties to the lower id) with -inf and +inf among them: the same ids as the reference's selection."""
    from m3export.ops.indexer import select_blocks
    from m3export.plugins.kernels import lightning_indexer as li
    from m3export.plugins.tensorrt.launch import run_wrapper, tensor_infos

    h, topk, bs, nb = 2, 8, 4, 1100
    own = torch.tensor([0, 5, 63, 64, 66, 200, 256, 258, 700, 1023, 1026, 1099])
    positions = own * bs + torch.tensor([0, 3, 1, 2] * 3)
    gen = torch.Generator().manual_seed(31 + local)
    scores = torch.randint(-4, 5, (own.numel(), h, nb), generator=gen).float()
    scores[scores == 4] = float("inf")
    scores[scores == -4] = float("-inf")
    attrs = dict(block_size=bs, topk_blocks=topk, local_blocks=local, init_blocks=init, max_blocks=nb)
    plan = aot.plan("LightningIndexerTopK", tensor_infos([scores, positions]), attrs)
    assert list(plan.constexprs["TIERS"]) == li.topk_tiers(2048, 8) == [64, 256, 1024, 2048]
    assert plan.constexprs["METHOD"] == "bitonic" and plan.constexprs["GROUP"] == li.DEFAULTS["topk"]["group"]
    out = torch.empty((own.numel(), h, topk), dtype=torch.int32)
    run_wrapper(plan, [scores, positions], [out])
    assert torch.equal(out, select_blocks(scores, positions, bs, topk, local, init))


# ------------------------------------------------------------------------------------ AOT compile for sm_90
@pytest.fixture(scope="module")
def sm90_report(tmp_path_factory):
    """Every plugin kernel and tactic compiled for sm_90 at mini dims in a clean process (no TRITON_INTERPRET,
    which would compile the interpreter's code paths), artifacts and report written to a directory."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install 'm3export[gpu]')")
    out = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "m3export.plugins.tensorrt.compile", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "kernels.json").read_text())


def test_every_plugin_kernel_compiles_for_sm90_with_tensorrt_launch_convention(sm90_report):
    out, report = sm90_report
    plugins = {k["plugin"] for k in report["kernels"]}
    assert plugins == set(aot.PLANNERS)
    for k in report["kernels"]:
        assert k["arch"] == 90 and k["global_scratch_size"] == 0 and k["profile_scratch_size"] == 0
        declared = k["num_inputs"] + k["num_extras"] + k["num_outputs"]
        assert len(k["params"]) == declared + k["hidden_params"]
        assert all(p == "u64 ptr" for p in k["params"][:k["num_inputs"]])
        assert all(p == "u32" for p in k["params"][k["num_inputs"]:k["num_inputs"] + k["num_extras"]])
        ptx = (out / k["ptx"]).read_text()
        assert f".entry {k['name']}(" in ptx and ".target sm_90" in ptx
        assert (out / k["cubin"]).stat().st_size > 0
        assert k["block"][0] == 32 * k["num_warps"]


def test_triton_hidden_parameters_are_counted_for_this_version(sm90_report):
    """Triton 3.3 added global_scratch, 3.5 profile_scratch: the PTX must show exactly that many trailing pointers."""
    import triton

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    want = 0 if (major, minor) < (3, 3) else 1 if (major, minor) < (3, 5) else 2
    assert {k["hidden_params"] for k in sm90_report[1]["kernels"]} == {want}


def test_launch_convention_refuses_a_wrong_order():
    """A plan whose declared inputs / outputs do not split the parameters as TensorRT passes them is refused."""
    plan = aot.KernelPlan("X", None, {"a_ptr": "*fp32", "n": "i32", "b_ptr": "*fp32"}, {}, 4, 1, 1, 1, (), (1, 1, 1))
    ptx = (".visible .entry k(\n .param .u64 .ptr .global .align 1 k_param_0,\n .param .u32 k_param_1,\n"
           " .param .u64 .ptr .global .align 1 k_param_2,\n .param .u64 .ptr .global .align 1 k_param_3\n)\n{ ret; }")

    class Md:
        global_scratch_size = 0
        profile_scratch_size = 0

    with pytest.raises(aot.LaunchConventionError, match="0 extra arguments for 1 scalar"):
        aot.launch_convention(plan, ptx, "k", Md)
    good = aot.KernelPlan("X", None, plan.signature, {}, 4, 1, 1, 1, (5,), (1, 1, 1))
    assert aot.launch_convention(good, ptx, "k", Md) == (("u64 ptr", "u32", "u64 ptr", "u64 ptr"), 1)
    with pytest.raises(aot.LaunchConventionError, match="reads hidden parameter k_param_3"):
        aot.launch_convention(good, ptx.replace("ret;", "ld.param.u64 %rd1, [k_param_3]; ret;"), "k", Md)
    Md.global_scratch_size = 64
    with pytest.raises(aot.LaunchConventionError, match="global_scratch_size"):
        aot.launch_convention(good, ptx, "k", Md)
    Md.global_scratch_size, Md.num_ctas = 0, 2
    with pytest.raises(aot.LaunchConventionError, match="num_ctas=2 needs a launch TensorRT does not make"):
        aot.launch_convention(good, ptx, "k", Md)


def test_aot_plans_take_the_kernels_tile_arithmetic_and_import_without_triton():
    """``next_pow2`` has one owner (``plugins/kernels/_batch.py``): the AOT planners import it when they plan
    (they need Triton then anyway), so importing the TensorRT modules (export's TensorRT flavour) needs no Triton."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(aot.__file__).read_text())
    assert not [n.lineno for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "next_pow2"]
    code = ("import sys; sys.modules['triton'] = None\n"  # any 'import triton' now raises ImportError
            "import m3export.plugins.tensorrt.aot, m3export.plugins.tensorrt.steps\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed: the missing-package path cannot be seen")
def test_registering_plugins_without_tensorrt_says_what_to_install():
    from m3export.errors import BackendUnavailable
    from m3export.plugins.tensorrt import plugins

    with pytest.raises(BackendUnavailable, match="pip install 'm3export\\[trt\\]'"):
        plugins.register()


@pytest.mark.skipif(not HAS_TENSORRT, reason="TensorRT is not installed (its wheels download from NVIDIA's index, "
                    "unreachable here; pip install 'm3export[trt]' on a GPU host)")
def test_plugins_register_with_tensorrt():
    import tensorrt.plugin as trtp  # noqa: F401

    from m3export.plugins.tensorrt import plugins

    names = plugins.register()
    assert set(names) == set(shapes.PLUGINS)


def test_driver_launch_passes_exactly_tensorrt_arguments_then_null_scratch():
    """The raw cuLaunchKernel marshalling of ``launch.DriverKernel`` (used on the H200), checked against a recording
    stand-in for libcuda: input pointers, int32 extras, output pointers, null per hidden parameter, the plan's grid."""
    import ctypes

    from m3export.plugins.tensorrt.launch import DriverKernel

    plan = aot.KernelPlan("X", None, {"a": "*fp32", "b": "*i32", "n": "i32", "m": "i32", "y": "*fp32"}, {}, 4, 1,
                          2, 1, (7, -3), (5, 2, 1))
    kernel = aot.AotKernel(plan, "k", "", b"", 1024, (128, 1, 1), ("u64 ptr",) * 2 + ("u32",) * 2 + ("u64 ptr",) * 3,
                           2)
    seen = {}

    class FakeCuda:
        def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            seen["grid"] = (gx.value, gy.value, gz.value)
            seen["block"] = (bx.value, by.value, bz.value, smem.value)
            n = len(kernel.params)
            ptrs = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            kinds = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32, ctypes.c_uint64,
                     ctypes.c_uint64, ctypes.c_uint64]
            seen["args"] = [ctypes.cast(ptrs[i], ctypes.POINTER(k)).contents.value for i, k in zip(range(n), kinds)]
            return 0

    class T:
        def __init__(self, p):
            self.p = p

        def data_ptr(self):
            return self.p

    dk = DriverKernel.__new__(DriverKernel)
    dk.kernel, dk.cuda, dk.function = kernel, FakeCuda(), ctypes.c_void_p(1)
    dk.launch([T(0x1000), T(0x2000)], [T(0x3000)])
    assert seen["args"] == [0x1000, 0x2000, 7, -3, 0x3000, 0, 0]
    assert seen["grid"] == (5, 2, 1) and seen["block"] == (128, 1, 1, 1024)


def test_symbolic_extents_evaluate_to_the_concrete_launch():
    """What the H200 test relies on: the formulas ``kernels.json`` records (the ShapeExprs ``aot_impl`` returns),
    evaluated on a step's dimensions, are the grid and extras the plan computes from that step's concrete shapes,
    with the same kernel constants; ``bind_dims`` reads the dimensions off the inputs."""
    from m3export.config import preset
    from m3export.plugins.tensorrt.compile import plugin_instances
    from m3export.plugins.tensorrt.launch import bind_dims, concrete, evaluate

    values = {"T": 7, "B": 3, "max_pages": 5, "pages": 40, "num_blocks": 9}
    seen = set()
    for plugin, inputs, attrs in plugin_instances(preset("mini"), "bfloat16", 16, 4096):
        compiled_for = [{"shape": shapes.describe(t.shape), "dtype": t.dtype} for t in inputs]
        step = [TensorInfo(tuple(evaluate(d, values) for d in c["shape"]), c["dtype"]) for c in compiled_for]
        dims = bind_dims(compiled_for, step, plugin)
        assert dims and all(values[k] == v for k, v in dims.items())
        for tactic in aot.PLANNERS[plugin][1]:
            sym, conc = aot.plan(plugin, inputs, attrs, tactic), aot.plan(plugin, step, attrs, tactic)
            assert (conc.constexprs, conc.signature) == (sym.constexprs, sym.signature), plugin
            assert [evaluate(g, dims) for g in shapes.describe(sym.grid)] == list(concrete(conc.grid)), plugin
            assert [evaluate(x, dims) for x in shapes.describe(sym.extra_args)] == list(concrete(conc.extra_args))
            seen.add(plugin)
    assert seen == set(aot.PLANNERS)
    q = [{"shape": ["T", 64, 128], "dtype": "bfloat16"}, {"shape": ["(T+1)"], "dtype": "int32"}]
    with pytest.raises(ValueError, match=r"input 0 is float16 \[3, 64, 128\], the kernel was compiled for bfloat16"):
        bind_dims(q, [TensorInfo((3, 64, 128), "float16"), TensorInfo((4,), "int32")], "x")
    with pytest.raises(ValueError, match=r"input 0 dimension 1 is 32, the kernel was compiled for 64"):
        bind_dims(q, [TensorInfo((3, 32, 128), "bfloat16"), TensorInfo((4,), "int32")], "x")
    with pytest.raises(ValueError, match=r"input 1 dimension 0 is 5, the kernel was compiled for \(T\+1\) = 4"):
        bind_dims(q, [TensorInfo((3, 64, 128), "bfloat16"), TensorInfo((5,), "int32")], "x")
    with pytest.raises(ValueError, match="only names, ints and"):
        evaluate("__import__('os')", {})
