"""Every element type the project stores, feeds or names: one row per dtype, the only such table.

A row ties together what each side calls the same bytes: the name written in manifests, graph signatures and on
the command line (torch's name without ``torch.``), the torch dtype, the safetensors header code, the
``onnx.TensorProto`` element type, and the numpy type that holds the bytes. numpy has no bfloat16 or float8, so
those are stored (and fed to ONNX Runtime) as same-sized unsigned integers and viewed back as the real type;
``to_numpy`` / ``to_torch`` are the one place that view is taken.

Adding a dtype is one row here. The ONNX codes are written as numbers so that naming a dtype never imports onnx
(``tests/test_dtypes.py`` checks each against ``onnx.TensorProto``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and numpy load on first use: naming a dtype (a CLI choice) must stay cheap
    import numpy as np
    import torch


@dataclass(frozen=True)
class DType:
    name: str  # manifest / CLI / graph-signature name, and torch's attribute name
    safetensors: str  # safetensors header code
    onnx: int  # onnx.TensorProto element type
    storage_name: str  # numpy type holding the bytes (a same-sized uint where numpy lacks the type)

    @property
    def torch(self) -> torch.dtype:
        import torch

        return getattr(torch, self.name)

    @property
    def storage(self) -> np.dtype:
        import numpy as np

        return np.dtype(self.storage_name)

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def is_view(self) -> bool:
        """True when numpy holds the bits under another type (bfloat16 as uint16, float8 as uint8)."""
        return self.storage_name != self.name

    def to_numpy(self, t: torch.Tensor) -> np.ndarray:
        """``t`` converted to this dtype, on the host, as a numpy array of ``storage`` (bit pattern for views)."""
        import torch

        t = t.detach().to("cpu", self.torch).contiguous()
        return (t.view(getattr(torch, self.storage_name)) if self.is_view else t).numpy()

    def to_torch(self, a: np.ndarray) -> torch.Tensor:
        """A numpy array of ``storage`` (as ``to_numpy`` or ONNX Runtime wrote it) as a tensor of this dtype,
        sharing its memory."""
        import numpy as np
        import torch

        t = torch.from_numpy(np.ascontiguousarray(a))
        return t.view(self.torch) if self.is_view and a.dtype == self.storage else t


DTYPES: tuple[DType, ...] = (
    DType("float64", "F64", 11, "float64"),
    DType("float32", "F32", 1, "float32"),
    DType("float16", "F16", 10, "float16"),
    DType("bfloat16", "BF16", 16, "uint16"),
    DType("float8_e4m3fn", "F8_E4M3", 17, "uint8"),  # MXFP8 values
    DType("float8_e5m2", "F8_E5M2", 19, "uint8"),
    DType("uint8", "U8", 2, "uint8"),  # MXFP8 UE8M0 scales
    DType("int8", "I8", 3, "int8"),
    DType("int16", "I16", 5, "int16"),
    DType("int32", "I32", 6, "int32"),
    DType("int64", "I64", 7, "int64"),
    DType("bool", "BOOL", 9, "bool"),
)
BY_NAME = {d.name: d for d in DTYPES}
BY_SAFETENSORS = {d.safetensors: d for d in DTYPES}
BY_ONNX = {d.onnx: d for d in DTYPES}

#: The dtypes a model runs in (activations, caches and unquantised weights): ``--dtype`` choices everywhere.
MODEL_DTYPES = ("float32", "bfloat16", "float16")
# ``--kv-cache-dtype`` choices (vLLM's name): ``auto`` = the model dtype; ``fp8`` = E4M3 pools with per-row fp32
# scales (``m3export.ops.kv_fp8``, which maps these names to torch dtypes).
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")


def by_name(name: str) -> DType:
    """The row called ``name``; ValueError listing the known names otherwise."""
    if not isinstance(name, str) or name not in BY_NAME:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(BY_NAME)}")
    return BY_NAME[name]


@functools.cache
def _by_torch() -> dict:
    return {d.torch: d for d in DTYPES}


def of_torch(dtype: torch.dtype) -> DType:
    """The row of a torch dtype; ValueError for one the project does not store."""
    if not known_torch(dtype):
        raise ValueError(f"dtype {dtype} has no row in m3export.dtypes")
    return _by_torch()[dtype]


def known_torch(dtype: torch.dtype) -> bool:
    return dtype in _by_torch()
