"""Transformer layers (decoder and ViT blocks): attention (MHA / GQA / MLA, FlashAttention or
unfused), the MLP (dense or mixture-of-experts) and what each keeps for backward, as
Korthikanti et al. 2022 (arXiv:2205.05198) Eq. 1-6 write it, tensor by tensor."""

from __future__ import annotations

from planner.cost.layer_cost import (
    ACT,
    MASK,
    NO_RERUN,
    AttnCore,
    Gemm,
    LayerContext,
    LayerCost,
    Rerun,
    eager_extra,
    mirrored,
)
from planner.errors import UserError, arg
from planner.model.spec import DecoderBlock, DenseMLP, MoEMLP, VisionBlock, norm_params


def _attention_parts(b: DecoderBlock, tokens: int, ctx: LayerContext):
    """GEMMs, core, stored bytes (replicated, sharded), params split for one attention."""
    a, h, t = b.attention, b.hidden, ctx.tp
    heads = a.heads / t
    if a.kind == "mla":
        m = a.mla
        assert m is not None
        gemms, repl_store, shard_store = [], 0.0, 0.0
        if m.q_lora_rank:
            gemms += [Gemm(tokens, m.q_lora_rank, h), Gemm(tokens, int(a.heads * m.q_head_dim / t), m.q_lora_rank)]
            repl_store += 2 * ACT * m.q_lora_rank  # q_a output (norm input) and normed latent (q_b input)
            repl_params = h * m.q_lora_rank + m.q_lora_rank
            shard_params = m.q_lora_rank * a.heads * m.q_head_dim
        else:
            gemms.append(Gemm(tokens, int(a.heads * m.q_head_dim / t), h))
            repl_params, shard_params = 0, h * a.heads * m.q_head_dim
        # Megatron-Core MLA: the down-projections are replicated, the up-projections split by heads.
        gemms += [Gemm(tokens, m.kv_lora_rank + m.qk_rope_head_dim, h),
                  Gemm(tokens, int(a.heads * (m.qk_nope_head_dim + m.v_head_dim) / t), m.kv_lora_rank)]
        repl_store += ACT * (m.kv_lora_rank + m.qk_rope_head_dim) + ACT * m.kv_lora_rank
        repl_params += h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        shard_params += m.kv_lora_rank * a.heads * (m.qk_nope_head_dim + m.v_head_dim)
        qk, v = m.q_head_dim, m.v_head_dim
        shard_store += ACT * a.heads * (2 * qk + v)  # q, k (nope + rope), v
        out_in = a.heads * v
    else:
        qw, kvw = a.heads * a.head_dim, a.kv_heads * a.head_dim
        qkv = qw + 2 * kvw
        gemms = [Gemm(tokens, int(qkv / t), h, split=(qw / qkv, kvw / qkv, kvw / qkv))]
        shard_store = ACT * (qw + 2 * kvw)  # Q, K, V kept for the score and value products
        shard_store += ACT * (qw + kvw) if a.qk_norm else 0  # the QK-norm inputs, for its backward
        repl_store, repl_params = 0.0, a.qk_norm_params  # the head_dim norm scales: every rank
        shard_params = h * (qw + 2 * kvw) + ((qw + 2 * kvw) if a.qkv_bias else 0)
        qk, v = a.head_dim, a.head_dim
        out_in = qw
    gemms.append(Gemm(tokens, h, int(out_in / t)))
    gemms = [g._replace(low=ctx.recipe is not None) for g in gemms]
    reruns = {"mla_up_proj": _mla_up_rerun(b, tokens, ctx, gemms)} if a.kind == "mla" else {}
    shard_store += ctx.linear_input_bytes * out_in  # output-projection input
    shard_params += out_in * h + (a.heads if a.sinks else 0)  # a sink logit per head, split with the heads
    repl_params += h if a.out_bias else 0
    core = AttnCore(1, tokens, heads, qk, v, causal=True, flash=ctx.flash, dropout=ctx.dropout, context=ctx.cp,
                    window=a.window)
    return gemms, core, repl_store, shard_store, repl_params, shard_params, reruns


