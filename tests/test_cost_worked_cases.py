"""Worked cases: cost-model terms pinned by numbers derived by hand.

Each test picks a small configuration, works the expected number out in its comments from
first principles and published inputs (parameter counts of the presets, bytes moved per
collective, Adam's traffic per parameter, Korthikanti et al. 2022's activation tensors, the
1F1B schedule) and asserts that ``estimate`` and the search's evaluation of the same candidate
(one array cost model, applied to one candidate and to a space) both give that number. The only
inputs read from the project are what is tested elsewhere against measurements: the time of a
collective of given bytes over a given group (planner/cost/collectives.py,
tests/test_collectives.py), the per-micro-batch compute times (tests/test_layer_costs.py,
tests/test_step_time.py) and the HBM bandwidth of the hardware profile with the one documented
HBM calibration factor.

Layer parameter counts used below (GPT-3 block: QKV 3h^2 + 3h, projection h^2 + h, fc1
4h^2 + 4h, fc2 4h^2 + h, two LayerNorms 4h -> 12h^2 + 13h):

    gpt3-125m  h = 768:  12*768^2 + 13*768   =  7,087,872;  embedding 50257*768 = 38,597,376,
                                                            positions 2048*768  =  1,572,864
    gpt3-2.7b  h = 2560: 12*2560^2 + 13*2560 = 78,676,480;  embedding 50257*2560 = 128,657,920,
                                                            positions 2048*2560 =   5,242,880
(12 x 7,087,872 + 1,536 + 38,597,376 + 1,572,864 = 125,226,240 and 32 x 78,676,480 + 5,120 +
133,900,800 = 2,651,553,280: the totals of reference/models.)
"""

from __future__ import annotations

import numpy as np
import pytest

from planner.cost import efficiency as eff
from planner.cost.collectives import collective_time_for_size
from planner.cost.estimate import estimate
from planner.cost.layers import layer_costs
from planner.cost.parallel import ParallelConfig, Workload
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.load import load_model
from planner.search.request import candidate_space
from planner.search.space import Constraints
from tests.scalar_oracle import build_comms
from tests.search_cases import candidate, case_of


def ds_copies(cluster: Cluster, grad_bytes: float, dp: int, zero: int) -> float:
    """DeepSpeed's copies around one gradient reduction on a GPU (runtime_copies.py), as HBM
    traffic, read plus write: ZeRO-0 into a flat tensor and all back (2 x g); ZeRO-1 into it and
    the owned 1/dp back; ZeRO-2 also into the bucket and the owned share into the partition."""
    copied = {0: 2.0, 1: 1.0 + 1.0 / dp, 2: 2.0 + 2.0 / dp}[zero] * grad_bytes
    return 2.0 * copied / eff.device(cluster.profile).hbm_effective

PROFILE = "dgx-a100-80g"


def _cluster(nodes: int) -> Cluster:
    return Cluster.build(load_profile(PROFILE), nodes)


def _searched(model_name: str, nodes: int, w: Workload, cfg: ParallelConfig):
    """``cfg`` through the search's evaluation, and ``estimate`` on the partition the search
    chose: (plan, partition, per-rank table, assembled per-rank detail)."""
    model, cluster = load_model(model_name), _cluster(nodes)
    cons = Constraints(dp=(cfg.dp,), tp=(cfg.tp,), pp=(cfg.pp,), ep=(cfg.ep,), zero=(cfg.zero_stage,),
                       offload=(cfg.offload,), micro_batch=(cfg.micro_batch,), recompute=(cfg.recompute,),
                       virtual_stages=(cfg.virtual_stages,), framework=(cfg.framework,),
                       sequence_parallel=(cfg.sequence_parallel,))
    space = candidate_space(model, cluster, w, cons)
    rows = [i for i in range(len(space)) if space.config(i) == cfg]
    assert len(rows) == 1
    parts, ranks, detail, _ = candidate(case_of(model, cluster, w, space), rows[0])
    plan = estimate(model, cluster, w, cfg, partition=parts)
    return plan, parts, ranks, detail


