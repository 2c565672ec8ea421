"""ONNX Runtime execution providers by name: what ``--provider`` accepts, and where an EP keeps its tensors.

``--provider`` takes ``cpu``, ``cuda``, ``tensorrt``, ``migraphx``, ... (a short name below) or any name ONNX
Runtime lists (``onnxruntime.get_all_providers()``), optionally followed by ``:key=value,key=value`` provider
options, e.g. ``cuda:device_id=1`` or ``TensorrtExecutionProvider:trt_fp16_enable=1``. An EP that this
onnxruntime build lacks is one clear error naming the package that has it.

Only the CPU EP runs in this project's CI; the device paths (CUDA and the others) are written to ONNX Runtime's
documented API and are unverified until run on such a machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from m3export.errors import BackendUnavailable

SHORT_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "nv-tensorrt-rtx": "NvTensorRTRTXExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
    "directml": "DmlExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "dnnl": "DnnlExecutionProvider",
    "xnnpack": "XnnpackExecutionProvider",
    "cann": "CANNExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
}

# The PyPI package whose onnxruntime build has the EP (the plain `onnxruntime` wheel has CPU only, plus CoreML on
# macOS). ROCm was removed from ONNX Runtime; MIGraphX is its successor on AMD GPUs.
PACKAGES = {
    "CUDAExecutionProvider": "onnxruntime-gpu",
    "TensorrtExecutionProvider": "onnxruntime-gpu (with TensorRT's libraries on the library path)",
    "NvTensorRTRTXExecutionProvider": "onnxruntime-ep-nv-tensorrt-rtx",
    "MIGraphXExecutionProvider": "onnxruntime-migraphx",
    "ROCMExecutionProvider": "onnxruntime-migraphx (ONNX Runtime removed the ROCm EP; use --provider migraphx)",
    "OpenVINOExecutionProvider": "onnxruntime-openvino",
    "DmlExecutionProvider": "onnxruntime-directml",
    "QNNExecutionProvider": "onnxruntime-qnn",
    "CANNExecutionProvider": "onnxruntime-cann",
    "WebGpuExecutionProvider": "onnxruntime-webgpu",
    "CoreMLExecutionProvider": "onnxruntime (its macOS wheel)",
}

# EPs whose tensors live in device memory that torch can own (CUDA, or HIP through torch's "cuda" device):
# the cache pools, inputs and outputs are bound there; every other EP takes host memory.
DEVICE_MEMORY = {
    "CUDAExecutionProvider": "cuda",
    "TensorrtExecutionProvider": "cuda",
    "NvTensorRTRTXExecutionProvider": "cuda",
    "MIGraphXExecutionProvider": "cuda",
}


# Options set unless the user gives them (``cuda:use_tf32=1`` overrides). ONNX Runtime's CUDA EP defaults
# ``use_tf32`` to 1, so fp32 MatMul / Gemm round their operands to TF32 (10-bit mantissa, ~1e-3 relative error):
# the first H200 run (2026-11-30) saw exactly that, verify at ~1e-3 on an fp32 artifact and 85 % block selections.
# Every M3 graph computes in fp32 where the reference does (a whole fp32 artifact; the router, indexer and attention
# scores of a bf16 / fp16 one, whose block and expert selections depend on them), so fp32 stays exact fp32 by
# default. The option only concerns fp32 GEMMs (16-bit ones are unaffected).
EXACT_FP32 = {"CUDAExecutionProvider": {"use_tf32": "0"}}


def _ort():
    import onnxruntime

    return onnxruntime


@dataclass(frozen=True)
class Provider:
    """One execution provider with its options, as ONNX Runtime names them."""

    name: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def device(self) -> str:
        """Where this EP's tensors live, as a torch device string: ``cpu`` or ``cuda:<device_id>``."""
        kind = DEVICE_MEMORY.get(self.name)
        return "cpu" if kind is None else f"{kind}:{int(self.options.get('device_id', 0))}"

    def session_options(self) -> dict[str, str]:
        """The provider options a session gets: ``EXACT_FP32``'s defaults for this EP, then the user's own."""
        return {**EXACT_FP32.get(self.name, {}), **self.options}

    def session_providers(self) -> list:
        """The ``providers`` argument of ``onnxruntime.InferenceSession``: this EP first, the CPU EP after it for
        any node the EP has no kernel for."""
        options = self.session_options()
        first = (self.name, options) if options else self.name
        return [first] if self.name == "CPUExecutionProvider" else [first, "CPUExecutionProvider"]

    def __str__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}:{opts}" if opts else self.name


def parse_provider(spec: str | Provider | Sequence | None) -> Provider:
    """``cuda``, ``cuda:device_id=1``, ``CUDAExecutionProvider``, a ``Provider``, or ONNX Runtime's own list form
    (``["CUDAExecutionProvider", ...]`` / ``[("CUDAExecutionProvider", {...}), ...]``: its first entry) -> a
    ``Provider``; None is the CPU EP. Unknown names and malformed options raise BackendUnavailable (one line,
    listing the accepted names)."""
    if spec is None:
        return Provider("CPUExecutionProvider")
    if isinstance(spec, Provider):
        return spec
    if not isinstance(spec, str):
        if not spec:
            raise BackendUnavailable("no execution provider given")
        first = spec[0]
        if isinstance(first, str):
            return parse_provider(first)
        name, options = first
        return Provider(parse_provider(name).name, {str(k): str(v) for k, v in dict(options).items()})
    name, _, text = spec.strip().partition(":")
    full = SHORT_NAMES.get(name.lower(), name)
    known = _ort().get_all_providers()
    if full not in known and full not in PACKAGES:
        raise BackendUnavailable(f"unknown execution provider {name!r}: use one of "
                                 f"{', '.join(sorted(SHORT_NAMES))} or a name ONNX Runtime lists "
                                 f"({', '.join(known)}), optionally with :key=value,...")
    options = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BackendUnavailable(f"execution provider option {item!r} in {spec!r}: expected key=value")
        options[key.strip()] = value.strip()
    return Provider(full, options)


def require(provider: Provider) -> Provider:
    """``provider`` if this onnxruntime build has it, else BackendUnavailable: one line naming the package."""
    ort = _ort()
    available = ort.get_available_providers()
    if provider.name not in available:
        package = PACKAGES.get(provider.name, "an onnxruntime build with this execution provider")
        raise BackendUnavailable(
            f"execution provider {provider.name} is not in this onnxruntime {ort.__version__} (it has "
            f"{', '.join(available)}): install {package} in place of onnxruntime")
    return provider


def add_argument(parser, default: str = "cpu") -> None:
    """The ``--provider`` option, the same on every command that runs ONNX Runtime."""
    parser.add_argument(
        "--provider", default=default, metavar="EP[:KEY=VALUE,...]",
        help="ONNX Runtime execution provider: cpu, cuda, tensorrt, migraphx, openvino, dml, ... or any name "
             "onnxruntime.get_all_providers() lists, with provider options after ':' (e.g. cuda:device_id=1); "
             "default: %(default)s")