def _mla_up_rerun(b: DecoderBlock, tokens: int, ctx: LayerContext, gemms: list[Gemm]) -> Rerun:
    """Megatron-Core's "mla_up_proj" recompute (multi_latent_attention.py): the query and key-value
    up-projections and the RoPE application run again in backward, so Q, K and V are not kept;
    the latents they start from are. Under a recipe the two latents are quantized again."""
    a, t = b.attention, ctx.tp
    m = a.mla
    assert m is not None
    up = [gemms[1], gemms[3]] if m.q_lora_rank else [gemms[0], gemms[2]]  # without a q latent: q from h
    qkv = ACT * a.heads * (2 * m.q_head_dim + m.v_head_dim) / t  # Q, K, V written contiguous, kept otherwise
    quant = ctx.recipe.quantize_bytes_per_element() * (
        (m.q_lora_rank or b.hidden) + m.kv_lora_rank) if ctx.recipe else 0.0
    return Rerun(tuple(up), tokens * (2 * ACT * _rope_width(b) / t + qkv + quant), (), tokens * qkv)


def _cp_bytes(b: DecoderBlock, tokens: int, ctx: LayerContext) -> dict[str, float]:
    """What context parallelism moves per sample for one attention (context_parallel.py): the
    K and V chunk a ring step passes on (the keys and values TE's attention reads, after MLA's
    up-projection), and the Q, K, V and output tensors the all-to-all variant exchanges."""
    if ctx.cp == 1:
        return {}
    a = b.attention
    if a.kind == "mla":
        assert a.mla is not None
        q = k = a.heads * a.mla.q_head_dim
        v = o = a.heads * a.mla.v_head_dim
    else:
        q = o = a.heads * a.head_dim
        k = v = a.kv_heads * a.head_dim
    per = tokens * ACT / ctx.tp
    return {"cp_kv": per * (k + v), "cp_qkv": per * (q + k + v), "cp_o": per * o}


def _score_bytes(core: AttnCore) -> float:
    """Bytes of the s^2 terms per sample on one GPU (0 with FlashAttention, which keeps only
    the fp32 log-sum-exp per row). Unfused: softmax output 2as^2b, plus with dropout the mask
    as^2b and its output 2as^2b (Korthikanti Eq. 1: 5as^2b)."""
    rows = core.seqs * core.heads * core.seq
    if core.flash:
        return 4.0 * rows
    per = ACT + ((MASK + ACT) if core.dropout else 0)
    return per * rows * core.seq


def _mlp_parts(b: DecoderBlock, tokens: int, ctx: LayerContext):
    """A dense or MoE MLP: GEMMs, stored bytes per token (replicated, sharded), parameters
    (replicated, TP-sharded, routed experts per GPU), memory traffic per token, EP traffic, and
    the MLP's own TP collectives (forward)."""
    h, t, mlp = b.hidden, ctx.tp, b.mlp
    pair = ctx.tp_pair(tokens * h * ACT)
    if isinstance(mlp, DenseMLP):
        g, stored, traffic = _ffn(mlp.ffn, mlp.gated, tokens, h, t, 1, ctx)
        out_bias = h if mlp.bias else 0
        rerun = {"mlp": _module_rerun(g, traffic, stored / t, tokens, h, ctx)}
        return (g, 0.0, stored / tokens, out_bias, mlp.params(h) - out_bias, 0.0, traffic / tokens, 0.0, 0, pair,
                rerun)
    assert isinstance(mlp, MoEMLP)
    gated = mlp.act == "swiglu"
    e, k, et = mlp.routed_experts, mlp.top_k, ctx.expert_tp
    gemms = [Gemm(tokens, e, h)]  # router, replicated
    repl = 2 * 4.0 * e  # fp32 router logits and probabilities
    shard, traffic, reruns = 0.0, 0.0, {}
    if mlp.shared_ffn:
        g, stored, tr = _ffn(mlp.shared_ffn, gated, tokens, h, t, 1, ctx)
        gemms += g
        shard += stored / tokens
        traffic += tr / tokens
        reruns["shared_experts"] = _module_rerun(g, tr, stored / t, tokens, h, ctx)
    # Routed experts (Megatron-Core's alltoall dispatcher): each rank routes the tokens it holds
    # (tokens / tp under sequence parallelism), sends top_k copies of each over EP, and the
    # expert-TP group of ``et`` ranks gathers what its ranks received: the grouped GEMMs of the
    # e / ep local experts see tokens x top_k x et / tp copies with 1/et of each expert's width.
    # Under tp > 1 without SP (DeepSpeed) et is tp and every TP rank holds every token. The
    # busiest EP rank receives ``imbalance`` x the mean copies, and every rank waits for it;
    # with a capacity factor every expert is dropped or padded to exactly that many.
    local, copies = e // ctx.ep, k * (ctx.capacity or (ctx.imbalance if ctx.ep > 1 else 1.0))
    held = 1 / t if ctx.sp else 1.0  # share of the tokens a rank holds and dispatches
    gathered = tokens * copies * et / t
    g, stored, tr = _ffn(mlp.expert_ffn, gated, gathered / local, h, et, local, ctx)
    gemms += g
    shard += stored * t / et / tokens
    reruns["moe_act"] = _moe_act_rerun(gathered * mlp.expert_ffn / et, tr, ctx)
    # Kept for backward: the experts' (gathered) input and the outputs awaiting combine (held).
    shard += copies * ACT * h * (et + held * t)
    traffic += tr / tokens + copies * 4 * ACT * h * held  # permute + unpermute: read and write each copy
    expert_rank = e * mlp.expert_params(h) / (et * ctx.ep)
    a2a = tokens * copies * h * ACT * held
    # TP collectives: the shared expert's input gather and output reduce-scatter over TP; the
    # routed copies' gather and reduce-scatter over expert TP (the TP group itself when et = tp).
    if ctx.sp:
        pair = ((pair if mlp.shared_ffn else ()) + (ctx.tp_pair(gathered * h * ACT) if et > 1 else ()))
    if ctx.allgather and et * ctx.ep > 1:
        # The allgather dispatcher: every token of the experts' TP x EP group (et x ep ranks holding
        # ``held`` of the tokens each) gathered whole to each rank, its local experts' copies
        # permuted out of it, the outputs reduce-scattered back; it replaces the expert-TP pair.
        # The gathered tokens are read by the permute and written by the unpermute.
        group = tokens * held * et * ctx.ep
        traffic += 2 * ACT * h * group / tokens
        shared = ctx.tp_pair(tokens * h * ACT) if mlp.shared_ffn else ()
        return (gemms, repl, shard, mlp.gate_params(h), mlp.shared_params(h), expert_rank, traffic,
                group * h * ACT, 1, shared, reruns)
    return gemms, repl, shard, mlp.gate_params(h), mlp.shared_params(h), expert_rank, traffic, a2a, 2, pair, reruns


