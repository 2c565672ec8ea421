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

**Every plugin node is AOT** (engines need no Python): the indexer runs as two kernels (scan, top-k) and the MoE
as an fp32 router ``Gemm`` plus six kernels on the permutation-free GEMV path of ``plugins/kernels/moe_gemv.py``
(``steps.py``). What the AOT path gives up against the torch launchers, to be measured on the H200: attention runs
one context split per (token, KV head) (a split-K merge would be a second launch), decode-shaped tiling for every
batch (one token per program), and the MoE on CUDA cores (the grouped tensor-core GEMMs of ``moe.py`` need a
device-side permutation with torch glue between launches). Each ``plugins.py`` plugin also has a Python ``impl``
on the torch launchers, which TensorRT uses when a node's ``aot`` attribute is 0.

**Why not TensorRT's own layers** (``docs/tensorrt.md`` has the detail). TensorRT's attention (``IAttention``,
``TRT_Attention``) takes K/V contiguous per sequence (no block tables), its ``IKVCacheUpdateLayer``
(``TRT_KVCacheUpdate``) writes a ``[batch, heads, S_max, d]`` cache per sequence (not a page pool addressed by slot
mappings), and ``IMoELayer`` runs on SM100+ only, with none / SiLU GLU experts and no MXFP8 weight form. M3 on
Hopper needs paged KV with block tables, the lightning indexer's per-KV-head block selection feeding block-sparse
attention, and MXFP8 experts dequantised on chip: the plugins here.
"""
