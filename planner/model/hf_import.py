"""Build a ModelSpec from a Hugging Face ``config.json`` dict.

Dispatch is on ``model_type``: each known type fixes the family facts its config does not
spell out (norm kind, gated MLP, which linears have biases, tied head, learned positions),
exactly as the transformers / vendor model classes hard-code them. The decoder shape itself
always comes from the keys (aliases in ``hf_keys``), so one builder serves every family:
MLA when the config has DeepSeek's latent ranks, MoE in the DeepSeek, Mixtral or Qwen-MoE
layout when their expert keys are present, sliding windows per ``layer_types``. Every
default applied is listed in ``ModelSpec.defaulted``. Source of the rules: reference/models/README.md sec. 5.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from planner import limits
from planner.errors import UserError, describe_validation_error
from planner.limits import shown
from planner.model import hf_keys as K
from planner.model.hf_keys import ConfigReader
from planner.model.hf_router import router_from_config
from planner.model.hf_vision import deepseek_vl2_vision, qwen2_vl_vision
from planner.model.spec import (
    MLA,
    Attention,
    DecoderBlock,
    DenseMLP,
    EmbeddingBlock,
    LMHeadBlock,
    ModelSpec,
    MoEMLP,
    MTPBlock,
    NormBlock,
    Positions,
)

# Long context windows are reached by a short extension phase after pretraining at a shorter
# length (Llama 3.1: 8K then 128K; DeepSeek-V2/V3: 4K then YaRN). Plans are for the main phase,
# so an imported model's default training length is its window capped at this value.
TRAIN_SEQ_CAP = 8192


class HFImportWarning(UserWarning):
    """A config imported with a guess the user should check (unknown model_type, ignored parts)."""


@dataclass(frozen=True)
class Family:
    """What a model class hard-codes that its config.json leaves out."""

    name: str
    norm: str = "rmsnorm"
    gated: bool | None = True  # None: decided by the activation (unknown model types)
    act_keys: tuple[str, ...] = ("hidden_act",)
    default_act: str = "silu"
    qkv_bias: bool = False  # Qwen2: q/k/v projections carry biases, o_proj does not
    linear_bias: bool = False  # GPT-2 / BLOOM / NeoX: every linear layer has a bias
    tied: bool = False  # the model class's tie_word_embeddings default
    learned_positions: bool = False
    embedding_norm: bool = False  # BLOOM's word_embeddings_layernorm
    deepseek: bool = False  # DeepSeek's bundled DeepseekV2Config defaults and MLA
    has_kv_heads: bool = True  # the config format knows num_key_value_heads at all
    default_ffn_ratio: int | None = None  # n_inner null -> 4 * hidden
    default_max_seq: int | None = None
    vision: str | None = None  # "deepseek_vl2" | "qwen2_vl"
    # Positions and norm epsilon when the config leaves them out: the transformers config
    # class's defaults (LlamaConfig: rope_theta 10000, rms_norm_eps 1e-6; MixtralConfig: 1e6,
    # 1e-5; GPT2/BLOOM/GPT-NeoX: layer-norm epsilon 1e-5; GPT-NeoX rotates 25% of each head).
    positions: str = "rope"  # "rope" | "learned" | "alibi" (mrope is read from rope_scaling)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    rotary_percent: float = 1.0
    attention_bias: bool = False  # the config class's attention_bias default (GptOssConfig: True)
    qk_norm: bool = False  # Qwen3: RMSNorm of head_dim on queries and keys
    sinks: bool = False  # gpt-oss: a learned softmax sink per head
    moe_biases: bool = False  # gpt-oss: the router and every expert projection carry biases
    sliding_window: int | None = None  # without layer_types: this window on even layers (gpt-oss)
    shared_expert: bool = True  # a Qwen-MoE layout reads shared_expert_intermediate_size
    glu_limit: float | None = None  # the clamped GLU's limit when swiglu_limit is left out (GptOssConfig: 7.0)


_DEEPSEEK = dict(deepseek=True)
FAMILIES: dict[str, Family] = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral"),
    "mixtral": Family("Mixtral", rope_theta=1e6, norm_eps=1e-5),
    "qwen2": Family("Qwen2", qkv_bias=True),
    "qwen2_moe": Family("Qwen2-MoE", qkv_bias=True),
    "qwen2_vl": Family("Qwen2-VL", qkv_bias=True, vision="qwen2_vl", rope_theta=1e6),
    "qwen3": Family("Qwen3", qk_norm=True),
    "qwen3_moe": Family("Qwen3-MoE", qk_norm=True, shared_expert=False),
    # GptOssConfig: attention biases, sinks, biased router and experts, 128-token windows on even layers.
    "gpt_oss": Family("gpt-oss", rope_theta=150000.0, norm_eps=1e-5, attention_bias=True, sinks=True,
                      moe_biases=True, sliding_window=128, glu_limit=7.0),
    "deepseek_v2": Family("DeepSeek-V2", **_DEEPSEEK),
    "deepseek_v3": Family("DeepSeek-V3", **_DEEPSEEK),
    "deepseek_vl_v2": Family("DeepSeek-VL2", vision="deepseek_vl2", **_DEEPSEEK),
    "gpt2": Family("GPT-2", norm="layernorm", gated=False, act_keys=("activation_function",), default_act="gelu_new",
                   linear_bias=True, tied=True, learned_positions=True, has_kv_heads=False, default_ffn_ratio=4,
                   positions="learned", norm_eps=1e-5),
    "gpt_neox": Family("GPT-NeoX", norm="layernorm", gated=False, default_act="gelu", linear_bias=True,
                       has_kv_heads=False, default_ffn_ratio=4, norm_eps=1e-5, rotary_percent=0.25),
    # BLOOM has no position table (ALiBi) and no length key; it was trained at 2048.
    "bloom": Family("BLOOM", norm="layernorm", gated=False, act_keys=(), default_act="gelu_tanh", linear_bias=True,
                    tied=True, embedding_norm=True, has_kv_heads=False, default_ffn_ratio=4, default_max_seq=2048,
                    positions="alibi", norm_eps=1e-5),
}
# Unknown model types: a Llama-style decoder read from the standard keys; the head is tied by
# default because that is PretrainedConfig's default.
_GENERIC = Family("unknown", gated=None, tied=True)

# DeepSeek's bundled DeepseekV2Config defaults (deepseek_vl2/models/configuration_deepseek.py),
# not transformers' generic ones (reference README section 1).
DEEPSEEK_DEFAULTS = dict(vocab=102400, layers=30, heads=32, q_lora_rank=1536, kv_lora_rank=512,
                         qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_seq=2048)

_ACTIVATIONS = {
    "silu": "swiglu", "swish": "swiglu", "swiglu": "swiglu",
    "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh", "quick_gelu": "quick_gelu", "relu": "relu",
}


def spec_from_hf_config(config: dict[str, Any], name: str, source: str) -> ModelSpec:
    """Import a config.json dict; ``source`` (a path or preset name) is named in every error.

    Raises UserError for anything the file gets wrong; warns (HFImportWarning) on guesses.
    """
    try:
        spec = _build(config, name, source)
    except ValidationError as err:  # a rule in spec.py the explicit checks here did not catch
        raise UserError(describe_validation_error(source, err)) from None
    params = spec.total_params()
    if params > limits.MAX_PARAMS:
        raise UserError(f"{source}: the model has {shown(params)} parameters, above the largest supported "
                        f"{limits.MAX_PARAMS:,} (five hundred times the largest published models); check its sizes")
    return spec


def _language_config(config: dict[str, Any], source: str) -> tuple[ConfigReader, ConfigReader, Any, str | None]:
    """(the whole config, the language model's part, its family, model_type): a VLM keeps its
    decoder under ``language_config`` or ``text_config``; an unknown model_type imports as a
    Llama-style decoder, with a warning."""
    if not isinstance(config, dict):
        raise UserError(f"{source}: expected a JSON object (a Hugging Face config.json), got {type(config).__name__}")
    root = ConfigReader(config, source)
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        root.fail("model_type", f"must be a string, got {type(model_type).__name__}")
    family = FAMILIES.get(model_type or "")
    if family is None:
        family = _GENERIC
    lm = root.sub("language_config") if family.vision == "deepseek_vl2" else (
        root.sub("text_config") if isinstance(config.get("text_config"), dict) else root)

    _require(lm, family)
    if family is _GENERIC:
        shown = repr(model_type) if model_type else "(none)"
        warnings.warn(f"{source}: model_type {shown} is not one dsplan knows; imported it as a Llama-style "
                      "decoder from its standard keys: check the result with `dsplan models show`",
                      HFImportWarning, stacklevel=4)
    return root, lm, family, model_type


def _build(config: dict[str, Any], name: str, source: str) -> ModelSpec:
    root, lm, family, model_type = _language_config(config, source)
    ds = DEEPSEEK_DEFAULTS if family.deepseek else {}
    hidden = lm.get_int(K.HIDDEN)
    # Every layer becomes a block the planner walks: at most limits.MAX_LAYERS (hf_keys bounds each key).
    layers = lm.get_int(K.LAYERS, ds.get("layers", K.REQUIRED))
    vocab = lm.get_int(K.VOCAB, ds.get("vocab", K.REQUIRED))
    default_seq = ds.get("max_seq") or family.default_max_seq or K.REQUIRED
    max_seq = lm.get_int(K.MAX_SEQ, default_seq)
    tied = lm.get_bool(K.TIED, family.tied) if (lm.has(*K.TIED) or family is _GENERIC) else family.tied

    decoders = _decoders(lm, family, hidden, layers)
    positions = max_seq if family.learned_positions else 0
    blocks: list = []
    vision = None
    if family.vision == "deepseek_vl2":
        parts = deepseek_vl2_vision(root, hidden)
        blocks, vision = list(parts.blocks), parts.tiling
    elif family.vision == "qwen2_vl":
        parts = qwen2_vl_vision(root, hidden)
        blocks, vision = list(parts.blocks), parts.tiling
    blocks.append(EmbeddingBlock(vocab=vocab, hidden=hidden, learned_positions=positions,
                                 norm="layernorm" if family.embedding_norm else None))
    blocks.extend(decoders)
    blocks.append(NormBlock(hidden=hidden, norm=decoders[0].norm))
    blocks.append(LMHeadBlock(vocab=vocab, hidden=hidden, tied=tied))
    # DeepSeek-V3's multi-token-prediction depths follow the head, each one of its last layer's kind.
    blocks.extend([MTPBlock(layer=decoders[-1], vocab=vocab)] * (lm.get_int(K.MTP, minimum=0) if lm.has(*K.MTP) else 0))

    defaulted = list(lm.defaulted)
    train_seq = min(max_seq, TRAIN_SEQ_CAP)
    if train_seq < max_seq:
        defaulted.append("train_seq_len")
    positions = _positions(lm, family)
    norm_eps = lm.get_float(K.NORM_EPS, family.norm_eps)
    return ModelSpec(
        name=name,
        family=family.name if family is not _GENERIC else (model_type or "unknown"),
        hf_model_type=model_type,
        max_seq_len=max_seq,
        train_seq_len=train_seq,
        blocks=blocks,
        vision=vision,
        defaulted=defaulted + [d for d in lm.defaulted if d not in defaulted],
        positions=positions,
        norm_eps=norm_eps,
    )


_SCALING_VALUE = (bool, int, float, str, type(None))


def _positions(lm: ConfigReader, family: Family) -> Positions:
    """The position encoding as a launcher must restate it: the family's kind, the rotary base
    and share, and ``rope_scaling`` as the config gives it (entries that are not numbers,
    strings or number lists are dropped: nothing dsplan emits reads them)."""
    if family.positions != "rope":
        return Positions(kind=family.positions)  # type: ignore[arg-type]
    theta = lm.get_float(K.ROPE_THETA, family.rope_theta)
    percent = lm.get_float(K.ROTARY_PCT, family.rotary_percent) if lm.find(K.ROTARY_PCT) else family.rotary_percent
    if percent > 1:
        lm.fail(lm.find(K.ROTARY_PCT) or K.ROTARY_PCT[0],
                f"must be at most 1 (the share of each head rotated), got {percent}")
    raw = lm.config.get("rope_scaling")
    if raw is not None and not isinstance(raw, dict):
        lm.fail("rope_scaling", "must be a JSON object or null")
    scaling = None
    if raw:
        scaling = {str(k): v for k, v in raw.items()
                   if isinstance(v, _SCALING_VALUE) or (isinstance(v, list) and all(
                       isinstance(x, (int, float)) and not isinstance(x, bool) for x in v))}
    mrope = bool(scaling) and ("mrope_section" in scaling or scaling.get("type") == "mrope"
                               or scaling.get("rope_type") == "mrope")
    return Positions(kind="mrope" if mrope else "rope", rope_theta=theta, rotary_percent=percent, rope_scaling=scaling)


def _require(lm: ConfigReader, family: Family) -> None:
    """Refuse, in one message, a config missing keys that nothing can default."""
    required = {"hidden": K.HIDDEN}
    if not family.deepseek:
        required.update(layers=K.LAYERS, heads=K.HEADS, vocab=K.VOCAB)
        if family.default_max_seq is None:
            required["max_seq"] = K.MAX_SEQ
    if family.default_ffn_ratio is None and not lm.has("num_experts", "n_routed_experts", "num_local_experts"):
        required["ffn"] = K.FFN
    missing = lm.missing_keys(required)
    if missing:
        raise UserError(f"{lm.source}: missing key(s) the planner needs: {'; '.join(missing)}. "
                        "Add them (a Hugging Face config.json of a decoder model has them all)")


def _activation(lm: ConfigReader, family: Family) -> str:
    key = lm.find(family.act_keys) if family.act_keys else None
    raw = lm.get_str(key) if key else family.default_act
    act = _ACTIVATIONS.get(raw)
    if act is None:
        lm.fail(key or "hidden_act", f"names an unknown activation ({raw!r}); known: {', '.join(_ACTIVATIONS)}")
    gated = family.gated if family.gated is not None else act == "swiglu"
    if gated:
        return "swiglu"
    return "gelu" if act == "swiglu" else act


def _attention(lm: ConfigReader, family: Family, hidden: int) -> Attention:
    ds = DEEPSEEK_DEFAULTS if family.deepseek else {}
    heads = lm.get_int(K.HEADS, ds.get("heads", K.REQUIRED))
    use_mla = family.deepseek and (lm.get_bool("use_mla", True) if family.vision or "use_mla" in lm.config else True)
    if use_mla:
        kv_heads = lm.get_int(K.KV_HEADS, heads)  # MLA: every head has its own K and V
        q_lora = lm.opt_int("q_lora_rank", ds["q_lora_rank"], minimum=0) or None
        mla = MLA(
            q_lora_rank=q_lora,
            kv_lora_rank=lm.get_int("kv_lora_rank", ds["kv_lora_rank"]),
            qk_nope_head_dim=lm.get_int("qk_nope_head_dim", ds["qk_nope_head_dim"]),
            qk_rope_head_dim=lm.get_int("qk_rope_head_dim", ds["qk_rope_head_dim"]),
            v_head_dim=lm.get_int("v_head_dim", ds["v_head_dim"]),
        )
        if kv_heads != heads:
            lm.fail("num_key_value_heads", f"({kv_heads}) must equal num_attention_heads ({heads}) for MLA")
        return Attention(kind="mla", heads=heads, kv_heads=heads, head_dim=mla.q_head_dim, mla=mla)
    if family.has_kv_heads:
        kv_heads = lm.get_int(K.KV_HEADS, heads)
    else:
        kv_heads = heads
    if lm.find(K.HEAD_DIM):
        head_dim = lm.get_int(K.HEAD_DIM)
    else:
        if hidden % heads:
            key = lm.find(K.HEADS) or K.HEADS[0]
            lm.fail(key, f"({heads}) must divide the hidden size ({hidden}) or the file must give head_dim")
        head_dim = hidden // heads
    if heads % kv_heads:
        lm.fail(lm.find(K.KV_HEADS) or K.KV_HEADS[0],
                f"({kv_heads}) must divide the number of attention heads ({heads})")
    bias = lm.get_bool("attention_bias", family.attention_bias) if lm.has("attention_bias") else family.attention_bias
    return Attention(kind="mha" if kv_heads == heads else "gqa", heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     qkv_bias=family.qkv_bias or family.linear_bias or bias, out_bias=family.linear_bias or bias,
                     qk_norm=family.qk_norm, sinks=family.sinks)


def _windows(lm: ConfigReader, family: Family, layers: int) -> list[int | None]:
    """Each layer's sliding window (None: full), from transformers' ``layer_types`` and
    ``sliding_window``; without layer_types gpt-oss slides on even layers (GptOssConfig), and
    other families' ``sliding_window`` alone is not read (Qwen2's use_sliding_window is off)."""
    types = lm.str_list("layer_types")
    if types is None and family.sliding_window:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        lm.defaulted.append(lm.path("layer_types"))
    if types is not None and len(types) != layers:
        lm.fail("layer_types", f"has {len(types)} entries for {layers} layers")
    unknown = sorted(set(types or ()) - {"full_attention", "sliding_attention"})
    if unknown:
        lm.fail("layer_types", f"names {unknown[0]!r}: dsplan models full_attention and sliding_attention only")
    if not types or "sliding_attention" not in types:
        return [None] * layers
    window = lm.get_int("sliding_window", family.sliding_window or K.REQUIRED)
    return [window if t == "sliding_attention" else None for t in types]


def _decoders(lm: ConfigReader, family: Family, hidden: int, layers: int) -> list[DecoderBlock]:
    """The decoder blocks, each with its layer's attention window (one object per distinct block)."""
    blocks, windows = _mlp_layers(lm, family, hidden, layers), _windows(lm, family, layers)
    copies: dict[tuple[int, int], DecoderBlock] = {}
    return [b if w is None else copies.setdefault((id(b), w), b.model_copy(update={
        "attention": b.attention.model_copy(update={"window": w})})) for b, w in zip(blocks, windows)]