def _moe_act_rerun(fc2_in: float, traffic: float, ctx: LayerContext) -> Rerun:
    """"moe_act" (experts.py): the experts' activation (``traffic``) runs again from the kept fc1
    output, so their ``fc2_in`` input elements (quantized under a recipe, again then) are not kept."""
    quant = ctx.recipe.quantize_bytes_per_element() * fc2_in if ctx.recipe else 0.0
    return Rerun((), traffic + quant, (), fc2_in * ctx.linear_input_bytes)


def _module_rerun(gemms: list[Gemm], traffic: float, stored: float, tokens: int, h: int,
                  ctx: LayerContext) -> Rerun:
    """A checkpointed MLP ("mlp", "shared_experts"): its forward again, TP collectives included
    (its input kept by the checkpoint), none of its inner tensors kept (``stored`` per GPU).
    Under a recipe its GEMMs' inputs are quantized again."""
    return Rerun(tuple(gemms), traffic + _requantized(gemms, ctx), ctx.tp_pair(tokens * h * ACT), stored)


def _moe_rerun(gemms: list[Gemm], repl: float, shard: float, traffic: float, tp: tuple, tokens: int,
               ctx: LayerContext) -> Rerun:
    """"moe" (Megatron-Core's MoE-layer checkpoint): the router, the dispatch, the experts and the
    combine run again in backward from the kept layer input (one more pass of the layer's
    all-to-alls and TP collectives); none of its inner tensors (``repl`` and ``shard`` per token,
    as _transformer_layer splits them) are kept."""
    kept = (ctx.repl(repl) + shard / ctx.tp) * tokens
    return Rerun(tuple(gemms), traffic * tokens + _requantized(gemms, ctx), tuple(tp), kept, 1)


def _requantized(gemms: list[Gemm], ctx: LayerContext) -> float:
    """Bytes of quantizing the recipe's GEMM inputs again when a module's forward reruns."""
    if ctx.recipe is None:
        return 0.0
    return ctx.recipe.quantize_bytes_per_element() * sum(g.tokens * g.k * g.batch for g in gemms if g.low)


def flex_routing(mlp: MoEMLP) -> dict[str, float]:
    """What the flex dispatcher's pricing reads of a layer's router (block_times, moe_dispatch.py):
    experts, top-k, and the expert groups of group-limited routing with those picked per token."""
    r = mlp.router
    return {"flex_experts": mlp.routed_experts, "flex_topk": mlp.top_k, "flex_groups": r.groups,
            "flex_group_topk": r.group_topk if r.groups > 1 else 0}


