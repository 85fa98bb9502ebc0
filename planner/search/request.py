"""The candidate space of one request: the model facts and framework rules enumeration reads,
and, when nothing is left, why (which pins to drop, which rule refused the candidates)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from planner.cost.framework_rules import ConfigColumns, RunFacts, check_framework_for, first_broken, model_facts
from planner.cost.parallel import ParallelConfig, Workload, check_against_model
from planner.errors import UserError, arg, marked
from planner.hardware.cluster import Cluster
from planner.model.spec import ModelSpec
from planner.search.space import Constraints, ModelFacts, Space, allowed_settings, divisors, enumerate_space


def space_facts(model: ModelSpec) -> ModelFacts:
    """The model facts the space depends on: every head count TP must divide (a vision-language
    model's vision blocks too), the KV heads, the routed experts and the pipeline units."""
    vision_heads = {b.heads for b in model.blocks if b.kind == "vision"} if model.is_vlm else set()
    return ModelFacts(heads=tuple(sorted({model.attention_heads} | vision_heads)), kv_heads=model.kv_heads,
                      routed_experts=model.routed_experts, units=model.num_layers)


def check_pins(cons: Constraints, world: int, model: ModelSpec) -> None:
    """Pinned degrees that can never hold on this cluster or model, as one UserError."""
    for name, values in (("dp", cons.dp), ("tp", cons.tp), ("pp", cons.pp)):
        bad = [v for v in values or () if world % v]
        if bad:
            raise UserError(f"{arg(name)} {','.join(map(str, bad))} cannot divide the {world} GPUs; "
                            f"pick from {', '.join(map(str, divisors(world)))}")
    if cons.ep and any(e > 1 for e in cons.ep) and not model.is_moe:
        raise UserError(f"{arg('ep')} {','.join(map(str, cons.ep))}: {model.name} is dense (no experts); "
                        f"use {arg('ep')} 1 or leave it out")


# The pins a user can drop (Constraints fields, each its input's name), in the order an error names them.
PINS = ("dp", "tp", "pp", "ep", "virtual_stages", "micro_batch", "zero", "offload", "recompute", "framework",
        "sequence_parallel")


def candidate_space(model: ModelSpec, cluster: Cluster, workload: Workload, cons: Constraints,
                    explain: bool = True, cp: tuple[int, str] = (1, "p2p"), rep: int = 1,
                    etp: int | None = None, tp1: bool = True) -> Space:
    """The candidate space beside one context-parallel split ``cp`` (degree, comm) and one count
    of hybrid-sharding groups ``rep``; UserError when it is empty, saying why (``explain``: and
    which single pin, dropped, would leave candidates, which costs one enumeration per pin)."""
    gb = workload.global_batch
    run_facts = RunFacts(**model_facts(model), optimizer=workload.optimizer, precision=workload.precision,
                         recipe=workload.recipe, precision_aware_optimizer=workload.precision_aware_optimizer,
                         zero_pp=workload.zero_pp, ep_overlap=workload.ep_comm_overlap,
                         dispatcher=workload.moe_dispatcher, modules=workload.recompute_modules,
                         pp_schedule=workload.pp_schedule, compiled=workload.compile)

    def rule(cols: ConfigColumns) -> np.ndarray:
        return first_broken(cols, run_facts)

    facts = space_facts(model)

    def enumerate_with(c: Constraints) -> Space:
        return enumerate_space(cluster.num_gpus, cluster.gpus_per_node, gb, facts, c, rule, cp[0], cp[1],
                               1 if cp[1] == "p2p" else cp[0], nvlink_gpus=cluster.nvlink_gpus, rep=rep, etp=etp,
                               tp1=tp1, min_accumulation=2 if workload.pp_schedule == "dualpipev" else 1)

    space = enumerate_with(cons)
    if len(space):
        return space
    dps = [d for d in divisors(cluster.num_gpus) if cons.dp is None or d in cons.dp]
    if not any(gb % d == 0 for d in dps):
        raise UserError(f"{arg('global_batch')} {gb} is not divisible by any data-parallel size possible on "
                        f"{cluster.num_gpus} GPUs ({', '.join(map(str, dps))}); pick a multiple of one of them")
    raise UserError(_empty_space_message(model, cluster, workload, cons, space, facts, enumerate_with, explain))


def _impossible_pins(cons: Constraints, facts: ModelFacts, cluster: Cluster) -> list[str]:
    """The pinned axes none of whose values can ever hold, each with estimate's own message for
    the broken rule (parallel.check_against_model), so the error names the cause rather than
    the generic rules."""
    node = cluster.nvlink_gpus

    def model_rule(**degrees: int) -> str | None:
        cfg = ParallelConfig(dp=degrees.get("ep", 1), **degrees)
        for heads in facts.heads:
            try:
                check_against_model(cfg, heads=heads, kv_heads=facts.kv_heads, routed_experts=facts.routed_experts,
                                    blocks=facts.units)
            except UserError as err:
                return marked(err)
        return None

    def tp_rule(tp: int) -> str | None:
        if tp > node and not cons.allow_tp_across_nodes and not model_rule(tp=tp):
            where = "a node's" if cluster.domain_nodes == 1 else "an NVLink domain's"
            return f"{arg('tp')} {tp} spans more than {where} {node} GPUs (add {arg('allow_tp_across_nodes')})"
        return model_rule(tp=tp)

    pps, vss = cons.pp or (), cons.virtual_stages or ()
    rules = [(cons.tp, tp_rule), (cons.ep, lambda ep: model_rule(ep=ep)), (cons.pp, lambda pp: model_rule(pp=pp))]
    if vss and pps and all(p == 1 for p in pps) and all(v > 1 for v in vss):
        rules.append((vss, lambda v: f"{arg('virtual_stages')} {v} needs {arg('pp')} > 1"))
    if cons.sequence_parallel == (True,) and cons.tp and all(t == 1 for t in cons.tp):
        rules.append(((True,), lambda _: f"{arg('sequence_parallel')} needs {arg('tp')} > 1"))
    out = []
    for values, rule in rules:
        found = [rule(v) for v in values or ()]
        if found and all(found):
            out += found
    return out


def _empty_space_message(model: ModelSpec, cluster: Cluster, workload: Workload, cons: Constraints, space: Space,
                         facts: ModelFacts, enumerate_with: Callable[[Constraints], Space], explain: bool) -> str:
    """Why no candidate is left, leading with the fix: the pins that, dropped one at a time,
    leave candidates (one enumeration each), then what ruled the candidates out."""
    world, gb = cluster.num_gpus, workload.global_batch
    freed = []
    for name in PINS if explain else ():
        values = getattr(cons, name)
        if values is None:
            continue
        n = len(enumerate_with(replace(cons, **{name: None})))
        if n:
            if name == "sequence_parallel":
                shown = "/".join(arg("sequence_parallel" if v else "no_sequence_parallel") for v in values)
            else:
                shown = f"{arg(name)} {','.join(map(str, values))}"
            freed.append(f"{shown} ({n:,} candidates)")
    why = _impossible_pins(cons, facts, cluster)
    pinned = [(tp, pp) for tp in cons.tp or divisors(world) for pp in cons.pp or divisors(world)
              if world % (tp * pp) == 0 and (cons.dp is None or world // (tp * pp) in cons.dp)]
    if not pinned:
        why.append(f"no {arg('dp')}/{arg('tp')}/{arg('pp')} combination multiplies to the {world} GPUs")
    if not allowed_settings(cons):
        why.append(f"{arg('offload')} optimizer needs ZeRO 1-3 and {arg('offload')} optimizer+params ZeRO-3; "
                   f"{arg('recompute')} op is {arg('framework')} torchtitan's")
    bad, refused = space.rejected["indivisible"], space.rejected["framework"]
    if pinned and bad:
        text = f"{bad:,} degree combination{' breaks' if bad == 1 else 's break'} a divisibility rule"
        if not why and not refused:  # the only cause: spell the rules out
            text += (f": TP must divide the {'/'.join(map(str, facts.heads))} heads and {facts.kv_heads} KV heads and "
                     f"stay in a node, PP x virtual stages <= {facts.units} layers, DP and the micro-batch must divide "
                     f"the global batch {gb}, every process group must hold equal shares of the nodes it spans")
        why.append(text)
    if refused:
        text = f"{refused:,} candidate{' needs' if refused == 1 else 's need'} something their framework cannot run"
        most = space.most_refused()
        if most is not None and most[0] == refused:  # one rule refused them all: name it, with its fix
            try:
                check_framework_for(most[1], model, optimizer=workload.optimizer,
                                    precision=workload.precision_name,
                                    precision_aware_optimizer=workload.precision_aware_optimizer,
                                    zero_pp=workload.zero_pp, ep_overlap=workload.ep_comm_overlap,
                                    dispatcher=workload.moe_dispatcher, modules=workload.recompute_modules,
                                    pp_schedule=workload.pp_schedule, compiled=workload.compile)
            except UserError as err:
                text += f" ({marked(err)})"
        why.append(text)
    lead = "the constraints exclude every plan"
    if freed:
        return f"{lead}: dropping {' or '.join(freed)} leaves plans to rank. Why: {'; '.join(why)}"
    return f"{lead} ({'; '.join(why)}); relax {arg('tp')}/{arg('pp')}/{arg('zero')}/{arg('framework')} or the batch"
