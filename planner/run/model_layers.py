"""Torch layers, one per ModelSpec block, that pass a tuple of tensors along.

The tuple is what DeepSpeed's pipeline sends between stages, so every layer has the same
shape of contract:
- before the token embedding: ``(act, aux, tokens)`` (vision activations, MoE aux loss,
  the token ids riding along to the embedding); the first vision layer takes the data
  ``(tokens, tiles)``;
- from the token embedding on: ``(hidden, aux)``; the LM head returns ``(logits, aux)``.
``aux`` is a float tensor derived from the activations (so it always has a gradient path,
which the pipeline's backward needs) and accumulates the MoE load-balancing losses.

What the reference trainer runs in place of a spec's rarer parts: an attention ``window`` as
full causal attention (more attention work than the model does), and no softmax sinks or
router bias (gpt-oss: a logit per head and a bias per expert, 6,912 weights in all).

Linear names follow the Hugging Face Llama layout (``self_attn.q_proj`` ... ``o_proj``,
``mlp.gate_proj/up_proj/down_proj``, ``lm_head``) because DeepSpeed AutoTP picks column and
row parallel layers by those names; attention infers its local head count from the (possibly
sharded) projection widths for the same reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.model.spec import (
    Attention,
    DecoderBlock,
    DenseMLP,
    EmbeddingBlock,
    LMHeadBlock,
    MoEMLP,
    NormBlock,
    ProjectorBlock,
    VisionBlock,
    VisionEmbedBlock,
)

ACTIVATIONS = {
    "swiglu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(kind: str, hidden: int) -> nn.Module:
    return RMSNorm(hidden) if kind == "rmsnorm" else nn.LayerNorm(hidden)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, recompute: bool) -> torch.Tensor:
    """The attention core; ``recompute`` is selective recomputation (scores are not stored)."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(F.scaled_dot_product_attention, q, k, v, None, 0.0, causal, use_reentrant=False)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class SelfAttention(nn.Module):
    """MHA / GQA with separate q, k, v projections (local heads inferred after AutoTP)."""

    def __init__(self, hidden: int, attn: Attention, causal: bool, out_bias: bool | None = None):
        super().__init__()
        self.head_dim, self.causal, self.selective = attn.head_dim, causal, False
        self.q_proj = nn.Linear(hidden, attn.heads * attn.head_dim, bias=attn.qkv_bias)
        self.k_proj = nn.Linear(hidden, attn.kv_heads * attn.head_dim, bias=attn.qkv_bias)
        self.v_proj = nn.Linear(hidden, attn.kv_heads * attn.head_dim, bias=attn.qkv_bias)
        self.o_proj = nn.Linear(attn.heads * attn.head_dim, hidden,
                                bias=attn.out_bias if out_bias is None else out_bias)
        self.q_norm = RMSNorm(attn.head_dim) if attn.qk_norm else nn.Identity()  # Qwen3's QK-norm
        self.k_norm = RMSNorm(attn.head_dim) if attn.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = _attend(q, k, v, self.causal, self.selective)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LatentAttention(nn.Module):
    """A compact MLA: keys and values come up from a shared low-rank latent (DeepSeek-V2, 2.1).

    The decoupled RoPE key is kept as a shared extra key slice so the widths match the spec;
    no rotary embedding is applied (synthetic data does not need positions).
    """

    def __init__(self, hidden: int, attn: Attention):
        super().__init__()
        m = attn.mla
        assert m is not None
        self.m, self.selective = m, False
        q_width = attn.heads * m.q_head_dim
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, attn.heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(attn.heads * m.v_head_dim, hidden, bias=attn.out_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, (b, s, _) = self.m, x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if m.q_lora_rank else self.q_proj(x)
        q = q.view(b, s, -1, m.q_head_dim).transpose(1, 2)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, -1, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_rope = k_rope.view(b, 1, s, m.qk_rope_head_dim).expand(b, k_nope.shape[1], s, m.qk_rope_head_dim)
        k = torch.cat([k_nope, k_rope], dim=-1)
        out = _attend(q, k, v, True, self.selective)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU (gate/up/down), gpt-oss's clamped GLU (``limit``), or a plain two-matrix MLP (up/down)."""

    def __init__(self, hidden: int, ffn: int, act: str, bias: bool = False, limit: float | None = None):
        super().__init__()
        self.gated, self.act, self.limit = act == "swiglu", ACTIVATIONS[act], limit
        if self.gated:
            self.gate_proj = nn.Linear(hidden, ffn, bias=bias)
        self.up_proj = nn.Linear(hidden, ffn, bias=bias)
        self.down_proj = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up_proj(x)
        if not self.gated:
            return self.down_proj(self.act(up))
        if self.limit is None:
            return self.down_proj(self.act(self.gate_proj(x)) * up)
        # gpt-oss (transformers GptOssExperts): both halves clamped, a quick GELU on the gate, 1 added to up.
        glu = ACTIVATIONS["quick_gelu"](self.gate_proj(x).clamp(max=self.limit))
        return self.down_proj((up.clamp(-self.limit, self.limit) + 1) * glu)


class MoEFeedForward(nn.Module):
    """Routed experts through DeepSpeed MoE (expert parallel over ``ep_size``) plus shared experts.

    ``capacity``: DeepSpeed's capacity factor, the plan's routing imbalance (Workload.moe_imbalance):
    its top-k gating sends fixed [experts, capacity, hidden] buffers, capacity x the mean copies,
    which is what dsplan priced (tokens beyond it are dropped)."""

    def __init__(self, hidden: int, mlp: MoEMLP, ep_size: int, capacity: float = 1.0):
        super().__init__()
        from deepspeed.moe.layer import MoE

        expert = FeedForward(hidden, mlp.expert_ffn, mlp.act, mlp.expert_bias, mlp.glu_limit)
        self.experts = MoE(hidden_size=hidden, expert=expert,
                           num_experts=mlp.routed_experts, ep_size=ep_size, k=mlp.top_k,
                           capacity_factor=capacity, eval_capacity_factor=capacity, min_capacity=4)
        self.shared_experts = FeedForward(hidden, mlp.shared_ffn, mlp.act) if mlp.shared_ffn else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if mlp.shared_gate else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed, l_aux, _ = self.experts(x)
        if self.shared_experts is None:
            return routed, l_aux
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return routed + shared, l_aux


class _Recomputable(nn.Module):
    """Full recomputation: the whole block's activations are recomputed in backward."""

    recompute_full = False

    def forward(self, *state: torch.Tensor):
        if self.recompute_full and torch.is_grad_enabled():
            return checkpoint(self.body, *state, use_reentrant=False)
        return self.body(*state)

    def body(self, *state: torch.Tensor):
        raise NotImplementedError


class DecoderLayer(_Recomputable):
    def __init__(self, block: DecoderBlock, ep_size: int = 1, capacity: float = 1.0):
        super().__init__()
        a = block.attention
        self.input_layernorm = make_norm(block.norm, block.hidden)
        self.self_attn = LatentAttention(block.hidden, a) if a.kind == "mla" else SelfAttention(block.hidden, a, True)
        self.post_attention_layernorm = make_norm(block.norm, block.hidden)
        if isinstance(block.mlp, MoEMLP):
            self.mlp: nn.Module = MoEFeedForward(block.hidden, block.mlp, ep_size, capacity)
        else:
            assert isinstance(block.mlp, DenseMLP)
            self.mlp = FeedForward(block.hidden, block.mlp.ffn, block.mlp.act, block.mlp.bias)

    def body(self, hidden: torch.Tensor, aux: torch.Tensor):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden))
        out = self.mlp(self.post_attention_layernorm(hidden))
        if isinstance(out, tuple):
            out, l_aux = out
            aux = aux + l_aux
        return hidden + out, aux


