"""M3 configuration: one dataclass that reads every spelling of the release's ``config.json``.

The released checkpoint nests the text backbone under ``text_config`` and uses MiniMax's original field names
(``sparse_attention_config``, ``moe_layer_freq``); ``transformers`` rewrites them as flat fields
(``index_topk_blocks``, ``layer_types``, ``mlp_layer_types``). Both must load to the same ``M3Config`` so that
every other module reads exactly one set of names.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPARSE = "minimax_m3_sparse"
DENSE_ATTN = "full_attention"
ATTENTION_TYPES = (SPARSE, DENSE_ATTN)
MLP_TYPES = ("dense", "sparse")
ACTIVATIONS = ("swigluoai",)
SCORE_TYPES = ("max",)
SCORING_FUNCS = ("sigmoid",)


from .errors import M3Error


class ConfigError(M3Error, ValueError):
    """A config value is missing, of the wrong type or inconsistent; the message names the field."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: What each ``M3Config`` field annotation admits (JSON gives bool for true/false, which must not pass as a number).
_TYPE_CHECKS: dict[str, tuple[Any, str]] = {
    "int": (_is_int, "an integer"),
    "float": (_is_number, "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int | None": (lambda v: v is None or _is_int(v), "an integer or null"),
    "list[int]": (lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "a list of integers"),
    "list[str]": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
}

#: Fields without which a config does not describe a model (their defaults are the full release, which a missing
#: key must not silently select).
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def _expect(value: Any, kind: type | tuple[type, ...], what: str, where: str) -> Any:
    """``value`` when it is a ``kind`` (bool never counts as a number), else a ConfigError naming ``where``."""
    ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple)
                                                                                   else (kind,)))
    if not ok:
        raise ConfigError(f"{where} must be {what}, got {value!r}")
    return value


@dataclass(frozen=True)
class QuantConfig:
    """``quantization_config`` of an MXFP8 checkpoint: E4M3 values with one UE8M0 scale per 32 along K."""

    quant_method: str = "mxfp8"
    weight_block_size: tuple[int, int] = (1, 32)
    activation_scheme: str = "dynamic"
    ignored_layers: tuple[str, ...] = ("lm_head", "model.embed_tokens", "vision_tower")

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "quantization_config") -> "QuantConfig":
        method = d.get("quant_method")
        if method != "mxfp8":
            raise ConfigError(f"{where}.quant_method: only 'mxfp8' is supported, got {method!r}")
        block = tuple(_expect(d.get("weight_block_size", [1, 32]), list, "a list", f"{where}.weight_block_size"))
        if block != (1, 32):
            raise ConfigError(f"{where}.weight_block_size: MXFP8 needs [1, 32], got {list(block)}")
        return cls(
            quant_method=method,
            weight_block_size=block,  # type: ignore[arg-type]
            activation_scheme=d.get("activation_scheme", "dynamic"),
            ignored_layers=tuple(_expect(d.get("ignored_layers", list(cls.ignored_layers)), list, "a list",
                                         f"{where}.ignored_layers")),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": self.quant_method,
            "activation_scheme": self.activation_scheme,
            "weight_block_size": list(self.weight_block_size),
            "ignored_layers": list(self.ignored_layers),
        }


