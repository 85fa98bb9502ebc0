"""Megatron-LM's mixture-of-experts flags for a plan: the experts, their parallelism and routing,
and the all-to-all overlap the plan was priced with (planner/cost/paid.py)."""

from __future__ import annotations

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
        _a("--moe-layer-freq", pattern),
        _a("--moe-token-dispatcher-type", "alltoall"),
        _a("--moe-router-load-balancing-type", "aux_loss"),
        _a("--moe-aux-loss-coeff", "0.001"),
    ]
    if moe.shared_ffn:
        args.append(_a("--moe-shared-expert-intermediate-size", moe.shared_ffn))
    if runs_ep_overlap(plan.framework, plan.ep, plan.pp, plan.virtual_stages, plan.recompute, plan.ep_comm_overlap):
        args += [_a("--overlap-moe-expert-parallel-comm"), _a("--delay-wgrad-compute")]  # as priced (paid.py)
    return args
