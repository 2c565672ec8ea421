"""The AOT artifacts the TensorRT plugins hand TensorRT, loaded and launched outside TensorRT on the GPU (H200).

1. ``python -m m3export.plugins.tensorrt.compile`` writes the artifacts at ``mini`` dims (the release's widths:
   64 / 4 heads of 128, index blocks of 128, top-16, hidden 6144, 16 experts of 3072, top-4) for this GPU, as
   ``aot_impl`` compiles them under TensorRT: from symbolic inputs (``T``, ``B``, ``pages`` ... are symbols, the
   engine's constants are ints). Three sets, compiled in parallel processes: bf16 and fp32 with pages of 16 (every
   kernel and tactic), bf16 with pages of 64 (the paged kernels).
2. Every step of every op runs from those files: the PTX ``aot_impl`` returns is JIT-compiled by the driver
   (``cuModuleLoadData``, as TensorRT does) and launched with ``cuLaunchKernel`` with exactly TensorRT's
   arguments: input pointers, the extra int32 scalars and the grid evaluated from the artifact's formulas on the
   step's shapes (what TensorRT computes from the returned ShapeExprs; they must equal the plan's own numbers),
   output pointers, then null for each of Triton's hidden scratch parameters (``global_scratch`` and, since 3.5,
   ``profile_scratch``; ``aot.launch_convention`` proved from the PTX that the kernel never reads them). Block and
   shared memory come from ``kernels.json``. No Triton launcher is involved: a wrong order, a missing parameter, a
   wrong formula gives wrong numbers or a launch error.
3. Results are judged by the conformance suite's rules against the float64 references, on release-shaped batches
   (contexts past 2048 tokens, 16k contexts with a 256-token prefill chunk, a ragged batch with sequences of 0 new
   tokens, pages shared between sequences and NaN in the unused tail of last pages), the MoE and MoEMXFP8 as their
   six-kernel chains. Each launch must finish within ``LAUNCH_LIMIT_S``.

  PYTHONPATH=. timeout 290 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs tests/test_tensorrt_plugins_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from m3export.ops import conformance as cf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 tier)")]

MAX_MODEL_LEN = 131072  # the compile command's default: LightningIndexerTopK is compiled for 1024 blocks of 128
LAUNCH_LIMIT_S = 30.0  # per launch; the slowest (fp32 attention over 16k contexts, one split) takes milliseconds
COMPILE_LIMIT_S = 240  # per artifact set (up to 21 kernels, the three sets in parallel: ~80 s on 2 CPU cores)
PAGED = ("PagedAttention", "SparsePagedAttention", "LightningIndexerScan", "LightningIndexerTopK")
SETS = {("bfloat16", 16): None, ("float32", 16): None, ("bfloat16", 64): PAGED}  # (dtype, page) -> plugins
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

_HUNG: list[str] = []  # a kernel that never finished: the GPU is busy for good, later launches would wait forever
LAUNCHED: dict[tuple[str, int], set] = {}  # artifact set -> (plugin, tactic) launched from it


def _mini_cases() -> dict[str, cf.Case]:
    """Cases at mini dims the conformance suite lacks: a ragged adversarial batch at M3's heads and index blocks
    (pages of 16, two shared; NaN tails; sequences with 0 new tokens), the linear at hidden x hidden, the MoE with
    the mini preset's 16 experts."""
    m3, adv = dict(cf.M3_HEADS), dict(share_pages=2, nan_tails=True)
    ctx, new = [2100, 300, 1500, 40, 640, 17], [3, 0, 21, 1, 0, 1]
    moe = dict(h=6144, e=16, i=3072, shared=3072)
    tags = frozenset({"m3-shape", "adversarial"})
    out = [cf.Case("mini-ragged", "PagedAttention", tags, cf._attention_case(ctx, new, 16, **m3, **adv), cpu=False),
           cf.Case("mini-ragged-indexer", "SparsePagedAttention", tags,
                   cf._sparse_case(ctx, new, 16, cf.M3_INDEX, "indexer", **m3, **adv), cpu=False),
           cf.Case("mini-ragged", "LightningIndexer", tags,
                   cf._indexer_case(ctx, new, 16, cf.M3_INDEX, h=4, d=128, **adv), cpu=False),
           cf.Case("mini-hidden", "MXFP8Linear", tags, cf._mxfp8_linear_case((4,), 6144, 6144), cpu=False),
           cf.Case("mini-hidden-edge-codes", "MXFP8Linear", tags, cf._mxfp8_linear_case((5,), 6144, 6144, edge=True),
                   cpu=False),
           cf.Case("mini-widths", "MoE", tags, cf._moe_case(4, 5, **moe), cpu=False),
           cf.Case("mini-widths", "MoEMXFP8", tags, cf._moe_mxfp8_case(4, 5, **moe), cpu=False)]
    return {c.id: c for c in out}


