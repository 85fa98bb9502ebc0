"""Vision towers, projectors and tiling facts of the vision-language configs.

Two designs are supported, each from its own config layout:

* DeepSeek-VL2 (``deepseek_vl_v2``): a SigLIP-SO400M/14@384 ViT, the ``downsample_mlp_gelu``
  projector and dynamic 384-px tiling with a global view (reference README section 1).
* Qwen2-VL (``qwen2_vl``): a 32-layer ViT with 3-D (temporal x 14 x 14) patches, no learned
  positions (2-D RoPE), and a 2x2 PatchMerger (reference README section 4).

Each builder returns the blocks in forward order (patch embedding, ViT blocks, final norm if
any, projector) plus the ``VisionTiling`` facts the workload needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.limits import MAX_CONFIG_INT
from planner.model.hf_keys import ConfigReader
from planner.model.spec import (
    NormBlock,
    ProjectorBlock,
    VisionBlock,
    VisionEmbedBlock,
    VisionTiling,
    linear_params,
    norm_params,
)

# DeepSeek-VL2: a typical training image is planned as a 2x2 local canvas (768x768) plus the
# global view: 5 ViT passes and 1,023 language tokens (tokens_by_canvas_WxH["768x768"] in the
# reference). It sits between the 1x1 minimum (421 tokens) and the 3x3 maximum (2,017), and
# one image per sample is the common case of the captioning/VQA mixtures; a workload may
# override both.
VL2_DEFAULT_LOCAL_TILES = 4

# Qwen2-VL has no fixed tiles: an image of H x W pixels becomes (H/14)(W/14) patches and a
# quarter as many language tokens. For planning, a "tile" is a 448 x 448 pixel region: 32 x 32
# = 1,024 patches -> 256 language tokens, so the vision cost scales with tiles exactly as the
# real processor's does with pixels. Defaults: one 896 x 896 image (4 tiles, 1,024 tokens).
# The maximum, 64 tiles, is the processor's max_pixels of 12,845,056 (= 64 * 448^2); the
# reference lists that default as not checked (README section 6).
QWEN2VL_TILE_PX = 448
QWEN2VL_DEFAULT_TILES = 4
QWEN2VL_MAX_TILES = 64

# A ViT's MLP is width x mlp_ratio wide; published towers use 4 (SigLIP-SO400M: 3.74).
MAX_MLP_RATIO = 64.0
_MLP_RATIO_WHY = " (the MLP is width x mlp_ratio wide; towers use about 4)"


@dataclass(frozen=True)
class VisionParts:
    blocks: list
    tiling: VisionTiling


def siglip_map_head_params(width: int, mlp: int) -> int:
    """SigLIP's attention-pool (MAP) head: latent, q, kv, out projections, LayerNorm, MLP.

    The checkpoint holds it, but DeepSeek-VL2 builds the tower with ``ignore_head=True``
    (siglip_vit.py), so it costs memory and no FLOPs (15,238,352 params for SO400M).
    """
    latent = width
    attn = linear_params(width, width, True) + linear_params(width, 2 * width, True) + linear_params(width, width, True)
    return (latent + attn + norm_params(width, "layernorm") + linear_params(width, mlp, True)
            + linear_params(mlp, width, True))


def deepseek_vl2_vision(root: ConfigReader, lm_hidden: int) -> VisionParts:
    """SigLIP tower + downsample_mlp_gelu projector + dynamic tiling for DeepSeek-VL2.

    Defaults are SigLIP_MODEL_CONFIG["siglip_so400m_patch14_384"] (siglip_vit.py) and the
    projector/processor defaults of deepseek-ai/DeepSeek-VL2, as transcribed in the reference.
    """
    v = root.sub("vision_config")
    model_name = v.get_str("model_name", "siglip_so400m_patch14_384")
    if "siglip" not in model_name:
        v.fail("model_name",
               f"names an unsupported vision tower ({model_name!r}); dsplan knows siglip_so400m_patch14_384")
    layers = v.get_int("layers", 27)
    width = v.get_int("width", 1152)
    heads = v.get_int("heads", 16)
    mlp_ratio = v.get_float("mlp_ratio", 3.7362, maximum=MAX_MLP_RATIO, why=_MLP_RATIO_WHY)
    patch = v.get_int("patch_size", 14)
    image = v.get_int("image_size", 384)
    if width % heads:
        v.fail("heads", f"({heads}) must divide the vision width ({width})")
    if patch > image:
        v.fail("patch_size", f"({patch}) is larger than image_size ({image})")
    mlp = int(width * mlp_ratio)  # timm: int(embed_dim * mlp_ratio) -> 4304 for SO400M
    grid = image // patch  # the stride-14 conv drops the 6-px remainder: 27 x 27
    patches = grid * grid

    n_embed, ratio, down = _vl2_projector(root, width, lm_hidden)
    side = -(-grid // down)  # pad 27 -> 28, then 2x2 unfold -> 14 x 14
    tokens = side * side

    max_local = _max_local_tiles(root, image)
    blocks = [
        VisionEmbedBlock(hidden=width, patch_size=patch, patch_bias=True, learned_positions=patches),
        *[VisionBlock(hidden=width, heads=heads, mlp=mlp, act="gelu_tanh", qkv_bias=True) for _ in range(layers)],
        NormBlock(hidden=width, norm="layernorm", unused_params=siglip_map_head_params(width, mlp)),
        ProjectorBlock(in_dim=width, merge=down * down, mlp_hidden=n_embed * ratio, out_dim=n_embed,
                       extra_vectors=2),  # image_newline + view_seperator
    ]
    tiling = VisionTiling(
        tile_px=image,
        patches_per_tile=patches,
        tokens_per_tile=tokens,
        global_view=True,
        max_local_tiles=max_local,
        default_images_per_sample=1,
        default_tiles_per_image=min(VL2_DEFAULT_LOCAL_TILES, max_local),
        newline_tokens=root.get_str("tile_tag", "2D") == "2D",
    )
    return VisionParts(blocks, tiling)


def _vl2_projector(root: ConfigReader, width: int, lm_hidden: int) -> tuple[int, int, int]:
    """DeepSeek-VL2's downsample_mlp_gelu projector: (output width, MLP ratio, downsample ratio)."""
    p = root.sub("projector_config")
    ptype = p.get_str("projector_type", "downsample_mlp_gelu")
    if ptype != "downsample_mlp_gelu":
        p.fail("projector_type", f"({ptype!r}) is not supported; dsplan knows downsample_mlp_gelu")
    in_dim = p.get_int("input_dim", width)
    n_embed = p.get_int("n_embed", lm_hidden)
    depth = p.get_int("depth", 2)
    ratio = p.get_int("mlp_ratio", 1)
    down = p.get_int("downsample_ratio", 2)
    if in_dim != width:
        p.fail("input_dim", f"({in_dim}) must equal the vision width ({width})")
    if n_embed != lm_hidden:
        p.fail("n_embed", f"({n_embed}) must equal the language hidden size ({lm_hidden}): "
                          "image_newline is added to text embeddings")
    if depth != 2:
        p.fail("depth", f"({depth}) is not supported; dsplan models the 2-layer downsample MLP")
    return n_embed, ratio, down


