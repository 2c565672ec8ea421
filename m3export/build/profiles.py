"""Optimisation profiles for an artifact's graphs and the metadata that ties an engine to its GPU and TensorRT.

Every dynamic dimension of the graph signatures (``manifest.json``: ``T``, ``B``, ``B + 1``, ``N``, ``max_pages``,
``pages``) gets (min, opt, max) from the build limits: tokens from 1 to ``max_num_tokens`` (opt: a decode batch of
``max_batch`` tokens, the step a server runs most), sequences from 1 to ``max_batch``, block-table width and pool
pages from ``max_model_len``. Static dimensions stay as exported.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ..errors import ArtifactError, BackendUnavailable

DEFAULTS = {"max_num_tokens": 2048, "max_batch": 64, "max_model_len": 32768}


@dataclass(frozen=True)
class Limits:
    max_num_tokens: int
    max_batch: int
    max_model_len: int
    page_size: int
    num_pages: int | None = None

    @classmethod
    def for_config(cls, config, page_size: int, max_num_tokens: int | None = None, max_batch: int | None = None,
                   max_model_len: int | None = None, num_pages: int | None = None) -> "Limits":
        mml = max_model_len or min(config.max_position_embeddings, DEFAULTS["max_model_len"])
        if mml > config.max_position_embeddings:
            raise ArtifactError(f"--max-model-len {mml} exceeds the model's max_position_embeddings "
                                f"{config.max_position_embeddings}")
        limits = cls(max_num_tokens or DEFAULTS["max_num_tokens"], max_batch or DEFAULTS["max_batch"], mml,
                     page_size, num_pages)
        for k, v in asdict(limits).items():
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ArtifactError(f"{k} must be a positive integer, got {v!r}")
        return limits

    @property
    def pages_per_sequence(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def pool_pages(self) -> int:
        return self.num_pages or self.max_batch * self.pages_per_sequence + 1

    def ranges(self) -> dict[str, tuple[int, int, int]]:
        """(min, opt, max) of every named dynamic dimension."""
        decode = min(self.max_batch, self.max_num_tokens)
        return {"T": (1, decode, self.max_num_tokens), "N": (1, decode, self.max_num_tokens),
                "B": (1, min(self.max_batch, decode), self.max_batch),
                "max_pages": (1, self.pages_per_sequence, self.pages_per_sequence),
                "pages": (1, self.pool_pages, self.pool_pages)}


_SUM = re.compile(r"^\s*(\w+)\s*([+-])\s*(\d+)\s*$")


def dim_range(dim, ranges: dict[str, tuple[int, int, int]], where: str) -> tuple[int, int, int]:
    """(min, opt, max) of one dimension of a signature: an int, a name, or ``name + k`` / ``name - k``."""
    if isinstance(dim, int):
        return dim, dim, dim
    if dim in ranges:
        return ranges[dim]
    m = _SUM.match(str(dim))
    if m and m[1] in ranges:
        k = int(m[3]) * (1 if m[2] == "+" else -1)
        return tuple(v + k for v in ranges[m[1]])
    raise ArtifactError(f"{where}: dimension {dim!r} has no build range (known: {', '.join(sorted(ranges))})")


def profile_shapes(graph, limits: Limits) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Input name -> (min shape, opt shape, max shape) for one graph signature (a manifest ``GraphInfo``)."""
    ranges = limits.ranges()
    out = {}
    for t in graph.inputs:
        dims = [dim_range(d, ranges, f"{graph.file}: input {t.name}") for d in t.shape]
        out[t.name] = tuple(tuple(d[i] for d in dims) for i in range(3))
    return out


def engine_metadata(trt_version: str, compute_capability: tuple[int, int], device_name: str, limits: Limits,
                    profiles: dict, flavour: dict, engines: dict, plugins: list[str]) -> dict:
    return {"format": "m3export.engines", "format_version": 1, "tensorrt": trt_version,
            "compute_capability": list(compute_capability), "device": device_name, "limits": asdict(limits),
            "profiles": {g: {n: [list(s) for s in v] for n, v in p.items()} for g, p in profiles.items()},
            "flavour": flavour, "engines": engines, "plugins": plugins}


def check_engine(meta: dict, trt_version: str, compute_capability: tuple[int, int], where: str) -> None:
    """Refuse an engine built for another GPU architecture or another TensorRT version (engines are neither
    portable across compute capabilities nor across TensorRT releases), saying what to do."""
    if meta.get("format") != "m3export.engines":
        raise ArtifactError(f"{where}: not an m3export engine directory (no build.json written by 'm3export build')")
    built_cc = tuple(meta.get("compute_capability", ()))
    if built_cc != tuple(compute_capability):
        raise BackendUnavailable(
            f"{where}: engines were built for compute capability {'.'.join(map(str, built_cc))} "
            f"({meta.get('device', '?')}), this GPU is {'.'.join(map(str, compute_capability))}: rebuild them here "
            "with 'm3export build'")
    if meta.get("tensorrt") != trt_version:
        raise BackendUnavailable(
            f"{where}: engines were built with TensorRT {meta.get('tensorrt')}, this is TensorRT {trt_version}: "
            "rebuild them with 'm3export build'")