MINI = _mini_cases()


def _case(case_id: str) -> cf.Case:
    return MINI[case_id] if case_id in MINI else cf.CASES[case_id]


# (case, dtype, page size of the artifact set, tactic): case-major, so each case's inputs are built once
RUNS = [(c, d, 16, 0) for c in ("PagedAttention/page16", "PagedAttention/mini-ragged",
                                "SparsePagedAttention/page16-indexer", "SparsePagedAttention/mini-ragged-indexer",
                                "LightningIndexer/mini-ragged") for d in ("bfloat16", "float32")]
RUNS += [("LightningIndexer/page16", d, 16, t) for d in ("bfloat16", "float32") for t in (0, 1, 2)]
RUNS += [(c, "bfloat16", 64, 0) for c in ("PagedAttention/page64", "PagedAttention/16k",
                                          "SparsePagedAttention/page64-indexer", "SparsePagedAttention/16k-indexer",
                                          "LightningIndexer/16k")]
RUNS += [("LightningIndexer/page64", "bfloat16", 64, t) for t in (0, 1, 2)]
RUNS += [("MXFP8Linear/mini-hidden", d, 16, t) for d in ("bfloat16", "float32") for t in (0, 1, 2)]
RUNS += [("MXFP8Linear/mini-hidden-edge-codes", "bfloat16", 16, 0)]
RUNS += [(c, d, 16, 0) for c in ("MoE/mini-widths", "MoEMXFP8/mini-widths") for d in ("bfloat16", "float32")]


class ArtifactSet:
    """One directory the compile command wrote: ``kernels.json`` and a PTX / cubin per kernel."""

    def __init__(self, key, directory: Path):
        self.key, self.dir = key, directory
        self.report = json.loads((directory / "kernels.json").read_text())
        self.entries = self.report["kernels"]
        self._loaded: dict[int, object] = {}

    def entry_for(self, plan) -> tuple[int, dict]:
        """The artifact compiled for this plan: same kernel constants, signature, warps and stages."""
        consts = json.loads(json.dumps(plan.constexprs))
        for i, e in enumerate(self.entries):
            if (e["plugin"] == plan.plugin and e["constexprs"] == consts and e["signature"] == plan.signature
                    and e["num_warps"] == plan.num_warps and e["num_stages"] == plan.num_stages):
                return i, e
        raise AssertionError(f"{self.key}: no artifact for {plan.plugin} with constants {consts} (the case's "
                             "static dimensions are not the mini preset's)")

    def launcher(self, plan, inputs, outputs) -> None:
        """``run_plugin_steps``' launch: the artifact's PTX through the driver, grid and extras from its formulas."""
        from m3export.plugins.tensorrt.launch import DriverKernel, bind_dims, concrete, evaluate, tensor_infos

        if _HUNG:
            pytest.fail(f"not launched: kernel {_HUNG[0]} never finished, the GPU is still busy with it")
        i, e = self.entry_for(plan)
        where = f"{self.key} {e['plugin']} t{e['tactic']}"
        dims = bind_dims(e["inputs"], tensor_infos(inputs), where)
        grid = [evaluate(g, dims) for g in e["grid"]]
        extras = [evaluate(x, dims) for x in e["extra_args"]]
        # the numbers TensorRT computes from the symbolic extents are the plan's own for these shapes
        assert tuple(grid) == concrete(plan.grid) and tuple(extras) == concrete(plan.extra_args), (where, dims)
        if i not in self._loaded:
            self._loaded[i] = DriverKernel.from_artifact(e, self.dir, plan)
        self._loaded[i].launch(inputs, outputs, grid=grid, extras=extras)
        _finish(where)
        LAUNCHED.setdefault(self.key, set()).add((e["plugin"], e["tactic"]))