VISION_ACTIVATIONS = ("gelu", "quick_gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (``vision_config``) and the VL wrapper's own fields (placeholder ids, projector width).

    The release stores the tower as a CLIP-style ``vision_config`` and the token ids and projector width at the
    top level of ``config.json``; they are kept together here because only the vision path reads them.
    """

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 2016
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    image_token_index: int = 200025
    video_token_index: int = 200026
    projector_hidden_size: int = 6144

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch in ``pixel_values``: channels x temporal patch x patch x patch."""
        return self.num_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches folded into one text token."""
        return self.spatial_merge_size**2

    def validate(self, text_hidden_size: int, vocab_size: int) -> "VisionConfig":
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                     "patch_size", "temporal_patch_size", "spatial_merge_size", "projector_hidden_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"vision_config.{name} must be a positive integer, got {v!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"vision_config.hidden_size ({self.hidden_size}) must be a multiple of "
                              f"num_attention_heads ({self.num_attention_heads})")
        if self.head_dim < 6:
            raise ConfigError(f"vision head_dim ({self.head_dim}) is too small for 3D rotary (needs >= 6)")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ConfigError(f"vision_config.hidden_act {self.hidden_act!r} is not supported "
                              f"(expected one of {list(VISION_ACTIVATIONS)})")
        for name in ("image_token_index", "video_token_index"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 0 <= v < vocab_size:
                raise ConfigError(f"{name} ({v!r}) must be a token id below vocab_size ({vocab_size})")
        if self.image_token_index == self.video_token_index:
            raise ConfigError("image_token_index and video_token_index must differ")
        del text_hidden_size  # any text width works: the projector maps into it
        return self

    @classmethod
    def from_dict(cls, top: dict[str, Any], vision: dict[str, Any], source: str) -> "VisionConfig":
        """``vision`` is ``vision_config`` (CLIP-style or ``transformers``' spelling); ``top`` the wrapper."""
        if not isinstance(vision, dict):
            raise ConfigError(f"{source}: vision_config must be an object")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: vision[k] for k in names & set(vision) if k not in ("image_token_index", "video_token_index",
                                                                       "projector_hidden_size")}
        rope = _expect(vision.get("rope_parameters") or {}, dict, "an object", f"{source}: vision_config.rope_parameters")
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"{source}: vision_config rope_type {rope.get('rope_type')!r} is not supported "
                              "(the vision tower uses axial 3D rotary)")
        if "rope_theta" not in vision and "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        heads, hidden = vision.get("num_attention_heads", cls.num_attention_heads), vision.get("hidden_size",
                                                                                               cls.hidden_size)
        if vision.get("head_dim") not in (None, hidden // heads):
            raise ConfigError(f"{source}: vision_config.head_dim ({vision['head_dim']}) must equal hidden_size / "
                              f"num_attention_heads ({hidden // heads})")
        for name in ("image_token_index", "video_token_index", "projector_hidden_size"):
            alias = {"image_token_index": "image_token_id", "video_token_index": "video_token_id"}.get(name)
            if name in top:
                kw[name] = top[name]
            elif alias in top:
                kw[name] = top[alias]
        for f in dataclasses.fields(cls):
            v = kw.get(f.name, getattr(cls, f.name))
            if f.type in ("int", int) and not (isinstance(v, int) and not isinstance(v, bool)):
                raise ConfigError(f"{source}: vision_config.{f.name} must be an integer, got {v!r}")
            if f.type in ("float", float) and not isinstance(v, (int, float)):
                raise ConfigError(f"{source}: vision_config.{f.name} must be a number, got {v!r}")
        return cls(**kw)

    def tower_dict(self) -> dict[str, Any]:
        """``vision_config`` as ``transformers`` spells it (the token ids and projector width live outside)."""
        d = dataclasses.asdict(self)
        for k in ("image_token_index", "video_token_index", "projector_hidden_size", "rope_theta"):
            d.pop(k)
        d["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        return d

    def wrapper_dict(self) -> dict[str, Any]:
        return {"image_token_index": self.image_token_index, "video_token_index": self.video_token_index,
                "projector_hidden_size": self.projector_hidden_size}


@dataclass
class M3Config:
    """Text backbone + MTP configuration (field names follow the ``transformers`` flat spelling)."""

    vocab_size: int = 200064
    hidden_size: int = 6144
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    intermediate_size: int = 3072
    shared_intermediate_size: int = 3072
    dense_intermediate_size: int = 12288
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.0
    scoring_func: str = "sigmoid"
    use_routing_bias: bool = True
    hidden_act: str = "swigluoai"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    swiglu_beta: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    rotary_dim: int = 64
    max_position_embeddings: int = 1_048_576
    tie_word_embeddings: bool = False
    layer_types: list[str] = field(default_factory=lambda: [DENSE_ATTN] * 3 + [SPARSE] * 57)
    mlp_layer_types: list[str] = field(default_factory=lambda: ["dense"] * 3 + ["sparse"] * 57)
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    index_init_blocks: int = 0
    index_score_type: str = "max"
    num_mtp_modules: int = 7
    bos_token_id: int | None = 200034
    eos_token_id: list[int] = field(default_factory=lambda: [200020])
    pad_token_id: int | None = None
    quantization: QuantConfig | None = None
    vision: VisionConfig | None = None  # the vision tower + projector; None for a text-only checkpoint

    # ------------------------------------------------------------------ derived
    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_sparse_layer(self, i: int) -> bool:
        return self.layer_types[i] == SPARSE

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    @property
    def has_sparse_layers(self) -> bool:
        return any(t == SPARSE for t in self.layer_types) or self.num_mtp_modules > 0

    # ------------------------------------------------------------------ validation
    def validate(self) -> "M3Config":
        """Check every invariant the model and the exported ops rely on; name the offending field."""
        for f in dataclasses.fields(self):
            check = _TYPE_CHECKS.get(f.type)
            v = getattr(self, f.name)
            if check is not None and not check[0](v):
                raise ConfigError(f"{f.name} must be {check[1]}, got {v!r}")
            if f.type == "float" and not math.isfinite(v):
                raise ConfigError(f"{f.name} must be finite, got {v!r}")
        for name in ("rms_norm_eps", "rope_theta", "routed_scaling_factor"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.swiglu_limit < 0:
            raise ConfigError(f"swiglu_limit must be >= 0, got {self.swiglu_limit!r}")
        if self.max_position_embeddings < 2:
            raise ConfigError(f"max_position_embeddings must be >= 2 (a prompt token and a generated one), "
                              f"got {self.max_position_embeddings}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            for t in v if isinstance(v, list) else [] if v is None else [v]:
                if not 0 <= t < self.vocab_size:
                    raise ConfigError(f"{name} ({t}) must be a token id in [0, vocab_size={self.vocab_size})")

        def positive(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")

        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "shared_intermediate_size", "dense_intermediate_size",
            "num_local_experts", "num_experts_per_tok", "index_n_heads", "index_head_dim", "index_block_size",
            "index_topk_blocks", "max_position_embeddings",
        ):
            positive(name)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.has_sparse_layers and self.index_n_heads != self.num_key_value_heads:
            raise ConfigError(
                f"index_n_heads / sparse_num_index_heads ({self.index_n_heads}) must equal num_key_value_heads "
                f"({self.num_key_value_heads}): index head r selects the blocks of KV head r"
            )
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim must be a positive even integer, got {self.rotary_dim}")
        if self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary_dim ({self.rotary_dim}) must not exceed head_dim ({self.head_dim})")
        if self.rotary_dim > self.index_head_dim:
            raise ConfigError(
                f"rotary_dim ({self.rotary_dim}) must not exceed index_head_dim ({self.index_head_dim})"
            )
        for name, allowed in (("layer_types", ATTENTION_TYPES), ("mlp_layer_types", MLP_TYPES)):
            values = getattr(self, name)
            if len(values) != self.num_hidden_layers:
                raise ConfigError(
                    f"{name} has {len(values)} entries but num_hidden_layers is {self.num_hidden_layers}"
                )
            bad = [(i, v) for i, v in enumerate(values) if v not in allowed]
            if bad:
                i, v = bad[0]
                raise ConfigError(f"{name}[{i}] = {v!r}: expected one of {list(allowed)}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (expected one of {list(ACTIVATIONS)})")
        if self.index_score_type not in SCORE_TYPES:
            raise ConfigError(
                f"sparse_score_type / index_score_type {self.index_score_type!r} is not supported "
                f"(expected one of {list(SCORE_TYPES)})"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func {self.scoring_func!r} is not supported (expected 'sigmoid')")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_local_experts "
                f"({self.num_local_experts})"
            )
        if self.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts must be 1 (one ungated shared expert), got {self.n_shared_experts}")
        if self.index_local_blocks < 0 or self.index_init_blocks < 0:
            raise ConfigError("index_local_blocks and index_init_blocks must be >= 0")
        if self.index_local_blocks + self.index_init_blocks > self.index_topk_blocks:
            raise ConfigError(
                f"index_local_blocks ({self.index_local_blocks}) + index_init_blocks ({self.index_init_blocks}) "
                f"exceeds index_topk_blocks ({self.index_topk_blocks}): forced blocks would not fit"
            )
        if self.num_mtp_modules < 0:
            raise ConfigError(f"num_mtp_modules must be >= 0, got {self.num_mtp_modules}")
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings=true is not an M3 configuration (lm_head is separate)")
        if self.quantization is not None and (
            self.hidden_size % 32 or self.intermediate_size % 32 or self.dense_intermediate_size % 32
            or self.shared_intermediate_size % 32 or (self.num_attention_heads * self.head_dim) % 32
        ):
            raise ConfigError("MXFP8 needs every linear input width (K) to be a multiple of 32")
        if self.vision is not None:
            self.vision.validate(self.hidden_size, self.vocab_size)
        return self

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "M3Config":
        """Accept the VL wrapper, the original MiniMax names and the ``transformers`` flat names."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        top = raw
        text = raw.get("text_config", raw)
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: text_config must be an object")
        text = dict(text)
        missing = [n for n in REQUIRED_FIELDS if n not in text]
        if missing:
            raise ConfigError(f"{source}: missing {', '.join(missing)} (a config must give the model's size; "
                              "nothing is assumed)")
        kw: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)} - {"quantization", "vision"}
        for name in names:
            if name in text:
                kw[name] = text[name]

        # The shapes of the nested values, before anything indexes into them (each a clear error, not a traceback).
        for name in ("sparse_attention_config", "rope_parameters", "rope_scaling"):
            if text.get(name) is not None:
                _expect(text[name], dict, "an object", f"{source}: {name}")
        for name in ("quantization_config", "vision_config"):
            for where, d in (("", top), ("text_config.", text)):
                if d.get(name) is not None:
                    _expect(d[name], dict, "an object", f"{source}: {where}{name}")
        for name in ("moe_layer_freq", "layer_types", "mlp_layer_types"):
            if text.get(name) is not None:
                _expect(text[name], list, "a list", f"{source}: {name}")
        for name in ("head_dim", "num_hidden_layers", "rotary_dim"):
            if name in text:
                _expect(text[name], int, "an integer", f"{source}: {name}")
        sparse = text.get("sparse_attention_config") or {}
        for name in ("sparse_attention_freq", "sparse_disable_index_value"):
            if sparse.get(name) is not None:
                _expect(sparse[name], list, "a list", f"{source}: sparse_attention_config.{name}")
        if "use_sparse_attention" in sparse:
            _expect(sparse["use_sparse_attention"], bool, "true or false",
                    f"{source}: sparse_attention_config.use_sparse_attention")
        legacy = {
            "sparse_num_index_heads": "index_n_heads",
            "sparse_index_dim": "index_head_dim",
            "sparse_block_size": "index_block_size",
            "sparse_topk_blocks": "index_topk_blocks",
            "sparse_local_block": "index_local_blocks",
            "sparse_init_block": "index_init_blocks",
            "sparse_score_type": "index_score_type",
        }
        for old, new in legacy.items():
            if old in sparse:
                kw[new] = sparse[old]
        n_layers = kw.get("num_hidden_layers", cls.num_hidden_layers)
        if "layer_types" not in text:
            freq = sparse.get("sparse_attention_freq")
            if freq is not None and sparse.get("use_sparse_attention", True):
                kw["layer_types"] = [SPARSE if f else DENSE_ATTN for f in freq]
            elif sparse and not sparse.get("use_sparse_attention", True):
                kw["layer_types"] = [DENSE_ATTN] * n_layers
            elif "num_hidden_layers" in text:
                kw["layer_types"] = [DENSE_ATTN] * min(3, n_layers) + [SPARSE] * max(0, n_layers - 3)
        disable_value = sparse.get("sparse_disable_index_value")
        if disable_value is not None and freq_mismatch(disable_value, kw.get("layer_types")):
            raise ConfigError(
                f"{source}: sparse_disable_index_value must be 1 on every sparse layer "
                "(M3 has no index value/output projection)"
            )
        if "mlp_layer_types" not in text:
            freq = text.get("moe_layer_freq")
            if freq is not None:
                kw["mlp_layer_types"] = ["sparse" if f else "dense" for f in freq]
            elif "num_hidden_layers" in text:
                kw["mlp_layer_types"] = ["dense"] * min(3, n_layers) + ["sparse"] * max(0, n_layers - 3)

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if "rope_theta" not in text and "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") not in ("default", None):
            raise ConfigError(f"{source}: rope_type {rope.get('rope_type')!r} is not supported (M3 uses plain RoPE)")
        head_dim = kw.get("head_dim", cls.head_dim)
        factor = text.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
        if factor is not None:
            _expect(factor, (int, float), "a number", f"{source}: partial_rotary_factor")
            from_factor = int(head_dim * float(factor))
            if "rotary_dim" in text and int(text["rotary_dim"]) != from_factor:
                raise ConfigError(
                    f"{source}: rotary_dim ({text['rotary_dim']}) disagrees with partial_rotary_factor "
                    f"({factor}) x head_dim ({head_dim}) = {from_factor}"
                )
            kw["rotary_dim"] = from_factor
        if text.get("model_type") == "minimax_m3_vl_text" and kw.get("hidden_act") == "silu":
            # transformers rewrites the release's "swigluoai" to "silu" and computes SwiGLU-OAI inline anyway.
            kw["hidden_act"] = "swigluoai"
        if text.get("use_gemma_norm") is False:
            raise ConfigError(f"{source}: use_gemma_norm=false is not an M3 configuration")
        if text.get("qk_norm_type", "per_head") != "per_head" or text.get("use_qk_norm") is False:
            raise ConfigError(f"{source}: only per-head QK norm (qk_norm_type='per_head') is supported")
        if text.get("attention_output_gate"):
            raise ConfigError(f"{source}: attention_output_gate=true is not supported")
        if "num_experts" in text and "num_local_experts" not in text:
            kw["num_local_experts"] = text["num_experts"]
        if "num_mtp_modules" not in text:
            kw["num_mtp_modules"] = 0  # a config that declares no MTP modules has none (transformers' text config)
        eos = kw.get("eos_token_id", top.get("eos_token_id"))
        if eos is not None:
            kw["eos_token_id"] = [eos] if _is_int(eos) else eos  # one id or a list; validate() checks the rest
        kw["tie_word_embeddings"] = top.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        q = top.get("quantization_config") or text.get("quantization_config")
        quant = QuantConfig.from_dict(q, f"{source}: quantization_config") if q else None
        vision_raw = top.get("vision_config")
        vision = VisionConfig.from_dict(top, vision_raw, source) if vision_raw is not None else None
        try:
            cfg = cls(**kw, quantization=quant, vision=vision)
        except TypeError as e:  # pragma: no cover - dataclass signature errors
            raise ConfigError(f"{source}: {e}") from e
        try:
            return cfg.validate()
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "M3Config":
        """Read ``config.json`` from a checkpoint directory (or the file itself)."""
        p = Path(path)
        f = p / "config.json" if p.is_dir() else p
        if not f.exists():
            raise ConfigError(f"{f}: no config.json found")
        try:
            raw = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{f}: not valid JSON ({e})") from None
        except OSError as e:
            raise ConfigError(f"{f}: cannot read ({e.strerror or e})") from None
        return cls.from_dict(raw, source=str(f))

    def to_text_dict(self) -> dict[str, Any]:
        """The flat ``transformers`` spelling of the text config (what we write into artifacts)."""
        d = dataclasses.asdict(self)
        d.pop("quantization")
        d.pop("vision")
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.rotary_dim / self.head_dim,
        }
        if self.vision is not None:  # artifacts keep the tower too; from_dict reads it back from the flat dict
            d["vision_config"] = self.vision.tower_dict()
            d.update(self.vision.wrapper_dict())
        return d

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` for ``transformers``: ``MiniMaxM3VLForCausalLM`` (text only) or, with a vision tower,
        ``MiniMaxM3SparseForConditionalGeneration`` (the text config nested under ``text_config``)."""
        if self.vision is not None:
            return {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
                    "tie_word_embeddings": False, "text_config": self.replace(vision=None).to_hf_dict(),
                    "vision_config": self.vision.tower_dict(), **self.vision.wrapper_dict()}
        d = self.to_text_dict()
        for k in ("index_init_blocks", "index_score_type", "scoring_func", "use_routing_bias", "hidden_act",
                  "swiglu_beta", "n_shared_experts", "num_mtp_modules", "rope_theta"):
            d.pop(k)
        d.update(model_type="minimax_m3_vl_text", architectures=["MiniMaxM3VLForCausalLM"])
        d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id
        return d

    def to_original_dict(self) -> dict[str, Any]:
        """The release's own spelling: VL wrapper, ``sparse_attention_config``, ``moe_layer_freq``."""
        text = {
            k: v for k, v in self.replace(vision=None).to_text_dict().items()
            if not k.startswith("index_") and k not in ("layer_types", "mlp_layer_types", "rope_parameters")
        }
        text["model_type"] = "minimax_m3"
        text["partial_rotary_factor"] = self.rotary_dim / self.head_dim
        text["use_gemma_norm"] = True
        text["use_qk_norm"] = True
        text["qk_norm_type"] = "per_head"
        text["attention_output_gate"] = False
        text["moe_layer_freq"] = [1 if t == "sparse" else 0 for t in self.mlp_layer_types]
        text["sparse_attention_config"] = {
            "use_sparse_attention": True,
            "sparse_attention_freq": [1 if t == SPARSE else 0 for t in self.layer_types],
            "sparse_num_index_heads": self.index_n_heads,
            "sparse_index_dim": self.index_head_dim,
            "sparse_topk_blocks": self.index_topk_blocks,
            "sparse_block_size": self.index_block_size,
            "sparse_init_block": self.index_init_blocks,
            "sparse_local_block": self.index_local_blocks,
            "sparse_score_type": self.index_score_type,
            "sparse_disable_index_value": [1 if t == SPARSE else 0 for t in self.layer_types],
        }
        out: dict[str, Any] = {
            "model_type": "minimax_m3_vl",
            "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
            "text_config": text,
        }
        if self.quantization is not None:
            out["quantization_config"] = self.quantization.to_dict()
        if self.vision is not None:
            out["vision_config"] = {**self.vision.tower_dict(), "model_type": "clip_vision_model"}
            out.update(self.vision.wrapper_dict())
        return out

    def replace(self, **changes: Any) -> "M3Config":
        return dataclasses.replace(self, **changes).validate()


def freq_mismatch(disable_value: list[int], layer_types: list[str] | None) -> bool:
    """True when a sparse layer keeps an index value branch, which M3 never has."""
    if layer_types is None:
        return False
    return any(t == SPARSE and not dv for t, dv in zip(layer_types, disable_value))


def _layers(n: int, n_dense: int) -> tuple[list[str], list[str]]:
    return [DENSE_ATTN] * n_dense + [SPARSE] * (n - n_dense), ["dense"] * n_dense + ["sparse"] * (n - n_dense)


def preset(name: str) -> M3Config:
    """``tiny`` (CPU seconds, selection exercised at a few dozen tokens), ``mini`` (real per-layer dims, few
    layers and experts: GPU benchmarks) and ``full`` (the release)."""
    if name == "tiny":
        lt, mt = _layers(4, 1)
        return M3Config(
            vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=32, shared_intermediate_size=32, dense_intermediate_size=96,
            num_local_experts=8, num_experts_per_tok=2, rotary_dim=16, max_position_embeddings=4096,
            layer_types=lt, mlp_layer_types=mt, index_n_heads=2, index_head_dim=32, index_block_size=4,
            index_topk_blocks=3, index_local_blocks=1, num_mtp_modules=1, bos_token_id=256, eos_token_id=[257],
            pad_token_id=258,
        ).validate()
    if name == "mini":
        lt, mt = _layers(4, 1)
        return M3Config(
            num_hidden_layers=4, num_local_experts=16, layer_types=lt, mlp_layer_types=mt, num_mtp_modules=1,
            max_position_embeddings=131072,
        ).validate()
    if name == "full":
        return M3Config().validate()
    raise ConfigError(f"unknown preset {name!r}: expected one of tiny, mini, full")


PRESETS = ("tiny", "mini", "full")
