"""Qwen3-30B-A3B, Qwen3-235B-A22B and gpt-oss-120b: their parameters counted by hand, part by
part, against the published totals, and the attention work of gpt-oss's sliding-window layers
against a count of the query-key pairs its window leaves.

Published: Qwen3 model cards (30.5B / 3.3B, 29.9B non-embedding; 235B / 22B, 234B
non-embedding); gpt-oss model card (arXiv 2508.10925) Table 1 (MLP 114.71B, attention 0.96B,
embed + unembed 1.16B, active 5.13B, total 116.83B).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.cost.layer_cost import AttnCore
from planner.cost.layers import layer_costs
from planner.cost.parallel import Workload
from planner.model.load import load_model


def qwen3_moe(layers: int, h: int, heads: int, expert_ffn: int) -> tuple[int, int, int]:
    """(total, activated with the input embedding, non-embedding) of a Qwen3-MoE: GQA with 4 KV
    heads of 128, QK-norm (two RMSNorms of 128), 128 SwiGLU experts top-8, a router without a
    bias, two RMSNorms per layer, a final norm, an untied head over 151,936 tokens."""
    hd, kv, experts, top, vocab = 128, 4, 128, 8, 151936
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd
    expert = 3 * h * expert_ffn
    layer, active = attn + h * experts + experts * expert + 2 * h, attn + h * experts + top * expert + 2 * h
    emb = vocab * h
    return layers * layer + 2 * emb + h, layers * active + 2 * emb + h, layers * layer + h


@pytest.mark.parametrize("name, shape, published", [
    ("qwen3-30b-a3b", (48, 2048, 32, 768), ("30.5", "3.3", "29.9")),
    ("qwen3-235b-a22b", (94, 4096, 64, 1536), ("235", "22", "234")),
])
def test_qwen3_moe_counts_by_hand(name, shape, published):
    """Total and non-embedding to the card's own rounding; activated, which the cards count with
    the input embedding, within 2% (30B-A3B's 3.353B is printed 3.3B: cut, not rounded; without
    the embedding it would be 3.04B, 8% off)."""
    total, active, non_embedding = qwen3_moe(*shape)
    spec = load_model(name)
    assert spec.total_params() == total
    assert spec.activated_params(include_input_embedding=True) == active
    for ours, theirs in ((total, published[0]), (non_embedding, published[2])):
        digits = len(theirs.partition(".")[2])
        assert f"{ours / 1e9:.{digits}f}" == theirs, (ours, theirs)
    assert abs(active / (float(published[1]) * 1e9) - 1) < 0.02
    assert all(b.attention.qk_norm and b.mlp.shared_ffn == 0 for b in spec.decoder_blocks)


def test_gpt_oss_120b_counts_by_hand_match_the_model_card_table():
    h, layers, heads, kv, hd, experts, top, ffn, vocab = 2880, 36, 64, 8, 64, 128, 4, 2880, 201088
    attn = (h * (heads + 2 * kv) * hd + (heads + 2 * kv) * hd) + (heads * hd * h + h) + heads  # biases, sinks
    expert = 3 * h * ffn + 2 * ffn + h  # gate/up and down, with their biases
    router = h * experts + experts
    mlp = router + experts * expert
    spec = load_model("gpt-oss-120b")
    total = layers * (attn + mlp + 2 * h) + 2 * vocab * h + h
    active = layers * (attn + router + top * expert + 2 * h) + vocab * h + h  # unembedding in, embedding out
    assert spec.total_params() == total == 116_829_156_672
    assert spec.activated_params() == active == 5_132_849_472
    # Table 1, to its two decimals: MLP 114.71B, attention 0.96B, embed + unembed 1.16B
    assert (round(layers * mlp / 1e9, 2), round(layers * attn / 1e9, 2), round(2 * vocab * h / 1e9, 2)) == (
        114.71, 0.96, 1.16)
    assert (round(total / 1e9, 2), round(active / 1e9, 2)) == (116.83, 5.13)


def causal_pairs(s: int, w: int | None) -> int:
    """Query-key pairs of causal attention over s tokens, query i seeing min(i + 1, w) keys."""
    return sum(i + 1 if w is None else min(i + 1, w) for i in range(s))


def test_sliding_window_layer_flops_by_hand():
    """Block 1 of gpt-oss slides (128 keys), block 2 attends to everything: same GEMMs, and the
    attention core of the first does pairs(s, 128) / pairs(s) of the second's s^2-convention work."""
    s, heads, hd = 4096, 64, 64
    spec = load_model("gpt-oss-120b")
    costs = layer_costs(spec, Workload(global_batch=1, seq_len=s))
    slide, full = costs[1], costs[2]
    assert spec.blocks[1].attention.window == 128 and spec.blocks[2].attention.window is None
    assert full.attn.flops == 2 * s * s * heads * (hd + hd)  # Megatron's full s^2, causal or not
    share = causal_pairs(s, 128) / causal_pairs(s, None)
    assert causal_pairs(s, 128) == 128 * 129 // 2 + (s - 128) * 128
    assert slide.attn.flops == pytest.approx(full.attn.flops * share, rel=1e-12)
    assert share == pytest.approx(0.0615, abs=1e-4)
    assert slide.gemm_flops == full.gemm_flops and slide.params == full.params
    assert slide.fwd_flops == pytest.approx(full.fwd_flops - full.attn.flops * (1 - share), rel=1e-12)