def _layers(chunk: tuple[int, int], first_decoder: int, decoders: int) -> int:
    """Decoder layers inside a block range (decoder blocks are first_decoder .. +decoders-1)."""
    a, e = chunk
    return max(0, min(e, first_decoder + decoders) - max(a, first_decoder))


# -- (a) MoE expert-parallel all-to-all ----------------------------------------------------


@pytest.mark.parametrize(("recompute", "all_to_alls"), [("none", 4), ("full", 6)])
def test_moe_all_to_all_is_dispatch_and_combine_in_each_pass(recompute: str, all_to_alls: int) -> None:
    """Mixtral-8x7B, one DGX A100, tp 1, ep 8 (= dp), seq 4096, micro-batch 1, 2 micro-batches.

    Top-k routing with expert parallelism (GShard, Lepikhin et al. 2020; DeepSpeed-MoE,
    Rajbhandari et al. 2022; Megatron-Core's all-to-all token dispatcher): each MoE layer's
    forward runs a *dispatch* all-to-all (every token copied to its k experts' ranks) and a
    *combine* all-to-all (the k expert outputs back to the token's rank). The backward of an
    all-to-all is the inverse all-to-all, so backward runs two more (the gradient of the
    combine, then of the dispatch): 4 per layer per micro-batch. Full recompute runs the
    layer's forward again, dispatch and combine included: 6.

    Bytes each GPU sends per all-to-all (dropless, balanced): its s*b tokens x k copies x h
    bf16 values = 4096 * 1 * 2 * 4096 * 2 = 67,108,864 B (nccl-tests' send-buffer size; the
    1/ep that stays local is in the collective model's (n-1)/n).
    ep_comm = micro-batches x MoE layers x all-to-alls x t_alltoall(64 MiB over 8 GPUs), with the
    overlap off (tests/test_ep_overlap.py prices it on)."""
    s, b, k, h, layers, m = 4096, 1, 2, 4096, 32, 2
    w = Workload(global_batch=8 * b * m, seq_len=s, ep_comm_overlap=False)
    cfg = ParallelConfig(dp=8, ep=8, zero_stage=1, framework="megatron", micro_batch=b, grad_accum=m,
                         recompute=recompute)
    per_a2a = s * b * k * h * 2
    assert per_a2a == 67_108_864
    costs = layer_costs(load_model("mixtral-8x7b"), w, tp=1, sp=False, ep=8)
    moe = [c for c in costs if c.ep_a2a_count]
    assert len(moe) == layers and all(c.ep_a2a == per_a2a / b for c in moe)  # per sample
    # The EP group is 8 consecutive GPUs of one node (tp = 1, EP innermost).
    t_a2a = collective_time_for_size(_cluster(1), "alltoall", 8, per_a2a).time_s
    expected = m * layers * all_to_alls * t_a2a
    plan, _, ranks, _ = _searched("mixtral-8x7b", 1, w, cfg)
    assert plan.time.ep_comm == pytest.approx(expected, rel=1e-9)
    assert plan.stages[0].microbatch.ep == pytest.approx(layers * all_to_alls * t_a2a, rel=1e-9)
    assert m * ranks["ep"][0] == pytest.approx(expected, rel=1e-9)  # the search's evaluation


# -- (b) data-parallel reduction hidden behind the pipeline cool-down ----------------------

GPT27_LAYER, GPT27_EMBED, GPT27_POS, GPT27_LN = 78_676_480, 128_657_920, 5_242_880, 2 * 2560


def _gpt27_dense(chunk: tuple[int, int]) -> int:
    """gpt3-2.7b parameters of a pipeline rank: blocks 0 embedding, 1..32 layers, 33 final
    LayerNorm, 34 tied LM head (on another rank than the embedding: a copy of the word
    embeddings, Megatron's shared embedding on the last stage)."""
    a, e = chunk
    n = _layers(chunk, 1, 32) * GPT27_LAYER
    if a == 0:
        n += GPT27_EMBED + GPT27_POS
    if e == 35:
        n += GPT27_LN + GPT27_EMBED
    return n


