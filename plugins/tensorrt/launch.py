"""Launch a plugin kernel the way TensorRT would, without TensorRT: for the CPU tests and the H200 check.

* :func:`tensor_infos` turns tensors into the ``TensorInfo`` a plugin sees, and :func:`trt_arguments` lists the
  kernel arguments TensorRT passes for a plan: input pointers, the extra int32 scalars evaluated on these shapes,
  output pointers (nothing else).
* :func:`run_wrapper` launches the plan's ``@triton.jit`` wrapper with exactly those arguments through Triton's
  own launcher: under ``TRITON_INTERPRET=1`` on CPU tensors (CI), or compiled on a GPU.
* :class:`DriverKernel` loads the AOT artifact itself (the PTX string TensorRT receives, JIT-compiled by the CUDA
  driver as TensorRT does) with ``ctypes`` on ``libcuda`` and launches it with ``cuLaunchKernel``, passing the
  TensorRT arguments followed by null pointers for Triton's hidden scratch parameters (what TensorRT pads them
  with; ``aot.launch_convention`` proves the kernel never reads them). No Triton launcher and no torch op touches
  the launch, so a wrong argument order or a missing parameter shows up as wrong numbers or a launch error.
  :meth:`DriverKernel.from_artifact` loads it from the files ``compile.py`` writes (``kernels.json`` + PTX).
* :func:`bind_dims` and :func:`evaluate`: the values of the symbolic dimensions a kernel was compiled for (``T``,
  ``B``, ``pages`` ...) read off a step's inputs, and the grid / extra-argument formulas of ``kernels.json``
  evaluated on them: what TensorRT computes from the ShapeExprs ``aot_impl`` returned.
"""

from __future__ import annotations

import ast
import ctypes
import operator
from pathlib import Path
from typing import Mapping, Sequence

from .aot import AotKernel, KernelPlan
from .shapes import TensorInfo


def tensor_infos(tensors) -> list[TensorInfo]:
    from m3export.dtypes import of_torch

    return [TensorInfo(tuple(int(d) for d in t.shape), of_torch(t.dtype).name) for t in tensors]


def concrete(values) -> tuple[int, ...]:
    """Extras / grid of a plan built from int shapes (already ints; checked, since TensorRT wants int32)."""
    out = tuple(int(v) for v in values)
    for v in out:
        if not -(2**31) <= v < 2**31:
            raise ValueError(f"launch value {v} does not fit int32")
    return out


def trt_arguments(plan: KernelPlan, inputs: Sequence, outputs: Sequence) -> list:
    if len(inputs) != plan.num_inputs or len(outputs) != plan.num_outputs:
        raise ValueError(f"{plan.plugin}: {len(inputs)} inputs / {len(outputs)} outputs, expected "
                         f"{plan.num_inputs} / {plan.num_outputs}")
    return [*inputs, *concrete(plan.extra_args), *outputs]


