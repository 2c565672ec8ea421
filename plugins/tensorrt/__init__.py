"""TensorRT plugins for the ``m3`` ops (namespace ``m3``, version "1"), ready for a machine with TensorRT.

TensorRT cannot be installed where this project is developed (its PyPI wheels download from NVIDIA's index), so
everything before ``builder.build_serialized_network`` is plain Python checked on the CPU, and only the thin
registration in ``plugins.py`` imports TensorRT:

* ``shapes.py``: the plugin list (``PLUGINS``: one per op of ``docs/ops.md`` plus kernel steps), output shapes and
  types on ints or TensorRT ShapeExprs, input checks naming the input. Checked against the reference and fake ops'
  outputs (conformance cases, 200 random shapes per op).
* ``wrappers.py``, ``aot.py``: each plugin kernel in TensorRT's argument order, its launch plan (grid and extra int32
  arguments as formulas of the input dims, compile-time constants), the AOT compile and the launch-convention proof
  (Triton's hidden scratch parameters). The wrappers run under the Triton interpreter with TensorRT's argument
  list against the references; every kernel and tactic is compiled for sm_90 in CI.
* ``steps.py``: which plugin nodes each op becomes (the indexer is two kernels: scan, then top-k).
* ``compile.py``: ``python -m m3export.plugins.tensorrt.compile --out DIR``, every AOT kernel for one GPU (PTX,
  cubin, ``kernels.json``).
* ``launch.py``: an AOT kernel launched as TensorRT would, without TensorRT: through Triton's launcher, or raw
  ``cuLaunchKernel`` on the PTX (``tests/test_tensorrt_plugins_gpu.py`` on the H200).
* ``plugins.py``: ``tensorrt.plugin`` ``register`` / ``aot_impl`` / ``impl`` / ``autotune`` (skipped without
  TensorRT).

**What is not AOT yet.** ``MoE`` / ``MoEMXFP8`` run five launches with torch glue (routing, permutation, two
grouped GEMMs, combine); their plugins have a Python ``impl`` only, so an engine holding them needs Python (and
``plugins.register()``) at run time. An AOT chain would use the permutation-free GEMV kernels of
``plugins/kernels/moe_gemv.py`` (route -> gate-up -> down -> combine, four plugin steps). Attention plugins run one
context split (a split-K merge is a second launch): decode at small batch fills fewer SMs than the torch path.

**Why not TensorRT's own layers.** TensorRT 11 adds ``TRT_Attention`` (attention over contiguous K/V: no paged
KV, no block tables), ``TRT_KVCacheUpdate`` (a contiguous per-sequence cache, not a shared page pool addressed by
slot mappings) and ``IMoELayer`` (SM100+ only, softmax routing, no sigmoid + correction-bias selection, no
MXFP8 E4M3 + UE8M0 weights on Hopper). M3 on Hopper needs paged KV with block tables, the lightning indexer's
per-KV-head block selection feeding block-sparse attention, and MXFP8 experts dequantised on chip: the plugins
here.
"""
