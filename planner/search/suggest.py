"""``suggest``: the best parallel plans for a model on a cluster.

Pipeline: resolve the request (defaults printed by the CLI) -> enumerate the space
(planner/search/space.py) -> bound every candidate (a step time and a peak memory no
partition can beat) -> evaluate candidates in full, best bound first, until the bound of
what is left cannot reach the top K (branch and bound: exact, since the bounds are proven;
tests/test_pruning_exact.py checks it against exhaustive ``estimate`` calls) -> rebalance
pipelines whose time-balanced split runs out of memory under a memory limit
(planner/search/memfit.py), best split-independent bound first, until that bound cannot
reach the top K (bounds.split_time_bound), skipping those where one pack proves no split
within memory is fast enough (partition.fits_within) -> collapse identical predictions (the same
layout under two runtimes) -> rank ->
build the winners' ``Plan`` objects from the twin's per-rank parts (planner/search/plans.py;
tests/test_suggest.py checks they equal ``estimate`` for the same configuration and partition).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from planner.cost.candidates import take
from planner.cost.frameworks import ConfigColumns, RunFacts, check_framework_for, first_broken, model_facts
from planner.cost.memory import host_capacity_bytes
from planner.cost.notes import batch_notes
from planner.cost.parallel import FRAMEWORKS, ParallelConfig, Workload, check_against_model
from planner.cost.plan import Plan
from planner.cost.schedule_check import schedule_notes
from planner.errors import UserError
from planner.hardware.cluster import Cluster
from planner.hardware.profile import HardwareProfile
from planner.model.spec import ModelSpec
from planner.model.vision_inputs import vision_inputs
from planner.search import rank as rk
from planner.search.branch_and_bound import Outcome, search
from planner.search.evaluate import Pricing, build_plans, evaluate_keys
from planner.search.keys import KeyedSpace, group_by_key
from planner.search.splits import BALANCERS
from planner.search.space import Constraints, ModelFacts, Space, allowed_settings, default_global_batch, divisors, \
    enumerate_space



@dataclass
class RankedPlan:
    """One suggested plan: the estimate's Plan plus its rank and the balancers' bottlenecks."""

    id: int
    plan: Plan
    balancer_bottleneck_s: dict[str, float | None]
    objective_value: float
    also_runs_on: list[str] = field(default_factory=list)  # runtimes that predict this plan identically
    why: str = ""  # #1: why it beat the runner-up; the others: why they rank below #1

    def to_json(self) -> dict[str, Any]:
        data = {"id": self.id, **self.plan.to_json()}
        data["balancer_bottleneck_s"] = dict(self.balancer_bottleneck_s)
        data["objective_value"] = self.objective_value
        data["also_runs_on"] = list(self.also_runs_on)
        data["why"] = self.why
        return data


@dataclass
class SuggestResult:
    plans: list[RankedPlan]
    evaluated: int  # candidates scored (in full, or ruled out by a proven bound)
    rejected: dict[str, int]  # out_of_memory, indivisible, framework
    fully_evaluated: int
    pruned: int  # candidates a bound proves cannot reach the top K
    inputs: dict[str, Any]  # what was searched, defaults filled in
    objective: str
    why: str = ""  # one line: why the best plan beat the runner-up
    elapsed_s: float = 0.0
    cpu_s: float = 0.0  # CPU seconds of the search proper: space, bounds, evaluation, ranking
    setup_cpu_s: float = 0.0  # CPU seconds before it: loading the model and hardware, building the cluster
    closest: Plan | None = None  # nothing fits: the plan nearest to fitting
    notes: list[str] = field(default_factory=list)  # what limits the best plan beyond the layout (cost/notes.py)
    advice: list[str] = field(default_factory=list)

    @property
    def best(self) -> RankedPlan:
        return self.plans[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs, "objective": self.objective,
            "plans": [p.to_json() for p in self.plans],
            "evaluated": self.evaluated, "rejected": dict(self.rejected),
            "search": {"fully_evaluated": self.fully_evaluated, "pruned_by_bound": self.pruned,
                       "elapsed_s": self.elapsed_s, "cpu_s": self.cpu_s, "setup_cpu_s": self.setup_cpu_s},
            "why": self.why, "notes": list(self.notes),
        }


class NoPlanFits(UserError):
    """Every candidate runs out of memory; carries the closest plan and what would help."""

    def __init__(self, message: str, result: SuggestResult) -> None:
        super().__init__(message)
        self.result = result


def describe(p: dict) -> str:
    """dp8 tp4 pp2 z1 mb2x16 — the short name of a plan in messages."""
    extra = f" ep{p['ep']}" if p.get("ep", 1) > 1 else ""
    vs = f" v{p['virtual_stages']}" if p.get("virtual_stages", 1) > 1 else ""
    off = f" offload-{p['offload']}" if p.get("offload", "none") != "none" else ""
    sp = " sp" if p.get("sequence_parallel") else ""
    return (f"{p['framework']} dp{p['dp']} tp{p['tp']}{sp} pp{p['pp']}{vs}{extra} zero{p['zero_stage']}{off} "
            f"mb{p['micro_batch']}x{p['grad_accum']} recompute-{p['recompute']}")


# -- request ---------------------------------------------------------------------------------


def _profile(hardware: str | HardwareProfile, gpus_per_node: int | None) -> HardwareProfile:
    from planner.hardware.load import load_profile

    profile = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
    return profile if gpus_per_node is None else profile.with_gpus_per_node(gpus_per_node)


def _facts(model: ModelSpec) -> ModelFacts:
    """The model facts the space depends on. Only a vision-language model has vision blocks
    (ModelSpec's validator), so only its block list is walked for their heads, and by kind:
    isinstance(b, VisionBlock) fails on every decoder block through ABCMeta's Python-level
    __instancecheck__."""
    vision_heads = {b.heads for b in model.blocks if b.kind == "vision"} if model.is_vlm else set()
    return ModelFacts(heads=tuple(sorted({model.attention_heads} | vision_heads)), kv_heads=model.kv_heads,
                      routed_experts=model.routed_experts, units=model.num_layers)


def _check_pins(cons: Constraints, world: int, model: ModelSpec) -> None:
    for flag, values in (("--dp", cons.dp), ("--tp", cons.tp), ("--pp", cons.pp)):
        bad = [v for v in values or () if world % v]
        if bad:
            raise UserError(f"{flag} {','.join(map(str, bad))} cannot divide the {world} GPUs; "
                            f"pick from {', '.join(map(str, divisors(world)))}")
    if cons.ep and any(e > 1 for e in cons.ep) and not model.is_moe:
        raise UserError(f"--ep {','.join(map(str, cons.ep))}: {model.name} is dense (no experts); use --ep 1 or leave it out")


# -- the search ------------------------------------------------------------------------------


def suggest(model: ModelSpec | str, hardware: str | HardwareProfile = "dgx-a100-80g", nodes: int = 1, *,
            gpus_per_node: int | None = None, global_batch: int | None = None, seq_len: int | None = None,
            images_per_sample: int | None = None, tiles_per_image: int | None = None, precision: str = "bf16",
            optimizer: str = "adamw", constraints: Constraints | None = None, balancer: str = "optimal",
            objective: str = "throughput", top: int = 5,
            progress: Callable[[float], None] | None = None) -> SuggestResult:
    """Rank the plans that fit; raise ``NoPlanFits`` (a UserError) when none does."""
    started, cpu_started = time.perf_counter(), time.process_time()
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise UserError(f"--nodes: need a whole number of nodes >= 1, got {nodes!r}")
    if top < 1:
        raise UserError(f"--top: need at least 1, got {top}")
    if balancer not in BALANCERS:
        raise UserError(f"--balancer: use {' or '.join(BALANCERS)}, not {balancer!r}")
    if objective not in rk.OBJECTIVES:
        raise UserError(f"--objective: use one of {', '.join(rk.OBJECTIVES)}, not {objective!r}")
    if isinstance(model, str):
        from planner.model.catalog import load_model

        model = load_model(model)
    profile = _profile(hardware, gpus_per_node)
    cluster = Cluster.build(profile, nodes)
    world = cluster.num_gpus
    cons = constraints or Constraints()
    _check_pins(cons, world, model)
    seq = seq_len or model.train_seq_len
    if seq < 1:
        raise UserError(f"--seq-len: need a positive length, got {seq}")
    if seq > model.max_seq_len:
        raise UserError(f"--seq-len {seq} exceeds {model.name}'s maximum context of {model.max_seq_len}")
    gb = default_global_batch(seq, world) if global_batch is None else global_batch
    if gb < 1:
        raise UserError(f"--global-batch: need a positive number of samples, got {gb}")
    images, tiles = vision_inputs(model, images_per_sample, tiles_per_image, seq)
    workload = Workload(global_batch=gb, seq_len=seq, images_per_sample=images, tiles_per_image=tiles,
                        precision=precision, optimizer=optimizer)  # type: ignore[arg-type]
    inputs = {"model": model.name, "hardware": profile.name, "nodes": nodes, "gpus_per_node": cluster.gpus_per_node,
              "gpus": world, "global_batch": gb, "seq_len": seq, "tokens_per_step": gb * seq, "precision": precision,
              "optimizer": optimizer, "images_per_sample": images, "tiles_per_image": tiles, "balancer": balancer,
              "objective": objective, "top": top, "gpu_memory_bytes": profile.gpu.memory_bytes}
    search_cpu_started = time.process_time()
    space = _space(model, cluster, workload, cons)
    result = _search(model, cluster, workload, space, balancer, objective, top, inputs, progress)
    result.elapsed_s = time.perf_counter() - started
    result.cpu_s = time.process_time() - search_cpu_started
    result.setup_cpu_s = search_cpu_started - cpu_started
    if not result.plans:
        result.advice = _advice(model, profile, nodes, workload, cons, balancer)
        raise NoPlanFits(_nothing_fits_message(result, profile), result)
    return result


# The pins a user can drop, as (flag, Constraints field), in the order an error names them.
_PINS = (("--dp", "dp"), ("--tp", "tp"), ("--pp", "pp"), ("--ep", "ep"), ("--virtual-stages", "virtual_stages"),
         ("--micro-batch", "micro_batch"), ("--zero", "zero"), ("--offload", "offload"), ("--recompute", "recompute"),
         ("--framework", "framework"), ("--sequence-parallel", "sequence_parallel"))


def _space(model: ModelSpec, cluster: Cluster, workload: Workload, cons: Constraints, explain: bool = True) -> Space:
    """The candidate space; UserError when it is empty, saying why (``explain``: and which
    single pin, dropped, would leave candidates, which costs one enumeration per pin)."""
    gb = workload.global_batch
    run_facts = RunFacts(**model_facts(model), optimizer=workload.optimizer, precision=workload.precision)

    def rule(cols: ConfigColumns) -> np.ndarray:
        return first_broken(cols, run_facts)

    facts = _facts(model)

    def enumerate_with(c: Constraints) -> Space:
        return enumerate_space(cluster.num_gpus, cluster.gpus_per_node, gb, facts, c, rule)

    space = enumerate_with(cons)
    if len(space):
        return space
    dps = [d for d in divisors(cluster.num_gpus) if cons.dp is None or d in cons.dp]
    if not any(gb % d == 0 for d in dps):
        raise UserError(f"--global-batch {gb} is not divisible by any data-parallel size possible on "
                        f"{cluster.num_gpus} GPUs ({', '.join(map(str, dps))}); pick a multiple of one of them")
    raise UserError(_empty_space_message(model, cluster, workload, cons, space, facts, enumerate_with, explain))


def _impossible_pins(cons: Constraints, facts: ModelFacts, cluster: Cluster) -> list[str]:
    """The pinned axes none of whose values can ever hold, each with estimate's own message for
    the broken rule (parallel.check_against_model), so the error names the cause rather than
    the generic rules."""
    node = cluster.gpus_per_node

    def model_rule(**degrees: int) -> str | None:
        cfg = ParallelConfig(dp=degrees.get("ep", 1), **degrees)
        for heads in facts.heads:
            try:
                check_against_model(cfg, heads=heads, kv_heads=facts.kv_heads, routed_experts=facts.routed_experts,
                                    blocks=facts.units)
            except UserError as err:
                return str(err)
        return None

    def tp_rule(tp: int) -> str | None:
        if tp > node and not cons.allow_tp_across_nodes and not model_rule(tp=tp):
            return f"--tp {tp} spans more than a node's {node} GPUs (add --allow-tp-across-nodes)"
        return model_rule(tp=tp)

    pps, vss = cons.pp or (), cons.virtual_stages or ()
    rules = [(cons.tp, tp_rule), (cons.ep, lambda ep: model_rule(ep=ep)), (cons.pp, lambda pp: model_rule(pp=pp))]
    if vss and pps and all(p == 1 for p in pps) and all(v > 1 for v in vss):
        rules.append((vss, lambda v: f"--virtual-stages {v} needs --pp > 1"))
    if cons.sequence_parallel == (True,) and cons.tp and all(t == 1 for t in cons.tp):
        rules.append(((True,), lambda _: "--sequence-parallel needs --tp > 1"))
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
    for flag, name in _PINS if explain else ():
        values = getattr(cons, name)
        if values is None:
            continue
        n = len(enumerate_with(replace(cons, **{name: None})))
        if n:
            if name == "sequence_parallel":
                shown = "/".join("--sequence-parallel" if v else "--no-sequence-parallel" for v in values)
            else:
                shown = f"{flag} {','.join(map(str, values))}"
            freed.append(f"{shown} ({n:,} candidates)")
    why = _impossible_pins(cons, facts, cluster)
    pinned = [(tp, pp) for tp in cons.tp or divisors(world) for pp in cons.pp or divisors(world)
              if world % (tp * pp) == 0 and (cons.dp is None or world // (tp * pp) in cons.dp)]
    if not pinned:
        why.append(f"no --dp/--tp/--pp combination multiplies to the {world} GPUs")
    if not allowed_settings(cons):
        why.append("--offload optimizer needs ZeRO 1-3 and --offload optimizer+params ZeRO-3")
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
                check_framework_for(most[1], model, optimizer=workload.optimizer, precision=workload.precision)
            except UserError as err:
                text += f" ({err})"
        why.append(text)
    lead = "the constraints exclude every plan"
    if freed:
        return f"{lead}: dropping {' or '.join(freed)} leaves plans to rank. Why: {'; '.join(why)}"
    return f"{lead} ({'; '.join(why)}); relax --tp/--pp/--zero/--framework or the batch"


def _search(model: ModelSpec, cluster: Cluster, workload: Workload, space: Space, balancer: str, objective: str,
            top: int, inputs: dict, progress) -> SuggestResult:
    p = Pricing.of(model, cluster, workload, balancer)
    ks = group_by_key(space)
    out = search(p, ks, objective, top, progress)
    fitting = out.fitting(p)
    done, certain_oom = out.done, out.certain_oom
    oom = int(certain_oom.sum() + (done & ~certain_oom & ~fitting).sum())
    pruned = int((~done & ~certain_oom).sum())
    rejected = {"out_of_memory": oom, "indivisible": space.rejected["indivisible"], "framework": space.rejected["framework"]}
    result = SuggestResult([], len(space), rejected, int(done.sum()), pruned, inputs, objective)
    overrides = {i: parts for i, (parts, _) in out.overrides.items()}
    idx = np.nonzero(fitting)[0]
    if not idx.size:
        result.closest = _closest(p, ks, out, overrides)
        return result
    gpus = cluster.num_gpus
    tps = workload.global_batch * workload.seq_len / out.step[idx]
    ranked = idx[rk.order(objective, take(space.columns, idx), tps, out.peak[idx], out.cpu[idx], gpus)]
    chosen = rk.distinct_top(ranked, space.columns, out.step, out.peak, top)
    built = build_plans(p, ks, [i for i, _ in chosen], out.details, overrides)
    plans = sorted(zip(chosen, built), key=lambda ip: _scalar_key(objective, ip[1][0], gpus))
    for k, ((i, alts), (plan, (g, o))) in enumerate(plans):
        bottlenecks = ({"greedy": float(g), "optimal": float(o)} if plan.cfg.pp > 1
                       else {"greedy": None, "optimal": None})
        if i in out.overrides:  # the time-balanced split ran out of memory: the split used instead
            bottlenecks["memory_constrained"] = float(out.overrides[i][1])
        value = rk.objective_value(objective, plan.tokens_per_s, plan.memory.peak, gpus)
        result.plans.append(RankedPlan(k + 1, plan, bottlenecks, value, [FRAMEWORKS[f] for f in alts]))
    best_json = _explain(result, objective, idx.size > 1 or pruned > 0)
    best = result.plans[0].plan
    result.notes = batch_notes(best_json, workload.seq_len) + schedule_notes(p.tables, best.cfg, best.partition,
                                                                             best.step_time_s)
    return result


def _explain(result: SuggestResult, objective: str, others: bool) -> dict:
    """Why #1 beat the runner-up, and why each other plan ranks below it; #1's JSON."""
    jsons = [rp.plan.to_json() for rp in result.plans]  # each once: the lines below read them again
    best_json = jsons[0]
    if len(result.plans) > 1:
        # The runner-up worth explaining: the first plan that predicts differently (plans that
        # tie on every number, e.g. the same layout under two runtimes, say nothing).
        best = result.plans[0].plan
        runner = next((j for rp, j in zip(result.plans[1:], jsons[1:])
                       if abs(rp.plan.step_time_s - best.step_time_s) > 1e-9 * best.step_time_s
                       or abs(rp.plan.memory.peak - best.memory.peak) > 1e-9 * best.memory.peak),
                      jsons[1])
        result.why = rk.why_better(best_json, runner, objective, describe)
        for rp, j in zip(result.plans[1:], jsons[1:]):
            rp.why = rk.why_behind(best_json, j, objective)
    elif others:  # --top 1: others fit (or may: pruned ones were not evaluated)
        result.why = "ranked first (--top 2 or more names the runner-up and why it lost)"
    else:
        result.why = "the only plan that fits"
    result.plans[0].why = result.why
    return best_json


def _closest(p: Pricing, ks: KeyedSpace, out: Outcome, overrides: dict) -> Plan:
    """Nothing fits: the evaluated plan nearest to fitting (when every candidate was ruled out by
    its memory bound, the keys of the 64 nearest by that bound are evaluated first)."""
    if not out.done.any():
        near_keys = np.unique(ks.inverse[np.argsort(out.mem_lb, kind="stable")[:64]])
        res = evaluate_keys(p, ks, near_keys)
        out.peak[res.rows], out.done[res.rows] = res.peak_bytes, True
        out.details.update(res.details)
    near = np.nonzero(out.done)[0]
    i = int(near[np.argmin(out.peak[near])])
    return build_plans(p, ks, [i], out.details, overrides)[0][0]


def _scalar_key(objective: str, plan: Plan, gpus: int) -> tuple:
    if objective == "memory":
        return (plan.memory.peak, -plan.tokens_per_s)
    if objective == "cost":
        return (round(float(rk.gpu_hours_per_mtok(plan.tokens_per_s, gpus)), 9), plan.cpu_bytes_per_node,
                plan.memory.peak)
    return (-plan.tokens_per_s, plan.memory.peak)


# -- nothing fits ------------------------------------------------------------------------------


def _advice(model: ModelSpec, profile: HardwareProfile, nodes: int, workload: Workload, cons: Constraints,
            balancer: str) -> list[str]:
    """Relaxations that produce a plan that fits, each checked by a search of its own."""
    tries: list[tuple[str, Constraints]] = []
    if cons.recompute is not None and "full" not in cons.recompute:
        tries.append(("full recomputation (--recompute full)", replace(cons, recompute=("full",))))
    if cons.micro_batch is not None and 1 not in cons.micro_batch:
        tries.append(("micro-batch 1 (--micro-batch 1)", replace(cons, micro_batch=(1,))))
    # Offload steps Adam on the host (never sgd); Megatron-Core offloads only in bf16.
    megatron_only = cons.framework == ("megatron",)
    megatron_offloads = workload.precision == "bf16"
    no_offload = (cons.offload is not None and "optimizer" not in cons.offload) or cons.zero == (0,) or \
        (megatron_only and not megatron_offloads)
    if no_offload and workload.optimizer != "sgd":
        if megatron_only and not megatron_offloads:
            tries.append(("optimizer offload on DeepSpeed (--offload optimizer --framework deepspeed)",
                          replace(cons, offload=("optimizer",), zero=None, framework=None)))
        else:
            tries.append(("optimizer offload (--offload optimizer)", replace(cons, offload=("optimizer",), zero=None)))
    if (cons.zero is not None and 3 not in cons.zero) or megatron_only:
        # Megatron has no ZeRO-3: a megatron pin gives way to DeepSpeed, and the advice says so.
        on_ds, fw_flag, fws = (" on DeepSpeed", " --framework deepspeed", ("deepspeed",)) if megatron_only else \
            ("", "", cons.framework)
        tries.append((f"ZeRO-3{on_ds} (--zero 3{fw_flag})", replace(cons, zero=(3,), framework=fws)))
        tries.append((f"ZeRO-3 with optimizer offload{on_ds} (--zero 3 --offload optimizer{fw_flag})",
                      replace(cons, zero=(3,), offload=("optimizer",), framework=fws)))
    if any(v is not None for v in (cons.dp, cons.tp, cons.pp, cons.ep, cons.framework, cons.virtual_stages)):
        tries.append(("letting dp/tp/pp/ep/framework vary (drop those pins)",
                      replace(cons, dp=None, tp=None, pp=None, ep=None, framework=None, virtual_stages=None)))
    out = []
    for label, c in tries:
        if _fits_somewhere(model, profile, nodes, workload, c, balancer):
            out.append(label)
    for factor in (2, 4, 8, 16):
        more = nodes * factor
        if _fits_somewhere(model, profile, more, workload, replace(cons, dp=None), balancer):
            out.append(f"{more} nodes (--nodes {more})")
            break
    return out


def _fits_somewhere(model: ModelSpec, profile: HardwareProfile, nodes: int, workload: Workload, cons: Constraints,
                    balancer: str) -> bool:
    try:
        cluster = Cluster.build(profile, nodes)
        space = _space(model, cluster, workload, cons, explain=False)
    except UserError:
        return False
    res = _search(model, cluster, workload, space, balancer, "memory", 1, {}, None)
    return bool(res.plans)


def _nothing_fits_message(result: SuggestResult, profile: HardwareProfile) -> str:
    cap = profile.gpu.memory_bytes
    gib = 2**30
    host = host_capacity_bytes(profile.node.host_memory_GiB) / 2**40
    lines = [f"no plan fits in {cap / gib:.0f} GiB per GPU and {host:.2f} TiB of usable host memory per node "
             f"({result.evaluated} candidates evaluated, "
             f"{result.rejected['out_of_memory']} out of memory)."]
    if result.closest is not None:
        p = result.closest
        m = p.memory
        parts = (f"weights {m.weights / gib:.1f}, grads {m.grads / gib:.1f}, optimizer {m.optimizer / gib:.1f}, "
                 f"activations {m.activations / gib:.1f} GiB")
        if m.peak > cap:
            lines.append(f"closest: {describe(p.to_json())} needs {m.peak / gib:.1f} GiB on pipeline rank "
                         f"{p.worst_stage.rank}, {(m.peak - cap) / gib:.1f} GiB short ({parts}).")
        else:  # fits on the GPU; its offloaded states overflow the host
            short = (p.cpu_bytes_per_node - p.host_capacity_bytes) / 2**40
            lines.append(f"closest: {describe(p.to_json())} fits on the GPU ({m.peak / gib:.1f} GiB) but {p.why_not()}: "
                         f"{short:.2f} TiB short per node.")
    if result.advice:
        lines.append("would fit with: " + "; or ".join(result.advice) + ".")
    else:
        lines.append("try more nodes, --offload optimizer, --recompute full, --zero 3 or --micro-batch 1.")
    return " ".join(lines)