def run_wrapper(plan: KernelPlan, inputs: Sequence, outputs: Sequence) -> None:
    """The wrapper kernel through Triton's launcher, with the TensorRT argument list (interpreter or GPU)."""
    grid = concrete(plan.grid)
    if 0 in grid:
        return  # an empty batch: nothing to launch (TensorRT's profiles start at one token)
    plan.kernel[grid](*trt_arguments(plan, inputs, outputs), **plan.constexprs, num_warps=plan.num_warps,
                      num_stages=plan.num_stages)


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def evaluate(expr, values: Mapping[str, int]) -> int:
    """An int, or a formula as ``shapes.describe`` writes it (names, ints, ``+ - * //``), on dimension values."""
    if isinstance(expr, int) and not isinstance(expr, bool):
        return expr
    if not isinstance(expr, str):
        raise ValueError(f"formula {expr!r}: not an int or a string")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in values:
                raise ValueError(f"formula {expr!r}: dimension {node.id} has no value (known: {sorted(values)})")
            return int(values[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"formula {expr!r}: only names, ints and + - * // are allowed")

    return ev(ast.parse(expr, mode="eval"))


def bind_dims(compiled_for: Sequence[dict], infos: Sequence[TensorInfo], where: str) -> dict[str, int]:
    """The value of each named dimension of a kernel's inputs (``kernels.json``'s ``inputs``: shapes of ints,
    names and formulas) in a step with inputs ``infos``; ValueError naming the input whose dtype, rank or fixed
    dimensions are not what the kernel was compiled for."""
    if len(compiled_for) != len(infos):
        raise ValueError(f"{where}: {len(infos)} inputs, the kernel was compiled for {len(compiled_for)}")
    values: dict[str, int] = {}
    for i, (c, t) in enumerate(zip(compiled_for, infos)):
        if c["dtype"] != t.dtype or len(c["shape"]) != len(t.shape):
            raise ValueError(f"{where}: input {i} is {t.dtype} {list(t.shape)}, the kernel was compiled for "
                             f"{c['dtype']} {c['shape']}")
        for d, n in zip(c["shape"], t.shape):
            if isinstance(d, str) and d.isidentifier() and values.setdefault(d, int(n)) != n:
                raise ValueError(f"{where}: input {i} has {d} = {n}, an earlier input {values[d]}")
    for i, (c, t) in enumerate(zip(compiled_for, infos)):
        for j, (d, n) in enumerate(zip(c["shape"], t.shape)):
            if evaluate(d, values) != n:
                raise ValueError(f"{where}: input {i} dimension {j} is {n}, the kernel was compiled for {d} = "
                                 f"{evaluate(d, values)}")
    return values


class CudaError(RuntimeError):
    pass


class DriverKernel:
    """An AOT kernel loaded from its PTX through the CUDA driver API and launched with raw arguments (GPU only)."""

    def __init__(self, kernel: AotKernel, use_cubin: bool = False):
        self.kernel = kernel
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self._check(self.cuda.cuInit(0), "cuInit")
        self.module = ctypes.c_void_p()
        image = kernel.cubin if use_cubin else kernel.ptx.encode() + b"\0"
        self._check(self.cuda.cuModuleLoadData(ctypes.byref(self.module), ctypes.c_char_p(image)),
                    "cuModuleLoadData")
        self.function = ctypes.c_void_p()
        self._check(self.cuda.cuModuleGetFunction(ctypes.byref(self.function), self.module,
                                                  kernel.name.encode()), "cuModuleGetFunction")
        if kernel.shared_mem > 48 * 1024:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
            self._check(self.cuda.cuFuncSetAttribute(self.function, 8, kernel.shared_mem), "cuFuncSetAttribute")

    def _check(self, code: int, what: str) -> None:
        if code:
            name = ctypes.c_char_p()
            self.cuda.cuGetErrorName(code, ctypes.byref(name))
            raise CudaError(f"{self.kernel.name}: {what} failed with {name.value.decode() if name.value else code}")

    @classmethod
    def from_artifact(cls, entry: dict, directory: str | Path, plan: KernelPlan | None = None,
                      use_cubin: bool = False) -> "DriverKernel":
        """The kernel of one ``kernels.json`` entry, loaded from its PTX (or cubin) file in ``directory``;
        ``plan`` (a ``KernelPlan``) supplies the argument counts and, unless overridden at launch, grid and extras."""
        directory = Path(directory)
        kernel = AotKernel(plan=plan, name=entry["name"], ptx=(directory / entry["ptx"]).read_text(),
                           cubin=(directory / entry["cubin"]).read_bytes(), shared_mem=int(entry["shared_mem"]),
                           block=tuple(entry["block"]), params=tuple(entry["params"]),
                           hidden_params=int(entry["hidden_params"]), metadata=dict(entry))
        return cls(kernel, use_cubin)

    def launch(self, inputs: Sequence, outputs: Sequence, stream: int = 0, grid: Sequence[int] | None = None,
               extras: Sequence[int] | None = None) -> None:
        """inputs / outputs: CUDA torch tensors (contiguous). Extras (default: the plan's), then hidden null
        pointers. ``grid`` / ``extras``: as TensorRT computes them (``evaluate`` on ``kernels.json``)."""
        plan = self.kernel.plan
        grid = concrete(plan.grid if grid is None else grid)
        if 0 in grid:
            return
        values = []
        for t in inputs:
            values.append(ctypes.c_void_p(t.data_ptr()))
        values += [ctypes.c_int32(v) for v in concrete(plan.extra_args if extras is None else extras)]
        for t in outputs:
            values.append(ctypes.c_void_p(t.data_ptr()))
        values += [ctypes.c_void_p(0) for _ in range(self.kernel.hidden_params)]
        if len(values) != len(self.kernel.params):
            raise CudaError(f"{self.kernel.name}: {len(values)} arguments for {len(self.kernel.params)} parameters")
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        bx, by, bz = self.kernel.block
        dims = [ctypes.c_uint(v) for v in (*grid, bx, by, bz, self.kernel.shared_mem)]
        self._check(self.cuda.cuLaunchKernel(self.function, *dims, ctypes.c_void_p(stream), params, None),
                    "cuLaunchKernel")
