"""Megatron-LM / Megatron-DeepSpeed command-line flags for the same plan.

Flag names follow Megatron-LM's argument parser (megatron/training/arguments.py); for
megatron-deepspeed plans, Megatron-DeepSpeed's (deepspeedai/Megatron-DeepSpeed
megatron/arguments.py plus ``deepspeed.add_config_arguments``), which spells grouped-query
attention (--num-key-value-heads), norms (lowercase) and RoPE (--use-rotary-position-embeddings)
differently. tests/test_emit_scripts.py keeps the list of known flags and checks every emitted
one against it.
"""

from __future__ import annotations

from planner.cost.memory import group_to_set
from planner.cost.precision import RECIPES, gathers_fp8_params
from planner.emit.container import DEFAULT_IMAGE
from planner.emit.ds_config import TrainSettings
from planner.emit.megatron_flag import Arg, _a
from planner.emit.megatron_moe import moe_args
from planner.emit.megatron_positions import position_args
from planner.emit.plan_file import PlanFile
from planner.emit.resilience import megatron_checkpoint_args
from planner.errors import UserError
from planner.model.spec import DecoderBlock, DenseMLP, LMHeadBlock, ModelSpec, MoEMLP


def bigscience_fork(model: ModelSpec, plan: PlanFile) -> bool:
    """A megatron-deepspeed plan of an ALiBi model runs on BigScience's fork, whose parser
    spells some flags its own way: --pad-vocab-size-to, --checkpoint-activations, LayerNorm only."""
    return plan.framework == "megatron-deepspeed" and model.positions is not None and model.positions.kind == "alibi"


def _model_args(model: ModelSpec, plan: PlanFile) -> list[Arg]:
    mds = plan.framework == "megatron-deepspeed"
    bigscience = bigscience_fork(model, plan)
    first: DecoderBlock = model.decoder_blocks[0]
    attn = first.attention
    args = [
        _a("--num-layers", model.num_layers),
        _a("--hidden-size", model.hidden),
        _a("--num-attention-heads", attn.heads),
        _a("--seq-length", plan.seq_len),
        _a("--max-position-embeddings", max(model.max_seq_len, plan.seq_len)),
        _a("--pad-vocab-size-to" if bigscience else "--vocab-size", model.vocab),
    ]
    if model.mtp_layers:  # DeepSeek-V3's multi-token prediction (Megatron-Core's default loss weight 0.1)
        args.append(_a("--mtp-num-layers", model.mtp_layers))
    dense = next((b.mlp for b in model.decoder_blocks if isinstance(b.mlp, DenseMLP)), None)
    moe = next((b.mlp for b in model.decoder_blocks if isinstance(b.mlp, MoEMLP)), None)
    ffn = dense.ffn if dense is not None else (moe.expert_ffn if moe is not None else None)
    if ffn:
        args.append(_a("--ffn-hidden-size", ffn))
    if attn.kind == "mla":
        m = attn.mla
        assert m is not None
        args.append(_a("--multi-latent-attention"))
        if m.q_lora_rank:
            args.append(_a("--q-lora-rank", m.q_lora_rank))
        args += [
            _a("--kv-lora-rank", m.kv_lora_rank),
            _a("--qk-head-dim", m.qk_nope_head_dim),
            _a("--qk-pos-emb-head-dim", m.qk_rope_head_dim),
            _a("--v-head-dim", m.v_head_dim),
        ]
    else:
        args.append(_a("--kv-channels", attn.head_dim))
        if attn.kv_heads < attn.heads:
            # Megatron-DeepSpeed (deepspeedai/Megatron-DeepSpeed megatron/arguments.py) spells
            # grouped-query attention, norms and RoPE its own way; its parser refuses Megatron-LM's.
            args += ([_a("--num-key-value-heads", attn.kv_heads)] if mds else
                     [_a("--group-query-attention"), _a("--num-query-groups", attn.kv_heads)])
    if not mds:
        args += _attention_variant_args(model)
    args += _glu_args(model, mds)[0]
    args += _norm_args(model, first, mds, bigscience)
    args += position_args(model, mds)[0]
    head = next((b for b in model.blocks if isinstance(b, LMHeadBlock)), None)
    if head is not None and not head.tied:
        args.append(_a("--untie-embeddings-and-output-weights"))
    # Megatron-LM defaults both dropouts to 0.1; dsplan's plans count no dropout masks (suggest
    # searches without dropout, as Llama/DeepSeek/Qwen pre-training runs), so say so.
    args += [_a("--hidden-dropout", 0.0), _a("--attention-dropout", 0.0)]
    linear_bias = attn.out_bias or (dense is not None and dense.bias)
    if not linear_bias:
        args.append(_a("--disable-bias-linear"))
        if attn.qkv_bias:
            args.append(_a("--add-qkv-bias"))
    return args


