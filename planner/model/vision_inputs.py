"""Images and tiles per sample for a vision-language model: defaults and the rules they obey.

One place for what ``suggest``, ``estimate``, ``generate`` and the Python API accept, so the
commands cannot disagree: the flags only apply to vision-language models, a tile count cannot
pass the model's local-tile limit, and the image tokens must leave room for text in the
sequence (the trainer refuses such a plan when it starts; the planner refuses it first).
"""

from __future__ import annotations

from planner import limits
from planner.errors import UserError, arg
from planner.model.spec import ModelSpec


def image_tokens(model: ModelSpec, images: int, tiles: int) -> int:
    """Language tokens the images of one sample take: each image's local tiles plus its global
    view, at the projector's tokens per tile (row-newline and separator tokens not counted,
    so this is a lower bound)."""
    if model.vision is None:
        return 0
    v = model.vision
    return images * (tiles + (1 if v.global_view else 0)) * v.tokens_per_tile


def vision_inputs(model: ModelSpec, images: int | None, tiles: int | None, seq_len: int) -> tuple[int, int]:
    """(images, tiles) with the model's defaults filled in; UserError naming the input if a rule breaks."""
    img_name, tile_name, seq_name = arg("images_per_sample"), arg("tiles_per_image"), arg("seq_len")
    v = model.vision
    if v is None:
        for name, value in ((img_name, images), (tile_name, tiles)):
            if value:
                raise UserError(f"{name}: {model.name} is not a vision-language model; leave it out")
        return 0, 0
    images = limits.count("images_per_sample", v.default_images_per_sample if images is None else images, low=0)
    tiles = limits.count("tiles_per_image", v.default_tiles_per_image if tiles is None else tiles, low=0)
    if tiles > v.max_local_tiles:
        raise UserError(f"{tile_name} {tiles} exceeds {model.name}'s {v.max_local_tiles} local tiles per image")
    used = image_tokens(model, images, tiles)
    if used >= seq_len:
        raise UserError(f"{img_name} {images} x {tile_name} {tiles} take at least {used:,} of the {seq_len:,} tokens "
                        f"of a sample ({v.tokens_per_tile} per tile"
                        f"{', global view included' if v.global_view else ''}); "
                        f"use fewer images or tiles, or a longer {seq_name}")
    return images, tiles
