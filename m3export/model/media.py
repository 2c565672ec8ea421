"""Images and video in the text stream: encode each item, then put its tokens at its placeholder positions.

``grid_thw`` rows are items (an image, or one chunk of a video's temporal patches): ``t x h x w`` patches each,
``t * h * w / merge_unit`` text tokens each. Placeholders are filled in order, exactly as many as there are
tokens; anything else is an error that names the counts.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import VisionConfig
from ..errors import MediaError
from .projector import MultiModalProjector
from .vision import VisionTower, vision_position_ids


class VisionEncoder(nn.Module):
    """Tower + projector for one item: pixel_values [N, patch_dim], position_ids [N, 3] -> tokens [N / unit, H].

    What the runtime runs once per item and what the exporter writes as the vision graph."""

    def __init__(self, tower: VisionTower, projector: MultiModalProjector):
        super().__init__()
        self.tower, self.projector = tower, projector

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(pixel_values, position_ids))


def check_grid(cfg: VisionConfig, pixel_values: torch.Tensor, grid_thw, what: str) -> list[tuple[int, int, int]]:
    """``grid_thw`` as a list of (t, h, w), checked against the config and the number of patch rows."""
    grids = [tuple(int(v) for v in row) for row in torch.as_tensor(grid_thw).reshape(-1, 3).tolist()]
    if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_dim:
        raise MediaError(f"{what}: pixel values must be [patches, {cfg.patch_dim}] (channels x temporal patch x "
                         f"patch x patch), got {list(pixel_values.shape)}")
    for i, (t, h, w) in enumerate(grids):
        if t <= 0 or h <= 0 or w <= 0 or h % cfg.spatial_merge_size or w % cfg.spatial_merge_size:
            raise MediaError(f"{what}: grid_thw[{i}] = {[t, h, w]} must be positive with h and w multiples of "
                             f"the spatial merge size {cfg.spatial_merge_size}")
    total = sum(t * h * w for t, h, w in grids)
    if total != pixel_values.shape[0]:
        raise MediaError(f"{what}: grid_thw describes {total} patches but pixel values hold {pixel_values.shape[0]}")
    return grids


def encode_items(encoder: VisionEncoder, cfg: VisionConfig, pixel_values: torch.Tensor, grid_thw,
                 what: str = "image") -> list[torch.Tensor]:
    """One [t*h*w / unit, H] token block per grid row, each encoded on its own (attention stays in the item)."""
    grids = check_grid(cfg, pixel_values, grid_thw, what)
    out, start = [], 0
    for t, h, w in grids:
        n = t * h * w
        pos = vision_position_ids(t, h, w, cfg.spatial_merge_size, pixel_values.device)
        out.append(encoder(pixel_values[start:start + n], pos))
        start += n
    return out


def place_tokens(embeds: torch.Tensor, input_ids: torch.Tensor, token_id: int, tokens: torch.Tensor,
                 what: str = "image") -> torch.Tensor:
    """embeds [T, H] with the rows where ``input_ids == token_id`` replaced, in order, by ``tokens`` [n, H]."""
    mask = input_ids == token_id
    n = int(mask.sum())
    if n != tokens.shape[0]:
        raise MediaError(f"{what} placeholders and {what} tokens do not match: the prompt has {n} placeholder "
                         f"token(s) (id {token_id}) but the {what}s encode to {tokens.shape[0]}")
    return embeds.masked_scatter(mask[:, None], tokens.to(embeds.dtype))


def place_rows(embeds: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """embeds [T, H] with rows ``rows`` [M] replaced by ``values`` [M, H]: a step's media tokens over its token
    embeddings (the runtime knows the rows; one ScatterND in the exported step graph, a no-op for M = 0)."""
    return embeds.index_put((rows,), values.to(embeds.dtype))