class VisionLayer(_Recomputable):
    """Pre-norm ViT block: bidirectional attention with biases, non-gated MLP."""

    def __init__(self, block: VisionBlock):
        super().__init__()
        attn = Attention(kind="mha", heads=block.heads, kv_heads=block.heads, head_dim=block.hidden // block.heads,
                         qkv_bias=block.qkv_bias)
        self.layer_norm1 = make_norm(block.norm, block.hidden)
        self.self_attn = SelfAttention(block.hidden, attn, causal=False, out_bias=True)
        self.layer_norm2 = make_norm(block.norm, block.hidden)
        self.mlp = FeedForward(block.hidden, block.mlp, "gelu" if block.act == "swiglu" else block.act, bias=True)

    def body(self, act: torch.Tensor, aux: torch.Tensor, tokens: torch.Tensor):
        act = act + self.self_attn(self.layer_norm1(act))
        return act + self.mlp(self.layer_norm2(act)), aux, tokens


class VisionEmbedLayer(nn.Module):
    """Patch embedding as a linear over patch pixels, plus learned positions; takes the data."""

    def __init__(self, block: VisionEmbedBlock):
        super().__init__()
        self.patch_embed = nn.Linear(block.patch_pixels, block.hidden, bias=block.patch_bias)
        self.pos_embed = nn.Parameter(torch.zeros(block.learned_positions, block.hidden)) \
            if block.learned_positions else None

    def forward(self, tokens: torch.Tensor, tiles: torch.Tensor):
        b, t, n, p = tiles.shape  # batch, tiles per sample, patches per tile, pixels per patch
        act = self.patch_embed(tiles.reshape(b * t, n, p).to(self.patch_embed.weight.dtype))
        if self.pos_embed is not None:
            act = act + self.pos_embed[:n]
        return act, act.sum() * 0.0, tokens


