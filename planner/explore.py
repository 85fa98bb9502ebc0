"""Trade-off sweeps: the numbers behind the plots of notebooks/tradeoffs.ipynb and ``dsplan plot``.

Each sweep is a pure function over the Python API (planner/api.py) that returns a list of
flat records (dicts), one per point, so the results print, serialise and become a DataFrame
without pandas being needed here:

- ``scaling``: the best plan at each node count (throughput and MFU against nodes);
- ``candidates``: every candidate of the search space scored in one vectorised pass, for
  ``pareto_front`` (the plans no other plan beats on both peak memory and throughput) and
  ``tp_pp_grid`` (the best tokens/s for each TP x PP pair);
- ``zero_stages``: one layout under ZeRO 0-3 (memory parts and step time);
- ``partition_comparison``: greedy vs optimal layer partition, stage by stage;
- ``fabric_whatif``: the best plan on copies of a profile with another fabric;
- ``vision_load``: the best plan as images and tiles per sample grow (VLMs).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from planner import api
from planner.errors import Message, UserError

DEFAULT_NODES = (1, 2, 4, 8, 16, 32, 64)


# -- scaling over node counts ----------------------------------------------------------------


def scaling(model: Any, hardware: Any = api.DEFAULT_HARDWARE, nodes: Sequence[int] = DEFAULT_NODES, *,
            global_batch: int | None = None, workload_options: Mapping[str, Any] | None = None,
            **constraints: Any) -> list[dict[str, Any]]:
    """The best plan at each node count, under one fixed workload (global batch and sequence
    length do not change with the cluster, as when a training recipe is scaled out).

    Rows that nothing fits have ``fits=False``, ``tokens_per_s=0`` and the reason.

    >>> rows = scaling("vl2", nodes=(1, 2, 4))
    >>> [r["nodes"] for r in rows]
    [1, 2, 4]
    """
    api.constraints(**constraints)  # unknown axis names fail here, not once per point
    spec = api.load_model(model)
    nodes = _node_list(nodes)
    opts = dict(workload_options or {})
    if global_batch is not None:
        opts["global_batch"] = global_batch
    wl = api.make_workload(spec, gpus=max(nodes) * api.load_hardware(hardware).gpus_per_node, **opts)
    rows = []
    for n in nodes:
        cluster = api.load_cluster(hardware, n)
        rows.append(_best_row(spec, cluster, wl, constraints) | {"nodes": n})
    return rows


def _node_list(nodes: Iterable[int]) -> list[int]:
    out = sorted(dict.fromkeys(int(n) for n in nodes))
    if not out or out[0] < 1:
        raise UserError(f"nodes: need node counts >= 1, got {list(nodes)}")
    return out


def _best_row(spec: Any, cluster: Any, wl: Any, constraints: Mapping[str, Any]) -> dict[str, Any]:
    """The best plan's record, or a row saying why nothing fits."""
    try:
        found = api.suggest(spec, cluster, workload=wl, top=1, **constraints)
    except UserError as err:
        return _empty_row(spec, cluster, wl, Message(err))
    if not found.plans:
        return _empty_row(spec, cluster, wl, "no plan fits")
    return api.record(found.plans[0])


def _empty_row(spec: Any, cluster: Any, wl: Any, reason: str) -> dict[str, Any]:
    return {"model": spec.name, "hardware": cluster.profile.name, "nodes": cluster.nodes, "gpus": cluster.num_gpus,
            "global_batch": wl.global_batch, "seq_len": wl.seq_len, "fits": False, "reason": reason,
            "tokens_per_s": 0.0, "mfu": 0.0, "tflops_per_gpu": 0.0, "step_time_s": float("inf"),
            "peak_bytes": float("nan"), "peak_gib": float("nan"), "label": "none fits"}


# -- every candidate at once ------------------------------------------------------------------