@pytest.mark.parametrize("s, w", [(4, 2), (5, 1), (7, 3), (8, 8), (8, 100), (1000, 128)])
def test_window_share_is_the_pair_count(s, w):
    core = AttnCore(1, s, 1.0, 64, 64, True, True, False, window=w)
    assert core.window_share == pytest.approx(causal_pairs(s, w) / causal_pairs(s, None), rel=1e-12)
    split = AttnCore(1, s // 2, 1.0, 64, 64, True, True, False, context=2, window=w) if s % 2 == 0 else core
    assert split.window_share == core.window_share  # context parallel: the window is over the whole sequence


def test_qk_norm_and_sinks_are_priced_and_counted():
    """Every preset's profile sums to its parameters; QK-norm scales sit on every TP rank, the sink
    logits split with the heads."""
    for name, tp, ep in (("qwen3-30b-a3b", 2, 4), ("gpt-oss-120b", 2, 8)):
        spec = load_model(name)
        costs = layer_costs(spec, Workload(global_batch=1, seq_len=4096), tp=tp, ep=ep)
        assert sum(c.params for c in costs) == spec.total_params()
    qwen = load_model("qwen3-30b-a3b")
    plain = qwen.model_copy(update={"blocks": [
        b.model_copy(update={"attention": b.attention.model_copy(update={"qk_norm": False})}) if b.kind == "decoder"
        else b for b in qwen.blocks]})
    w = Workload(global_batch=1, seq_len=4096)
    with_norm, without = layer_costs(qwen, w, tp=2, ep=4)[1], layer_costs(plain, w, tp=2, ep=4)[1]
    assert with_norm.params_rank - without.params_rank == 2 * 128  # replicated: not divided by tp
    assert with_norm.act["none"] - without.act["none"] == 4096 * 2 * (32 + 4) * 128 / 2  # its inputs, split by tp
    oss = layer_costs(load_model("gpt-oss-120b"), w, tp=2, ep=8)[1]
    h, qkv = 2880, (64 + 2 * 8) * 64
    replicated = h + (h * 128 + 128) + 2 * h  # o bias, router weight and bias, two RMSNorms
    split = h * qkv + qkv + 64 * 64 * h + 64  # q/k/v with biases, o, a sink per head
    assert oss.params_rank == replicated + split / 2
    assert oss.expert_params_rank == 128 * (3 * h * h + 2 * h + h) / (2 * 8)


def test_the_brief_estimate_runs():
    args = ["estimate", "--model", "qwen3-30b-a3b", "--hardware", "dgx-h100", "--nodes", "2", "--ep", "8", "--pp", "2",
            "--framework", "megatron", "--zero", "1", "--global-batch", "512", "--seq-len", "4096", "--micro-batch",
            "2", "--recompute", "full", "--json"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["fits"] and d["ep"] == 8 and d["pp"] == 2 and 0 < d["mfu"] < 1