GATED = (0.5, 0.5)  # a gated MLP's fc1: gate and up, held as two weights (Gemm.split)


def _ffn(width: int, gated: bool, tokens: float, h: int, t: int, batch: int, ctx: LayerContext | None = None):
    """A (gated) MLP of ``width`` over ``batch`` x ``tokens``: GEMMs, stored bytes and memory
    traffic per sample (totals, not per token). ``ctx`` with a recipe: a decoder layer's MLP,
    whose GEMMs run in it and whose fc2 input is kept quantized."""
    w = width / t
    up = 2 * w if gated else w
    low = ctx is not None and ctx.recipe is not None
    gemms = [Gemm(tokens, int(up), h, batch, low, GATED if gated else (1.0,)),
             Gemm(tokens, h, int(w), batch, low)]
    rows = tokens * batch
    # gated: fc1 output (gate and up, 2w) + fc2 input (w); GELU: its input (w) + fc2 input (w).
    # The fc1 input is the layer's MLP input, counted with the replicated tensors.
    fc2_in = ctx.linear_input_bytes if low else ACT
    stored = rows * (ACT * (2 * width if gated else width) + fc2_in * width)  # whole width: the caller splits by t
    traffic = rows * ACT * (up + w)  # activation kernel: read fc1 output, write fc2 input
    return gemms, stored, traffic


def decoder_cost(i: int, b: DecoderBlock, s: int, ctx: LayerContext) -> LayerCost:
    h = b.hidden
    ag, core, a_repl, a_shard, a_rp, a_sp, a_rerun = _attention_parts(b, s, ctx)
    mg, m_repl, m_shard, m_rp, m_sp, expert_rank, m_traffic, a2a, a2a_count, m_tp, m_rerun = _mlp_parts(b, s, ctx)
    if isinstance(b.mlp, MoEMLP):
        m_rerun["moe"] = _moe_rerun(mg, m_repl, m_shard, m_traffic, m_tp, s, ctx)
    if ctx.rope:  # fused RoPE reads and writes the rotary part of Q and K once
        m_traffic += 2 * ACT * _rope_width(b) / ctx.tp
    if b.attention.qk_norm:  # QK-norm reads and writes every query and key head once
        m_traffic += 2 * ACT * (b.attention.heads + b.attention.kv_heads) * b.attention.head_dim / ctx.tp
    if ctx.recipe is not None:  # quantize each low-precision GEMM's input, per token
        m_traffic += ctx.recipe.quantize_bytes_per_element() * sum(g.tokens * g.k * g.batch
                                                                    for g in ag + mg if g.low) / s
    cost = _transformer_layer(i, "decoder", b.params(), h, s, 1, ag + mg, core, a_repl + m_repl, a_shard + m_shard,
                              a_rp + m_rp + 2 * norm_params(h, b.norm), a_sp + m_sp, expert_rank, m_traffic,
                              a2a, a2a_count, ctx, m_tp, {**a_rerun, **m_rerun})
    if ctx.recipe is not None and ctx.sp and ctx.tp > 1:  # the attention's pair, and a dense MLP's
        n = len(cost.tp_fwd) if isinstance(b.mlp, DenseMLP) else 2
        cost = cost._replace(tp_fwd=quantized_gathers(cost.tp_fwd, n, ctx),
                             tp_bwd=quantized_gathers(cost.tp_bwd, n, ctx))
    cp = {**_cp_bytes(b, s, ctx), **_eager(b, s, mg, ctx)}
    cost = cost._replace(extra={**cost.extra, **cp}) if cp else cost
    if ctx.flex and isinstance(b.mlp, MoEMLP) and a2a:
        cost = cost._replace(extra={**cost.extra, **flex_routing(b.mlp)})
    if ctx.allgather and isinstance(b.mlp, MoEMLP) and a2a:
        cost = cost._replace(extra={**cost.extra, "ep_gather": 1.0})  # ep_a2a gathered, then reduce-scattered
    return op_sac(cost, b, s, ctx) if b.attention.kind != "mla" and isinstance(b.mlp, DenseMLP) else cost


