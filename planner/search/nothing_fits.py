"""When no plan fits: the relaxations worth trying, and the message that names the closest plan."""

from __future__ import annotations

from dataclasses import replace

from planner.cost.memory import host_capacity_bytes
from planner.cost.parallel import Workload
from planner.cost.plan import Plan
from planner.errors import arg, marked
from planner.hardware.profile import HardwareProfile
from planner.search.space import Constraints


def describe(p: dict) -> str:
    """dp8 tp4 pp2 z1 mb2x16 — the short name of a plan in messages."""
    extra = f" ep{p['ep']}" + ("-etp1" if p.get("etp", p["tp"]) < p["tp"] else "") if p.get("ep", 1) > 1 else ""
    extra += f" cp{p['cp']}" + ("" if p.get("cp_comm", "p2p") == "p2p" else f"-{p['cp_comm']}") \
        if p.get("cp", 1) > 1 else ""
    vs = f" v{p['virtual_stages']}" if p.get("virtual_stages", 1) > 1 else ""
    vs = " dualpipev" if p.get("pp_schedule") == "dualpipev" and p["pp"] > 1 else vs
    off = f" offload-{p['offload']}" if p.get("offload", "none") != "none" else ""
    sp = " sp" if p.get("sequence_parallel") else ""
    rep = f"-hsdp{p['dp_replicate']}" if p.get("dp_replicate", 1) > 1 else ""
    rep += f"-zeropp-{'-'.join(p['zero_pp'])}" if p.get("zero_pp") else ""
    return (f"{p['framework']} dp{p['dp']} tp{p['tp']}{sp} pp{p['pp']}{vs}{extra} zero{p['zero_stage']}{rep}{off} "
            f"mb{p['micro_batch']}x{p['grad_accum']} recompute-{p['recompute']}"
            + (f" act-offload{p['activation_offload']}" if p.get("activation_offload") else ""))


def relaxations(nodes: int, workload: Workload, cons: Constraints) -> list[tuple[str, int, Constraints]]:
    """What to try when nothing fits, in the order advice names them: (label, nodes,
    constraints). The caller keeps those under which some plan fits; of the larger clusters
    only the first that fits. Labels name the inputs to change with ``arg``."""
    recompute, micro_batch, offload, zero, framework = (arg(n) for n in ("recompute", "micro_batch", "offload", "zero",
                                                                          "framework"))
    tries: list[tuple[str, Constraints]] = []
    if cons.recompute is not None and "full" not in cons.recompute:
        tries.append((f"full recomputation ({recompute} full)", replace(cons, recompute=("full",))))
    if cons.micro_batch is not None and 1 not in cons.micro_batch:
        tries.append((f"micro-batch 1 ({micro_batch} 1)", replace(cons, micro_batch=(1,))))
    # Offload steps Adam on the host (never sgd); Megatron-Core offloads only in bf16.
    megatron_only = cons.framework == ("megatron",)
    megatron_offloads = workload.precision == "bf16"
    no_offload = (cons.offload is not None and "optimizer" not in cons.offload) or cons.zero == (0,) or \
        (megatron_only and not megatron_offloads)
    if no_offload and workload.optimizer != "sgd":
        if megatron_only and not megatron_offloads:
            tries.append((f"optimizer offload on DeepSpeed ({offload} optimizer {framework} deepspeed)",
                          replace(cons, offload=("optimizer",), zero=None, framework=None)))
        else:
            tries.append((f"optimizer offload ({offload} optimizer)", replace(cons, offload=("optimizer",), zero=None)))
    if (cons.zero is not None and 3 not in cons.zero) or megatron_only:
        # Megatron has no ZeRO-3: a megatron pin gives way to DeepSpeed, and the advice says so.
        on_ds, fw_flag, fws = (" on DeepSpeed", f" {framework} deepspeed", ("deepspeed",)) if megatron_only else \
            ("", "", cons.framework)
        tries.append((f"ZeRO-3{on_ds} ({zero} 3{fw_flag})", replace(cons, zero=(3,), framework=fws)))
        tries.append((f"ZeRO-3 with optimizer offload{on_ds} ({zero} 3 {offload} optimizer{fw_flag})",
                      replace(cons, zero=(3,), offload=("optimizer",), framework=fws)))
    if any(v is not None for v in (cons.dp, cons.tp, cons.pp, cons.ep, cons.framework, cons.virtual_stages)):
        tries.append(("letting dp/tp/pp/ep/framework vary (drop those pins)",
                      replace(cons, dp=None, tp=None, pp=None, ep=None, framework=None, virtual_stages=None)))
    out = [(label, nodes, c) for label, c in tries]
    for factor in (2, 4, 8, 16):
        more = nodes * factor
        out.append((f"{more} nodes ({arg('nodes')} {more})", more, replace(cons, dp=None)))
    return out


def nothing_fits_message(evaluated: int, out_of_memory: int, closest: Plan | None, advice: list[str],
                         profile: HardwareProfile) -> str:
    """One message: the capacity, how many candidates ran out of memory, the closest plan and what would fit."""
    cap = profile.gpu.memory_bytes
    gib = 2**30
    host = host_capacity_bytes(profile.node.host_memory_GiB) / 2**40
    lines = [f"no plan fits in {cap / gib:.0f} GiB per GPU and {host:.2f} TiB of usable host memory per node "
             f"({evaluated} candidates evaluated, "
             f"{out_of_memory} out of memory)."]
    if closest is not None:
        p = closest
        m = p.memory
        parts = (f"weights {m.weights / gib:.1f}, grads {m.grads / gib:.1f}, optimizer {m.optimizer / gib:.1f}, "
                 f"activations {m.activations / gib:.1f} GiB")
        if m.peak > cap:
            lines.append(f"closest: {describe(p.to_json())} needs {m.peak / gib:.1f} GiB on pipeline rank "
                         f"{p.worst_stage.rank}, {(m.peak - cap) / gib:.1f} GiB short ({parts}).")
        else:  # fits on the GPU; its offloaded states overflow the host
            short = (p.cpu_bytes_per_node - p.host_capacity_bytes) / 2**40
            lines.append(f"closest: {describe(p.to_json())} fits on the GPU ({m.peak / gib:.1f} GiB) "
                         f"but {p.why_not()}: "
                         f"{short:.2f} TiB short per node.")
    if advice:
        lines.append("would fit with: " + "; or ".join(marked(a) for a in advice) + ".")
    else:
        lines.append(_untried(closest))
    return " ".join(lines)


def _untried(closest: Plan | None) -> str:
    """The generic ways to save memory, less those the closest plan already takes (a hint to
    recompute in full is no help when the closest plan does)."""
    c = closest.cfg if closest is not None else None
    hints = ["more nodes"]
    for taken, hint in ((c is not None and c.offload != "none", f"{arg('offload')} optimizer"),
                        (c is not None and c.recompute == "full", f"{arg('recompute')} full"),
                        (c is not None and c.zero_stage == 3,  # Megatron-FSDP runs without a pipeline
                         f"{arg('zero')} 3" + (f" {arg('pp')} 1" if c and c.framework == "megatron" and c.pp > 1
                                                else "")),
                        (c is not None and c.micro_batch == 1, f"{arg('micro_batch')} 1")):
        if not taken:
            hints.append(hint)
    return "try " + (", ".join(hints[:-1]) + " or " + hints[-1] if len(hints) > 1 else hints[0]) + "."
