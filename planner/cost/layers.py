"""The layer cost profile: what each block of a ModelSpec costs on one GPU, per sample.

One ``LayerCost`` per block, for one (model, sequence length, images/tiles, tp, sequence
parallel, ep, precision, kernel choices). Every quantity is *per GPU and per sample* (a
micro-batch of b samples costs b times as much), so the search can build these once per
(tp, sp, ep) and scale by the micro-batch in numpy. GEMM shapes are kept (not only FLOPs)
because efficiency depends on them (planner/cost/efficiency.py).

Activation bytes follow Korthikanti et al. 2022 (arXiv:2205.05198) Eq. 1-6, written as a sum
of the tensors each operation keeps for backward, so that a GPT layer with dropout and without
FlashAttention reproduces Table 2 exactly (reference/korthikanti2022_activation_
memory_formulas.csv) while GQA, SwiGLU, MLA, MoE, ViT tiles, the projector, the embedding and
the fp32 logits of the LM head get their own terms. Tensors split into *replicated* (held by
every TP rank; split by t only under sequence parallelism) and *sharded* (split by t).
"""

from __future__ import annotations

from planner.cost.eager_kernels import eager_of
from planner.cost.layer_cost import (
    ACT,
    MASK,
    RECOMPUTE_MODES,
    AttnCore,
    Gemm,
    LayerContext,
    LayerCost,
    eager_extra,
    mirrored,
    same_in_every_mode,
)
from planner.cost.parallel import Workload
from planner.cost.precision import RECIPES
from planner.cost.transformer_layers import decoder_cost, vision_cost
from planner.model.spec import (
    Block,
    DecoderBlock,
    EmbeddingBlock,
    LMHeadBlock,
    ModelSpec,
    MTPBlock,
    NormBlock,
    ProjectorBlock,
    VisionBlock,
    VisionEmbedBlock,
    norm_params,
)

__all__ = ["ACT", "MASK", "RECOMPUTE_MODES", "AttnCore", "Gemm", "LayerCost", "korthikanti_layer_bytes",
           "layer_costs", "uses_rope", "vision_tiles"]


def vision_tiles(model: ModelSpec, workload: Workload) -> int:
    """ViT passes per sample: images x (local tiles + the global view)."""
    if model.vision is None:
        return 0
    return workload.images_per_sample * (workload.tiles_per_image + (1 if model.vision.global_view else 0))


def layer_costs(model: ModelSpec, workload: Workload, tp: int = 1, sp: bool = False, ep: int = 1,
                memo: dict[tuple[int, int, bool, int, int, int, bool], LayerCost] | None = None, cp: int = 1,
                etp: int | None = None, vocab_parallel: bool = True) -> list[LayerCost]:
    """The cost profile of every block, in ModelSpec order; under context parallelism ``cp``
    each block sees seq_len / cp tokens of a sample (Megatron-Core splits the whole sequence,
    embedding and loss included) and attention reads the whole context (AttnCore.context).

    ``memo``: a dict the caller keeps across calls for one (model, workload), holding each
    block's cost by (index, tp, sp, ep, cp, etp), with ep and etp 1 but for a mixture-of-experts
    layer (the only block that reads them): a search prices dozens of (tp, sp, ep), which differ
    in those layers only. ``etp``: the routed experts' TP degree (None: tp). ``vocab_parallel``
    False: DeepSpeed AutoTP's embedding and LM head (frameworks.Traits.vocab_parallel)."""
    etp = tp if etp is None else etp
    ctx = LayerContext(tp, sp, ep, workload.flash_attention, workload.dropout, uses_rope(model),
                       RECIPES[workload.recipe] if workload.recipe else None, cp, workload.moe_imbalance, etp,
                       workload.moe_dispatcher == "flex", allgather=workload.moe_dispatcher == "allgather",
                       capacity=workload.moe_capacity_factor or 0.0, vocab_parallel=vocab_parallel,
                       modules=frozenset(workload.recompute_modules),
                       eager=eager_of(workload.compile, workload.rms_norm_kernel == "composite",
                                      workload.pp_schedule == "dualpipev"))
    s = workload.seq_len // cp
    tiles = vision_tiles(model, workload)
    out: list[LayerCost] = []
    # Equal blocks cost the same (VL2's 27 ViT and 29 MoE layers, a dense model's every layer):
    # price each distinct one once and renumber the copies.
    seen: dict[object, LayerCost] = {}
    for i, b in enumerate(model.blocks):
        if memo is None:
            out.append(_block_cost(model, i, b, s, tiles, ctx, seen))
            continue
        layer = b.layer if b.kind == "mtp" else b
        moe = layer.kind == "decoder" and layer.mlp.kind == "moe"
        key = (i, tp, sp, ep if moe else 1, cp, etp if moe else 1, vocab_parallel)
        cost = memo.get(key)
        if cost is None:  # priced directly: hashing a layer for ``seen`` costs about as much
            cost = memo[key] = _block_cost(model, i, b, s, tiles, ctx, None)
        out.append(cost)
    return out


