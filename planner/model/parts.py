"""The parts of a transformer layer: attention (MHA / GQA / MLA) and the MLP (dense or
mixture-of-experts), with their parameter counts (reference/models/README.md: SwiGLU = 3
matrices, MLA including its latent norms, the MoE gate plus the ``noaux_tc`` bias, Qwen3's
QK-norm, gpt-oss's attention sinks and expert and router biases)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

NormKind = Literal["rmsnorm", "layernorm"]
Activation = Literal["swiglu", "gelu", "gelu_tanh", "quick_gelu", "relu"]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def empty_list() -> list:
    """An empty list, as a plain function for ``default_factory`` (keeps start-up short)."""
    return []


def norm_params(hidden: int, kind: NormKind) -> int:
    """RMSNorm has a scale; LayerNorm a scale and a bias."""
    return hidden if kind == "rmsnorm" else 2 * hidden


def linear_params(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


class MLA(Frozen):
    """Multi-head latent attention ranks (DeepSeek-V2 report, section 2.1)."""

    q_lora_rank: PositiveInt | None = None  # None: queries are not compressed (V2-Lite, VL2)
    kv_lora_rank: PositiveInt
    qk_nope_head_dim: PositiveInt
    qk_rope_head_dim: PositiveInt
    v_head_dim: PositiveInt

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class Attention(Frozen):
    """Self-attention: MHA (kv_heads == heads), GQA (kv_heads < heads) or MLA."""

    kind: Literal["mha", "gqa", "mla"]
    heads: PositiveInt
    kv_heads: PositiveInt
    head_dim: PositiveInt  # for MLA: the q.k head dim (nope + rope)
    qkv_bias: bool = False
    out_bias: bool = False
    mla: MLA | None = None
    # Qwen3 (Qwen3Attention q_norm / k_norm): an RMSNorm of head_dim on every query and key head.
    qk_norm: bool = False
    # gpt-oss (GptOssAttention.sinks): a learned logit per head that joins each softmax denominator.
    sinks: bool = False
    # Causal sliding window: each query attends to at most this many keys, itself included
    # (gpt-oss: 128 on every other layer); None attends to the whole causal prefix.
    window: PositiveInt | None = None

    @model_validator(mode="after")
    def _check(self) -> "Attention":
        if self.kind == "mla" and self.mla is None:
            raise ValueError("attention kind 'mla' needs the mla ranks")
        if self.kind != "mla" and self.heads % self.kv_heads != 0:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        return self

    def params(self, hidden: int) -> int:
        if self.kind == "mla":
            m = self.mla
            assert m is not None
            if m.q_lora_rank:
                q = hidden * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * self.heads * m.q_head_dim
            else:
                q = hidden * self.heads * m.q_head_dim
            kv_a = hidden * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # + latent norm
            kv_b = m.kv_lora_rank * self.heads * (m.qk_nope_head_dim + m.v_head_dim)
            out = linear_params(self.heads * m.v_head_dim, hidden, self.out_bias)
            return q + kv_a + kv_b + out + self.extra_params
        q_width = self.heads * self.head_dim
        kv_width = self.kv_heads * self.head_dim
        qkv = hidden * (q_width + 2 * kv_width) + ((q_width + 2 * kv_width) if self.qkv_bias else 0)
        return qkv + linear_params(q_width, hidden, self.out_bias) + self.extra_params

    @property
    def qk_norm_params(self) -> int:
        """The q and k norm scales (one head_dim vector each, shared by every head)."""
        return 2 * self.head_dim if self.qk_norm else 0

    @property
    def extra_params(self) -> int:
        """Weights beside the projections: QK-norm scales and one sink logit per head."""
        return self.qk_norm_params + (self.heads if self.sinks else 0)

    @property
    def v_width(self) -> int:
        """Width of the attention output before the output projection."""
        if self.kind == "mla":
            assert self.mla is not None
            return self.heads * self.mla.v_head_dim
        return self.heads * self.head_dim


class DenseMLP(Frozen):
    kind: Literal["dense"] = "dense"
    ffn: PositiveInt
    act: Activation = "swiglu"
    bias: bool = False

    @property
    def gated(self) -> bool:
        return self.act == "swiglu"

    def params(self, hidden: int) -> int:
        if self.gated:
            return 3 * hidden * self.ffn + ((2 * self.ffn + hidden) if self.bias else 0)
        return linear_params(hidden, self.ffn, self.bias) + linear_params(self.ffn, hidden, self.bias)


class Router(Frozen):
    """How a token picks its experts, as the model's config says; Megatron's --moe-router-* flags
    restate it (planner/emit/megatron_moe.py), so a run trains the published router."""

    score: Literal["softmax", "sigmoid"] = "softmax"
    # The top-k probabilities renormalised to sum to 1 (a softmax over the chosen experts' logits);
    # False: a softmax over every expert, kept as is (DeepSeek-V2, Qwen2-MoE: norm_topk_prob false).
    renormalise: bool = True
    groups: int = Field(1, ge=1)  # > 1: a token's experts come from its best ``group_topk`` groups (DeepSeek)
    group_topk: int = Field(1, ge=1)
    scaling: float = Field(1.0, gt=0)  # routed_scaling_factor on the routed experts' weights
    balance: Literal["aux_loss", "seq_aux_loss"] = "aux_loss"  # per batch, or per sequence (DeepSeek)
    aux_coeff: float = Field(0.0, ge=0)


class MoEMLP(Frozen):
    """Routed experts (each a SwiGLU of width expert_ffn) plus always-on shared experts."""

    kind: Literal["moe"] = "moe"
    routed_experts: PositiveInt
    top_k: PositiveInt
    expert_ffn: PositiveInt
    shared_experts: int = Field(0, ge=0)
    shared_ffn: int = Field(0, ge=0)  # total width of the shared experts (n_shared * expert_ffn)
    gate_bias: bool = False  # noaux_tc's e_score_correction_bias
    act: Activation = "swiglu"
    # gpt-oss (GptOssTopKRouter.bias): a learned bias on the router logits, one per expert.
    router_bias: bool = False
    # gpt-oss (GptOssExperts gate_up_proj_bias, down_proj_bias): each expert's projections carry biases.
    expert_bias: bool = False
    # Qwen2-MoE (Qwen2MoeSparseMoeBlock.shared_expert_gate): the shared experts' output scaled by
    # sigmoid(x . w), a hidden-wide vector per layer, replicated like the router.
    shared_gate: bool = False
    # gpt-oss (config swiglu_limit): its experts' GLU is (clamp(up) + 1) * g * sigmoid(1.702 g) with
    # g = clamp(gate), both at this limit; SwiGLU's weights and FLOPs, another function. None: SwiGLU.
    glu_limit: float | None = Field(None, gt=0)
    router: Router = Router()

    @model_validator(mode="after")
    def _check(self) -> "MoEMLP":
        if self.top_k > self.routed_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds routed_experts ({self.routed_experts})")
        return self

    def expert_params(self, hidden: int) -> int:
        gated = self.act == "swiglu"
        bias = ((2 if gated else 1) * self.expert_ffn + hidden) if self.expert_bias else 0
        return (3 if gated else 2) * hidden * self.expert_ffn + bias

    def gate_params(self, hidden: int) -> int:
        biases = int(self.gate_bias) + int(self.router_bias)  # one entry per expert each
        return (hidden + biases) * self.routed_experts + (hidden if self.shared_gate else 0)

    def shared_params(self, hidden: int) -> int:
        per = 3 if self.act == "swiglu" else 2
        return per * hidden * self.shared_ffn

    def params(self, hidden: int) -> int:
        return self.gate_params(hidden) + self.shared_params(hidden) + self.routed_experts * self.expert_params(hidden)

    def activated_params(self, hidden: int) -> int:
        return self.gate_params(hidden) + self.shared_params(hidden) + self.top_k * self.expert_params(hidden)


MLP = Annotated[Union[DenseMLP, MoEMLP], Field(discriminator="kind")]