def op_sac(cost: LayerCost, b: DecoderBlock, s: int, ctx: LayerContext) -> LayerCost:
    """``cost`` with torchtitan's per-op selective activation checkpointing ("op"; 0.2.2
    torchtitan/distributed/activation_checkpoint.py with llama3's _op_sac_save_list): in each
    transformer block it keeps the outputs of the block's aten.mm calls counted 1, 3, 5, ... in
    forward order (llama3's wq, wk, wv, wo, w1, w3, w2: wq, wv, w1 and w2), the SDPA outputs
    (with the fp32 log-sum-exp) and the TP reduce-scatters', and recomputes everything else,
    the block's input kept by the checkpoint. torchao's Float8Linear multiplies with
    _scaled_mm, which the policy neither counts nor keeps: under a float8 recipe every linear
    runs again. Dense GQA / MHA layers only (the Llama 3 flavors)."""
    a, h, t = b.attention, b.hidden, ctx.tp
    qw, kvw = a.heads * a.head_dim, a.kv_heads * a.head_dim
    ffn = b.mlp.ffn
    mms = [Gemm(s, int(qw / t), h), Gemm(s, int(kvw / t), h), Gemm(s, int(kvw / t), h), Gemm(s, h, int(qw / t))]
    mms += [Gemm(s, int(ffn / t), h)] * (2 if b.mlp.gated else 1) + [Gemm(s, h, int(ffn / t))]
    saved = () if ctx.recipe is not None else tuple(mms[0::2])
    reduce_scatters = 2 if (t > 1 and ctx.sp) else 0
    per_token = (ctx.repl(ACT * h) + ACT * qw / t + 4.0 * a.heads / t + reduce_scatters * ACT * h / t
                 + sum(ACT * g.n for g in saved))
    return cost._replace(act={**cost.act, "op": per_token * s}, sac_saved=saved, extra={**cost.extra, "op_sac": 1.0})


def quantized_gathers(ops: tuple[tuple[str, float], ...], n: int, ctx: LayerContext) -> tuple[tuple[str, float], ...]:
    """The first ``n`` of a layer's TP collectives with their all-gathers in the recipe's format:
    under sequence parallelism Transformer Engine quantizes a column-parallel linear's input
    before gathering it, and a row-parallel linear's output gradient before gathering it in
    backward (layernorm_linear.py / linear.py ``gather_along_first_dim(..., quantizer=)``), as
    torchao's Float8ColwiseParallel / Float8RowwiseParallel do for torchtitan's tensorwise float8
    (float8_tensor_parallel.py); the reduce-scatters stay 16-bit."""
    low = ctx.linear_input_bytes / ACT
    return tuple((op, b * low if op == "allgather" and i < n else b) for i, (op, b) in enumerate(ops))


def _eager(b: DecoderBlock, s: int, mlp_gemms: list[Gemm], ctx: LayerContext):
    """LayerCost.extra of the layer's eager kernels (eager_kernels.py): its gated MLPs' SwiGLU
    (a gated fc1's output elements, half its width: gate and up), RoPE over the rotary queries
    and keys, and its two RMSNorms, per sample on this GPU."""
    if ctx.eager is None:
        return eager_extra(None)
    swiglu = sum(g.tokens * g.n / 2 * g.batch for g in mlp_gemms if g.split == GATED)
    rope = s * _rope_width(b) / ctx.tp if ctx.rope else 0.0
    norms = 2 * ctx.repl(b.hidden) * s if b.norm == "rmsnorm" else 0.0
    return eager_extra(ctx.eager.block_extra(swiglu, rope, norms))


def _rope_width(b: DecoderBlock) -> float:
    a = b.attention
    if a.kind == "mla":
        assert a.mla is not None
        return (a.heads + 1) * a.mla.qk_rope_head_dim  # per-head query part + the shared key part
    return (a.heads + a.kv_heads) * a.head_dim


