"""``suggest``: the best parallel plans for a model on a cluster.

Enumerate -> bound -> evaluate -> rank: resolve the request (defaults printed by the CLI),
enumerate the space (space.py, request.py), bound and evaluate it by branch and bound
(bounds.py, evaluate.py, branch_and_bound.py: exact, since the bounds are proven), collapse
identical predictions (the same layout under two runtimes), rank (rank.py), and build the
winners' Plans from what evaluation kept (the cost model's own Plans: planner/cost/plans.py).
When nothing fits, say what would (nothing_fits.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from planner.cost.candidates import take
from planner.cost.degrees import default_global_batch
from planner.cost.eager_kernels import COMPILE_COMPONENTS
from planner.cost.notes import batch_notes
from planner.cost.parallel import FRAMEWORKS, Workload, zero_pp_variants
from planner.cost.plan import Plan
from planner.cost.precision import RECIPES, split_precision, unsupported
from planner.cost.schedule_check import schedule_notes
from planner.errors import Message, UserError, arg, whole_number
from planner.hardware.cluster import Cluster
from planner.hardware.profile import HardwareProfile
from planner.model.spec import ModelSpec
from planner.model.vision_inputs import vision_inputs
from planner.search import rank as rk
from planner.search.branch_and_bound import Outcome, search
from planner.search.evaluate import Pricing, build_plans, evaluate_keys
from planner.search.keys import KeyedSpace, group_by_key
from planner.search.nothing_fits import describe, nothing_fits_message, relaxations
from planner.search.request import candidate_space, check_pins
from planner.search.space import Constraints, Space
from planner.search.splits import BALANCERS
from planner.search.variants import left_out_notes, schedule_options, schedules_of, searches, share_progress

__all__ = ["NoPlanFits", "RankedPlan", "SuggestResult", "candidate_space", "describe", "restrict", "suggest"]

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


# -- request ---------------------------------------------------------------------------------


def _profile(hardware: str | HardwareProfile, gpus_per_node: int | None) -> HardwareProfile:
    from planner.hardware.load import load_profile

    profile = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
    return profile if gpus_per_node is None else profile.with_gpus_per_node(gpus_per_node)


# -- the search ------------------------------------------------------------------------------


def suggest(model: ModelSpec | str, hardware: str | HardwareProfile = "dgx-a100-80g", nodes: int = 1, *,
            precision: str | Sequence[str] = "bf16", **options: Any) -> SuggestResult:
    """Rank the plans that fit; raise ``NoPlanFits`` (a UserError) when none does.

    ``precision``: one name, or several: each is searched as its own workload and the plans are
    ranked together (precision is a property of the workload, so of every block's cost). A recipe
    the GPU cannot run, or one no plan fits, is left out with a note; all of them: the first's error.
    Each context-parallel split (search/context_splits.py), each count of hybrid-sharding groups
    (``constraints.dp_replicate``) and each expert-TP choice (search/expert_tp.py) is searched
    on its own too, and ranked with the rest.
    ``options``: the keywords of ``_suggest_one``; ``pp_schedule`` may name several schedules,
    each searched (DualPipeV's for pipelines only, which 1F1B's search has the rest of)."""
    names = (precision,) if isinstance(precision, str) else tuple(dict.fromkeys(precision))
    variants = zero_pp_variants(options.pop("zero_pp", ()))  # --zeropp auto: each ZeRO++ choice its own search
    schedules = schedules_of(options.pop("pp_schedule", "1f1b"))
    if isinstance(model, str):
        from planner.model.catalog import load_model

        model = load_model(model)
    cons = options.get("constraints") or Constraints()
    seq = options.get("seq_len") or model.train_seq_len
    gpus = _profile(hardware, options.get("gpus_per_node")).node.gpus * whole_number("nodes", nodes)
    splits = searches(model, cons, seq, options.get("flash_attention", True), gpus, variants, schedules)
    if len(names) == 1 and len(splits) == 1:
        return _suggest_one(model, hardware, nodes, precision=names[0], cp=splits[0][0], rep=splits[0][1],
                            zero_pp=splits[0][2], etp=splits[0][3], pp_schedule=schedules[0], **options)
    profile = _profile(hardware, options.get("gpus_per_node"))
    results, left_out, first_error = [], [], None
    ran, refused = set(), {}  # ZeRO++ choices that gave plans; the first error of the others
    for name in names:
        recipe = RECIPES.get(split_precision(name)[1] or "")
        why = recipe and unsupported(recipe, profile.gpu.peak_TFLOPs, profile.gpu.name)  # type: ignore[arg-type]
        errors = [UserError(f"{arg('precision')} {name}: {why}")] if why else []
        for split, rep, zpp, etp, sched in ([] if why else splits):
            try:
                opts = {**share_progress(options, len(results) + len(errors), len(names) * len(splits)),
                        **schedule_options(options, sched, len(schedules), gpus)}
                results.append(_suggest_one(model, hardware, nodes, precision=name, cp=split, rep=rep, zero_pp=zpp,
                                            etp=etp, **opts))
                ran.update((zpp, sched))
            except UserError as err:
                errors.append(err)
                refused.setdefault(zpp, err)
                refused.setdefault(sched, err)
        first_error = first_error or (errors[0] if errors else None)
        if len(errors) == (1 if why else len(splits)):  # nothing of this precision fits: say why
            left_out.append(f"left out: {errors[0]}")
    if options.get("progress") is not None:
        options["progress"](1.0)
    if not results:
        raise first_error  # type: ignore[misc]
    left_out += left_out_notes(variants, schedules, ran, refused)
    if len(names) == 1 and len(results) == 1 and len(variants) == 1 and len(schedules) == 1:
        return results[0]
    merged = _merge(results, names, left_out, options.get("objective", "throughput"), options.get("top", 5))
    if len(variants) > 1:
        merged.inputs["zero_pp"] = "auto"
    merged.inputs["pp_schedule"] = ",".join(schedules)
    return merged



def _merge(results: list[SuggestResult], names: tuple[str, ...], left_out: list[str], objective: str,
           top: int) -> SuggestResult:
    """One ranking of the plans of several searches (one per precision): renumbered, explained
    again among themselves, the counts added; notes are the best plan's search's."""
    gpus = results[0].inputs["gpus"]
    pooled = sorted((rp for r in results for rp in r.plans), key=lambda rp: _scalar_key(objective, rp.plan, gpus))
    plans = [replace(rp, id=k + 1, why="") for k, rp in enumerate(pooled[:top])]
    home = next(r for r in results if any(rp.plan is plans[0].plan for rp in r.plans[:1]))
    rejected = {k: sum(r.rejected[k] for r in results) for k in results[0].rejected}
    out = SuggestResult(plans, sum(r.evaluated for r in results), rejected, sum(r.fully_evaluated for r in results),
                        sum(r.pruned for r in results), {**results[0].inputs, "precision": ",".join(names)}, objective,
                        elapsed_s=sum(r.elapsed_s for r in results), cpu_s=sum(r.cpu_s for r in results),
                        setup_cpu_s=sum(r.setup_cpu_s for r in results),
                        notes=list(home.notes) + [Message(n) for n in left_out])
    _explain(out, objective, True)
    return out


def _suggest_one(model: ModelSpec | str, hardware: str | HardwareProfile = "dgx-a100-80g", nodes: int = 1, *,
                 gpus_per_node: int | None = None, global_batch: int | None = None, seq_len: int | None = None,
                 images_per_sample: int | None = None, tiles_per_image: int | None = None, precision: str = "bf16",
                 constraints: Constraints | None = None, balancer: str = "optimal", objective: str = "throughput",
                 top: int = 5, progress: Callable[[float], None] | None = None, cp: tuple[int, str] = (1, "p2p"),
                 rep: int = 1, zero_pp: tuple[str, ...] = (), etp: tuple[int | None, bool] = (None, True),
                 **knobs: Any) -> SuggestResult:
    """``suggest`` for one precision, context-parallel split ``cp``, sharding groups ``rep`` and expert-TP
    ``etp``; ``knobs``: the Workload's other fields (optimizer, flash_attention, ..., moe_dispatcher)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    whole_number("nodes", nodes), whole_number("top", top)
    if balancer not in BALANCERS:
        raise UserError(f"{arg('balancer')}: use {' or '.join(BALANCERS)}, not {balancer!r}")
    if objective not in rk.OBJECTIVES:
        raise UserError(f"{arg('objective')}: use one of {', '.join(rk.OBJECTIVES)}, not {objective!r}")
    if isinstance(model, str):
        from planner.model.catalog import load_model

        model = load_model(model)
    profile = _profile(hardware, gpus_per_node)
    cluster = Cluster.build(profile, nodes)
    world = cluster.num_gpus
    cons = constraints or Constraints()
    check_pins(cons, world, model)
    seq = seq_len or model.train_seq_len
    whole_number("seq_len", seq)
    if seq > model.max_seq_len:
        raise UserError(f"{arg('seq_len')} {seq} exceeds {model.name}'s maximum context of {model.max_seq_len}")
    gb = default_global_batch(seq, world) if global_batch is None else global_batch
    whole_number("global_batch", gb)
    images, tiles = vision_inputs(model, images_per_sample, tiles_per_image, seq)
    workload = Workload(global_batch=gb, seq_len=seq, images_per_sample=images, tiles_per_image=tiles,
                        precision=precision, zero_pp=zero_pp, **knobs)  # type: ignore[arg-type]
    model, workload = workload.trained(model), workload.resolved(model)
    if workload.pp_schedule == "dualpipev":  # torchtitan's schedule, two chunks a pipelined rank
        cons = replace(cons, framework=cons.framework or ("torchtitan",), virtual_stages=cons.virtual_stages or (1, 2))
    if workload.compile != COMPILE_COMPONENTS:  # what torchtitan compiles: its plans only
        cons = replace(cons, framework=cons.framework or ("torchtitan",))
    inputs = {"model": model.name, "hardware": profile.name, "nodes": nodes, "gpus_per_node": cluster.gpus_per_node,
              "gpus": world, **_workload_inputs(workload), "precision": precision,
              "balancer": balancer, "objective": objective, "top": top, "gpu_memory_bytes": profile.gpu.memory_bytes}
    search_cpu_started = time.process_time()
    space = candidate_space(model, cluster, workload, cons, cp=cp, rep=rep, etp=etp[0], tp1=etp[1])
    result = _search(model, cluster, workload, space, balancer, objective, top, inputs, progress, cp, rep, etp[0])
    result.elapsed_s = time.perf_counter() - started
    result.cpu_s = time.process_time() - search_cpu_started
    result.setup_cpu_s = search_cpu_started - cpu_started
    if not result.plans:
        result.advice = [Message(a) for a in _advice(model, profile, nodes, workload, cons, balancer)]
        raise NoPlanFits(nothing_fits_message(result.evaluated, result.rejected["out_of_memory"], result.closest,
                                              result.advice, profile), result)
    return result


_WORKLOAD_INPUTS = ("global_batch", "seq_len", "tokens_per_step", "optimizer", "dropout", "mtbf_hours",
                    "tp_comm_overlap", "te_attention", "fp8_param_gather", "precision_aware_optimizer", "mtp_layers",
                    "ep_comm_overlap", "moe_imbalance", "moe_dispatcher", "moe_capacity_factor", "flash_attention",
                    "images_per_sample", "tiles_per_image", "recompute_modules", "pp_schedule", "compile",
                    "rms_norm_kernel", "flash_version")


def _workload_inputs(w: Workload) -> dict[str, Any]:
    """What the search's inputs record of its workload (the precision as the caller named it)."""
    return {**{k: getattr(w, k) for k in _WORKLOAD_INPUTS}, "zero_pp": ",".join(w.zero_pp),
            "compile": ",".join(w.compile) or "none",
            "layer_profile": w.layer_profile.summary() if w.layer_profile else None}


def _search(model: ModelSpec, cluster: Cluster, workload: Workload, space: Space, balancer: str, objective: str,
            top: int, inputs: dict, progress, cp: tuple[int, str] = (1, "p2p"), rep: int = 1,
            etp: int | None = None) -> SuggestResult:
    p = Pricing.of(model, cluster, workload, balancer, *cp, rep=rep, etp=etp)
    ks = group_by_key(space)
    out = search(p, ks, objective, top, progress)
    fitting = out.fitting(p)
    done, certain_oom = out.done, out.certain_oom
    oom = int(certain_oom.sum() + (done & ~certain_oom & ~fitting).sum())
    pruned = int((~done & ~certain_oom).sum())
    rejected = {"out_of_memory": oom, "indivisible": space.rejected["indivisible"],
                "framework": space.rejected["framework"]}
    result = SuggestResult([], len(space), rejected, int(done.sum()), pruned, inputs, objective)
    overrides = {i: parts for i, (parts, _) in out.overrides.items()}
    idx = np.nonzero(fitting)[0]
    if not idx.size:
        result.closest = _closest(p, ks, out, overrides)
        return result
    gpus = cluster.num_gpus
    tps = workload.global_batch * workload.seq_len / out.step[idx]
    if objective == "goodput":
        tps = tps * out.goodput[idx]
    ranked = idx[rk.order(objective, take(space.columns, idx), tps, out.peak[idx], out.cpu[idx], gpus)]
    chosen = rk.distinct_top(ranked, space.columns, out.step, out.peak, top)
    built = build_plans(p, ks, [i for i, _ in chosen], out.details, overrides)
    plans = sorted(zip(chosen, built), key=lambda ip: _scalar_key(objective, ip[1][0], gpus))
    for k, ((i, alts), (plan, (g, o))) in enumerate(plans):
        bottlenecks = ({"greedy": float(g), "optimal": float(o)} if plan.cfg.pp > 1
                       else {"greedy": None, "optimal": None})
        if i in out.overrides:  # the time-balanced split ran out of memory: the split used instead
            bottlenecks["memory_constrained"] = float(out.overrides[i][1])
        value = rk.objective_value(objective, plan.tokens_per_s, plan.memory.peak, gpus, plan.goodput)
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
        result.why = Message(f"ranked first ({arg('top')} 2 or more names the runner-up and why it lost)")
    else:
        result.why = "the only plan that fits"
    result.plans[0].why = result.why
    return best_json


def restrict(result: SuggestResult, keep: Callable[[RankedPlan], bool]) -> SuggestResult:
    """``result`` with only the plans ``keep`` accepts, renumbered from 1 and explained again
    among themselves: for a caller whose rule the search's pins cannot state (``dsplan generate``
    for the reference trainer). The kept plans are the best of their kind exactly, since every
    plan ranked above the last of them was seen. ``notes`` belong to the search's #1, so they
    go when #1 is not kept."""
    kept = [replace(rp, id=k + 1, why="") for k, rp in enumerate(rp for rp in result.plans if keep(rp))]
    first_kept = bool(kept) and kept[0].plan is result.plans[0].plan
    out = replace(result, plans=kept, why="", notes=list(result.notes) if first_kept else [])
    if kept:
        _explain(out, result.objective, len(result.plans) > 1 or result.pruned > 0)
    return out


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
    if objective == "goodput":
        return (-plan.tokens_per_s * plan.goodput, plan.memory.peak)
    return (-plan.tokens_per_s, plan.memory.peak)


# -- nothing fits --------------------------------------------------------------------------


def _advice(model: ModelSpec, profile: HardwareProfile, nodes: int, workload: Workload, cons: Constraints,
            balancer: str) -> list[str]:
    """The relaxations under which a plan fits, each checked by a search of its own (of the
    larger clusters, the first that fits)."""
    out, larger = [], False
    for label, n, c in relaxations(nodes, workload, cons):
        if n != nodes and larger:
            continue
        if _fits_somewhere(model, profile, n, workload, c, balancer):
            out.append(label)
            larger = larger or n != nodes
    return out


def _fits_somewhere(model: ModelSpec, profile: HardwareProfile, nodes: int, workload: Workload, cons: Constraints,
                    balancer: str) -> bool:
    try:
        cluster = Cluster.build(profile, nodes)
        space = candidate_space(model, cluster, workload, cons, explain=False)
    except UserError:
        return False
    res = _search(model, cluster, workload, space, balancer, "memory", 1, {}, None)
    return bool(res.plans)