def candidates(model: Any, cluster: Any, *, workload: Any = None, balancer: str = "optimal",
               **axes: Any) -> list[dict[str, Any]]:
    """Every candidate of the search space (``axes`` restrict it as in ``api.suggest``),
    scored by the search's vectorised cost model in one pass: the configuration plus
    ``step_time_s``, ``tokens_per_s``, ``mfu``, ``peak_bytes``, ``peak_gib``, ``fits`` and
    ``label``. The search checks this model against ``estimate`` on every quantity, so
    these are the numbers ``estimate`` gives, without its per-stage breakdowns.

    >>> rows = candidates("llama-3-8b", api.load_cluster(nodes=1), framework="deepspeed")
    >>> len(rows) > 100, any(r["fits"] for r in rows)
    (True, True)
    """
    import numpy as np

    from planner.cost.candidates import take
    from planner.cost.parallel import CP_COMMS, FRAMEWORKS, OFFLOADS, RECOMPUTES
    from planner.search.context_splits import context_splits
    from planner.search.evaluate import Pricing, evaluate_keys
    from planner.search.expert_tp import expert_tp_choices
    from planner.search.keys import group_by_key
    from planner.search.request import candidate_space

    spec = api.load_model(model)
    wl = workload if workload is not None else api.make_workload(spec, gpus=cluster.num_gpus)
    spec, wl = wl.trained(spec), wl.resolved(spec)  # with the workload's multi-token-prediction depths
    cons = api.constraints(**axes)
    capacity = cluster.profile.gpu.memory_bytes
    base = {"model": spec.name, "hardware": cluster.profile.name, "nodes": cluster.nodes, "gpus": cluster.num_gpus,
            "global_batch": wl.global_batch, "seq_len": wl.seq_len, "capacity_bytes": capacity}
    rows, spaces, errors = [], [], []
    searches = [(split, etp) for split in context_splits(cons, spec, wl.seq_len, wl.flash_attention, cluster.num_gpus)
                for etp in expert_tp_choices(cons, spec)]  # as suggest does
    for split, etp in searches:
        try:
            spaces.append(((split, etp[0]), candidate_space(spec, cluster, wl, cons, cp=split, etp=etp[0], tp1=etp[1])))
        except UserError as err:  # a split the pins leave nothing of: the others stand
            errors.append(err)
    if not spaces:
        raise errors[0]
    for (split, etp), space in spaces:
        pricing = Pricing.of(spec, cluster, wl, balancer, *split, etp=etp)
        res = evaluate_keys(pricing, group_by_key(space))
        col = take(space.columns, res.rows)
        tokens = wl.global_batch * wl.seq_len / res.step_time
        mfu = pricing.tables.runs.flops_per_step() / res.step_time / cluster.num_gpus / pricing.ctx.dev.mfu_peak
        for i in range(len(res.rows)):
            row = dict(base, dp=int(col["dp"][i]), tp=int(col["tp"][i]), pp=int(col["pp"][i]), ep=int(col["ep"][i]),
                       etp=int(col["etp"][i]), cp=int(col["cp"][i]), cp_comm=CP_COMMS[col["cp_comm"][i]],
                       zero_stage=int(col["zero"][i]), offload=OFFLOADS[col["offload"][i]],
                       micro_batch=int(col["micro_batch"][i]), grad_accum=int(col["grad_accum"][i]),
                       recompute=RECOMPUTES[col["recompute"][i]], sequence_parallel=bool(col["sp"][i]),
                       virtual_stages=int(col["vs"][i]), framework=FRAMEWORKS[col["framework"][i]],
                       fits=bool(res.fits[i]), step_time_s=float(res.step_time[i]), tokens_per_s=float(tokens[i]),
                       mfu=float(mfu[i]), peak_bytes=float(res.peak_bytes[i]),
                       peak_gib=float(res.peak_bytes[i]) / 2**30)
            row["label"] = api.label(row)
            rows.append(row)
    order = np.argsort(-np.array([r["tokens_per_s"] for r in rows]), kind="stable")
    return [rows[i] for i in order]


# -- Pareto front ----------------------------------------------------------------------------


def pareto_front(rows: Iterable[Mapping[str, Any]], x: str = "peak_bytes",
                 y: str = "tokens_per_s") -> list[dict[str, Any]]:
    """Rows no other row beats on both ``x`` (lower is better) and ``y`` (higher is better),
    sorted by ``x``. Of rows equal on both, the first is kept.

    >>> pareto_front([{"peak_bytes": 1, "tokens_per_s": 1}, {"peak_bytes": 2, "tokens_per_s": 3},
    ...               {"peak_bytes": 3, "tokens_per_s": 2}])
    [{'peak_bytes': 1, 'tokens_per_s': 1}, {'peak_bytes': 2, 'tokens_per_s': 3}]
    """
    ordered = sorted((dict(r) for r in rows), key=lambda r: (r[x], -r[y]))
    front: list[dict[str, Any]] = []
    for r in ordered:
        if not front or r[y] > front[-1][y]:
            front.append(r)
    return front


# -- TP x PP heatmap -------------------------------------------------------------------------


def tp_pp_grid(rows: Iterable[Mapping[str, Any]], value: str = "tokens_per_s") -> list[dict[str, Any]]:
    """The best fitting candidate (highest ``value``) of each (tp, pp) pair in ``rows``
    (from ``candidates``); pairs where nothing fits get ``fits=False`` and ``value`` 0.

    >>> grid = tp_pp_grid([{"tp": 1, "pp": 1, "fits": True, "tokens_per_s": 5.0},
    ...                    {"tp": 1, "pp": 1, "fits": True, "tokens_per_s": 7.0},
    ...                    {"tp": 2, "pp": 1, "fits": False, "tokens_per_s": 9.0}])
    >>> [(g["tp"], g["pp"], g["tokens_per_s"]) for g in grid]
    [(1, 1, 7.0), (2, 1, 0.0)]
    """
    best: dict[tuple[int, int], dict[str, Any]] = {}
    for r in rows:
        key = (int(r["tp"]), int(r["pp"]))
        if key not in best:
            best[key] = {**r, "fits": False, value: 0.0, "label": "none fits"} if not r["fits"] else dict(r)
        elif r["fits"] and (not best[key]["fits"] or r[value] > best[key][value]):
            best[key] = dict(r)
    return [best[k] for k in sorted(best)]