def _gpt27_pp2(cluster, **cfg):
    """gpt3-2.7b on dp 8 x pp 2 with the partition fixed at blocks [0, 10) and [10, 35): the plan
    and each rank's dense parameters (P_0, P_1 of the cases below)."""
    w = Workload(global_batch=16, seq_len=768)
    parts = [(0, 10), (10, 35)]
    plan = estimate(load_model("gpt3-2.7b"), cluster, w,
                    ParallelConfig(dp=8, pp=2, micro_batch=1, grad_accum=2, **cfg), partition=parts)
    dense = [_gpt27_dense(c) for c in parts]
    assert dense == [841_989_120, 1_938_222_080]
    return plan, dense


def test_dp_reduction_hides_behind_the_pipeline_cool_down() -> None:
    """gpt3-2.7b on two DGX A100, dp 8 inside each node, pp 2 across them, Megatron without the
    distributed optimizer (zero 0: one all-reduce of the fp32 main_grad, 4 B per parameter),
    seq 768, micro-batch 1, 2 micro-batches.

    1F1B, worked on the timeline (f_r, b_r: one micro-batch's forward/backward on rank r):
    rank 1's last backward ends b_0 before rank 0's (rank 0 still runs the last micro-batch's
    backward), so rank 1's bucketed all-reduce, started with its last backward, has
    b_1 + b_0 to hide in before the pipeline drains; rank 0 has only its own b_0:

        exposed_0 = max(0, AR(4 P_0) - b_0)        exposed_1 = max(0, AR(4 P_1) - b_1 - b_0)
        dp_comm   = max over ranks

    Stage 0 = embedding + 9 layers, stage 1 = 23 layers + final LN + the tied head's copy:
        P_0 = 133,900,800 + 9 * 78,676,480              =   841,989,120
        P_1 = 23 * 78,676,480 + 5,120 + 128,657,920     = 1,938,222,080
    AR over the 8 GPUs of a node from the collective model; b_r from the plan's micro-batch
    times. The case is chosen so rank 1's reduction is fully hidden (by b_1 + b_0, and equally
    by the model's r * b_r cool-down), while without the cool-down it would be exposed longer
    than rank 0's and set dp_comm."""
    cluster = _cluster(2)
    plan, dense = _gpt27_pp2(cluster, zero_stage=0, framework="megatron")
    assert [s.memory.weights for s in plan.stages] == [2 * d for d in dense]  # bf16 weights
    ar = [collective_time_for_size(cluster, "allreduce", 8, 4 * d).time_s for d in dense]
    b0, b1 = (s.microbatch.bwd + s.microbatch.recompute for s in plan.stages)
    assert ar[1] <= b1 + b0 and ar[1] <= 2 * b1  # rank 1 hidden by its backward + the cool-down
    assert ar[1] - b1 > ar[0] - b0 > 0  # ... and would be the most exposed without it
    assert plan.time.dp_comm == pytest.approx(ar[0] - b0, rel=1e-9)

    # The search's evaluation, on its own (time-balanced) partition, per rank.
    plan, parts, ranks, detail = _searched("gpt3-2.7b", 2, plan.workload, plan.cfg)
    dense = [_gpt27_dense(c) for c in parts]
    assert list(ranks["dense"]) == dense
    ar = [collective_time_for_size(cluster, "allreduce", 8, 4 * d).time_s for d in dense]
    b0, b1 = ranks["bwd"] + ranks["rc"]
    assert ar[1] <= b1 + b0 and ar[1] <= 2 * b1 and ar[1] > b1  # hidden only thanks to the cool-down
    assert detail["dp"][0] == pytest.approx([ar[0] - b0, 0.0], rel=1e-9, abs=1e-12)
    assert plan.time.dp_comm == pytest.approx(ar[0] - b0, rel=1e-9)