def _max_local_tiles(root: ConfigReader, tile: int) -> int:
    """Largest local canvas among candidate_resolutions, in tiles (9 for the 3x3 / 1x9 grids)."""
    if "candidate_resolutions" not in root.config:
        root.defaulted.append(root.path("candidate_resolutions"))
        return 9
    value = root.config["candidate_resolutions"]
    ok = isinstance(value, list) and value and all(
        isinstance(r, list) and len(r) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= MAX_CONFIG_INT for x in r)
        for r in value
    )
    if not ok:
        root.fail("candidate_resolutions", f"must be a non-empty list of [width, height] pixel pairs, each at most "
                                           f"{MAX_CONFIG_INT:,}")
    return max(max(1, (w // tile) * (h // tile)) for w, h in value)


def qwen2_vl_vision(root: ConfigReader, lm_hidden: int) -> VisionParts:
    """Qwen2-VL ViT + PatchMerger. Absent keys take transformers' Qwen2VLVisionConfig defaults.

    The published configs store only ``in_chans`` and ``spatial_patch_size`` (+``hidden_size``
    for 72B) in ``vision_config``; the rest are those class defaults (reference README sec. 4).
    """
    v = root.sub("vision_config")
    depth = v.get_int("depth", 32)
    embed = v.get_int("embed_dim", 1280)
    heads = v.get_int("num_heads", 16)
    mlp_ratio = v.get_float("mlp_ratio", 4.0, maximum=MAX_MLP_RATIO, why=_MLP_RATIO_WHY)
    patch = v.get_int(("patch_size", "spatial_patch_size"), 14)
    temporal = v.get_int("temporal_patch_size", 2)
    merge = v.get_int("spatial_merge_size", 2)
    channels = v.get_int(("in_channels", "in_chans"), 3)
    out = v.get_int("hidden_size", lm_hidden)
    act = v.get_str("hidden_act", "quick_gelu")
    acts = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
    if act not in acts:
        v.fail("hidden_act", f"({act!r}) is not a known vision activation ({', '.join(acts)})")
    if embed % heads:
        v.fail("num_heads", f"({heads}) must divide embed_dim ({embed})")
    if out != lm_hidden:
        v.fail("hidden_size",
               f"({out}) must equal the language hidden size ({lm_hidden}): the merger feeds the decoder")
    if QWEN2VL_TILE_PX % (patch * merge):
        v.fail("patch_size",
               f"({patch}) x spatial_merge_size ({merge}) must divide the {QWEN2VL_TILE_PX}-px planning tile")
    mlp = int(embed * mlp_ratio)
    grid = QWEN2VL_TILE_PX // patch
    blocks = [
        VisionEmbedBlock(hidden=embed, patch_size=patch, channels=channels, temporal_patch=temporal,
                         patch_bias=False, learned_positions=0),
        *[VisionBlock(hidden=embed, heads=heads, mlp=mlp, act=acts[act],
                      qkv_bias=True) for _ in range(depth)],
        ProjectorBlock(in_dim=embed, merge=merge * merge, mlp_hidden=embed * merge * merge, out_dim=out,
                       in_norm="layernorm"),
    ]
    tiling = VisionTiling(
        tile_px=QWEN2VL_TILE_PX,
        patches_per_tile=grid * grid,
        tokens_per_tile=grid * grid // (merge * merge),
        global_view=False,
        max_local_tiles=QWEN2VL_MAX_TILES,
        default_images_per_sample=1,
        default_tiles_per_image=QWEN2VL_DEFAULT_TILES,
        newline_tokens=False,
    )
    return VisionParts(blocks, tiling)

