"""Plain-data summaries of a ModelSpec, for ``dsplan models`` and anything else that reports.

Keys are snake_case and stable (they are the ``--json`` output). Consecutive identical blocks
are grouped ("decoder (MoE) x29") so a 126-layer model reads as a few rows.
"""

from __future__ import annotations

from typing import Any

from planner.model.spec import (
    DecoderBlock,
    EmbeddingBlock,
    LMHeadBlock,
    ModelSpec,
    MoEMLP,
    MTPBlock,
    NormBlock,
    ProjectorBlock,
    VisionBlock,
    VisionEmbedBlock,
)

_VISION_KINDS = ("vision_embed", "vision", "projector")


def block_label(block: Any, in_vision: bool = False) -> str:
    """A short human name: 'decoder (MoE, MLA)', 'decoder (MoE, GQA, window 128)', 'lm_head (tied)'."""
    if isinstance(block, DecoderBlock):
        mlp = "MoE" if isinstance(block.mlp, MoEMLP) else "dense"
        window = f", window {block.attention.window}" if block.attention.window else ""
        return f"decoder ({mlp}, {block.attention.kind.upper()}{window})"
    if isinstance(block, MTPBlock):  # its layer's kind, after the main model's head
        return "mtp depth " + block_label(block.layer).removeprefix("decoder ")
    if isinstance(block, NormBlock):
        return "norm (vision)" if in_vision else "norm"
    if isinstance(block, LMHeadBlock):
        return "lm_head (tied)" if block.tied else "lm_head"
    if isinstance(block, VisionBlock):
        return "vision block"
    if isinstance(block, VisionEmbedBlock):
        return "vision patch embed"
    if isinstance(block, ProjectorBlock):
        return "projector"
    if isinstance(block, EmbeddingBlock):
        return "embedding"
    return block.kind


def block_groups(spec: ModelSpec) -> list[dict[str, Any]]:
    """Runs of identical consecutive blocks, with per-block and per-run parameter counts."""
    groups: list[dict[str, Any]] = []
    seen_embedding = False
    for index, block in enumerate(spec.blocks):
        seen_embedding = seen_embedding or isinstance(block, EmbeddingBlock)
        if groups and groups[-1]["_block"] == block:
            groups[-1]["count"] += 1
            continue
        groups.append({"_block": block, "first_index": index, "count": 1,
                       "label": block_label(block, in_vision=not seen_embedding)})
    out = []
    for g in groups:
        block, count = g.pop("_block"), g["count"]
        each, active = block.params(), block.activated_params()
        out.append({
            "kind": block.kind,
            "label": g["label"],
            "first_index": g["first_index"],
            "count": count,
            "params_each": each,
            "activated_params_each": active,
            "params_total": each * count,
            "activated_params_total": active * count,
            "block": block.model_dump(),
        })
    return out


def moe_facts(spec: ModelSpec) -> dict[str, int]:
    """Routed / shared experts, top-k and the number of MoE layers (zeros for dense models)."""
    moe = [b.mlp for b in spec.decoder_blocks if isinstance(b.mlp, MoEMLP)]
    if not moe:
        return {"routed_experts": 0, "shared_experts": 0, "top_k": 0, "moe_layers": 0}
    return {"routed_experts": moe[0].routed_experts, "shared_experts": moe[0].shared_experts,
            "top_k": moe[0].top_k, "moe_layers": len(moe)}


def vision_params(spec: ModelSpec) -> int:
    """Parameters of the vision tower and projector (everything before the token embedding)."""
    total = 0
    for block in spec.blocks:
        if isinstance(block, EmbeddingBlock):
            break
        total += block.params()
    return total


def model_summary(spec: ModelSpec, blocks: bool = False) -> dict[str, Any]:
    """The catalog row of a model; with ``blocks`` also its grouped block breakdown."""
    first = spec.decoder_blocks[0]
    head = next(b for b in spec.blocks if isinstance(b, LMHeadBlock))
    out: dict[str, Any] = {
        "name": spec.name,
        "family": spec.family,
        "hf_model_type": spec.hf_model_type,
        "total_params": spec.total_params(),
        "mtp_layers": spec.mtp_layers,
        "mtp_params": spec.total_params() - spec.with_mtp_layers(0).total_params(),
        "activated_params": spec.activated_params(),
        "activated_params_incl_embedding": spec.activated_params(include_input_embedding=True),
        "stated_total_params": spec.stated_total_params,
        "stated_activated_params": spec.stated_activated_params,
        "layers": spec.num_layers,
        "hidden": spec.hidden,
        "heads": first.attention.heads,
        "kv_heads": first.attention.kv_heads,
        "attention": first.attention.kind,
        "vocab": spec.vocab,
        "tied_embeddings": head.tied,
        "max_seq_len": spec.max_seq_len,
        "train_seq_len": spec.train_seq_len,
        **moe_facts(spec),
        "vision": spec.is_vlm,
        "vision_params": vision_params(spec),
        "tiling": spec.vision.model_dump() if spec.vision else None,
        "positions": spec.positions.model_dump() if spec.positions else None,
        "norm_eps": spec.norm_eps,
        "defaulted": list(spec.defaulted),
    }
    if blocks:
        out["blocks"] = block_groups(spec)
    return out


def describe_positions(positions: dict[str, Any] | None, norm_eps: float | None) -> str:
    """One line on what a launcher must restate: the position encoding and the norm epsilon."""
    if positions is None:
        text = "positions: not stated"
    elif positions["kind"] == "learned":
        text = "positions: learned table"
    elif positions["kind"] == "alibi":
        text = "positions: ALiBi biases (no position table)"
    else:
        name = "M-RoPE" if positions["kind"] == "mrope" else "RoPE"
        theta = positions["rope_theta"]
        text = (f"positions: {name} base {int(theta):,}" if float(theta).is_integer()
                else f"positions: {name} base {theta:g}")
        if positions["rotary_percent"] < 1:
            text += f" on {positions['rotary_percent']:.0%} of each head"
        scaling = positions["rope_scaling"] or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind and kind != "mrope":
            text += f", {kind} scaling" + (f" x{scaling['factor']:g}"
                                           if isinstance(scaling.get("factor"), (int, float)) else "")
    return text + (f"; norm epsilon {norm_eps:g}" if norm_eps else "")
