"""Images and video in a request: encoded once per item, placed at their placeholders during (chunked) prefill.

A request's prompt holds one placeholder token per media token (``image_token_index`` / ``video_token_index``,
as ``m3export.preprocess.expand_prompt`` writes them). ``attach_media`` checks the placeholders against the items,
encodes each item once (items with the same content hash share one encoding, across requests, through
``MediaCache``) and records, for the engine, which prompt positions take which embedding row, and, for the
prefix cache, the content hash of the media under each position: two prompts with the same placeholder ids but
different images must never share pages.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from m3export.config import VisionConfig
from m3export.errors import MediaError

KINDS = ("image", "video")


@dataclass
class MediaItem:
    """One preprocessed image (one ``grid_thw`` row) or video (one row per temporal chunk)."""

    kind: str
    pixel_values: torch.Tensor  # [patches, patch_dim]
    grid_thw: torch.Tensor  # [rows, 3]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise MediaError(f"media kind must be one of {KINDS}, got {self.kind!r}")
        self.grid_thw = torch.as_tensor(self.grid_thw, dtype=torch.long).reshape(-1, 3)
        if self.kind == "image" and self.grid_thw.shape[0] != 1:
            raise MediaError(f"an image has one grid_thw row, got {self.grid_thw.shape[0]}")

    def num_tokens(self, unit: int) -> int:
        return int(self.grid_thw.prod(-1).sum()) // unit

    def digest(self) -> bytes:
        """SHA-256 of what the encoder sees (kind, grid, pixel values): equal digests, equal embeddings."""
        h = hashlib.sha256(self.kind.encode())
        h.update(self.grid_thw.numpy().tobytes())
        px = self.pixel_values.detach().cpu().contiguous()
        h.update(str(px.dtype).encode())
        h.update(px.view(torch.uint8).numpy().tobytes())
        return h.digest()


class MediaCache:
    """Encoded items by content digest, least recently used dropped beyond ``max_items`` (a 448 x 448 image is
    256 tokens: 3 MB in bf16 at the release's width; a 2016 x 2016 one 5184 tokens, 64 MB)."""

    def __init__(self, max_items: int = 16):
        self.max_items = max_items
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, digest: bytes, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        if digest in self._items:
            self.hits += 1
            self._items.move_to_end(digest)
            return self._items[digest]
        self.misses += 1
        value = encode()
        self._items[digest] = value
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)
        return value


@dataclass
class RequestMedia:
    """Where a request's media tokens go: prompt ``positions`` [M] take ``embeds`` [M, H], in order; ``spans``
    are each item's (first position, last position + 1, digest) for the prefix cache."""

    positions: torch.Tensor
    embeds: torch.Tensor
    spans: list[tuple[int, int, bytes]]

    def rows_in(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in [lo, hi), their embedding rows)."""
        keep = (self.positions >= lo) & (self.positions < hi)
        return self.positions[keep], self.embeds[keep]

    def page_key(self, lo: int, hi: int) -> bytes:
        """The media under positions [lo, hi): each overlapping item's digest and placement (empty if none)."""
        out = b""
        for start, end, digest in self.spans:
            if start < hi and end > lo:
                out += digest + start.to_bytes(8, "little") + end.to_bytes(8, "little")
        return out


def attach_media(prompt_ids: Sequence[int], items: Sequence[MediaItem], vision: VisionConfig | None,
                 encode: Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]],
                 cache: MediaCache | None = None) -> RequestMedia:
    """Check the prompt's placeholders against ``items`` (images and videos each in prompt order) and encode.

    ``encode(pixel_values, grid_thw)`` -> one token block per grid row (the backend's vision encoder)."""
    if vision is None:
        raise MediaError("this model has no vision tower (its config has no vision_config): requests cannot carry "
                         "images or video")
    ids = torch.as_tensor(list(prompt_ids))
    unit = vision.merge_unit
    positions, embeds, spans = [], [], []
    for kind, token in (("image", vision.image_token_index), ("video", vision.video_token_index)):
        mine = [it for it in items if it.kind == kind]
        slots = (ids == token).nonzero()[:, 0]
        need = sum(it.num_tokens(unit) for it in mine)
        if need != slots.numel():
            raise MediaError(f"{kind} placeholders and {kind} tokens do not match: the prompt has {slots.numel()} "
                             f"placeholder token(s) (id {token}) but the {len(mine)} {kind}(s) encode to {need}")
        used = 0
        for it in mine:
            n = it.num_tokens(unit)
            digest = it.digest()

            def run(it=it) -> torch.Tensor:
                return torch.cat(encode(it.pixel_values, it.grid_thw))

            tokens = cache.get(digest, run) if cache is not None else run()
            where = slots[used:used + n]
            positions.append(where)
            embeds.append(tokens)
            spans.append((int(where[0]), int(where[-1]) + 1, digest))
            used += n
    if not positions:
        raise MediaError("no media items given")
    return RequestMedia(torch.cat(positions), torch.cat(embeds), spans)
