"""The layer cost profile against published formulas and the model's own parameter counts."""

from __future__ import annotations

import csv

import pytest

from planner.cost.layers import RECOMPUTE_MODES, korthikanti_layer_bytes, layer_costs, vision_tiles
from planner.cost.parallel import Workload
from planner.model.load import load_model
from planner.model.spec import (
    Attention,
    DecoderBlock,
    DenseMLP,
    EmbeddingBlock,
    LMHeadBlock,
    ModelSpec,
    NormBlock,
)


def gpt(h: int = 6144, a: int = 48, layers: int = 2, vocab: int = 51200, s: int = 2048) -> ModelSpec:
    """A Megatron GPT: learned positions, LayerNorm, 4h GELU MLP with biases, tied head."""
    attn = Attention(kind="mha", heads=a, kv_heads=a, head_dim=h // a, qkv_bias=True, out_bias=True)
    layer = DecoderBlock(hidden=h, attention=attn, mlp=DenseMLP(ffn=4 * h, act="gelu", bias=True), norm="layernorm")
    blocks = [EmbeddingBlock(vocab=vocab, hidden=h, learned_positions=s), *[layer] * layers,
              NormBlock(hidden=h, norm="layernorm"), LMHeadBlock(vocab=vocab, hidden=h, tied=True)]
    return ModelSpec(name="gpt", family="gpt", max_seq_len=s, train_seq_len=s, blocks=blocks)


# Korthikanti et al. 2022 Table 2 rows as printed in the reference CSV, keyed to (tp, sp, mode).
TABLE2 = {
    "no parallelism": (1, False, "none"),
    "tensor parallel (baseline)": (8, False, "none"),
    "tensor + sequence parallel": (8, True, "none"),
    "tensor parallel + selective recompute": (8, False, "selective"),
    "tensor + sequence parallel + selective recompute": (8, True, "selective"),
    "full activation recompute": (1, False, "full"),
}


@pytest.mark.parametrize("row", sorted(TABLE2))
@pytest.mark.parametrize("s,h,a", [(2048, 6144, 48), (2048, 12288, 96), (4096, 4096, 32)])
def test_korthikanti_table2_exact(reference_dir, row, s, h, a):
    """A GPT layer with dropout and without FlashAttention reproduces Table 2 byte for byte."""
    formulas = {r["configuration"]: r["bytes_per_transformer_layer"]
                for r in csv.DictReader(open(reference_dir / "korthikanti2022_activation_memory_formulas.csv"))}
    t, sp, mode = TABLE2[row]
    b = 1
    published = eval(formulas[row], {"__builtins__": {}}, {"s": s, "b": b, "h": h, "a": a, "t": t})  # noqa: S307
    w = Workload(global_batch=1, seq_len=s, flash_attention=False, dropout=True)
    layer = layer_costs(gpt(h, a, s=s), w, tp=t, sp=sp)[1]
    assert layer.act[mode] == pytest.approx(published, rel=1e-12)
    assert korthikanti_layer_bytes(s, b, h, a, t, sp, mode) == pytest.approx(published, rel=1e-12)


def test_flash_attention_default_drops_the_score_matrix():
    """Default kernels: no 5as^2b; only Q, K, V, outputs and a 4-byte log-sum-exp per row stay."""
    s, h, a = 2048, 6144, 48
    w = Workload(global_batch=1, seq_len=s, dropout=True)
    assert w.flash_attention
    layer = layer_costs(gpt(h, a, s=s), w)[1]
    assert layer.act["none"] == s * h * 34 + 4 * a * s
    # Selective recompute has nothing left to drop with FlashAttention.
    assert layer.act["selective"] == layer.act["none"]
    no_dropout = layer_costs(gpt(h, a, s=s), Workload(global_batch=1, seq_len=s))[1]
    assert no_dropout.act["none"] == s * h * 32 + 4 * a * s  # two 1-byte masks per hidden element fewer


def test_gpt_layer_params_and_flops_match_megatron():
    """Per layer: 12h^2 + 13h parameters, 24 s h^2 + 4 s^2 h forward FLOPs (Narayanan 2021)."""
    s, h, a, t = 2048, 6144, 48, 8
    costs = layer_costs(gpt(h, a, s=s), Workload(global_batch=1, seq_len=s), tp=t)
    layer = costs[1]
    assert layer.params == 12 * h * h + 13 * h
    assert layer.fwd_flops == pytest.approx((24 * s * h * h + 4 * s * s * h) / t)
    # TP shards everything but the norms and the row-parallel biases (2 x 2h + 2h = 6h).
    assert layer.params_rank == pytest.approx(6 * h + (12 * h * h + 7 * h) / t)
    # two all-reduces of the layer output forward and two backward
    assert layer.tp_fwd == (("allreduce", s * h * 2.0),) * 2
    assert layer.tp_bwd == layer.tp_fwd
    sp = layer_costs(gpt(h, a, s=s), Workload(global_batch=1, seq_len=s), tp=t, sp=True)[1]
    assert [op for op, _ in sp.tp_fwd] == ["allgather", "reducescatter"] * 2
    assert [op for op, _ in sp.tp_bwd] == ["reducescatter", "allgather"] * 2


def test_profile_params_sum_to_model_params_for_every_preset_kind():
    w = Workload(global_batch=1, seq_len=4096, images_per_sample=1, tiles_per_image=4)
    for name in ("llama-3-8b", "deepseek-v2-lite", "mixtral-8x7b", "deepseek-vl2-tiny", "qwen2-vl-7b", "bloom-176b"):
        model = load_model(name)
        costs = layer_costs(model, w, tp=2, ep=2 if model.is_moe else 1)
        assert sum(c.params for c in costs) == model.total_params(), name


def test_gqa_and_swiglu_widths():
    """Llama-2-70B: GQA's QKV is (64 + 2 x 8) x 128 wide; SwiGLU keeps 3 x ffn per token."""
    model = load_model("llama-2-70b")
    s, t = 4096, 8
    layer = layer_costs(model, Workload(global_batch=1, seq_len=s, dropout=False), tp=t)[1]
    qkv, out, up, down = layer.gemms
    assert (qkv.n, qkv.k) == ((64 + 16) * 128 // t, 8192)
    assert (up.n, down.k) == (2 * 28672 // t, 28672 // t)
    h, f = 8192, 28672
    replicated = 4 * 2 * h  # norm inputs, attention input, MLP input
    sharded = 2 * (64 + 16) * 128 + 2 * h + 2 * 3 * f  # Q K V, out-proj input, SwiGLU
    assert layer.act["none"] == pytest.approx(s * (replicated + sharded / t) + 4 * (64 / t) * s)
    assert layer.act["full"] == s * 2 * h


def test_moe_expert_sharding_and_all_to_all():
    """Mixtral 8x7B: 8 experts over ep=4 x tp=2; top-2 dispatch and combine per layer."""
    model = load_model("mixtral-8x7b")
    s, t, ep = 4096, 2, 4
    layer = layer_costs(model, Workload(global_batch=1, seq_len=s), tp=t, ep=ep)[1]
    h, f = 4096, 14336
    assert layer.expert_params_rank == pytest.approx(8 * 3 * h * f / (t * ep))
    assert layer.ep_a2a == s * 2 * h * 2  # top-2 copies of every token, bf16
    assert layer.ep_a2a_count == 2
    experts = [g for g in layer.gemms if g.batch == 8 // ep]
    assert experts and experts[0].tokens == pytest.approx(s * 2 / (8 // ep))
    # expert FLOPs per sample: top-2 SwiGLU experts per token, split over TP
    assert sum(g.flops for g in experts) == pytest.approx(2 * s * 2 * 3 * h * f / t)


def test_mla_and_shared_experts_are_first_class():
    """DeepSeek-V2-Lite: MLA projections and shared experts appear as their own GEMMs."""
    model = load_model("deepseek-v2-lite")
    costs = layer_costs(model, Workload(global_batch=1, seq_len=4096), tp=2)
    moe = next(c for c, b in zip(costs, model.blocks) if getattr(b, "is_moe", False))
    block = model.blocks[moe.index]
    assert moe.params == block.params()
    ks = {(g.n, g.k) for g in moe.gemms}
    assert (512 + 64, 2048) in ks  # kv down-projection, replicated over TP
    assert (16 * (128 + 128) // 2, 512) in ks  # kv up-projection, split by heads
    assert (2 * 2 * 1408 // 2, 2048) in ks  # two shared experts (width 2816) as one gated MLP
    assert moe.attn.qk_dim == 192 and moe.attn.v_dim == 128


def test_vision_tiles_and_projector():
    """DeepSeek-VL2-Tiny: 2 images x (4 local + global) tiles of 729 patches through the ViT."""
    model = load_model("deepseek-vl2-tiny")
    w = Workload(global_batch=1, seq_len=4096, images_per_sample=2, tiles_per_image=4)
    assert vision_tiles(model, w) == 10
    costs = layer_costs(model, w)
    vit = next(c for c in costs if c.kind == "vision")
    assert vit.tokens == 10 * 729
    assert vit.attn.seqs == 10 and vit.attn.seq == 729 and not vit.attn.causal
    proj = next(c for c in costs if c.kind == "projector")
    assert proj.tokens == 10 * 729 // 4
    text_only = layer_costs(model, Workload(global_batch=1, seq_len=4096))
    assert all(c.fwd_flops == 0 for c in text_only if c.kind in ("vision", "vision_embed", "projector"))


def test_lm_head_keeps_fp32_logits_and_embedding_all_reduces():
    s, h, v, t = 4096, 4096, 128256, 4
    model = load_model("llama-3-8b")
    costs = layer_costs(model, Workload(global_batch=1, seq_len=s), tp=t)
    head, emb = costs[-1], costs[0]
    assert head.act["none"] == pytest.approx(s * (2 * h + 4 * v / t))  # Korthikanti Sec 4.3
    assert head.fwd_flops == pytest.approx(2 * s * h * v / t)
    assert emb.tp_fwd == (("allreduce", s * h * 2.0),)
    assert emb.params_rank == pytest.approx(v * h / t)
    assert all(set(c.act) == set(RECOMPUTE_MODES) for c in costs)


@pytest.mark.parametrize("name", ["vl2", "deepseek-v3", "llama-3.1-405b", "mixtral-8x7b"])
def test_a_memo_shared_across_groups_gives_the_direct_costs(name):
    """The search's memo (per block, tp, sp, ep; ep only for MoE layers) returns what a fresh call
    prices, whatever order the (tp, sp, ep) groups come in."""
    model, workload = load_model(name), Workload(global_batch=64, seq_len=4096)
    memo: dict = {}
    for tp, sp, ep in [(1, False, 1), (2, True, 4), (2, True, 1), (4, False, 2), (2, True, 8), (1, False, 2)]:
        assert layer_costs(model, workload, tp, sp, ep, memo) == layer_costs(model, workload, tp, sp, ep)