def _block_cost(model: ModelSpec, i: int, b: Block, s: int, tiles: int, ctx: LayerContext,
                seen: dict[object, LayerCost] | None) -> LayerCost:
    """Block ``i``'s cost, dispatched on the block's ``kind`` tag; a transformer layer equal to
    one in ``seen`` (when given) is that one renumbered."""
    kind = b.kind
    if kind == "decoder" or kind == "vision":
        cost = seen.get(b) if seen is not None else None
        if cost is None:
            if isinstance(b, DecoderBlock):
                cost = decoder_cost(i, b, s, ctx)
            else:
                assert model.vision is not None
                cost = vision_cost(i, b, tiles, model.vision.patches_per_tile, ctx)
            if seen is not None:
                seen[b] = cost
        return cost if cost.index == i else cost._replace(index=i)
    if kind == "vision_embed":
        assert isinstance(b, VisionEmbedBlock) and model.vision is not None
        return _vision_embed(i, b, tiles * model.vision.patches_per_tile, ctx)
    if kind == "projector":
        assert isinstance(b, ProjectorBlock) and model.vision is not None
        return _projector(i, b, tiles * model.vision.patches_per_tile, ctx)
    if kind == "embedding":
        assert isinstance(b, EmbeddingBlock)
        return _embedding(i, b, s, ctx)
    if kind == "norm":
        assert isinstance(b, NormBlock)
        tokens = tiles * model.vision.patches_per_tile if (model.vision and _in_vision_tower(model, i)) else s
        return _norm(i, b, tokens, ctx)
    if kind == "lm_head":
        assert isinstance(b, LMHeadBlock)
        return _lm_head(i, b, s, ctx)
    if kind == "mtp":
        assert isinstance(b, MTPBlock)
        return _mtp(i, b, s, ctx)
    raise TypeError(f"unknown block {type(b).__name__}")  # pragma: no cover - the Block union is closed


def uses_rope(model: ModelSpec) -> bool:
    """Rotary positions (RoPE or M-RoPE), as the model states them (ModelSpec.positions). A spec
    built by hand without them: rotary unless it learns absolute positions (GPT-2/3) or uses
    ALiBi (BLOOM, recognisable by its embedding LayerNorm)."""
    if model.positions is not None:
        return model.positions.kind in ("rope", "mrope")
    emb = next((b for b in model.blocks if isinstance(b, EmbeddingBlock)), None)
    return emb is not None and emb.learned_positions == 0 and emb.norm is None


def _in_vision_tower(model: ModelSpec, index: int) -> bool:
    """A norm belongs to the vision tower when the block before it is a vision block."""
    return index > 0 and isinstance(model.blocks[index - 1], VisionBlock)


# -- the other blocks -------------------------------------------------------------------