def test_dp_cool_down_is_the_earlier_ranks_backward_not_this_ranks() -> None:
    """Unequal stages: gpt3-1.3b, 2 layers on stage 0 and 22 on stage 1. Rank 1's reduction is
    hidden by its own last backward plus rank 0's (b_1 + b_0), not by 2 x b_1: with a short
    stage 0 the difference leaves most of rank 1's all-reduce exposed."""
    model, cluster = load_model("gpt3-1.3b"), _cluster(2)
    w = Workload(global_batch=16, seq_len=512)
    cfg = ParallelConfig(dp=8, pp=2, zero_stage=0, framework="megatron", micro_batch=1, grad_accum=2)
    parts = [(0, 3), (3, 27)]
    plan = estimate(model, cluster, w, cfg, partition=parts)
    dense = [sum(b.params() for b in model.blocks[a:e]) for a, e in parts]
    dense[1] += model.vocab * model.hidden  # the tied head's copy of the embedding, on the last stage
    ar = [collective_time_for_size(cluster, "allreduce", 8, 4 * d).time_s for d in dense]
    b0, b1 = (s.microbatch.bwd + s.microbatch.recompute for s in plan.stages)
    exposed = [max(0.0, ar[0] - b0), max(0.0, ar[1] - b1 - b0)]
    assert exposed[1] > max(0.0, ar[1] - 2 * b1) + 1e-3  # the two readings differ by > 1 ms here
    assert plan.time.dp_comm == pytest.approx(max(exposed), rel=1e-9)


def test_deepspeed_pipeline_reduces_after_the_drain_with_all_reduces() -> None:
    """The same gpt3-2.7b layout (two DGX A100, dp 8 inside each node, pp 2 across them, seq
    768, 2 micro-batches) on DeepSpeed's PipelineEngine with ZeRO-1 (framework deepspeed).

    Three things differ from Megatron's runtime (planner/cost/frameworks.py Traits.pipe_engine,
    zero_grad_allreduce; DeepSpeed 0.19.8):
    - no reduction during backward: ReduceGrads follows a rank's last backward, so nothing of
      a rank's own last backward hides it (pipe/engine.py enable_backward_allreduce = False,
      overlap_comm switched off for a PipelineModule);
    - ZeRO-1 all-reduces the 16-bit gradient buckets (use_multi_rank_bucket_allreduce) rather
      than reduce-scattering them, then all-gathers the updated 16-bit weights after the step;
    - ReduceTiedGrads first all-reduces the tied embedding's gradient between rank 0 (the
      embedding) and rank 1 (the head's copy): a two-rank ring moves the 2 x 128,657,920 bytes
      once each way, as one point-to-point transfer of them over the pp hop does; and rank 1
      waits for rank 0's last backward for it, so no cool-down is left to hide its reduction.

    - its ZeRO-1 copies the buckets into a new flat tensor and its 1/dp share back
      (``ds_copies``: 2 x 1.125 x 2 P_r bytes of HBM traffic), which the reduction waits for.

        exposed_r = tied + AR(2 P_r) + copies(2 P_r) + AG(2 P_r)      dp_comm = max over ranks

    with P_0 = 841,989,120 and P_1 = 1,938,222,080 as in the Megatron case above (the partition
    is fixed, so both ranks hold one copy of the embedding)."""
    cluster = _cluster(2)
    plan, dense = _gpt27_pp2(cluster, zero_stage=1, framework="deepspeed")
    comms = build_comms(cluster, plan.cfg)
    tied = comms.pp(2 * GPT27_EMBED)
    exposed = [tied + collective_time_for_size(cluster, "allreduce", 8, 2 * d).time_s + ds_copies(cluster, 2 * d, 8, 1)
               + collective_time_for_size(cluster, "allgather", 8, 2 * d).time_s for d in dense]
    b0, b1 = (s.microbatch.bwd + s.microbatch.recompute for s in plan.stages)
    assert exposed[1] - tied > b0 * 0.05  # a cool-down would have hidden some of rank 1's reduction
    assert plan.time.dp_comm == pytest.approx(max(exposed), rel=1e-9)

    # The search's evaluation on its own partition, per rank.
    plan, parts, ranks, detail = _searched("gpt3-2.7b", 2, plan.workload, plan.cfg)
    dense = [_gpt27_dense(c) for c in parts]
    exposed = [tied + collective_time_for_size(cluster, "allreduce", 8, 2 * d).time_s + ds_copies(cluster, 2 * d, 8, 1)
               + collective_time_for_size(cluster, "allgather", 8, 2 * d).time_s for d in dense]
    assert detail["dp"][0] == pytest.approx(exposed, rel=1e-9)
    assert plan.time.dp_comm == pytest.approx(max(exposed), rel=1e-9)