def _attention_variant_args(model: ModelSpec) -> list[Arg]:
    """Qwen3's QK-norm, gpt-oss's learned softmax sinks and its sliding window on alternate layers
    (TransformerConfig qk_layernorm, softmax_type, window_size, window_attn_skip_freq: every
    second layer skips the window, layer 0 keeps it, as gpt-oss's layer_types)."""
    attn = [b.attention for b in model.decoder_blocks]
    args = [_a("--qk-layernorm")] if any(a.qk_norm for a in attn) else []
    if any(a.sinks for a in attn):
        args.append(_a("--softmax-type", "learnable"))
    windows = {a.window for a in attn} - {None}
    if windows:
        (w,) = windows  # a window of w keys, the query included: w - 1 to the left, none to the right
        windowed = [a.window is not None for a in attn]
        if windowed != [i % 2 == 0 for i in range(len(attn))] and not all(windowed):
            raise UserError(f"{model.name}: sliding windows on layers other than every other one have no "
                            "Megatron-LM flag (--window-attn-skip-freq); plan it with --framework torchtitan")
        args.append(_a("--window-size", f"{w - 1},0"))
        if not all(windowed):
            args.append(_a("--window-attn-skip-freq", 2))
    return args


def _norm_args(model: ModelSpec, first: DecoderBlock, mds: bool, bigscience: bool) -> list[Arg]:
    """The norm and its epsilon, in each parser's spelling (BigScience's fork: LayerNorm only)."""
    args = []
    if mds and not bigscience:
        args.append(_a("--normalization", first.norm))  # layernorm | rmsnorm
    elif not mds:
        args.append(_a("--normalization", "RMSNorm" if first.norm == "rmsnorm" else "LayerNorm"))
    if model.norm_eps is not None:
        args.append(_a("--layernorm-epsilon" if mds else "--norm-epsilon", model.norm_eps))
    return args


def _glu_args(model: ModelSpec, mds: bool) -> tuple[list[Arg], list[str]]:
    """The MLP's activation: SwiGLU, or gpt-oss's clamped GLU, (clamp(up, -L, L) + 1) *
    g * sigmoid(1.702 g) with g = clamp(gate, max=L): Megatron-Core's gated quick GELU
    (--quick-geglu, megatron/training/argument_utils.py) with TransformerConfig's
    glu_linear_offset and activation_func_clamp_value, which its parser exposes as flags, as
    Megatron-Bridge's GPTOSSProvider sets them. And what no flag says."""
    dense = next((b.mlp for b in model.decoder_blocks if isinstance(b.mlp, DenseMLP)), None)
    moe = next((b.mlp for b in model.decoder_blocks if isinstance(b.mlp, MoEMLP)), None)
    mlp = dense or moe
    if mlp is not None and mlp.act != "swiglu":
        return [], []
    limit = moe.glu_limit if moe is not None else None
    if limit is None:
        return [_a("--swiglu")], []
    if mds:
        return [_a("--swiglu")], [f"{model.name}'s clamped GLU has no Megatron-DeepSpeed flag: the experts run SwiGLU"]
    return [_a("--quick-geglu"), _a("--glu-linear-offset", 1.0), _a("--activation-func-clamp-value", limit)], []