def vision_cost(i: int, b: VisionBlock, tiles: int, patches: int, ctx: LayerContext) -> LayerCost:
    """A ViT block over ``tiles`` independent sequences of ``patches`` tokens (full attention)."""
    if b.heads % ctx.tp:
        raise UserError(f"{arg('tp')} {ctx.tp} does not divide the vision tower's {b.heads} heads; "
                        f"pick a {arg('tp')} that divides {b.heads}")
    h, t, tokens = b.hidden, ctx.tp, tiles * patches
    gemms = [Gemm(tokens, int(3 * h / t), h), Gemm(tokens, h, int(h / t))]
    g, stored, traffic = _ffn(b.mlp, False, tokens, h, t, 1)
    core = AttnCore(tiles, patches, b.heads / t, h // b.heads, h // b.heads, False, ctx.flash, ctx.dropout)
    per_tok = stored / tokens if tokens else 0.0
    shard = ACT * 4 * h + per_tok  # Q, K, V, output-projection input + MLP
    repl_params = 2 * norm_params(h, b.norm) + h + h  # norms, out bias, fc2 bias
    return _transformer_layer(i, "vision", b.params(), h, tokens, tiles, gemms + g, core, 0.0, shard, repl_params,
                              b.params() - repl_params, 0.0, traffic / tokens if tokens else 0.0, 0.0, 0, ctx)


def _transformer_layer(i, kind, params, h, tokens, seqs, gemms, core, extra_repl, shard, repl_params, shard_params,
                       expert_rank, mlp_traffic, a2a, a2a_count, ctx: LayerContext, mlp_tp=None,
                       reruns: dict[str, Rerun] | None = None) -> LayerCost:
    """Assemble a pre-norm transformer layer (Korthikanti Eq. 1 layout) from its parts; the
    MLP's TP collectives are ``mlp_tp`` (default: the dense MLP's pair, as the attention's).
    ``reruns``: what each of Megatron's recompute modules of the layer runs again and frees;
    selective recompute keeps what the chosen ones (``ctx.modules``) do not."""
    t = ctx.tp
    # Replicated per token: two norm inputs, attention input, MLP input (4 x 2h = 8h), plus a
    # dropout mask after attention and after the MLP (2 x 1h): Korthikanti's 10sbh. Under a TE
    # recipe the attention and MLP inputs (the QKV and fc1 GEMMs' inputs) are kept quantized.
    linear_in = ctx.linear_input_bytes if kind == "decoder" else ACT
    repl = 2 * ACT * h + 2 * linear_in * h + (2 * MASK * h if ctx.dropout else 0) + extra_repl
    scores = _score_bytes(core) / tokens if tokens else 0.0
    stored_none = ctx.repl(repl) + shard / t + scores
    # "layernorm" (transformer_layer.py): both norms run again, their outputs (the QKV and fc1
    # GEMMs' inputs, saved unquantized then, TE re-quantizing in backward) not kept.
    quant = 2 * ctx.recipe.quantize_bytes_per_element() * h if ctx.recipe and kind == "decoder" else 0.0
    norms = Rerun((), tokens * ctx.repl(2 * 2 * ACT * h + quant), (), tokens * ctx.repl(2 * linear_in * h))
    inside = {"moe_act", "shared_experts"} if "moe" in ctx.modules else set()  # what "moe" reruns already
    rerun = sum((r for m, r in {**(reruns or {}), "layernorm": norms}.items() if m in ctx.modules - inside),
                NO_RERUN)
    attn_again = "core_attn" in ctx.modules
    freed = rerun.saved / tokens if tokens else 0.0
    stored_sel = stored_none - (scores if attn_again and not core.flash else 0.0) - freed
    checkpoint = ctx.repl(ACT * h)  # full recompute keeps the layer input only
    # Per-op SAC keeps less than "none" and more than "full"; until op_sac prices a layer's own
    # ops it is the full recompute's (torchtitan's rules refuse it where op_sac does not apply).
    act = {"none": stored_none * tokens, "selective": stored_sel * tokens, "full": checkpoint * tokens,
           "op": checkpoint * tokens}
    # Memory-bound traffic per token, forward: 2 norms (read 2h, write 2h), 2 residual adds
    # (read 4h, write 2h, + mask 1h with dropout), the MLP activation, and without
    # FlashAttention the softmax (+ dropout) over a*s scores per token.
    per_tok = 2 * 4 * h + 2 * (6 * h + (MASK * h if ctx.dropout else 0))
    per_tok = ctx.repl(per_tok) + mlp_traffic
    score_tok = 0.0 if core.flash else core.heads * core.seq * (2 * ACT + ((2 * ACT + MASK) if ctx.dropout else 0))
    per_tok += score_tok
    nbytes = tokens * h * ACT
    tp = ctx.tp_pair(nbytes) + (ctx.tp_pair(nbytes) if mlp_tp is None else mlp_tp)
    bwd = mirrored(tp)
    return LayerCost(i, kind, params, repl_params + shard_params / t, expert_rank, tokens, h, tuple(gemms), core,
                     per_tok * tokens, act, stored_none * tokens, tp, bwd, a2a, a2a_count, True,
                     {"score_hbm": score_tok * tokens, "sel_attn": float(attn_again)}, rerun=rerun)

