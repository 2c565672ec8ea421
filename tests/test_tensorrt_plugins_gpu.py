"""The AOT artifacts the TensorRT plugins hand TensorRT, loaded and launched outside TensorRT on the GPU.

For every plugin kernel: the plan of ``plugins/tensorrt/aot.py`` compiled for this GPU (the PTX ``aot_impl``
returns), loaded through the CUDA driver (``cuModuleLoadData`` JIT-compiles the PTX as TensorRT does) and launched
with ``cuLaunchKernel`` with exactly TensorRT's arguments: input pointers, the extra int32 scalars evaluated on the
batch's shapes, output pointers, then null for Triton's hidden scratch parameters (``launch.DriverKernel``). No
Triton launcher is involved, so a wrong order, a missing parameter or a wrong grid gives wrong numbers or a launch
error. Results are judged by the conformance suite's rules against the float64 references, on the release-shaped
cases (M3's heads, head size 128, index blocks of 128, top-16, pages of 16 and 64, the MoE at release widths)
and the adversarial ones, every op (the MoE and MoEMXFP8 as their six-kernel chains).

  GPU_TEST_FILES="test_tensorrt_plugins_gpu.py:300" bash scripts/gpu_check.sh tests
"""

from __future__ import annotations

import pytest
import torch

from m3export.ops import conformance as cf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 tier)")]

CASES = [c.id for c in cf.CASES.values()
         if ("m3-shape" in c.tags or "adversarial" in c.tags or c.name in ("decode-batch", "rows7", "top2-9tok"))]
_KERNELS: dict = {}  # one driver module per compiled variant for the whole file


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case_id", CASES)
def test_aot_kernels_launched_as_tensorrt_would_match_the_reference(case_id, dtype):
    from m3export.plugins.tensorrt.steps import run_plugin_steps

    case = cf.CASES[case_id]
    inputs, attrs = case.inputs(dtype, "cuda")
    got = run_plugin_steps(case.op, inputs, attrs, compiled=True, cache=_KERNELS)
    torch.cuda.synchronize()
    verdict = cf.compare(case, dtype, got, inputs, attrs)  # the float64 oracle runs on the GPU too
    assert verdict.ok, verdict


@pytest.mark.parametrize("tactic", [1, 2])
def test_every_tactic_launches(tactic):
    """The other tactics TensorRT may pick (indexer context splits, linear tiles) on a release-shaped case."""
    from m3export.plugins.tensorrt.steps import run_plugin_steps

    for case_id in ("LightningIndexer/page16", "MXFP8Linear/release-k"):
        case = cf.CASES[case_id]
        inputs, attrs = case.inputs(torch.bfloat16, "cuda")
        got = run_plugin_steps(case.op, inputs, dict(attrs, _tactic=tactic), compiled=True, cache=_KERNELS)
        torch.cuda.synchronize()
        verdict = cf.compare(case, torch.bfloat16, got, inputs, attrs)
        assert verdict.ok, (case_id, tactic, verdict)


def test_cubin_and_ptx_give_the_same_bits():
    """The cubin Triton assembled and the PTX the driver JIT-compiles (what TensorRT loads) agree bit for bit."""
    from m3export.plugins.tensorrt import aot
    from m3export.plugins.tensorrt.launch import DriverKernel, tensor_infos
    from m3export.plugins.tensorrt.shapes import PLUGINS

    case = cf.CASES["PagedAttention/page16"]
    inputs, attrs = case.inputs(torch.bfloat16, "cuda")
    infos = tensor_infos(inputs)
    plan = aot.plan("PagedAttention", infos, attrs)
    cc = torch.cuda.get_device_capability()
    kernel = aot.compile_plan(plan, cc[0] * 10 + cc[1])
    (o,) = PLUGINS["PagedAttention"].infer(infos, attrs)
    outs = []
    for cubin in (False, True):
        out = torch.full(o.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        DriverKernel(kernel, use_cubin=cubin).launch(inputs, [out])
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()