# -- ZeRO stages side by side ----------------------------------------------------------------


def zero_stages(model: Any, cluster: Any, *, stages: Sequence[int] = (0, 1, 2, 3), workload: Any = None,
                **knobs: Any) -> list[dict[str, Any]]:
    """One layout (``knobs`` as for ``api.estimate``) under each ZeRO stage: memory parts and
    step time. Stages the runtime rejects for this layout are left out (e.g. ZeRO-2/3 with
    DeepSpeed's pipeline engine).

    >>> [r["zero_stage"] for r in zero_stages("llama-3-8b", api.load_cluster(nodes=1))]
    [0, 1, 2, 3]
    """
    spec = api.load_model(model)
    wl = workload if workload is not None else api.make_workload(spec, gpus=cluster.num_gpus)
    rows = []
    for z in stages:
        try:
            plan = api.estimate(spec, cluster, workload=wl, **{**knobs, "zero": z})
        except UserError:
            continue
        rows.append(api.record(plan))
    if not rows:
        raise UserError(f"no ZeRO stage in {list(stages)} can run the layout {knobs}; change the layout")
    return rows


# -- greedy vs optimal partition ------------------------------------------------------------


def block_seconds(model: Any, cluster: Any, workload: Any, cfg: Any) -> list[float]:
    """Seconds of one micro-batch (forward, backward, recompute, TP, EP and CP collectives) per
    block of ``model`` under ``cfg``: the cost the layer balancers balance."""
    from planner.cost.block_times import BlockTables
    from planner.cost.context import workload_device
    from planner.cost.parallel import RECOMPUTES

    tables = BlockTables(model, cluster, workload, workload_device(cluster, workload),
                         cfg.cp, cfg.cp_comm)
    table = tables.table(cfg.tp, int(cfg.sequence_parallel), cfg.ep, (cfg.micro_batch,))
    return table.total(RECOMPUTES.index(cfg.recompute), table.b_index(cfg.micro_batch)).tolist()


def partition_comparison(model: Any, cluster: Any, *, pp: int, workload: Any = None,
                         **knobs: Any) -> list[dict[str, Any]]:
    """Greedy and optimal layer partitions of one pipelined layout, stage by stage.

    Both balancers split the per-block costs (``block_seconds``), grouped into the search's
    pipeline units (each ViT or decoder layer with the small blocks before it), into ``pp x
    virtual stages`` contiguous ranges; the plan is then estimated with each partition, so the rows
    carry the cost model's per-stage micro-batch time and peak memory. One row per
    (balancer, stage): ``balancer``, ``stage``, ``blocks`` ("a-b"), ``decoder_layers``,
    ``stage_time_s``, ``peak_bytes``, ``bottleneck_s``, ``tokens_per_s``, ``fits``.

    >>> rows = partition_comparison("vl2", api.load_cluster(nodes=1), pp=4, ep=2)
    >>> sorted({r["balancer"] for r in rows})
    ['greedy', 'optimal']
    """
    from planner.search.partition import greedy_partition, optimal_partition
    from planner.search.splits import pipeline_units

    if pp < 2:
        raise UserError(f"pp: partition_comparison needs a pipeline (pp >= 2), got {pp}")
    spec = api.load_model(model)
    wl = workload if workload is not None else api.make_workload(spec, gpus=cluster.num_gpus)
    base = api.estimate(spec, cluster, workload=wl, pp=pp, **knobs)
    cfg = base.cfg
    stages = cfg.pp * cfg.virtual_stages
    costs = block_seconds(spec, cluster, wl, cfg)
    units = pipeline_units(spec)
    unit_costs = [sum(costs[a:b]) for a, b in units]
    rows = []
    for name, part in (("greedy", greedy_partition(unit_costs, stages)),
                       ("optimal", optimal_partition(unit_costs, stages))):
        bounds = [(units[a][0], units[b - 1][1]) for a, b in part.bounds]
        plan = api.estimate(spec, cluster, workload=wl, partition=bounds, pp=pp, **knobs)
        bottleneck = max(s.microbatch.total for s in plan.stages)
        for s in plan.stages:
            rows.append({"balancer": name, "stage": s.rank, "blocks": ",".join(f"{a}-{b}" for a, b in s.chunks),
                         "decoder_layers": s.decoder_layers, "block_kinds": dict(s.block_kinds),
                         "stage_time_s": s.microbatch.total, "peak_bytes": s.memory.peak,
                         "peak_gib": s.memory.peak / 2**30, "bottleneck_s": bottleneck,
                         "step_time_s": plan.step_time_s, "tokens_per_s": plan.tokens_per_s, "fits": plan.fits,
                         "label": api.label(api.record(plan))})
    return rows


