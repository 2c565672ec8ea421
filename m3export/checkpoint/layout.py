"""Tensor names: where each of our parameters lives in the two checkpoint layouts.

One table serves both directions. ``pieces(name)`` lists the checkpoint tensors that make up one of our
parameters (with the slice each fills); the loader inverts it, the synthetic writer follows it.

- ``original``: MiniMax's release (``language_model.model.layers.{i}.block_sparse_moe.experts.{e}.w1`` ...,
  ``self_attn.index_q_proj``, ``language_model.model.mtp.layers.{k}``).
- ``hf``: what ``transformers`` writes (``model.language_model.layers`` for the VL model or ``model.layers`` for
  the text-only ``MiniMaxM3VLForCausalLM``; stacked ``mlp.experts.gate_up_proj``; ``self_attn.indexer.*``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import M3Config

LAYOUTS = ("original", "hf")
# Tensors that belong to the checkpoint but not to the text backbone: skipped, reported once.
IGNORED = re.compile(r"^(vision_tower|multi_modal_projector|patch_merge_mlp|model\.vision_tower|"
                     r"model\.multi_modal_projector)\.")


@dataclass(frozen=True)
class Piece:
    """Checkpoint tensor ``name`` fills ``index`` of our parameter (``()`` = the whole parameter)."""

    name: str
    index: tuple = ()


def _rows(lo: int, hi: int) -> slice:
    return slice(lo, hi)


class Layout:
    """Name mapping for one layout; ``prefix`` distinguishes the VL (``model.language_model.``) and text-only
    (``model.``) spellings of the ``hf`` layout."""

    def __init__(self, kind: str, cfg: M3Config, hf_prefix: str = "model.language_model."):
        if kind not in LAYOUTS:
            raise ValueError(f"unknown layout {kind!r}: expected one of {LAYOUTS}")
        self.kind, self.cfg = kind, cfg
        self.model_prefix = "language_model.model." if kind == "original" else hf_prefix
        self.lm_head = "language_model.lm_head.weight" if kind == "original" else "lm_head.weight"
        self.vision_prefix = hf_prefix[: -len("language_model.")] if hf_prefix.endswith("language_model.") else hf_prefix

    # ------------------------------------------------------------------ public
    def pieces(self, name: str) -> list[Piece]:
        """Our parameter name -> the checkpoint tensors that make it up."""
        if name == "lm_head.weight":
            return [Piece(self.lm_head)]
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m:
            return self._layer(f"{self.model_prefix}layers.{m[1]}.", m[2])
        m = re.fullmatch(r"mtp\.(\d+)\.transformer_layer\.(.+)", name)
        if m:
            return self._layer(f"{self.model_prefix}mtp.layers.{m[1]}.transformer_layer.", m[2])
        m = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
        if m:
            return [Piece(f"{self.model_prefix}mtp.layers.{m[1]}.{m[2]}")]
        m = re.fullmatch(r"model\.(embed_tokens\.weight|norm\.weight)", name)
        if m:
            return [Piece(self.model_prefix + m[1])]
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return [Piece(self._vision(name))]
        raise KeyError(f"no checkpoint name for parameter {name!r}")

    def _vision(self, name: str) -> str:
        """Vision tower / projector names: ``transformers`` nests them under ``model.``; the release keeps CLIP's
        ``vision_tower.vision_model.{embeddings.patch_embedding,pre_layrnorm,encoder.layers}`` and stores the
        projector's merge MLP as ``patch_merge_mlp``."""
        if self.kind == "hf":
            return self.vision_prefix + name
        for ours, theirs in (("vision_tower.embeddings.proj.", "vision_tower.vision_model.embeddings.patch_embedding."),
                             ("vision_tower.pre_layrnorm.", "vision_tower.vision_model.pre_layrnorm."),
                             ("vision_tower.layers.", "vision_tower.vision_model.encoder.layers."),
                             ("multi_modal_projector.merge_linear_", "patch_merge_mlp.linear_")):
            if name.startswith(ours):
                return theirs + name[len(ours):]
        return name

    # ------------------------------------------------------------------ per layer
    def _layer(self, p: str, rest: str) -> list[Piece]:
        c, orig = self.cfg, self.kind == "original"
        m = re.fullmatch(r"self_attn\.indexer\.index_(q_proj|k_proj|q_norm|k_norm)\.(.+)", rest)
        if m:
            return [Piece(f"{p}self_attn.index_{m[1]}.{m[2]}" if orig else f"{p}self_attn.indexer.{m[1]}.{m[2]}")]
        if rest.startswith("mlp.gate.") and orig:
            leaf = rest[len("mlp.gate."):]
            return [Piece(f"{p}block_sparse_moe.e_score_correction_bias" if leaf == "e_score_correction_bias"
                          else f"{p}block_sparse_moe.gate.{leaf}")]
        m = re.fullmatch(r"mlp\.experts\.(w13|w2)(_scale_inv)?", rest)
        if m:
            return self._experts(p, m[1], m[2] or "")
        m = re.fullmatch(r"mlp\.(shared_experts\.)?(gate_up_proj|down_proj)\.(weight|weight_scale_inv)", rest)
        if m:
            shared, proj, leaf = m[1] or "", m[2], m[3]
            base = f"{p}block_sparse_moe.shared_experts." if (orig and shared) else f"{p}mlp.{shared}"
            if proj == "gate_up_proj" and orig:
                inter = c.shared_intermediate_size if shared else c.dense_intermediate_size
                return [Piece(f"{base}gate_proj.{leaf}", (_rows(0, inter),)),
                        Piece(f"{base}up_proj.{leaf}", (_rows(inter, 2 * inter),))]
            return [Piece(f"{base}{proj}.{leaf}")]
        return [Piece(p + rest)]

    def _experts(self, p: str, which: str, scale: str) -> list[Piece]:
        inter = self.cfg.intermediate_size
        if self.kind == "hf":
            stacked = "gate_up_proj" if which == "w13" else "down_proj"
            return [Piece(f"{p}mlp.experts.{stacked}{scale}")]
        leaf = "weight" + scale
        out = []
        for e in range(self.cfg.num_local_experts):
            base = f"{p}block_sparse_moe.experts.{e}."
            if which == "w13":
                out += [Piece(f"{base}w1.{leaf}", (e, _rows(0, inter))),
                        Piece(f"{base}w3.{leaf}", (e, _rows(inter, 2 * inter)))]
            else:
                out.append(Piece(f"{base}w2.{leaf}", (e,)))
        return out


def detect(names: list[str] | set[str]) -> tuple[str, str]:
    """(layout kind, hf prefix) from the tensor names a checkpoint holds."""
    names = set(names)
    if any(n.startswith("language_model.model.") for n in names):
        return "original", ""
    if any(n.startswith("model.language_model.") for n in names):
        return "hf", "model.language_model."
    if any(n.startswith("model.layers.") or n.startswith("model.embed_tokens.") for n in names):
        return "hf", "model."
    raise ValueError("tensor names match neither the original MiniMax layout (language_model.model.*) "
                     "nor the transformers layout (model.language_model.* / model.layers.*)")


def mtp_modules_present(names: set[str], layout: Layout) -> list[int]:
    """Indices k of the MTP modules the checkpoint actually ships (the release may declare but omit them)."""
    pat = re.compile(re.escape(layout.model_prefix) + r"mtp\.layers\.(\d+)\.")
    return sorted({int(m[1]) for n in names if (m := pat.match(n))})