def test_deepspeed_pipeline_untied_rank_keeps_only_the_cool_down() -> None:
    """llama-3-8b (untied head) on two DGX A100, dp 8 x pp 2, DeepSpeed ZeRO-1, seq 1024, 4
    micro-batches. Without a tied pair the last rank's ReduceGrads starts right after its last
    backward, while rank 0 still runs its own: rank 1 hides b_0 (the cool-down) and nothing of
    b_1; rank 0 hides nothing.

        exposed_0 = AR(2 P_0) + C_0 + AG(2 P_0)      exposed_1 = max(0, AR(2 P_1) + C_1 - b_0) + AG(2 P_1)

    (C_r: ZeRO-1's copies around the reduction, ``ds_copies``.)"""
    model, cluster = load_model("llama-3-8b"), _cluster(2)
    w = Workload(global_batch=32, seq_len=1024)
    cfg = ParallelConfig(dp=8, pp=2, zero_stage=1, framework="deepspeed", micro_batch=1, grad_accum=4)
    plan, parts, ranks, detail = _searched("llama-3-8b", 2, w, cfg)
    dense = [sum(b.params() for b in model.blocks[a:e]) for a, e in parts]
    assert list(ranks["dense"]) == dense and list(ranks["tied"]) == [0.0, 0.0]
    ar = [collective_time_for_size(cluster, "allreduce", 8, 2 * d).time_s + ds_copies(cluster, 2 * d, 8, 1)
          for d in dense]
    ag = [collective_time_for_size(cluster, "allgather", 8, 2 * d).time_s for d in dense]
    b0 = plan.stages[0].microbatch.bwd + plan.stages[0].microbatch.recompute
    exposed = [ar[0] + ag[0], max(0.0, ar[1] - b0) + ag[1]]
    assert plan.time.dp_comm == pytest.approx(max(exposed), rel=1e-9)
    assert detail["dp"][0] == pytest.approx(exposed, rel=1e-9)


# -- (c) what crosses a pipeline-stage boundary -----------------------------------------------