def _embedding(i: int, b: EmbeddingBlock, s: int, ctx: LayerContext) -> LayerCost:
    """Vocab-parallel lookup: each TP rank owns vocab/t rows; partial outputs are all-reduced
    (reduce-scattered under SP). Korthikanti Sec 4.3: only the dropout mask is kept. Under
    AutoTP's whole vocabulary every rank holds the table and looks up alone: nothing to reduce."""
    h, t = b.hidden, ctx.tp
    split = t if ctx.vocab_parallel else 1
    rp = b.learned_positions * h + (norm_params(h, b.norm) if b.norm else 0)
    act = ctx.repl(MASK * h if ctx.dropout else 0) * s + (ctx.repl(ACT * h) * s if b.norm else 0)
    traffic = ctx.repl(3 * ACT * h) * s  # gather rows, add positions, write
    fwd = ((("reducescatter" if ctx.sp else "allreduce"), s * h * ACT),) if split > 1 else ()
    bwd = (("allgather", s * h * ACT),) if (split > 1 and ctx.sp) else ()
    return LayerCost(i, "embedding", b.params(), rp + b.vocab * h / split, 0.0, s, h, (), None, traffic,
                     same_in_every_mode(act), act, fwd, bwd, 0.0, 0, False)


def _vision_embed(i: int, b: VisionEmbedBlock, patches: int, ctx: LayerContext) -> LayerCost:
    """Patch embedding as a GEMM over patch pixels (replicated; small)."""
    gemms = (Gemm(patches, b.hidden, b.patch_pixels),) if patches else ()
    act = patches * ACT * b.patch_pixels  # pixels kept for the weight gradient
    return LayerCost(i, "vision_embed", b.params(), b.params(), 0.0, patches, b.hidden, gemms, None,
                     patches * ACT * 2 * b.hidden, same_in_every_mode(act), act, (), (), 0.0, 0, False)


def _projector(i: int, b: ProjectorBlock, patches: int, ctx: LayerContext) -> LayerCost:
    """Token merge + 2-layer GELU MLP, replicated over TP (it is a few percent of a layer)."""
    tokens = patches // b.merge
    gemms = (Gemm(tokens, b.mlp_hidden, b.merged_dim), Gemm(tokens, b.out_dim, b.mlp_hidden)) if tokens else ()
    per_tok = ACT * (b.merged_dim * (2 if b.in_norm else 1) + 2 * b.mlp_hidden)
    return LayerCost(i, "projector", b.params(), b.params(), 0.0, tokens, b.out_dim, gemms, None,
                     tokens * ACT * (2 * b.merged_dim + 2 * b.mlp_hidden), same_in_every_mode(tokens * per_tok),
                     tokens * per_tok, (), (), 0.0, 0, False)


def _norm(i: int, b: NormBlock, tokens: int, ctx: LayerContext) -> LayerCost:
    act = ctx.repl(ACT * b.hidden) * tokens  # Korthikanti Sec 4.3: final LN input 2sbh (/t with SP)
    rms = ctx.repl(b.hidden) * tokens if b.norm == "rmsnorm" else 0.0
    return LayerCost(i, "norm", b.params(), b.params(), 0.0, tokens, b.hidden, (), None,
                     ctx.repl(4 * b.hidden) * tokens, same_in_every_mode(act), act, (), (), 0.0, 0, False,
                     eager_extra(ctx.eager.block_extra(0.0, 0.0, rms) if ctx.eager else None))


