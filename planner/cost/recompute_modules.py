"""Megatron-Core's selective recompute modules (--recompute-modules): which a model can use.

What each module runs again and frees is priced per block in transformer_layers.py
(LayerCost.rerun); this module reads the user's list and refuses the ones that name nothing in
the model, or that Megatron-Core refuses (transformer_config.py __post_init__).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from planner.cost.layer_cost import RECOMPUTE_MODULES
from planner.errors import UserError, arg, name_list

if TYPE_CHECKING:  # pragma: no cover - imports for type checkers only
    from planner.model.spec import ModelSpec

DEFAULT = ("core_attn",)  # Megatron-Core's default for --recompute-granularity selective


def parse_recompute_modules(value: "str | Sequence[str] | None") -> tuple[str, ...] | None:
    """'moe_act,layernorm' (or a sequence) -> the modules in RECOMPUTE_MODULES order; None: auto."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return name_list("recompute_modules", value, RECOMPUTE_MODULES, "module",
                     "Megatron-Core's selective recompute modules")


def auto_modules(model: "ModelSpec", flash_attention: bool, recipe: str | None = None) -> tuple[str, ...]:
    """``--recompute-modules`` left out: Megatron-Core's default, the attention core, where the
    attention is unfused (its s^2 scores are what selective recompute frees: Korthikanti et al.
    2022 Sec 4.1); under FlashAttention, which keeps no scores, so that the core's recompute would
    free nothing, the output-discarding modules the model has (layernorm, mla_up_proj, moe_act):
    the little memory-bound work and up-projections NVIDIA's MoE recipes recompute (under FP8
    delayed scaling, which refuses layernorm and moe_act, mla_up_proj alone, else the core)."""
    if not flash_attention:
        return DEFAULT
    cheap = ("mla_up_proj",) if recipe == "fp8-delayed" else ("layernorm", "mla_up_proj", "moe_act")
    return tuple(m for m in cheap if m in _present(model)) or DEFAULT


def _present(model: "ModelSpec") -> set[str]:
    """The modules that name something in ``model``'s decoder layers."""
    from planner.model.spec import DecoderBlock, DenseMLP, MoEMLP

    out = {"core_attn", "layernorm"}
    for b in model.blocks:
        layer = getattr(b, "layer", b)
        if not isinstance(layer, DecoderBlock):
            continue
        out |= {"mla_up_proj"} if layer.attention.kind == "mla" else set()
        out |= {"mlp"} if isinstance(layer.mlp, DenseMLP) else set()
        if isinstance(layer.mlp, MoEMLP):
            out |= {"moe_act", "moe"} | ({"shared_experts"} if layer.mlp.shared_ffn else set())
    return out


def check_recompute_modules(modules: tuple[str, ...], model: "ModelSpec", recipe: str | None) -> None:
    """One clear message for a module ``model`` does not have, or one the recipe cannot recompute."""
    if modules == DEFAULT:
        return
    missing = [m for m in modules if m not in _present(model)]
    if missing:
        raise UserError(f"{arg('recompute_modules')}: {model.name} has nothing for {', '.join(missing)} to recompute "
                        f"(mla_up_proj needs multi-latent attention, moe and moe_act a mixture-of-experts layer, "
                        f"shared_experts shared experts, mlp a dense MLP layer); drop "
                        f"{'it' if len(missing) == 1 else 'them'}")
    if recipe == "fp8-delayed" and {"moe_act", "layernorm"} & set(modules):
        raise UserError(f"{arg('recompute_modules')}: Megatron-Core recomputes moe_act and layernorm under FP8 with "
                        f"current or block scaling only; use {arg('precision')} fp8-tensorwise, fp8-blockwise or "
                        f"mxfp8, or drop moe_act and layernorm")
