"""Megatron-LM / Megatron-DeepSpeed position flags for a model: RoPE (base, partial rotation,
Llama 3.1's scaling, YaRN for MLA and for standard attention, multimodal sections), learned
tables and BigScience's ALiBi, with a note for each thing a parser cannot say."""

from __future__ import annotations

from planner.emit.megatron_flag import Arg, _a
from planner.errors import UserError
from planner.model.spec import EmbeddingBlock, ModelSpec

# Megatron-Core's YaRN for MLA (MLATransformerConfig) fixes these; the CLI sets the rest.
MEGATRON_YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
# Megatron-LM's --use-rope-scaling applies Llama 3.1's scaling with these fixed
# (megatron/core/models/common/embeddings/rotary_pos_embedding.py); the CLI sets the factor.
MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}


BIGSCIENCE_FORK_NOTE = ("ALiBi (--position-embedding-type alibi, --embed-layernorm) is in BigScience's fork, "
                        "github.com/bigscience-workshop/Megatron-DeepSpeed, which trained BLOOM; "
                        "deepspeedai/Megatron-DeepSpeed's parser refuses these flags: run this plan on that fork")


def _alibi_args(model: ModelSpec, embedding: EmbeddingBlock, mds: bool) -> tuple[list[Arg], list[str]]:
    """ALiBi exists only in BigScience's Megatron-DeepSpeed: its flags, and the note naming the fork."""
    if not mds:
        raise UserError(f"{model.name}: ALiBi position biases have no Megatron-LM flag; "
                        "plan it with --framework megatron-deepspeed or deepspeed")
    args = [_a("--position-embedding-type", "alibi")]
    if embedding.norm is not None:
        args.append(_a("--embed-layernorm"))
    return args, [BIGSCIENCE_FORK_NOTE]


def position_args(model: ModelSpec, mds: bool) -> tuple[list[Arg], list[str]]:
    """Position flags, and notes on what the parser cannot say (written into megatron_args.sh).

    Megatron-LM (megatron/training/arguments.py): --position-embedding-type
    learned_absolute|rope|yarn|mrope, --rotary-base (an int, default 10000), --rotary-percent,
    --use-rope-scaling/--rope-scaling-factor (Llama 3.1), --mrope-section; MLA layers take YaRN
    from --rotary-scaling-factor/--mscale/--mscale-all-dim. Megatron-DeepSpeed
    (megatron/arguments.py): a learned table unless --no-position-embedding,
    --use-rotary-position-embeddings, --rotary-position-embeddings-theta (an int), no scaling.
    ALiBi is BigScience's fork of Megatron-DeepSpeed (bigscience-workshop/Megatron-DeepSpeed
    megatron/arguments.py: --position-embedding-type alibi, --embed-layernorm), on which BLOOM
    was trained; Megatron-LM has none (framework_rules.RULES refuses such plans)."""
    embedding = next(b for b in model.blocks if isinstance(b, EmbeddingBlock))
    pos = model.positions
    kind = pos.kind if pos else ("learned" if embedding.learned_positions else "rope")
    if kind == "alibi":
        return _alibi_args(model, embedding, mds)
    if kind == "learned":
        return ([] if mds else [_a("--position-embedding-type", "learned_absolute")]), []
    args = ([_a("--use-rotary-position-embeddings"), _a("--no-position-embedding")] if mds
            else [_a("--position-embedding-type", kind)])
    notes: list[str] = []
    if pos is None:
        return args, notes
    theta = pos.rope_theta or 10000.0
    if float(theta).is_integer():
        args.append(_a("--rotary-position-embeddings-theta" if mds else "--rotary-base", int(theta)))
    else:
        notes.append(f"rope_theta {theta:g} is not an integer, which the parser's rotary base must be; "
                     "set it in the model code")
    if pos.rotary_percent < 1:
        args.append(_a("--rotary-percent", pos.rotary_percent))
    scaling = pos.rope_scaling or {}
    if kind == "mrope":
        if mds:
            notes.append("Megatron-DeepSpeed has no multimodal RoPE (M-RoPE): text positions run as 1-D RoPE")
        elif isinstance(scaling.get("mrope_section"), list):
            # nargs='+': one word per section, so the value goes unquoted (digits only)
            args.append(_a("--mrope-section", " ".join(str(int(x)) for x in scaling["mrope_section"]), raw=True))
        return args, notes
    if not pos.scaling_type:
        return args, notes
    head, scaled, scaled_notes = _scaling_args(model, pos.scaling_type, scaling, mds)
    return ([head] if head is not None else args[:1]) + args[1:] + scaled, notes + scaled_notes


