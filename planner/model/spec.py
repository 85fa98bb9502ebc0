"""ModelSpec: a model as an ordered list of typed blocks.

Heterogeneous models are the normal case: DeepSeek-VL2 is a SigLIP tower (patch embedding,
27 ViT blocks, final norm), a projector, a token embedding, one dense decoder block, 29 MoE
decoder blocks, a final norm and an LM head. The cost model and the pipeline balancer walk
this list in order, so the order is the forward order of the network.

Parameter formulas follow reference/models/README.md (RMSNorm = h, LayerNorm = 2h,
SwiGLU = 3 matrices, MLA including its latent norms, MoE gate plus the ``noaux_tc`` bias).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Annotated, Any, Literal, NamedTuple, Union

from pydantic import Field, PositiveInt, model_validator

from planner.model.parts import (
    MLA,
    MLP,
    Activation,
    Attention,
    DenseMLP,
    Frozen,
    MoEMLP,
    NormKind,
    empty_list,
    linear_params,
    norm_params,
)

__all__ = ["MLA", "MLP", "Activation", "Attention", "Block", "DecoderBlock", "DenseMLP", "EmbeddingBlock",
           "LMHeadBlock", "MTPBlock", "ModelSpec", "MoEMLP", "NormBlock", "NormKind", "Positions", "ProjectorBlock",
           "VisionBlock", "VisionEmbedBlock", "VisionTiling", "linear_params", "norm_params"]

PositionKind = Literal["learned", "rope", "mrope", "alibi"]
ScalingValue = Union[float, int, str, bool, list[int], None]


class EmbeddingBlock(Frozen):
    """Token embedding (plus learned positions and BLOOM's embedding LayerNorm when present)."""

    kind: Literal["embedding"] = "embedding"
    vocab: PositiveInt
    hidden: PositiveInt
    learned_positions: int = Field(0, ge=0)
    norm: NormKind | None = None

    def params(self) -> int:
        extra = norm_params(self.hidden, self.norm) if self.norm else 0
        return (self.vocab + self.learned_positions) * self.hidden + extra

    def activated_params(self) -> int:
        return self.params()


class VisionEmbedBlock(Frozen):
    """ViT patch embedding (a conv as a linear over patch pixels) and learned positions."""

    kind: Literal["vision_embed"] = "vision_embed"
    hidden: PositiveInt
    patch_size: PositiveInt
    channels: PositiveInt = 3
    temporal_patch: PositiveInt = 1  # Qwen2-VL folds 2 frames into a patch
    patch_bias: bool = True
    learned_positions: int = Field(0, ge=0)

    @property
    def patch_pixels(self) -> int:
        return self.channels * self.temporal_patch * self.patch_size**2

    def params(self) -> int:
        return linear_params(self.patch_pixels, self.hidden, self.patch_bias) + self.learned_positions * self.hidden

    def activated_params(self) -> int:
        return self.params()


class VisionBlock(Frozen):
    """One pre-norm ViT encoder block (LayerNorm, MHA with biases, GELU MLP)."""

    kind: Literal["vision"] = "vision"
    hidden: PositiveInt
    heads: PositiveInt
    mlp: PositiveInt
    act: Activation = "gelu"
    qkv_bias: bool = True
    norm: NormKind = "layernorm"

    @model_validator(mode="after")
    def _check(self) -> "VisionBlock":
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide the vision hidden size ({self.hidden})")
        return self

    def params(self) -> int:
        h = self.hidden
        attn = linear_params(h, 3 * h, self.qkv_bias) + linear_params(h, h, True)
        mlp = linear_params(h, self.mlp, True) + linear_params(self.mlp, h, True)
        return attn + mlp + 2 * norm_params(h, self.norm)

    def activated_params(self) -> int:
        return self.params()


class ProjectorBlock(Frozen):
    """Vision-to-language adaptor: token merge (downsample) then a small MLP.

    DeepSeek-VL2's ``downsample_mlp_gelu``: 2x2 unfold to 4*1152 = 4608 wide tokens,
    Linear(4608, n) - GELU - Linear(n, n), plus learned ``image_newline`` and
    ``view_seperator`` vectors. Qwen2-VL's PatchMerger: LayerNorm(1280), Linear(5120, 5120),
    GELU, Linear(5120, n).
    """

    kind: Literal["projector"] = "projector"
    in_dim: PositiveInt  # width of one vision token
    merge: PositiveInt = 1  # tokens merged into one (4 for 2x2)
    mlp_hidden: PositiveInt
    out_dim: PositiveInt
    in_norm: NormKind | None = None
    extra_vectors: int = Field(0, ge=0)  # learned separator / newline embeddings

    @property
    def merged_dim(self) -> int:
        return self.in_dim * self.merge

    def params(self) -> int:
        norm = norm_params(self.in_dim, self.in_norm) if self.in_norm else 0
        mlp = linear_params(self.merged_dim, self.mlp_hidden, True) + linear_params(self.mlp_hidden, self.out_dim, True)
        return norm + mlp + self.extra_vectors * self.out_dim

    def activated_params(self) -> int:
        return self.params()


class DecoderBlock(Frozen):
    """A transformer decoder layer: norm, attention, norm, MLP (dense or MoE)."""

    kind: Literal["decoder"] = "decoder"
    hidden: PositiveInt
    attention: Attention
    mlp: MLP
    norm: NormKind = "rmsnorm"

    @model_validator(mode="after")
    def _check(self) -> "DecoderBlock":
        a = self.attention
        if a.kind != "mla" and a.heads * a.head_dim != self.hidden and self.hidden % a.heads:
            raise ValueError(f"heads ({a.heads}) must divide the hidden size ({self.hidden})")
        return self

    def params(self) -> int:
        return (self.attention.params(self.hidden) + self.mlp.params(self.hidden)
                + 2 * norm_params(self.hidden, self.norm))

    def activated_params(self) -> int:
        mlp = self.mlp.activated_params(self.hidden) if isinstance(self.mlp, MoEMLP) else self.mlp.params(self.hidden)
        return self.attention.params(self.hidden) + mlp + 2 * norm_params(self.hidden, self.norm)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoEMLP)