def megatron_notes(model: ModelSpec, plan: PlanFile) -> list[str]:
    """What megatron_args.sh cannot express for this model, said in its comments."""
    mds = plan.framework == "megatron-deepspeed"
    flex = ([f"--moe-token-dispatcher-type flex imports DeepEP (deep_ep; HybridEP is in its hybrid-ep branch), which "
             f"{DEFAULT_IMAGE} does not ship: build it into the image (github.com/deepseek-ai/DeepEP, with "
             "NVSHMEM) or use an image that has it"] if model.is_moe and plan.moe_dispatcher == "flex" else [])
    return position_args(model, mds)[1] + _glu_args(model, mds)[1] + flex


def _pipeline_args(model: ModelSpec, plan: PlanFile) -> list[Arg]:
    """The planner's split of the decoder layers over pipeline stages and virtual stages.

    Megatron's default splits the layers evenly over pp x v chunks. Any other split goes as
    ``--pipeline-model-parallel-layout`` (one ``|``-separated entry per chunk in model order,
    which is Megatron's order too: chunk k runs on rank k mod pp; ``E`` the embedding on the
    first, ``L`` the loss on the last), which also sets the virtual stages, so it never comes
    with ``--num-virtual-stages-per-pipeline-rank`` (Megatron accepts one of the two). A
    plain pipeline that only moves layers off the first and last stage uses the shorter
    ``--decoder-first/last-pipeline-num-layers``. Vision-language models keep the even split:
    the layout has no vision-encoder layers and the entry places the towers.

    An interleaved plan whose micro-batches per step pp does not divide also names the
    micro-batch group it was planned with (memory.microbatch_group): Megatron's default group
    of pp refuses such a count.
    """
    chunks = plan.pp * plan.virtual_stages
    interleave = [_a("--num-virtual-stages-per-pipeline-rank", plan.virtual_stages)] if plan.virtual_stages > 1 else []
    g = group_to_set(plan.pp, plan.virtual_stages, plan.grad_accum)
    group = [_a("--microbatch-group-size-per-virtual-pipeline-stage", g)] if g else []
    if (plan.pp == 1 or not plan.stage_blocks or len(plan.stage_blocks) != chunks
            or plan.framework == "megatron-deepspeed" or model.is_vlm):
        return interleave + group
    decoder_at = [i for i, b in enumerate(model.blocks) if isinstance(b, DecoderBlock)]
    per_chunk = [sum(1 for i in decoder_at if first <= i < last) for first, last in plan.stage_blocks]
    if len(set(per_chunk)) == 1:
        return interleave + group  # Megatron's own even split
    middle = per_chunk[1:-1]
    if plan.virtual_stages == 1 and plan.pp > 2 and len(set(middle)) == 1:
        return [_a("--decoder-first-pipeline-num-layers", per_chunk[0]),
                _a("--decoder-last-pipeline-num-layers", per_chunk[-1])]
    stages = ["t" * n for n in per_chunk]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "m" * model.mtp_layers + "L"  # MTP last, before the loss
    return [_a("--pipeline-model-parallel-layout", "|".join(stages)), *group]