def _mlp_layers(lm: ConfigReader, family: Family, hidden: int, layers: int) -> list[DecoderBlock]:
    """One dense and (if any) one MoE block, repeated per the family's layer rule."""
    attn = _attention(lm, family, hidden)
    act = _activation(lm, family)
    bias = family.linear_bias or (lm.get_bool("mlp_bias") if lm.has("mlp_bias") else False)
    norm = family.norm

    def dense(ffn: int) -> DecoderBlock:
        return DecoderBlock(hidden=hidden, attention=attn, norm=norm, mlp=DenseMLP(ffn=ffn, act=act, bias=bias))

    def moe(mlp: MoEMLP) -> DecoderBlock:
        return DecoderBlock(hidden=hidden, attention=attn, norm=norm, mlp=mlp)

    ffn_default = family.default_ffn_ratio * hidden if family.default_ffn_ratio else K.REQUIRED
    if lm.config.get("n_routed_experts"):  # DeepSeekMoE
        moe_block = moe(_deepseek_moe(lm, act, family.name))
        first_dense = lm.get_int("first_k_dense_replace", 0, minimum=0)
        freq = lm.get_int("moe_layer_freq", 1)
        dense_block = dense(lm.get_int(K.FFN)) if first_dense or freq > 1 else None
        return [moe_block if (i >= first_dense and i % freq == 0) else dense_block for i in range(layers)]
    if lm.config.get("num_local_experts"):  # Mixtral: every layer, expert width = intermediate_size
        routed = lm.get_int("num_local_experts")
        clamped = act == "swiglu" and (lm.find(("swiglu_limit",)) or family.glu_limit)
        limit = lm.get_float("swiglu_limit", family.glu_limit) if clamped else None
        block = moe(MoEMLP(routed_experts=routed, top_k=_top_k(lm, routed, 2), expert_ffn=lm.get_int(K.FFN), act=act,
                           router_bias=family.moe_biases, expert_bias=family.moe_biases, glu_limit=limit,
                           router=router_from_config(lm, family.name)))
        return [block] * layers
    if lm.config.get("num_experts"):  # Qwen-MoE
        routed = lm.get_int("num_experts")
        # Qwen3-MoE has no shared expert (its config class has no such key); Qwen2-MoE one
        shared = lm.get_int("shared_expert_intermediate_size", 0, minimum=0) if family.shared_expert else 0
        mlp = MoEMLP(
            routed_experts=routed,
            top_k=_top_k(lm, routed),
            expert_ffn=lm.get_int("moe_intermediate_size"),
            shared_experts=1 if shared else 0,
            shared_ffn=shared, shared_gate=bool(shared),
            act=act, router=router_from_config(lm, family.name),
        )
        step = lm.get_int("decoder_sparse_step", 1)
        dense_only = set(lm.int_list("mlp_only_layers"))
        is_moe = [i not in dense_only and (i + 1) % step == 0 for i in range(layers)]
        dense_block = dense(lm.get_int(K.FFN)) if not all(is_moe) else None
        return [moe(mlp) if m else dense_block for m in is_moe]
    return [dense(lm.get_int(K.FFN, ffn_default))] * layers


def _deepseek_moe(lm: ConfigReader, act: str, family: str) -> MoEMLP:
    """DeepSeekMoE: routed experts, shared experts as one wide MLP, noaux_tc's gate bias."""
    expert_ffn = lm.get_int("moe_intermediate_size")
    shared = lm.get_int("n_shared_experts", 0, minimum=0)
    routed = lm.get_int("n_routed_experts")
    top_k = _top_k(lm, routed)
    method = lm.get_str("topk_method", "greedy")
    return MoEMLP(routed_experts=routed, top_k=top_k, expert_ffn=expert_ffn, shared_experts=shared,
                  shared_ffn=shared * expert_ffn, gate_bias=method == "noaux_tc", act=act,
                  router=router_from_config(lm, family))


def _top_k(lm: ConfigReader, routed: int, default: object = K.REQUIRED) -> int:
    top_k = lm.get_int("num_experts_per_tok", default)
    if top_k > routed:
        lm.fail("num_experts_per_tok", f"({top_k}) exceeds the number of routed experts ({routed})")
    return top_k
