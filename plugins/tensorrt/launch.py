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
"""

from __future__ import annotations

import ctypes
from typing import Sequence

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

    def launch(self, inputs: Sequence, outputs: Sequence, stream: int = 0) -> None:
        """inputs / outputs: CUDA torch tensors (contiguous). Extras from the plan, then hidden null pointers."""
        plan = self.kernel.plan
        grid = concrete(plan.grid)
        if 0 in grid:
            return
        values = []
        for t in inputs:
            values.append(ctypes.c_void_p(t.data_ptr()))
        values += [ctypes.c_int32(v) for v in concrete(plan.extra_args)]
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
