"""Megatron-LM's mixture-of-experts flags for a plan: the experts, their parallelism and routing,
and the all-to-all overlap the plan was priced with (planner/cost/paid.py)."""

from __future__ import annotations

from planner.cost.moe_dispatch import FLEX_SMS, flex_backend
from planner.cost.paid import runs_ep_overlap
from planner.emit.ds_config import moe_layer_indices
from planner.emit.megatron_flag import Arg, _a
from planner.emit.plan_file import PlanFile
from planner.model.spec import ModelSpec, MoEMLP


def moe_args(model: ModelSpec, plan: PlanFile) -> list[Arg]:
    moe = next((b.mlp for b in model.decoder_blocks if isinstance(b.mlp, MoEMLP)), None)
    if moe is None or plan.framework == "megatron-deepspeed":
        return []
    layers = moe_layer_indices(model)
    pattern = "[" + ",".join("1" if i in set(layers) else "0" for i in range(model.num_layers)) + "]"
    args = [
        _a("--num-experts", moe.routed_experts),
        _a("--moe-router-topk", moe.top_k),
        _a("--moe-ffn-hidden-size", moe.expert_ffn),
        _a("--expert-model-parallel-size", plan.ep),
        # Megatron's default is the attention's TP; a folded plan (etp 1) says so explicitly.
        _a("--expert-tensor-parallel-size", plan.etp or plan.tp),
        _a("--moe-layer-freq", pattern),
        *dispatcher_args(plan),
        *capacity_args(plan),
        # The local experts as one grouped GEMM, as dsplan prices them (layer_cost.Gemm.batch);
        # Megatron-Core's default is a loop of per-expert GEMMs (SequentialMLP).
        _a("--moe-grouped-gemm"),
        *router_args(moe),
    ]
    if moe.shared_ffn:
        args.append(_a("--moe-shared-expert-intermediate-size", moe.shared_ffn))
    if moe.shared_gate:  # TransformerConfig.moe_shared_expert_gate, a flag of its parser
        args.append(_a("--moe-shared-expert-gate"))
    if runs_ep_overlap(plan.framework, plan.ep, plan.pp, plan.virtual_stages, plan.recompute, plan.ep_comm_overlap):
        args += [_a("--overlap-moe-expert-parallel-comm"), _a("--delay-wgrad-compute")]  # as priced (paid.py)
    return args


def dispatcher_args(plan: PlanFile) -> list[Arg]:
    """The token dispatcher the plan was priced with (cost/moe_dispatch.py): alltoall, allgather,
    or flex over DeepEP on Hopper, HybridEP on Blackwell (TransformerConfig.moe_flex_dispatcher_backend)."""
    if plan.moe_dispatcher != "flex":
        return [_a("--moe-token-dispatcher-type", plan.moe_dispatcher)]
    from planner.hardware.load import load_profile

    backend = flex_backend(load_profile(plan.hardware))
    return [_a("--moe-token-dispatcher-type", "flex"), _a("--moe-flex-dispatcher-backend", backend),
            _a("--moe-flex-dispatcher-num-sms", FLEX_SMS[backend])]  # the SMs it was priced with


def capacity_args(plan: PlanFile) -> list[Arg]:
    """Capacity-factor dropping as priced (Workload.moe_capacity_factor): every expert dropped or
    padded to the factor; none for dropless routing, Megatron-Core's default."""
    if plan.moe_capacity_factor is None:
        return []
    return [_a("--moe-expert-capacity-factor", plan.moe_capacity_factor), _a("--moe-pad-expert-input-to-capacity")]


def router_args(moe: MoEMLP) -> list[Arg]:
    """The model's own router (parts.Router, read from its config) in Megatron-Core's flags
    (TransformerConfig.moe_router_*), so a run trains the published router: DeepSeek-V3's sigmoid
    scores, expert-bias balancing (noaux_tc, bias update rate 0.001 as in its report), 8 groups
    of which 4 per token, scaling 2.5 and a sequence-wise loss of 0.0001; Megatron's defaults
    are a softmax over the top k and a batch-wise auxiliary loss."""
    r = moe.router
    args = [_a("--moe-router-score-function", r.score)]
    if r.score == "softmax" and not r.renormalise:
        args.append(_a("--moe-router-pre-softmax"))  # softmax over every expert, before top-k
    if r.groups > 1:
        args += [_a("--moe-router-num-groups", r.groups), _a("--moe-router-group-topk", r.group_topk)]
    if r.scaling != 1.0:
        args.append(_a("--moe-router-topk-scaling-factor", r.scaling))
    if moe.gate_bias:
        args += [_a("--moe-router-enable-expert-bias"), _a("--moe-router-bias-update-rate", 1e-3)]
    return args + [_a("--moe-router-load-balancing-type", r.balance), _a("--moe-aux-loss-coeff", r.aux_coeff)]