class ProjectorLayer(nn.Module):
    """Merge side x side neighbouring patches into one token, then a GELU MLP to the LM width."""

    def __init__(self, block: ProjectorBlock, tiles_per_sample: int):
        super().__init__()
        self.merge, self.tiles = block.merge, tiles_per_sample
        self.norm = make_norm(block.in_norm, block.in_dim) if block.in_norm else None
        self.up_proj = nn.Linear(block.merged_dim, block.mlp_hidden)
        self.down_proj = nn.Linear(block.mlp_hidden, block.out_dim)

    def forward(self, act: torch.Tensor, aux: torch.Tensor, tokens: torch.Tensor):
        if self.norm is not None:
            act = self.norm(act)
        bt, n, d = act.shape
        grid, side = int(round(n**0.5)), int(round(self.merge**0.5))
        x = act.view(bt, grid // side, side, grid // side, side, d).permute(0, 1, 3, 2, 4, 5)
        x = x.reshape(bt, (grid // side) ** 2, side * side * d)
        x = self.down_proj(F.gelu(self.up_proj(x)))
        return x.reshape(bt // self.tiles, -1, x.shape[-1]), aux, tokens


class EmbeddingLayer(nn.Module):
    """Token embedding; for a VLM the first positions are replaced by the projected image tokens."""

    def __init__(self, block: EmbeddingBlock):
        super().__init__()
        self.embed_tokens = nn.Embedding(block.vocab, block.hidden)
        self.embed_positions = nn.Embedding(block.learned_positions, block.hidden) if block.learned_positions else None
        self.norm = make_norm(block.norm, block.hidden) if block.norm else None

    def forward(self, *state: torch.Tensor):
        tokens = state[-1]
        hidden = self.embed_tokens(tokens)
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions(torch.arange(tokens.shape[1], device=tokens.device))
        if self.norm is not None:
            hidden = self.norm(hidden)
        if len(state) == 1:
            return hidden, hidden.sum() * 0.0
        image, aux = state[0], state[1]
        return torch.cat([image, hidden[:, image.shape[1]:]], dim=1), aux


class NormLayer(nn.Module):
    def __init__(self, block: NormBlock):
        super().__init__()
        self.norm = make_norm(block.norm, block.hidden)

    def forward(self, act: torch.Tensor, *rest: torch.Tensor):
        return (self.norm(act), *rest)


class LMHeadLayer(nn.Module):
    def __init__(self, block: LMHeadBlock):
        super().__init__()
        self.lm_head = nn.Linear(block.hidden, block.vocab, bias=False)

    def forward(self, hidden: torch.Tensor, aux: torch.Tensor):
        return self.lm_head(hidden), aux