# -- fabric what-if --------------------------------------------------------------------------

DEFAULT_FABRICS: tuple[dict[str, Any], ...] = (
    {"name": "HDR 200G, full fat-tree", "fabric": "hdr", "oversubscription": 1.0},
    {"name": "HDR 200G, 2:1 oversubscribed", "fabric": "hdr", "oversubscription": 2.0},
    {"name": "NDR 400G, full fat-tree", "fabric": "ndr", "oversubscription": 1.0},
    {"name": "NDR 400G, 2:1 oversubscribed", "fabric": "ndr", "oversubscription": 2.0},
)


def fabric_whatif(model: Any, hardware: Any = api.DEFAULT_HARDWARE, nodes: int = 32, *,
                  variants: Sequence[Mapping[str, Any]] = DEFAULT_FABRICS, workload: Any = None,
                  **constraints: Any) -> list[dict[str, Any]]:
    """The best plan on copies of ``hardware`` with another inter-node fabric.

    Each variant is ``api.with_fabric`` keywords plus a ``name``. Oversubscription only
    matters once the job spans more than one leaf switch, so use enough nodes (32 DGX
    A100s span two leaf blocks of a 40-port HDR fabric). Rows carry ``variant`` and the
    exposed time parts (``dp_comm_s``, ...).

    >>> [r["variant"] for r in fabric_whatif("llama-3-8b", nodes=2, variants=DEFAULT_FABRICS[:1])]
    ['HDR 200G, full fat-tree']
    """
    api.constraints(**constraints)  # unknown axis names fail here, not once per point
    spec = api.load_model(model)
    base = api.load_hardware(hardware)
    wl = workload if workload is not None else api.make_workload(spec, gpus=nodes * base.gpus_per_node)
    rows = []
    for v in variants:
        opts = {k: val for k, val in v.items() if k != "name"}
        profile = api.with_fabric(base, name=v.get("name"), **opts)
        cluster = api.load_cluster(profile, nodes)
        rows.append(_best_row(spec, cluster, wl, constraints) | {"variant": v.get("name", profile.name),
                                                                 "nic_gbit": profile.node.nics.speed_gbit,
                                                                 "oversubscription": profile.fabric.oversubscription})
    return rows


# -- images and tiles per sample -------------------------------------------------------------


def vision_load(model: Any, cluster: Any, *, images: Sequence[int] = (1, 2), tiles: Sequence[int] = (1, 4, 9),
                workload_options: Mapping[str, Any] | None = None, **constraints: Any) -> list[dict[str, Any]]:
    """The best plan as images per sample and tiles per image grow (vision-language models).

    Rows carry ``images_per_sample``, ``tiles_per_image``, ``vision_share`` (the vision
    tower's and projector's fraction of a sample's forward FLOPs) and the best plan's record.

    >>> rows = vision_load("vl2", api.load_cluster(nodes=1), images=[1], tiles=[1, 4])
    >>> [r["tiles_per_image"] for r in rows]
    [1, 4]
    """
    api.constraints(**constraints)  # unknown axis names fail here, not once per point
    spec = api.load_model(model)
    if spec.vision is None:
        raise UserError(f"{spec.name} has no vision tower; vision_load needs a vision-language model such as vl2")
    opts = dict(workload_options or {})
    rows = []
    for n_img in images:
        for n_tiles in tiles:
            wl = api.make_workload(spec, gpus=cluster.num_gpus, images_per_sample=n_img, tiles_per_image=n_tiles,
                                   **opts)
            row = _best_row(spec, cluster, wl, constraints)
            row.update(images_per_sample=n_img, tiles_per_image=n_tiles, vision_share=vision_share(spec, wl))
            rows.append(row)
    return rows


def vision_share(model: Any, workload: Any) -> float:
    """Fraction of one sample's forward FLOPs in the blocks before the text embedding
    (vision patch embedding, vision tower, its norm and the projector)."""
    from planner.cost.layers import layer_costs

    spec = api.load_model(model)
    kinds = [b.kind for b in spec.blocks]
    first_text = kinds.index("embedding") if "embedding" in kinds else 0
    costs = layer_costs(spec, workload)
    total = sum(c.fwd_flops for c in costs)
    return sum(c.fwd_flops for c in costs[:first_text]) / total if total else 0.0