def _lm_head(i: int, b: LMHeadBlock, s: int, ctx: LayerContext) -> LayerCost:
    """Column-parallel output layer + vocab-parallel cross-entropy. Keeps its input (2sbh,
    /t with SP) and the fp32 logits/softmax 4sbv/t (Korthikanti Sec 4.3) until backward; a
    tied head holds no weights of its own but still does the GEMM. Under AutoTP's whole
    vocabulary the rank's logits are all-gathered and every rank runs the whole cross-entropy
    (4sbv kept, the loss's traffic over all v)."""
    h, v, t = b.hidden, b.vocab, ctx.tp
    loss_v = v / t if ctx.vocab_parallel else v  # the logits each rank's cross-entropy covers
    act = (ctx.repl(ACT * h) + 4.0 * loss_v) * s
    # Vocab-parallel cross-entropy in fp32 over the logits (Megatron): write the 16-bit logits
    # (2), upcast (read 2, write 4), max and sum-exp reductions (read 4 + 4), softmax written
    # for backward (4), gradient read and 16-bit write in backward (4 + 2): ~30 bytes per logit.
    traffic = s * loss_v * 30.0 / 3.0  # counted as forward traffic; backward doubles it
    fwd = (("allgather", s * h * ACT),) if (t > 1 and ctx.sp) else ()
    if t > 1 and not ctx.vocab_parallel:
        fwd = (("allgather", s * v * ACT),)  # the logits, gathered whole (the buffer: all v)
    bwd = ((("reducescatter" if ctx.sp else "allreduce"), s * h * ACT),) if t > 1 else ()
    return LayerCost(i, "lm_head", b.params(), b.params() / t, 0.0, s, h, (Gemm(s, int(v / t), h),), None,
                     traffic, same_in_every_mode(act), act, fwd, bwd, 0.0, 0, False,
                     eager_extra(ctx.eager.loss_extra(s * loss_v) if ctx.eager else None))


def _mtp(i: int, b: MTPBlock, s: int, ctx: LayerContext) -> LayerCost:
    """One multi-token-prediction depth: the shared embedding looked up again for the next
    tokens, the two input norms and the 2h -> h projection (column-parallel, as the MLP's first
    GEMM: its input kept, a TP pair), the transformer layer, the final norm and the shared head
    with its cross-entropy, summed into one block (they run on one stage, after the head)."""
    h, v = b.hidden, b.vocab
    layer = decoder_cost(i, b.layer, s, ctx)
    lookup = _embedding(i, EmbeddingBlock(vocab=v, hidden=h), s, ctx)
    head = _lm_head(i, LMHeadBlock(vocab=v, hidden=h, tied=True), s, ctx)
    norms = 3 * ctx.repl(4 * h) * s  # read and write h per token, three times
    kept = ctx.repl(2 * ACT * h) * s + 3 * ctx.repl(ACT * h) * s  # the projection's input, the norms' inputs
    pair = ctx.tp_pair(s * h * ACT)
    act = {m: layer.act[m] + lookup.act[m] + head.act[m] + (kept if m != "full" else 0.0) for m in layer.act}
    own = 2 * h * h / ctx.tp + 3 * norm_params(h, b.layer.norm)
    return layer._replace(
        kind="mtp", params=b.params(), params_rank=layer.params_rank + own,
        gemms=layer.gemms + (Gemm(s, int(h / ctx.tp), 2 * h),) + head.gemms,
        hbm_fwd=layer.hbm_fwd + lookup.hbm_fwd + head.hbm_fwd + norms + ctx.repl(2 * ACT * h) * s, act=act,
        act_live=layer.act_live + kept, tp_fwd=layer.tp_fwd + lookup.tp_fwd + pair + head.tp_fwd,
        tp_bwd=layer.tp_bwd + lookup.tp_bwd + mirrored(pair) + head.tp_bwd)


# -- published formulas (tests compare the profile against these) ----------------------


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, mode: str = "none") -> float:
    """Korthikanti et al. 2022 Table 2, bytes per GPT layer (no FlashAttention, with dropout)."""
    if mode == "full":
        return 2.0 * s * b * h
    score = 0.0 if mode == "selective" else 5.0 * a * s / (h * t)
    if sp:
        return s * b * h * (34.0 / t + score)
    return s * b * h * (10.0 + 24.0 / t + score)