@pytest.mark.parametrize(("framework", "sp", "divisor", "gathers", "transfers", "meta"), [
    # Megatron-Core sends (s, b, h), or (s/t, b, h) under sequence parallelism (schedules.py
    # get_tensor_shapes; its p2p_communication has no scatter/gather), the activation and the
    # gradient crossing a boundary batched as one exchange.
    ("megatron", False, 1, (0, 0), 1, 0),
    ("megatron", True, 2, (0, 0), 1, 0),
    # DeepSpeed's PipelineEngine on a TP grid (pipe_partitioned, grad_partitioned): 1/t sent;
    # all-gathered by the activation's receiver, and on the sending side once to rebuild the
    # output before backward and once for the returning gradient. Its sends and receives are
    # blocking and one after the other (TrainSchedule: SendGrad then RecvActivation, RecvGrad
    # then SendActivation): 2 transfers per neighbour and micro-batch, each data tensor after
    # its partition meta, int64 [ndims 3, s, b, h, parts 2, rank, offsets 0, n/2, n] = 9 x 8 B.
    ("megatron-deepspeed", False, 2, (2, 1), 2, 72),
])
def test_what_a_pipeline_boundary_sends(framework, sp, divisor, gathers, transfers, meta) -> None:
    """llama-3-8b on four DGX A100, tp 2, dp 4, pp 4 (one pipeline stage per node: every stage
    boundary crosses InfiniBand), seq 4096, micro-batch 1, 8 micro-batches.

    A stage boundary carries the s x b x h bf16 activation forward and its gradient back:
        whole tensor = 4096 * 1 * 4096 * 2 = 33,554,432 bytes.
    Megatron's 1F1B pairs the activation sent to the next stage with the gradient received from
    it (send_forward_recv_backward) and the gradient sent to the previous stage with the next
    activation from it: one transfer per neighbour per micro-batch on full-duplex links. So
    stage 0 and the last stage make 1 transfer per micro-batch, the middle stages 2 (DeepSpeed's
    engine twice that, plus the meta tensors); all-gathers of the whole tensor over the TP pair
    (NVLink) come on top per boundary side."""
    s, b, h, t, m = 4096, 1, 4096, 2, 8
    w = Workload(global_batch=4 * b * m, seq_len=s)
    cfg = ParallelConfig(dp=4, tp=t, pp=4, zero_stage=1, framework=framework, micro_batch=b, grad_accum=m,
                         sequence_parallel=sp)
    whole = s * b * h * 2
    assert whole == 33_554_432
    comms = build_comms(_cluster(4), cfg)
    # the pp group's point-to-point time, per neighbour and micro-batch
    t_p2p = transfers * (comms.pp(whole / divisor) + (comms.pp(meta) if meta else 0.0))
    t_ag = comms.tp("allgather", whole)
    # (sends after the stage, receives before it) per rank
    sides = [(1, 0), (1, 1), (1, 1), (0, 1)]
    expected = [o * (t_p2p + gathers[0] * t_ag) + i * (t_p2p + gathers[1] * t_ag) for o, i in sides]
    plan, _, ranks, _ = _searched("llama-3-8b", 4, w, cfg)
    assert [s_.microbatch.pp for s_ in plan.stages] == pytest.approx(expected, rel=1e-9)
    assert list(ranks["pp"]) == pytest.approx(expected, rel=1e-9)
    worst = max(range(4), key=lambda r: plan.stages[r].microbatch.total)
    assert worst in (1, 2)
    assert plan.time.pp_comm == pytest.approx(m * expected[worst], rel=1e-9)
    if gathers != (0, 0):
        assert t_ag > 0


# -- (d) fused GPU Adam ---------------------------------------------------------------------


def test_gpu_adam_streams_34_bytes_per_local_parameter() -> None:
    """gpt3-125m on one DGX A100, DeepSpeed ZeRO-1, dp 8: each GPU steps 1/8 of the
    125,226,240 parameters = 15,653,280.

    Fused multi-tensor Adam in mixed precision, bytes of HBM traffic per parameter:
      read  fp32 master weight, gradient, momentum, variance        4 + 4 + 4 + 4 = 16
      write fp32 master weight, momentum, variance                  4 + 4 + 4     = 12
      write the bf16 working copy of the weight                                    2
      gradient-norm / overflow pass over the fp32 gradient (read)                  4
                                                                            total 34
    DeepSpeed first flattens the rank's gradient partition into a new fp32 tensor (read and
    write 4 + 4 per parameter; runtime_copies.py), 42 in all.
    t = 15,653,280 * 42 B / (2039 GB/s * 0.85), the profile's HBM bandwidth times the
    model's one HBM calibration factor (efficiency.HBM_EFFICIENCY)."""
    adam_bytes = (4 + 4 + 4 + 4) + (4 + 4 + 4) + 2 + 4
    local = 125_226_240 / 8
    hbm = load_profile(PROFILE).gpu.hbm_GBps * 1e9 * eff.HBM_EFFICIENCY
    expected = local * (adam_bytes + 4 + 4) / hbm
    w = Workload(global_batch=64, seq_len=2048)
    cfg = ParallelConfig(dp=8, zero_stage=1, micro_batch=1, grad_accum=8)
    plan, _, _, detail = _searched("gpt3-125m", 1, w, cfg)
    assert adam_bytes == 34
    assert plan.time.optimizer == pytest.approx(expected, rel=1e-9)
    assert float(detail["opt"][0, 0]) == pytest.approx(expected, rel=1e-9)