class NormBlock(Frozen):
    """A final norm (language model or vision tower).

    ``unused_params`` are weights that exist in the checkpoint but never run (SigLIP's MAP
    pooling head in DeepSeek-VL2, ~15.2M): they cost memory, not FLOPs.
    """

    kind: Literal["norm"] = "norm"
    hidden: PositiveInt
    norm: NormKind = "rmsnorm"
    unused_params: int = Field(0, ge=0)

    def params(self) -> int:
        return norm_params(self.hidden, self.norm) + self.unused_params

    def activated_params(self) -> int:
        return norm_params(self.hidden, self.norm)  # unused weights never see a token


class LMHeadBlock(Frozen):
    """Output projection to the vocabulary. Tied heads reuse the embedding's weights."""

    kind: Literal["lm_head"] = "lm_head"
    vocab: PositiveInt
    hidden: PositiveInt
    tied: bool = False

    def params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def activated_params(self) -> int:
        return self.params()


class MTPBlock(Frozen):
    """One depth of a multi-token-prediction module (DeepSeek-V3, arXiv:2412.19437 sec. 2.2):
    the next token's embedding and the previous depth's hidden state, each RMS-normed,
    concatenated and projected from 2h to h, then one transformer ``layer`` and a final norm
    before the output head. The embedding and the head are the main model's (shared, no
    weights of their own); both still run for every token."""

    kind: Literal["mtp"] = "mtp"
    layer: DecoderBlock
    vocab: PositiveInt

    @property
    def hidden(self) -> int:
        return self.layer.hidden

    def own_params(self) -> int:
        """The projection and its three norms (enorm, hnorm, the final one)."""
        return 2 * self.hidden * self.hidden + 3 * norm_params(self.hidden, self.layer.norm)

    def params(self) -> int:
        return self.layer.params() + self.own_params()

    def activated_params(self) -> int:
        return self.layer.activated_params() + self.own_params() + self.vocab * self.hidden  # the shared head runs


Block = Annotated[
    Union[EmbeddingBlock, VisionEmbedBlock, VisionBlock, ProjectorBlock, DecoderBlock, NormBlock, LMHeadBlock,
          MTPBlock],
    Field(discriminator="kind"),
]


class VisionTiling(Frozen):
    """How images become vision-tower tiles and language tokens.

    DeepSeek-VL2: 384-px tiles, 27x27 = 729 patches each, 2x2 downsampling to 14x14 = 196
    language tokens per tile; a global view plus up to 9 local tiles per image; each image
    adds 14 row-newline tokens for the global view, one separator, and one newline per row
    of local tiles (processing_deepseek_vl_v2.py).
    """

    tile_px: PositiveInt
    patches_per_tile: PositiveInt
    tokens_per_tile: PositiveInt  # language tokens per tile after the projector
    global_view: bool = False
    max_local_tiles: PositiveInt = 1
    default_images_per_sample: PositiveInt = 1
    default_tiles_per_image: PositiveInt = 1  # local tiles (the global view is added on top)
    newline_tokens: bool = False  # DeepSeek-VL2 appends a newline token to each token row


class Positions(Frozen):
    """How the model encodes positions, which costs nothing to plan but everything to get wrong
    at launch: Megatron defaults to a rotary base of 10000 and no scaling, while Llama 3 trains
    with 500000 (and Llama 3.1's frequency scaling), Mixtral and Qwen with 1e6."""

    kind: PositionKind
    rope_theta: float | None = Field(None, gt=0)  # rotary base (rope / mrope)
    rotary_percent: float = Field(1.0, gt=0, le=1)  # share of each head's dims rotated (GPT-NeoX: 0.25)
    rope_scaling: dict[str, ScalingValue] | None = None  # the config's rope_scaling object, as given

    @model_validator(mode="after")
    def _check(self) -> "Positions":
        if self.kind in ("rope", "mrope") and self.rope_theta is None:
            raise ValueError(f"{self.kind} positions need a rotary base (rope_theta)")
        return self

    @property
    def scaling_type(self) -> str | None:
        """``rope_scaling``'s type (configs spell the key "rope_type" or "type")."""
        if not self.rope_scaling:
            return None
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        return str(kind) if kind is not None else None