def _scaling_args(model: ModelSpec, stype: str, scaling: dict, mds: bool) -> tuple[Arg | None, list[Arg], list[str]]:
    """RoPE scaling in Megatron-LM's flags: Llama 3.1's, MLA's YaRN, YaRN on standard attention
    (whose --position-embedding-type yarn replaces rope: the first return, else None); with what
    the parser cannot say as notes."""
    factor = scaling.get("factor")
    mla = model.decoder_blocks[0].attention.kind == "mla"
    args: list[Arg] = []
    notes: list[str] = []
    if mds:
        notes.append(f"rope_scaling ({stype}, factor {factor}) has no Megatron-DeepSpeed flag: positions run unscaled")
    elif stype == "llama3" and isinstance(factor, (int, float)):
        args += [_a("--use-rope-scaling"), _a("--rope-scaling-factor", float(factor))]
        notes += _fixed_differs(scaling, MEGATRON_LLAMA3_FIXED, "--use-rope-scaling")
    elif stype == "yarn" and mla and isinstance(factor, (int, float)):
        args += [_a("--rotary-scaling-factor", float(factor)), *_mscale_args(scaling)]
        notes += _fixed_differs(scaling, MEGATRON_YARN_FIXED, "MLA's YaRN")
    elif stype == "yarn" and isinstance(factor, (int, float)):
        yarn, yarn_notes = _yarn_args(scaling, float(factor))
        return _a("--position-embedding-type", "yarn"), yarn, yarn_notes
    else:
        notes.append(f"rope_scaling ({stype}, factor {factor}) has no Megatron-LM flag for this attention: positions "
                     "run unscaled")
    return None, args, notes


def _yarn_args(scaling: dict, factor: float) -> tuple[list[Arg], list[str]]:
    """YaRN on standard attention (gpt-oss): Megatron-Core's --position-embedding-type yarn reads
    the factor, the original context, beta fast/slow and the rounding of the correction range
    (megatron/training/argument_utils.py, _apply_yarn_config_from_args). Hugging Face's defaults
    (modeling_rope_utils, _compute_yarn_parameters): beta_fast 32, beta_slow 1, truncate true, and
    an attention factor of 0.1 ln(factor) + 1, which Megatron's mscale 1 / mscale_all_dim 0 give too."""
    args = [_a("--rotary-scaling-factor", factor)]
    original = scaling.get("original_max_position_embeddings")
    if isinstance(original, int):
        args.append(_a("--yarn-original-max-position-embeddings", original))
    args += [_a("--yarn-beta-fast", float(scaling.get("beta_fast", 32))),
             _a("--yarn-beta-slow", float(scaling.get("beta_slow", 1)))]
    if scaling.get("truncate") is False:
        args.append(_a("--no-yarn-correction-range-round-to-int"))
    args += _mscale_args(scaling)
    notes = ([f"YaRN's attention_factor {scaling['attention_factor']} has no Megatron-LM flag: it runs at "
              "0.1 ln(factor) + 1"] if isinstance(scaling.get("attention_factor"), (int, float)) else [])
    return args, notes


def _mscale_args(scaling: dict) -> list[Arg]:
    """YaRN's attention scaling as the config states it (DeepSeek: mscale, mscale_all_dim)."""
    flags = (("mscale", "--mscale"), ("mscale_all_dim", "--mscale-all-dim"))
    return [_a(flag, float(scaling[key])) for key, flag in flags if isinstance(scaling.get(key), (int, float))]


def _fixed_differs(scaling: dict, fixed: dict, what: str) -> list[str]:
    return [f"{what} fixes {k} at {v}; this model's config says {scaling[k]}" for k, v in fixed.items()
            if isinstance(scaling.get(k), (int, float)) and float(scaling[k]) != float(v)]