def _context_args(plan: PlanFile) -> list[Arg]:
    """Context parallelism as the plan was priced (cost/context_parallel.py): Megatron-Core's
    --context-parallel-size and --cp-comm-type, the hierarchical split a2a+p2p needs (a2a over
    a node's CP ranks, then the ring: --hierarchical-context-parallel-sizes, inner first);
    Megatron-DeepSpeed's Ulysses degree."""
    if plan.cp == 1:
        return []
    if plan.framework == "megatron-deepspeed":
        return [_a("--ds-sequence-parallel-size", plan.cp)]
    args = [_a("--context-parallel-size", plan.cp), _a("--cp-comm-type", plan.cp_comm)]
    if plan.cp_comm == "a2a+p2p":
        inner = max(1, min(plan.cp, plan.gpus_per_node // plan.tp))
        args.append(_a("--hierarchical-context-parallel-sizes", f"{inner} {plan.cp // inner}", raw=True))
    return args


def _training_args(plan: PlanFile, settings: TrainSettings, bigscience: bool = False,
                   nvlink_gpus: int | None = None) -> list[Arg]:
    args = [
        _a("--tensor-model-parallel-size", plan.tp),
        _a("--pipeline-model-parallel-size", plan.pp),
        *_context_args(plan),
        _a("--micro-batch-size", plan.micro_batch),
        _a("--global-batch-size", plan.global_batch),
        _a("--train-iters", settings.steps),
        _a("--lr", settings.lr),
        _a("--min-lr", settings.lr * settings.min_lr_ratio),
        _a("--lr-decay-style", settings.scheduler),
        _a("--lr-warmup-iters", settings.warmup),
        _a("--weight-decay", settings.weight_decay),
        _a("--clip-grad", settings.grad_clip),
        _a("--optimizer", "sgd" if plan.optimizer == "sgd" else "adam"),
    ]
    if plan.optimizer != "sgd":
        args += [_a("--adam-beta1", settings.betas[0]), _a("--adam-beta2", settings.betas[1]),
                 _a("--adam-eps", settings.eps)]
    if plan.sequence_parallel:
        args.append(_a("--sequence-parallel"))
        # a TP group inside the NVLink domain (a node, or an NVL72 rack's trays), as priced (paid.py)
        if plan.framework == "megatron" and plan.tp_comm_overlap and 1 < plan.tp <= (nvlink_gpus or plan.gpus_per_node):
            args.append(_a("--tp-comm-overlap"))  # TE userbuffers, as the plan was priced (Traits.tp_comm_overlap)
    if plan.work_precision in ("bf16", "fp16"):
        args.append(_a(f"--{plan.work_precision}"))
    if plan.recipe is not None:  # Transformer Engine's recipe (precision.py): Megatron-Core's flags for it
        args += [_a(flag, value) for flag, value in RECIPES[plan.recipe].megatron_flags]
        if gathers_fp8_params(plan.recipe, plan.fp8_param_gather, plan.framework, plan.zero_stage, plan.offload):
            args.append(_a("--fp8-param-gather"))  # as priced
    if plan.recompute == "selective":
        args.append(_a("--recompute-granularity", "selective"))
        if plan.recompute_modules != ("core_attn",):  # Megatron-Core's default otherwise (Workload.recompute_modules)
            args.append(_a("--recompute-modules", " ".join(plan.recompute_modules), raw=True))
    elif plan.recompute == "full" and bigscience:
        args.append(_a("--checkpoint-activations"))  # whole layers, as the fork checkpoints them
    elif plan.recompute == "full":
        args += [_a("--recompute-granularity", "full"), _a("--recompute-method", "uniform"),
                 _a("--recompute-num-layers", 1)]
    if plan.activation_offload:  # TE's CPU offload of the first layers' activations (activation_offload.py)
        args.append(_a("--cpu-offloading-num-layers", plan.activation_offload))
    if plan.framework != "megatron-deepspeed":  # Megatron-DeepSpeed hands ZeRO to DeepSpeed (--zero-stage below)
        args += _sharding_args(plan)
    args.append(_a("--log-interval", settings.steps_per_print))
    return args + megatron_checkpoint_args(plan, settings.checkpoint_every or 0)


def _sharding_args(plan: PlanFile) -> list[Arg]:
    """How Megatron-LM shards the model states, as priced: Megatron-FSDP (ZeRO-3) or the distributed
    optimizer (ZeRO-1), in ``dp_replicate`` instances over dp x cp / dp_replicate ranks each
    (Megatron-FSDP's HSDP, outer group replicated: mcore_fsdp_adapter.py)."""
    args: list[Arg] = []
    if plan.zero_stage == 3:
        args += _fsdp_args()
    elif plan.zero_stage >= 1:
        # Megatron-LM's ZeRO-1 is the distributed optimizer (optimizer states sharded over DP).
        args += [_a("--use-distributed-optimizer"), _a("--overlap-grad-reduce"), _a("--overlap-param-gather")]
        if plan.offload != "none":
            # Megatron-Core's HybridDeviceOptimizer, all of the optimizer on the host: it rides on the
            # precision-aware optimizer (megatron/training/arguments.py asserts the pair), and the
            # overlap flag pipelines the copies with the host step, as the cost model assumes
            # (step_time.hybrid_optimizer_time). Parameters stay on the GPU.
            args += [_a("--optimizer-cpu-offload"), _a("--optimizer-offload-fraction", 1.0),
                     _a("--use-precision-aware-optimizer"), _a("--overlap-cpu-optimizer-d2h-h2d")]
        elif plan.precision_aware_optimizer:
            # TE's FusedAdam with bf16 moments, as priced (Workload.state_dtypes); it keeps 16-bit
            # master remainders by default where it holds the master weights (store_param_remainders).
            args += [_a("--use-precision-aware-optimizer"), _a("--exp-avg-dtype", "bf16"),
                     _a("--exp-avg-sq-dtype", "bf16")]
    if plan.dp_replicate > 1 and plan.zero_stage in (1, 3):
        args.append(_a("--num-distributed-optimizer-instances", plan.dp_replicate))
    return args


def _fsdp_args() -> list[Arg]:
    """Megatron-FSDP (ZeRO-3) as priced: gradients in the weights' dtype ("auto" main-grads and
    grad-comm dtypes), fp32 main weights; the fsdp_dtensor checkpoint format Megatron-LM asserts,
    and each shard built in place on the meta device (docs/user-guide/features/megatron_fsdp.md)."""
    return [_a("--use-megatron-fsdp"), _a("--data-parallel-sharding-strategy", "optim_grads_params"),
            _a("--ckpt-format", "fsdp_dtensor"), _a("--init-model-with-meta-device"),
            _a("--overlap-grad-reduce"), _a("--overlap-param-gather")]


def megatron_lm_args(model: ModelSpec, plan: PlanFile, settings: TrainSettings | None = None,
                     nvlink_gpus: int | None = None) -> list[Arg]:
    """The plan in Megatron-LM's own flags (``nvlink_gpus``: the GPUs one NVLink domain holds,
    default the node's).

    For ``megatron`` plans this is the launch; for ``deepspeed`` plans it is the same layout
    translated (ZeRO >= 1 as the distributed optimizer, EP as expert-model-parallel); for
    ``megatron-deepspeed`` plans ZeRO and MoE go to DeepSpeed (``megatron_deepspeed_args``).
    """
    settings = settings or TrainSettings()
    return (_training_args(plan, settings, bigscience_fork(model, plan), nvlink_gpus) + _pipeline_args(model, plan)
            + _model_args(model, plan) + moe_args(model, plan))


def megatron_deepspeed_args(model: ModelSpec, plan: PlanFile) -> list[Arg]:
    """The extra flags Megatron-DeepSpeed needs to hand the plan's ZeRO/MoE settings to DeepSpeed."""
    if plan.framework != "megatron-deepspeed":
        return []
    args = [
        _a("--deepspeed"),
        _a("--deepspeed_config", '"$RUN_DIR/ds_config.json"', raw=True),
        _a("--zero-stage", plan.zero_stage),
    ]
    if plan.pp == 1 and not bigscience_fork(model, plan):
        args.append(_a("--no-pipeline-parallel"))
    if plan.recompute != "none":
        args.append(_a("--deepspeed-activation-checkpointing"))
    moe = next((b.mlp for b in model.decoder_blocks if isinstance(b.mlp, MoEMLP)), None)
    if moe is not None:
        args += [
            _a("--num-experts", moe.routed_experts),
            _a("--moe-expert-parallel-size", plan.ep),
            _a("--topk", moe.top_k),
        ]
        if moe.shared_experts:
            args += [_a("--mlp-type", "residual")]
    return args
