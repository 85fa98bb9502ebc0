"""Shrink a ModelSpec to a size a laptop (or a CPU test) can train, keeping its structure.

The reference trainer must exercise the same code paths as the real model: a ViT tower on
tiles, a 2x2-merging projector, a dense first decoder layer followed by MoE layers with shared
experts, GQA or MLA attention. ``scale_spec`` keeps every block *kind* and every run of
repeated blocks inside every pipeline stage, and only shrinks widths, repeat counts, experts,
vocabulary and patches per tile. The result is again a plain ``ModelSpec``, plus the pipeline
boundaries on its (shorter) block list: stage ``i`` of the scaled model holds exactly the
survivors of the planner's stage ``i``, so the planner's partition carries over unchanged.

Pure data; no torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.errors import UserError
from planner.model.spec import (
    MLA,
    Attention,
    DecoderBlock,
    DenseMLP,
    EmbeddingBlock,
    LMHeadBlock,
    ModelSpec,
    MoEMLP,
    NormBlock,
    ProjectorBlock,
    VisionBlock,
    VisionEmbedBlock,
    VisionTiling,
)


@dataclass(frozen=True)
class Scale:
    """Target sizes. ``factor`` is None for the named presets, else the fraction F."""

    name: str
    hidden: int | None  # language hidden size (None: derive from factor)
    heads: int | None
    vision_hidden: int | None
    vision_heads: int | None
    max_repeat: int | None  # blocks kept per run of repeated blocks per stage
    max_experts: int | None
    vocab: int | None
    patch_grid: int | None  # patches per tile side
    factor: float | None = None


TINY = Scale("tiny", hidden=64, heads=4, vision_hidden=32, vision_heads=2, max_repeat=2, max_experts=4,
             vocab=512, patch_grid=4)
SMALL = Scale("small", hidden=128, heads=8, vision_hidden=64, vision_heads=4, max_repeat=4, max_experts=8,
              vocab=2048, patch_grid=8)


def parse_scale(text: str) -> Scale:
    """``tiny`` | ``small`` | a fraction F in (0, 1] of every size (1 = the real model)."""
    if text == "tiny":
        return TINY
    if text == "small":
        return SMALL
    try:
        factor = float(text)
    except ValueError:
        raise UserError(f"--scale {text!r}: use tiny, small or a fraction such as 0.25")
    if not 0 < factor <= 1:
        raise UserError(f"--scale {text!r}: the fraction must be in (0, 1]")
    return Scale(f"{factor:g}", None, None, None, None, None, None, None, None, factor=factor)


def _round_to(x: float, multiple: int, minimum: int) -> int:
    return max(minimum, int(round(x / multiple)) * multiple)


@dataclass(frozen=True)
class _Widths:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ratio: float  # new hidden / old hidden, for FFN and rank widths


def _lm_widths(spec: ModelSpec, scale: Scale, tp: int) -> _Widths:
    attn = spec.decoder_blocks[0].attention
    h, heads = spec.hidden, attn.heads
    group = heads // attn.kv_heads if attn.kind != "mla" else 1
    if scale.factor is None:
        hidden, n_heads = scale.hidden or h, scale.heads or heads
    else:
        n_heads = max(2, round(heads * scale.factor))
        hidden = n_heads * max(8, round(h * scale.factor / n_heads))
    # keep GQA (kv < heads) but give every tensor-parallel rank at least one kv head
    kv = max(tp, n_heads // group, 1)
    n_heads = max(n_heads, kv) // kv * kv
    if hidden % n_heads:
        hidden = n_heads * math.ceil(hidden / n_heads)
    return _Widths(hidden, n_heads, kv if attn.kind != "mla" else n_heads, hidden // n_heads, hidden / h)


def _ffn(width: int, ratio: float, tp: int) -> int:
    return _round_to(width * ratio, 8 * tp, 8 * tp)


def _experts(n: int, scale: Scale, ep: int) -> int:
    target = min(n, scale.max_experts) if scale.factor is None else max(1, round(n * scale.factor))
    return max(ep, math.ceil(target / ep) * ep)


def _scale_attention(a: Attention, w: _Widths) -> Attention:
    if a.kind == "mla":
        assert a.mla is not None
        m = a.mla
        dim = lambda x: _round_to(x * w.ratio, 2, 8)  # noqa: E731 - one local rule for every rank
        mla = MLA(
            q_lora_rank=dim(m.q_lora_rank) if m.q_lora_rank else None,
            kv_lora_rank=dim(m.kv_lora_rank),
            qk_nope_head_dim=dim(m.qk_nope_head_dim),
            qk_rope_head_dim=dim(m.qk_rope_head_dim),
            v_head_dim=dim(m.v_head_dim),
        )
        return Attention(kind="mla", heads=w.heads, kv_heads=w.heads, head_dim=mla.q_head_dim, mla=mla,
                         qkv_bias=a.qkv_bias, out_bias=a.out_bias)
    kind = "mha" if w.kv_heads == w.heads else "gqa"
    return Attention(kind=kind, heads=w.heads, kv_heads=w.kv_heads, head_dim=w.head_dim,
                     qkv_bias=a.qkv_bias, out_bias=a.out_bias)


def _scale_decoder(b: DecoderBlock, w: _Widths, scale: Scale, tp: int, ep: int) -> DecoderBlock:
    mlp = b.mlp
    if isinstance(mlp, MoEMLP):
        experts = _experts(mlp.routed_experts, scale, ep)
        new_mlp: DenseMLP | MoEMLP = MoEMLP(
            routed_experts=experts,
            top_k=min(mlp.top_k, 2, experts),  # DeepSpeed's gate supports top-1 and top-2
            expert_ffn=_ffn(mlp.expert_ffn, w.ratio, tp),
            shared_experts=mlp.shared_experts,
            shared_ffn=_ffn(mlp.shared_ffn, w.ratio, tp) if mlp.shared_ffn else 0,
            gate_bias=mlp.gate_bias,
            act=mlp.act,
            glu_limit=mlp.glu_limit,
            shared_gate=mlp.shared_gate,
        )
    else:
        new_mlp = DenseMLP(ffn=_ffn(mlp.ffn, w.ratio, tp), act=mlp.act, bias=mlp.bias)
    return DecoderBlock(hidden=w.hidden, attention=_scale_attention(b.attention, w), mlp=new_mlp, norm=b.norm)


def _vision_widths(spec: ModelSpec, scale: Scale) -> tuple[int, int, float]:
    vb = next(b for b in spec.blocks if isinstance(b, VisionBlock))
    if scale.factor is None:
        hidden, heads = scale.vision_hidden or vb.hidden, scale.vision_heads or vb.heads
    else:
        heads = max(1, round(vb.heads * scale.factor))
        hidden = heads * max(8, round(vb.hidden * scale.factor / heads))
    return hidden, heads, hidden / vb.hidden


def _patch_grid(spec: ModelSpec, scale: Scale, merge: int) -> int:
    assert spec.vision is not None
    full = int(round(math.sqrt(spec.vision.patches_per_tile)))
    grid = scale.patch_grid if scale.factor is None else max(2, round(full * scale.factor))
    side = max(1, int(round(math.sqrt(merge))))
    return max(side, grid // side * side)  # the projector merges side x side patches


def _scale_block(b, spec: ModelSpec, scale: Scale, w: _Widths, tp: int, ep: int, grid: int, in_vision: bool):
    vocab = (scale.vocab or spec.vocab) if scale.factor is None else max(256, round(spec.vocab * scale.factor))
    if isinstance(b, EmbeddingBlock):
        return EmbeddingBlock(vocab=vocab, hidden=w.hidden, learned_positions=min(b.learned_positions, 4096),
                              norm=b.norm)
    if isinstance(b, LMHeadBlock):
        return LMHeadBlock(vocab=vocab, hidden=w.hidden, tied=False)
    if isinstance(b, DecoderBlock):
        return _scale_decoder(b, w, scale, tp, ep)
    if isinstance(b, NormBlock):
        hv = _vision_widths(spec, scale)[0] if in_vision else w.hidden
        return NormBlock(hidden=hv, norm=b.norm)
    hv, vheads, vratio = _vision_widths(spec, scale)
    if isinstance(b, VisionEmbedBlock):
        patch = 2 if scale.factor is None else max(1, round(b.patch_size * scale.factor))
        return VisionEmbedBlock(hidden=hv, patch_size=patch, channels=b.channels, temporal_patch=b.temporal_patch,
                                patch_bias=b.patch_bias, learned_positions=grid * grid)
    if isinstance(b, VisionBlock):
        return VisionBlock(hidden=hv, heads=vheads, mlp=_ffn(b.mlp, vratio, tp), act=b.act, qkv_bias=b.qkv_bias,
                           norm=b.norm)
    if isinstance(b, ProjectorBlock):
        return ProjectorBlock(in_dim=hv, merge=b.merge, mlp_hidden=w.hidden, out_dim=w.hidden, in_norm=b.in_norm,
                              extra_vectors=b.extra_vectors)
    raise TypeError(f"unknown block kind {type(b).__name__}")


def _signature(b) -> tuple[str, bool]:
    return (b.kind, isinstance(b, DecoderBlock) and b.is_moe)


def _keep_indices(blocks: list, first: int, last: int, scale: Scale) -> list[int]:
    """Indices kept in [first, last): runs of repeated blocks shrink; singletons stay."""
    kept: list[int] = []
    i = first
    while i < last:
        j = i
        while j < last and _signature(blocks[j]) == _signature(blocks[i]):
            j += 1
        n = j - i
        if blocks[i].kind in ("vision", "decoder"):
            keep = min(n, scale.max_repeat) if scale.factor is None else max(1, round(n * scale.factor))
        else:
            keep = n
        kept.extend(range(i, i + keep))
        i = j
    return kept


@dataclass(frozen=True)
class ScaledModel:
    """The scaled spec, which original block each layer came from, and the stage boundaries."""

    spec: ModelSpec
    origin: list[int]  # origin[layer] = index into the original ModelSpec.blocks
    parts: list[int]  # DeepSpeed-style boundaries: stage s owns layers parts[s]:parts[s+1]


def scale_spec(spec: ModelSpec, scale: Scale, stage_blocks: list[tuple[int, int]] | None = None,
               tp: int = 1, ep: int = 1) -> ScaledModel:
    """Shrink ``spec`` per ``scale``; ``stage_blocks`` are the planner's [first, last) per stage."""
    n = len(spec.blocks)
    stages = [tuple(s) for s in stage_blocks] if stage_blocks else [(0, n)]
    if stages[-1][1] != n:
        raise UserError(f"plan.json: stage_blocks ends at block {stages[-1][1]} but model {spec.name} has {n} "
                        "blocks; regenerate the run directory for this model")
    w = _lm_widths(spec, scale, tp)
    merge = next((b.merge for b in spec.blocks if isinstance(b, ProjectorBlock)), 1)
    grid = _patch_grid(spec, scale, merge) if spec.is_vlm else 0
    origin: list[int] = []
    parts = [0]
    for first, last in stages:
        origin.extend(_keep_indices(spec.blocks, first, last, scale))
        parts.append(len(origin))
    # a norm before the projector (or the token embedding) closes the vision tower
    lm_start = next(i for i, b in enumerate(spec.blocks) if isinstance(b, (ProjectorBlock, EmbeddingBlock)))
    blocks = [_scale_block(spec.blocks[i], spec, scale, w, tp, ep, grid, i < lm_start) for i in origin]
    vision = None
    if spec.vision is not None:
        patches = grid * grid
        vision = VisionTiling(
            tile_px=grid * next(b.patch_size for b in blocks if isinstance(b, VisionEmbedBlock)),
            patches_per_tile=patches, tokens_per_tile=max(1, patches // merge),
            global_view=spec.vision.global_view, max_local_tiles=spec.vision.max_local_tiles,
            default_images_per_sample=spec.vision.default_images_per_sample,
            default_tiles_per_image=spec.vision.default_tiles_per_image,
        )
    scaled = ModelSpec(name=f"{spec.name}@{scale.name}", family=spec.family, hf_model_type=spec.hf_model_type,
                       max_seq_len=spec.max_seq_len, train_seq_len=spec.train_seq_len, blocks=blocks, vision=vision)
    return ScaledModel(spec=scaled, origin=origin, parts=parts)