# -- (e) the tied embedding's copy on the last stage ----------------------------------------


def test_tied_head_on_the_last_stage_holds_a_copy_of_the_embedding() -> None:
    """gpt3-125m (tied head) on one DGX A100, DeepSpeed ZeRO-0, pp 2, dp 4.

    The last stage runs the LM head with the word embeddings as its weight; on another rank
    than the embedding it keeps its own copy (DeepSpeed's TiedLayerSpec / Megatron's shared
    embedding on the last stage, whose gradients are all-reduced with the first stage's), so
    it holds 50257 * 768 = 38,597,376 parameters more than its layers:
        P_first = 38,597,376 + 1,572,864 + L_0 * 7,087,872
        P_last  = L_1 * 7,087,872 + 1,536 (final LayerNorm) + 38,597,376
    DeepSpeed ZeRO-0 in bf16: 2 B weights, 2 B gradients, 12 B Adam states per parameter."""
    w = Workload(global_batch=64, seq_len=2048)
    cfg = ParallelConfig(dp=4, pp=2, zero_stage=0, micro_batch=1, grad_accum=16)
    plan, parts, ranks, detail = _searched("gpt3-125m", 1, w, cfg)
    layer, embed, pos, ln = 7_087_872, 50257 * 768, 2048 * 768, 2 * 768
    (a0, e0), (a1, e1) = parts
    assert a0 == 0 and e1 == 15  # blocks: embedding, 12 layers, final LN, tied head
    dense = [embed + pos + _layers(parts[0], 1, 12) * layer, _layers(parts[1], 1, 12) * layer + ln + embed]
    assert list(ranks["dense"]) == dense
    for r, stage in enumerate(plan.stages):
        assert (stage.memory.weights, stage.memory.grads, stage.memory.optimizer) == (
            2 * dense[r], 2 * dense[r], 12 * dense[r])
    assert detail["weights"][0] == pytest.approx([2 * d for d in dense], rel=1e-12)
    assert detail["optimizer"][0] == pytest.approx([12 * d for d in dense], rel=1e-12)


