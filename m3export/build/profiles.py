"""Optimisation profiles for an artifact's graphs and the metadata that ties an engine to its GPU and TensorRT.

Every dynamic dimension of the graph signatures (``manifest.json``: ``T``, ``B``, ``B + 1``, ``N``, ``max_pages``,
``pages``, and ``M`` the media tokens of a vision-language step graph) gets (min, opt, max) from the build limits:
sequences from 1 to ``max_batch``, block-table width and pool pages from ``max_model_len``, tokens by profile, and
media tokens from 0 (tuned at 0: text steps, decode included, feed none) to the profile's tokens. An engine has
one optimisation profile per token range (:meth:`Limits.token_ranges`), smallest first: decode steps (at most
``max_batch`` tokens, tuned at ``max_batch``, the step a server runs most) and, when ``max_num_tokens`` is larger,
every step up to ``max_num_tokens`` (tuned at a full prefill chunk). TensorRT picks kernels per profile, so decode
steps do not run tactics timed for 2k-token chunks; the runtime selects, per step, the first profile that holds its
shapes (``runtime/backends/tensorrt_bindings.py``). Static dimensions stay as exported.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ..errors import ArtifactError, BackendUnavailable

DEFAULTS = {"max_num_tokens": 2048, "max_batch": 64, "max_model_len": 32768}
FORMAT = "m3export.engines"
FORMAT_VERSION = 2  # 2: a list of optimisation profiles per graph


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

    def token_ranges(self) -> list[tuple[int, int, int]]:
        """(min, opt, max) tokens of each optimisation profile, smallest first (see the module docstring)."""
        decode = min(self.max_batch, self.max_num_tokens)
        out = [(1, decode, decode)]
        if self.max_num_tokens > decode:
            out.append((1, self.max_num_tokens, self.max_num_tokens))
        return out

    def ranges(self, tokens: tuple[int, int, int] | None = None) -> dict[str, tuple[int, int, int]]:
        """(min, opt, max) of every named dynamic dimension, for the profile of ``tokens`` (default: the one of
        every step, up to ``max_num_tokens``). Logits rows (``N``) range as tokens, at most one per token, from 0:
        a prefill chunk that samples nothing, and the MTP steps that only fill caches, ask for no row. Media rows
        (``M``, a vision-language step graph's ``media_rows`` / ``media_embeds``) are some of the step's tokens:
        0 on text steps, at most every token."""
        tokens = tokens or self.token_ranges()[-1]
        return {"T": tokens, "N": (0, *tokens[1:]), "M": (0, 0, tokens[2]),
                "B": (1, min(self.max_batch, tokens[1]), self.max_batch),
                "max_pages": (1, self.pages_per_sequence, self.pages_per_sequence),
                "pages": (1, self.pool_pages, self.pool_pages)}


_SUM = re.compile(r"^\s*(\w+)\s*([+-])\s*(\d+)\s*$")


def split_dim(dim) -> tuple[str | None, int]:
    """One dimension of a signature as (name, offset): ``7`` -> (None, 7), ``"B"`` -> ("B", 0), ``"B + 1"`` ->
    ("B", 1); a string of another form is its own name."""
    if isinstance(dim, int):
        return None, dim
    m = _SUM.match(str(dim))
    if m:
        return m[1], int(m[3]) * (1 if m[2] == "+" else -1)
    return str(dim).strip(), 0


def dim_range(dim, ranges: dict[str, tuple[int, int, int]], where: str) -> tuple[int, int, int]:
    """(min, opt, max) of one dimension of a signature: an int, a name, or ``name + k`` / ``name - k``."""
    name, k = split_dim(dim)
    if name is None:
        return k, k, k
    if name in ranges:
        return tuple(v + k for v in ranges[name])
    raise ArtifactError(f"{where}: dimension {dim!r} has no build range (known: {', '.join(sorted(ranges))})")


def profile_shapes(graph, limits: Limits, tokens: tuple[int, int, int] | None = None
                   ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Input name -> (min shape, opt shape, max shape) for one graph signature (a manifest ``GraphInfo``), in the
    profile of ``tokens`` (default: every step up to ``max_num_tokens``)."""
    ranges = limits.ranges(tokens)
    out = {}
    for t in graph.inputs:
        dims = [dim_range(d, ranges, f"{graph.file}: input {t.name}") for d in t.shape]
        out[t.name] = tuple(tuple(d[i] for d in dims) for i in range(3))
    return out


def profiles_for(graph, limits: Limits) -> list[dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]]:
    """Every optimisation profile of one graph's engine, in the order they are added to the builder config (the
    profile index TensorRT and the runtime use)."""
    return [profile_shapes(graph, limits, tokens) for tokens in limits.token_ranges()]


def engine_metadata(trt_version: str, compute_capability: tuple[int, int], device_name: str, limits: Limits,
                    profiles: dict, flavour: dict, engines: dict, plugins: list[str]) -> dict:
    """``build.json``: ``profiles`` maps each graph to its list of profiles (index = TensorRT's profile index), each
    mapping an input to its [min, opt, max] shapes."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "tensorrt": trt_version,
            "compute_capability": list(compute_capability), "device": device_name, "limits": asdict(limits),
            "profiles": {g: [{n: [list(s) for s in v] for n, v in p.items()} for p in ps]
                         for g, ps in profiles.items()},
            "flavour": flavour, "engines": engines, "plugins": plugins}


def check_engine(meta: dict, trt_version: str, compute_capability: tuple[int, int], where: str) -> None:
    """Refuse an engine built for another GPU architecture or another TensorRT version (engines are neither
    portable across compute capabilities nor across TensorRT releases), saying what to do."""
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{where}: not an m3export engine directory (no build.json written by 'm3export build')")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{where}: build.json format_version {meta.get('format_version')!r}, this runtime reads "
                            f"{FORMAT_VERSION}: rebuild the engines with 'm3export build'")
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