def _finish(where: str) -> None:
    """Wait for the launch (the legacy default stream, which torch's current stream is here) at most
    LAUNCH_LIMIT_S; a launch error surfaces here, named."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    deadline = time.monotonic() + LAUNCH_LIMIT_S
    try:
        while not event.query():
            if time.monotonic() > deadline:
                _HUNG.append(where)
                pytest.fail(f"{where}: the kernel did not finish within {LAUNCH_LIMIT_S} s")
            time.sleep(0.0002)
    except RuntimeError as err:  # e.g. an illegal address: the CUDA context is lost from here on
        _HUNG.append(where)
        raise AssertionError(f"{where}: the launch failed: {err}") from err


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict:
    """Every artifact set, written by the compile command in parallel processes (no TRITON_INTERPRET)."""
    torch.empty(1, device="cuda")  # the primary context, current on this thread, is the one the driver calls use
    major, minor = torch.cuda.get_device_capability()
    root = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {}
    for (dtype, page), only in SETS.items():
        out = root / f"{dtype}-p{page}"
        cmd = [sys.executable, "-m", "m3export.plugins.tensorrt.compile", "--out", str(out), "--preset", "mini",
               "--dtype", dtype, "--page-size", str(page), "--max-model-len", str(MAX_MODEL_LEN),
               "--arch", str(major * 10 + minor)] + (["--plugins", ",".join(only)] if only else [])
        procs[(dtype, page)] = (out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                       text=True, env=env))
    sets = {}
    for key, (out, proc) in procs.items():
        try:
            text, _ = proc.communicate(timeout=COMPILE_LIMIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"compiling the {key} artifacts took over {COMPILE_LIMIT_S} s")
        assert proc.returncode == 0, f"{key}: " + text[-3000:]
        sets[key] = ArtifactSet(key, out)
    return sets


def test_artifacts_follow_the_launch_convention_for_this_triton(artifacts):
    """Every kernel of every set: TensorRT's parameters in TensorRT's order, then exactly the hidden pointers this
    Triton adds (3.3: global_scratch; 3.5: profile_scratch), no scratch memory asked for, the PTX names the entry."""
    import triton

    from m3export.plugins.tensorrt import aot

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    hidden = 0 if (major, minor) < (3, 3) else 1 if (major, minor) < (3, 5) else 2
    for (dtype, page), only in SETS.items():
        s = artifacts[(dtype, page)]
        want = {(p, t) for p, (_, tactics) in aot.PLANNERS.items() if only is None or p in only for t in tactics}
        assert {(e["plugin"], e["tactic"]) for e in s.entries} == want
        for e in s.entries:
            n_in, n_x, n_out = e["num_inputs"], e["num_extras"], e["num_outputs"]
            assert e["params"] == ["u64 ptr"] * n_in + ["u32"] * n_x + ["u64 ptr"] * (n_out + hidden), e["name"]
            assert e["hidden_params"] == hidden and e["global_scratch_size"] == e["profile_scratch_size"] == 0
            assert f".entry {e['name']}(" in (s.dir / e["ptx"]).read_text()


@pytest.mark.parametrize("case_id, dtype, page, tactic", RUNS, ids=[f"{c}-{d}-p{p}-t{t}" for c, d, p, t in RUNS])
def test_aot_artifacts_launched_as_tensorrt_would_match_the_reference(artifacts, case_id, dtype, page, tactic):
    from m3export.plugins.tensorrt.steps import max_blocks, run_plugin_steps

    case, tdtype = _case(case_id), DTYPES[dtype]
    inputs, attrs = case.inputs(tdtype, "cuda")
    run_attrs = dict(attrs, _tactic=tactic, _max_blocks=max_blocks(MAX_MODEL_LEN, cf.M3_INDEX["block_size"]))
    got = run_plugin_steps(case.op, inputs, run_attrs, launcher=artifacts[(dtype, page)].launcher)
    torch.cuda.synchronize()
    verdict = cf.compare(case, tdtype, got, inputs, attrs)  # the float64 oracle, on the GPU too
    assert verdict.ok, verdict


def test_every_artifact_was_launched(artifacts):
    """The cases above reach every kernel and tactic of every set (run after them, in file order)."""
    if not LAUNCHED:
        pytest.skip("run the whole file: the launches are recorded by the test above")
    for key, s in artifacts.items():
        assert LAUNCHED.get(key, set()) == {(e["plugin"], e["tactic"]) for e in s.entries}, key


def test_cubin_and_ptx_give_the_same_bits(artifacts):
    """The cubin Triton assembled and the PTX the driver JIT-compiles (what TensorRT loads) agree bit for bit."""
    from m3export.plugins.tensorrt import aot
    from m3export.plugins.tensorrt.launch import DriverKernel, tensor_infos
    from m3export.plugins.tensorrt.shapes import PLUGINS

    s = artifacts[("bfloat16", 16)]
    inputs, attrs = cf.CASES["PagedAttention/page16"].inputs(torch.bfloat16, "cuda")
    infos = tensor_infos(inputs)
    plan = aot.plan("PagedAttention", infos, attrs)
    _, entry = s.entry_for(plan)
    (o,) = PLUGINS["PagedAttention"].infer(infos, attrs)
    outs = []
    for cubin in (False, True):
        out = torch.full(o.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        DriverKernel.from_artifact(entry, s.dir, plan, use_cubin=cubin).launch(inputs, [out])
        _finish(f"PagedAttention ({'cubin' if cubin else 'PTX'})")
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()