# -- (f) activations: Korthikanti's tensors x 1F1B in-flight micro-batches + the live layer --


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_activations_are_korthikanti_bytes_times_in_flight_micro_batches(recompute: str) -> None:
    """gpt3-1.3b (h 2048, a 16 heads, vocab 50257) on one DGX A100, Megatron, tp 2, pp 2, dp 2,
    seq 2048, micro-batch 1, 4 micro-batches, with dropout and without FlashAttention: the
    setting of Korthikanti et al. 2022 Table 2 (reference/korthikanti2022_activation_
    memory_formulas.csv).

    Per layer and micro-batch (s = 2048, b = 1, h = 2048, t = 2, sbh = 4,194,304):
      no recompute:   sbh (10 + 24/t + 5 a s / (h t)) = sbh (10 + 12 + 40) = 62 sbh
      full recompute: the layer input only, 2 sbh
    Outside the layers (Sec. 4.3, without sequence parallelism): the embedding's dropout mask
    sbh (first stage); the final LayerNorm's input 2 sbh, the output layer's input 2 sbh and
    the fp32 logits 4 s b v / t = 205,852,672 B (last stage).
    1F1B: stage r of p holds p - r micro-batches in flight at its peak (Narayanan et al.
    2021), here 2 and 1. Full recompute adds one layer's activations while it is recomputed
    for its backward (62 sbh, once, not per micro-batch)."""
    s, b, h, a, v, t, p = 2048, 1, 2048, 16, 50257, 2, 2
    sbh = s * b * h
    w = Workload(global_batch=8, seq_len=s, flash_attention=False, dropout=True)
    cfg = ParallelConfig(dp=2, tp=t, pp=p, zero_stage=1, framework="megatron", micro_batch=b, grad_accum=4,
                         recompute=recompute)
    layer_none = sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer_none == 62 * sbh
    per_layer = layer_none if recompute == "none" else 2 * sbh
    live = layer_none if recompute == "full" else 0.0
    plan, parts, ranks, detail = _searched("gpt3-1.3b", 1, w, cfg)
    first = 1 * sbh  # embedding dropout mask, 1 byte per element
    last = 2 * sbh + 2 * sbh + 4 * s * b * v / t
    expected = []
    for r, chunk in enumerate(parts):
        stored = _layers(chunk, 1, 24) * per_layer + (first if r == 0 else 0) + (last if r == p - 1 else 0)
        expected.append(stored * (p - r) + live)
        assert plan.stages[r].inflight == p - r
    assert [st.memory.activations for st in plan.stages] == pytest.approx(expected, rel=1e-12)
    assert detail["activations"][0] == pytest.approx(expected, rel=1e-12)
    assert np.all(detail["inflight"][0] == [2, 1])


def test_deepspeed_zero2_reduces_every_micro_batch_and_zero1_once() -> None:
    """DeepSpeed's ZeRO-2 keeps no full-size gradients between micro-batches, so it reduces each
    micro-batch's gradients in that micro-batch's backward (zero/stage_1_and_2.py,
    reduce_ready_partitions_and_remove_grads); ZeRO-1 reduces once, at the accumulation boundary.
    gpt3-2.7b on 2 nodes, dp 16, m = 4 micro-batches, no pipeline, P parameters per GPU (its
    16-bit weights are 2 P bytes, the model's whole count):

        AR  = all-reduce of 2 P bytes over the 16 ranks (use_multi_rank_bucket_allreduce), and
              DeepSpeed's copies around it (``ds_copies``)
        AG  = all-gather of the updated 16-bit weights, 2 P bytes, after the step (not hidden)
        b   = one micro-batch's backward
        ZeRO-1: dp_comm = max(0, AR - b) + AG
        ZeRO-2: dp_comm = max(0, AR - b) + AG + (m - 1) max(0, AR - b)"""
    model, cluster = load_model("gpt3-2.7b"), _cluster(2)
    w = Workload(global_batch=64, seq_len=512)  # short samples: a backward shorter than the reduction
    plans = {}
    for zero in (1, 2):
        cfg = ParallelConfig(dp=16, zero_stage=zero, framework="deepspeed", micro_batch=1, grad_accum=4)
        plans[zero] = plan = estimate(model, cluster, w, cfg)
        p = plan.stages[0].memory.weights / 2
        assert p == pytest.approx(model.total_params(), rel=1e-3)
        ar = collective_time_for_size(cluster, "allreduce", 16, 2 * p).time_s + ds_copies(cluster, 2 * p, 16, zero)
        ag = collective_time_for_size(cluster, "allgather", 16, 2 * p).time_s
        b = plan.stages[0].microbatch.bwd + plan.stages[0].microbatch.recompute
        assert ar > b  # the case: each reduction outlasts its backward
        expected = max(0.0, ar - b) + ag + ((4 - 1) * max(0.0, ar - b) if zero == 2 else 0.0)
        assert plan.time.dp_comm == pytest.approx(expected, rel=1e-9)
        # the search's evaluation prices it alike
        searched, _, _, detail = _searched("gpt3-2.7b", 2, w, cfg)
        assert searched.step_time_s == pytest.approx(plan.step_time_s, rel=1e-9)
    assert plans[2].time.dp_comm > plans[1].time.dp_comm
