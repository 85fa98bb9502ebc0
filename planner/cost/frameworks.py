"""The runtime a plan targets, and what that runtime can and cannot do.

Four runtimes, each with its own limits (the rules in planner/cost/framework_rules.py, one
UserError naming the broken rule) and its own behaviour the cost model reads (``Traits``):

- ``deepspeed``: ZeRO 0-3 and offload; AutoTP tensor parallelism only with ZeRO <= 2, on a
  dense model without a pipeline; ``PipelineModule`` pipelines, which DeepSpeed rejects with ZeRO-2/3
  (the pipeline engine asserts ``zero_stage < 2``); MoE with ``ep_size``; no sequence parallelism, no interleaved
  schedule, and per-layer (full) activation checkpointing only. Its PipelineEngine runs 1F1B's
  order but reduces gradients only after the drain and sends point-to-point one tensor at a
  time (``Traits.pipe_engine``); ZeRO-1/2 all-reduce gradients (``Traits.zero_grad_allreduce``).
- ``megatron-deepspeed``: Megatron's 3D parallelism on the DeepSpeed engine: ZeRO-1 with a
  pipeline (ZeRO-2/3 only without one), sequence parallelism, MoE, selective recompute; no
  interleaving, no multi-latent attention. ALiBi models (BLOOM) run on BigScience's fork of it.
- ``megatron`` (Megatron-LM / Megatron-Core): 3D parallelism, sequence parallelism, the
  interleaved 1F1B schedule, MLA, the distributed optimizer (``zero_stage=1`` here: optimizer
  states sharded over DP, ~ZeRO-1), Megatron-FSDP (``zero_stage=3``: ``--use-megatron-fsdp``
  with ``--data-parallel-sharding-strategy optim_grads_params``, weights, gradients and
  optimizer sharded over DP x CP), expert parallelism, selective recompute; no ZeRO-2.
  The precision-aware optimizer (TE's FusedAdam, bf16 moments) and optimizer CPU offload
  (HybridDeviceOptimizer, which rides on it) need the distributed optimizer, Adam and bf16
  (megatron/core/optimizer/optimizer_config.py); no parameter offload. Any split of the decoder
  layers over pp x v chunks, interleaved or not, runs through
  ``--pipeline-model-parallel-layout`` (Megatron-Core's custom pipeline layout,
  docs/source/api-guide/pipeline_parallel_layout.md), so 126 Llama-3.1-405B layers interleave
  on 16 ranks; the layout has no vision-encoder layers, so a vision-language model keeps
  Megatron's even split and interleaves only when its layers divide by pp x v. The
  interleaved schedule needs at least pp micro-batches per step; a count that pp does not
  divide runs with a larger micro-batch group (memory.microbatch_group).
- ``torchtitan`` (PyTorch FSDP2 + TP + PP + CP, torchtitan 0.2.2): ``--zero 3`` is FSDP2
  (``fully_shard`` with bf16 parameters and fp32 reduction), ``--zero 0`` plain DDP on a
  data-parallel-only run; TP always with sequence parallelism (its TP plan shards norms and
  residuals), 1F1B and interleaved 1F1B pipelines, ring-attention context parallelism, expert
  parallelism over the FSDP ranks, torchao FP8 (tensorwise) and MXFP8. It builds only the models
  it has flavors for (planner/cost/torchtitan.py) and is searched only when asked for.

Batch divisibility (global batch = micro-batch x gradient accumulation x dp) is checked where
the accumulation is filled in: planner/cost/degrees.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Traits:
    """Behaviour of a runtime that changes memory or time."""

    name: str
    # Gradients in fp32 (Megatron's main_grad buffer, reduced in fp32 for bf16) instead of the
    # working precision with an fp32 partition (DeepSpeed's ZeRO optimizers).
    fp32_grad_buffer: bool
    # What crosses a pipeline-stage boundary, per micro-batch:
    # - "full": the whole activation (DeepSpeed's PipelineModule with no model-parallel axis);
    # - "sequence_parallel": Megatron-Core sends (s/t, b, h) under sequence parallelism and the
    #   whole (s, b, h) otherwise (pipeline_parallel/schedules.py get_tensor_shapes; its
    #   p2p_communication has no scatter-gather any more);
    # - "partitioned": DeepSpeed's PipelineEngine over a tensor-parallel grid (Megatron-DeepSpeed)
    #   sends 1/t of activations and gradients and all-gathers them over the TP group: the
    #   receiver its input, the sender its output again before backward, and the sender the
    #   returning gradient (runtime/pipe/engine.py, pipe_partitioned / grad_partitioned).
    pp_send: str
    # Gradient reduction bucketed and started during the last micro-batch's backward
    # (DeepSpeed overlap_comm, Megatron-Core --overlap-grad-reduce, which dsplan's emitted
    # configs switch on).
    overlap_grad_reduce: bool
    # DeepSpeed ZeRO-1/2 bucket buffers (overlap_comm keeps ~4.5x the bucket sizes).
    zero_buckets: bool
    # Pipelines (pp > 1) run on DeepSpeed's PipelineEngine, which differs from Megatron's 1F1B in:
    # - no gradient reduction during backward: the engine turns its backward all-reduce off
    #   (runtime/pipe/engine.py:80, ``enable_backward_allreduce = False``) and
    #   ``deepspeed.initialize`` switches ZeRO's overlap_comm off for a PipelineModule
    #   (runtime/engine.py:2663-2666); TrainSchedule issues ReduceTiedGrads, ReduceGrads and
    #   OptimizerStep after a rank's last step (runtime/pipe/schedule.py:238-241), so a rank's
    #   reduction overlaps only the cool-down of the ranks before it;
    # - ReduceTiedGrads all-reduces the tied embedding's gradient between the ranks holding its
    #   two copies first (pipe/engine.py:269-285), so those ranks start their reduction only
    #   after rank 0's last backward;
    # - point-to-point transfers are separate blocking ``dist.send``/``dist.recv`` calls
    #   (runtime/pipe/p2p.py:48-81), issued one after the other (schedule.py:214-223: a
    #   forward step sends the last gradient, then receives the activation; a backward step
    #   receives the gradient, then sends the activation): two transfers per neighbour and
    #   micro-batch where Megatron's batched send_forward_recv_backward makes one; a
    #   partitioned tensor also sends its partition meta tensor before the data
    #   (engine.py:1043-1046, 1097-1100).
    pipe_engine: bool = False
    # ZeRO-1/2 reduce gradients with bucketed all-reduces, not reduce-scatters: DeepSpeed's
    # ``use_multi_rank_bucket_allreduce`` defaults to true (runtime/zero/config.py:119), which
    # sends every slice of a bucket through ``allreduce_and_scatter`` (zero/stage_1_and_2.py:1695)
    # and keeps the local partition.
    zero_grad_allreduce: bool = False
    # ZeRO-2 (partitioned gradients) reduces every micro-batch's gradients in that micro-batch's
    # backward, not once per step: the full-size gradients are not kept between micro-batches
    # (zero/stage_1_and_2.py:2293-2294, reduce_ready_partitions_and_remove_grads reduces when
    # partition_gradients or at the accumulation boundary; ZeRO-1 only at the boundary).
    zero2_reduces_every_microbatch: bool = False
    # Without ZeRO the engine all-reduces the gradients after the backward, not from hooks during
    # it: ``engine.backward`` ends with ``allreduce_gradients``, which for stage 0 runs
    # ``buffered_allreduce_fallback`` over every gradient (runtime/engine.py allreduce_gradients);
    # ZeRO-1/2 reduce from backward hooks (stage_1_and_2.py reduce_ready_partitions_and_remove_grads).
    zero0_reduces_after_backward: bool = False
    # Tensor-parallel collectives overlapped with the GEMMs beside them: Transformer Engine's
    # userbuffers (Megatron-Core ``--tp-comm-overlap``, which needs sequence parallelism and a TP
    # group inside one NVLink domain) split each all-gather / reduce-scatter into tp chunks and
    # pipeline them with the QKV, projection and MLP GEMMs, forward and backward. What stays
    # exposed per block: max(TP seconds - its GEMM seconds, one chunk = TP seconds / tp)
    # (comm_overlap.overlapped_tp).
    tp_comm_overlap: bool = False
    # Without that overlap, each column-parallel linear's input gradient is reduced (all-reduce, or
    # reduce-scatter under sequence parallelism) asynchronously while its weight-gradient GEMM runs:
    # Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication since Sep 2021 (megatron/mpu/
    # layers.py; Korthikanti et al. 2022 ran it), TE's Linear alike (comm_overlap.async_backward_tp).
    tp_backward_overlap: bool = False
    # Attention through Transformer Engine (Megatron-Core's default TE layers: cuDNN's fused
    # attention), written for Hopper and Blackwell, so it levels off at the GPU's MAMF; the
    # others run FlashAttention-2 (flash-attn, PyTorch SDPA), which on Hopper levels off at
    # gpu.flash_attention_efficiency (efficiency.flash_efficiency).
    te_attention: bool = False
    # Expert all-to-alls overlapped with another micro-batch's compute: Megatron-Core's combined
    # 1F1B (``--overlap-moe-expert-parallel-comm --delay-wgrad-compute``) runs one micro-batch's
    # forward beside another's backward, layer by layer, each one's dispatch and combine on a
    # second stream (comm_overlap.overlapped_ep). DeepSpeed MoE has no such schedule.
    ep_comm_overlap: bool = False
    # Megatron's vocabulary-parallel embedding and cross-entropy under TP (Megatron-LM, Megatron-
    # DeepSpeed's mpu, torchtitan's RowwiseParallel embedding and loss_parallel). False: DeepSpeed
    # AutoTP as it treats a Hugging Face model, the token embedding whole on every TP rank and the
    # LM head split by vocabulary with its logits all-gathered for a replicated loss (transformers'
    # lm_head "colwise_rep"; engine.py _autotp_partition, module_inject/layers.py LinearLayer).
    vocab_parallel: bool = True
    # DeepSpeed copies gradients into new flat tensors and back around each reduction, and gathers
    # ZeRO-3 weights into new storage (cost/runtime_copies.py).
    flat_copies: bool = False
    # Blocks a ZeRO-3 / FSDP rank holds gathered whole: DeepSpeed's estimator counts the largest
    # layer once (estimate_zero3_model_states_mem_needs); Megatron-FSDP all-gathers the next FSDP
    # unit while one computes and reduce-scatters the last one's gradients while the next
    # back-propagates, so two units' weights and gradients are live (its double buffer).
    zero3_live_blocks: int = 1
    # Hybrid sharding's all-reduce of the gradient shards across the replicas, every micro-batch
    # rather than on the last: FSDP2 runs it after each reduce-scatter unless told not to
    # (FSDPModule.set_requires_all_reduce, which torchtitan 0.2.2's loop never calls);
    # Megatron-FSDP only on the last micro-batch (megatron_fsdp.py, outer_fsdp_group_grad_reduce).
    hsdp_allreduce_every_microbatch: bool = False
    # ZeRO-3 gathers per module and prefetch bucket and reduces per gradient bucket (DeepSpeed's
    # parameter coordinator, zero3_fetch.py), not one call per wrapped block (FSDP2, Megatron-FSDP).
    zero3_module_fetch: bool = False
    # Under a pipeline, FSDP2 keeps each stage's weights gathered and its gradients unsharded
    # across the step's micro-batches: torch.distributed.pipelining runs every backward with
    # resharding and gradient sync off (stage.py backward_maybe_with_nosync) and reduce-scatters
    # once at the end (perform_reduce_grad), and torchtitan 0.2.2's default policy does not
    # reshard after forward under PP. So one gather in the step's first forward, one reduction,
    # and the stage's 16-bit weights plus fp32 accumulated gradients (reduce_dtype) held whole.
    fsdp_pp_keeps_stage_gathered: bool = False
    # DeepSeek's DualPipeV schedule (planner/cost/dualpipe.py): PyTorch's ScheduleDualPipeV, which
    # torchtitan runs, overlapping each pair's expert all-to-alls with the other pass's compute
    # (pipeline_parallel_expert_parallel_overlap) where no activation checkpointing runs.
    dualpipe: bool = False


TRAITS = {
    "deepspeed": Traits("deepspeed", False, "full", True, True, pipe_engine=True, zero_grad_allreduce=True,
                        zero2_reduces_every_microbatch=True, zero0_reduces_after_backward=True,
                        zero3_module_fetch=True, flat_copies=True, vocab_parallel=False),
    "megatron-deepspeed": Traits("megatron-deepspeed", False, "partitioned", True, True, pipe_engine=True,
                                 zero_grad_allreduce=True, zero2_reduces_every_microbatch=True,
                                 zero0_reduces_after_backward=True, zero3_module_fetch=True, flat_copies=True),
    "megatron": Traits("megatron", True, "sequence_parallel", True, False, tp_comm_overlap=True, te_attention=True,
                       ep_comm_overlap=True, zero3_live_blocks=2, tp_backward_overlap=True),
    # FSDP2 reduce-scatters fp32 (training.mixed_precision_reduce) and gathers the next block while
    # one computes (two live); a stage sends (s/t, b, h); attention is SDPA, not TE. No TP overlap:
    # torchtitan's async TP (inductor's micro-pipelined TP over symmetric memory) measured 1.04-1.16x
    # over plain TP (torchtitan benchmarks/asyncTP_llama3_h100_2025-06), where pricing it as TE's
    # userbuffers overlap (comm_overlap.overlapped_tp) gives 1.24-1.37x: not priced, not emitted.
    "torchtitan": Traits("torchtitan", True, "sequence_parallel", True, False, zero3_live_blocks=2,
                         hsdp_allreduce_every_microbatch=True, fsdp_pp_keeps_stage_gathered=True, dualpipe=True),
}

# DeepSpeed bucket sizes (elements) that dsplan plans with and that the emitted ds_config
# must use (planner/emit reads these): DeepSpeed's defaults are 5e8, which with overlap_comm
# costs 5e8 x 2 B x 2 x 4.5 = 9 GB (DeepSpeed docs, zero config "overlap_comm").
REDUCE_BUCKET_SIZE = int(2e8)
ALLGATHER_BUCKET_SIZE = int(2e8)
STAGE3_PREFETCH_BUCKET_SIZE = int(5e7)  # DeepSpeed default
STAGE3_MAX_LIVE_PARAMETERS = int(1e9)  # DeepSpeed default
# Host seconds DeepSpeed's ZeRO-3 hooks spend per fetched module per forward + backward (trace,
# fetch, wait, release): benchmarks/bench_zero3_host_overhead.py, DeepSpeed 0.19.8 on this
# project's 2-core host, 1033-1055 us. A faster host runs them faster: on GPU nodes this errs slow.
ZERO3_HOST_S_PER_MODULE = 1.04e-3


def stage3_persistence_threshold(hidden: int) -> int:
    """``stage3_param_persistence_threshold`` as transformers' DeepSpeed integration sets "auto"
    (10 x hidden): norms and biases stay resident instead of being gathered every layer."""
    return 10 * hidden
OVERLAP_COMM_FACTOR = 4.5  # DeepSpeed docs: "overlap_comm uses 4.5x the allgather_bucket_size and reduce_bucket_size"


def traits(framework: str) -> Traits:
    return TRAITS[framework]


def grad_reduce_overlaps(t: Traits, pp: int, zero: int = 1) -> bool:
    """Whether gradient reduction starts during the last micro-batch's backward: where the
    runtime buckets it (Traits.overlap_grad_reduce), but not in DeepSpeed's PipelineEngine nor
    in its engine without ZeRO (Traits.zero0_reduces_after_backward)."""
    return (t.overlap_grad_reduce and not (t.pipe_engine and pp > 1)
            and not (t.zero0_reduces_after_backward and zero == 0))


# How a TP layout's blocks are priced, the block tables' second key: TP (0), TP with sequence
# parallelism (1), or DeepSpeed AutoTP's whole vocabulary (2: Traits.vocab_parallel false).
TP_STYLES = ("tp", "tp+sp", "autotp")


def tp_styles(whole_vocab, tp, sp):
    """The TP_STYLES index of layouts, scalars or numpy arrays alike (``whole_vocab``: the runtime's
    Traits.vocab_parallel is false; ``sp`` 0 or 1): AutoTP's only where its vocabulary differs (tp > 1)."""
    autotp = (tp > 1) & whole_vocab
    return sp + autotp * (2 - sp)


def tp_style(framework: str, tp: int, sp: bool) -> int:
    """``tp_styles`` of one layout of ``framework``."""
    return int(tp_styles(not traits(framework).vocab_parallel, tp, int(sp)))