class _DecoderStack(NamedTuple):
    """A spec's decoder blocks and the routed experts of its MoE layers (0: dense)."""

    blocks: tuple[DecoderBlock, ...]
    routed_experts: int


class ModelSpec(Frozen):
    """A model: identity, training facts, and the ordered block list."""

    name: str
    family: str
    hf_model_type: str | None = None
    max_seq_len: PositiveInt
    train_seq_len: PositiveInt  # the default sequence length for planning
    blocks: list[Block]
    vision: VisionTiling | None = None
    stated_total_params: float | None = None  # the authors' figures, for checking
    stated_activated_params: float | None = None
    defaulted: list[str] = Field(default_factory=empty_list)  # fields filled by defaults on import
    # What a launcher must restate and the cost model does not read (None: not known, e.g. a
    # spec built by hand); Hugging Face configs and the presets always give both.
    positions: Positions | None = None
    norm_eps: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        kinds = [b.kind for b in self.blocks]
        if "decoder" not in kinds:
            raise ValueError("a model needs at least one decoder block")
        if ("vision" in kinds) != (self.vision is not None):
            raise ValueError("vision blocks and vision tiling facts go together")
        if self.positions is not None:
            learned = any(isinstance(b, EmbeddingBlock) and b.learned_positions for b in self.blocks)
            if learned != (self.positions.kind == "learned"):
                raise ValueError(f"positions '{self.positions.kind}' and the embedding's learned position table "
                                 "disagree")
        return self

    # -- derived facts -------------------------------------------------------------------
    def total_params(self) -> int:
        """Every block's parameters, a multi-token-prediction module's included."""
        return sum(b.params() for b in self.blocks)

    @property
    def mtp_layers(self) -> int:
        """Multi-token-prediction depths (MTPBlock) the model trains with."""
        return sum(1 for b in self.blocks if b.kind == "mtp")

    def with_mtp_layers(self, n: int) -> ModelSpec:
        """This model with ``n`` multi-token-prediction depths after its head (none: the main
        model, as the authors count its parameters), each a copy of its last decoder layer
        (DeepSeek-V3's MTP layer is one of its MoE layers), or the ones it has."""
        main = [b for b in self.blocks if b.kind != "mtp"]
        own = [b for b in self.blocks if b.kind == "mtp"]
        depth = own[0] if own else MTPBlock(layer=self._decoders.blocks[-1], vocab=self.vocab)
        return self.model_copy(update={"blocks": main + [depth] * n})

    def activated_params(self, include_input_embedding: bool = False) -> int:
        """Parameters a token passes through (top-k experts only; the lookup table excluded)."""
        total = 0
        for b in self.blocks:
            if isinstance(b, EmbeddingBlock) and not include_input_embedding:
                continue
            if isinstance(b, LMHeadBlock) and b.tied and not include_input_embedding:
                total += b.vocab * b.hidden  # the tied head still multiplies every token
                continue
            total += b.activated_params()
        return total

    @cached_property
    def _decoders(self) -> _DecoderStack:
        """The decoder stack, found once per spec (the facts below are read on every search). A
        cached_property under a private name stays out of ==, dict(), repr and model_dump
        (pydantic >= 2.6 compares fields only); ``model_copy`` drops it."""
        blocks = tuple(b for b in self.blocks if isinstance(b, DecoderBlock))
        experts = next((b.mlp.routed_experts for b in blocks if b.mlp.kind == "moe"), 0)
        return _DecoderStack(blocks, experts)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> ModelSpec:
        """pydantic's copy without the cached decoder stack, which copies with ``__dict__`` and
        would outlive an update of ``blocks``."""
        copied = super().model_copy(update=update, deep=deep)
        copied.__dict__.pop("_decoders", None)
        return copied

    @property
    def decoder_blocks(self) -> list[DecoderBlock]:
        return list(self._decoders.blocks)

    @property
    def hidden(self) -> int:
        return self._decoders.blocks[0].hidden

    @property
    def num_layers(self) -> int:
        return len(self._decoders.blocks)

    @property
    def vocab(self) -> int:
        return next(b.vocab for b in self.blocks if isinstance(b, EmbeddingBlock))

    @property
    def routed_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model)."""
        return self._decoders.routed_experts

    @property
    def attention_heads(self) -> int:
        return self._decoders.blocks[0].attention.heads

    @property
    def kv_heads(self) -> int:
        return self._decoders.blocks[0].attention.kv_heads

    @property
    def is_moe(self) -> bool:
        return self.routed_experts > 0

    @property
    def is_vlm(self) -> bool:
        return self.vision is not None
