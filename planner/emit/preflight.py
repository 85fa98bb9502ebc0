"""The expectations ``preflight.sh`` checks each node against, priced at generate time.

The bus bandwidths are dsplan's own prediction (planner/cost/collectives.py) for the group
nccl-tests runs over: the node's GPUs, and for a multi-node plan every GPU of the job, at the
sizes ``preflight.sh`` asks for (8 B .. 1 GiB, doubling). The node then compares what it
measures with what the plan was priced on, so a node that would make the plan slower than
predicted is caught before the job starts, not in its report.
"""

from __future__ import annotations

import json

from planner.cost.collectives import collective_time_for_size
from planner.emit.plan_file import PlanFile
from planner.hardware.cluster import Cluster
from planner.hardware.profile import RDMA_FABRICS, HardwareProfile
from planner.run.preflight_spec import BusbwPoint, Expectations, Gemm, Group

# The sizes preflight.sh runs nccl-tests over: -b 8 -e 1G -f 2 (1 GiB fits every GPU profiled
# and keeps a run under a minute: 8 ms per 1 GiB all-reduce on A100 x 25 iterations).
MIN_BYTES, MAX_BYTES = 8, 2**30
# nccl-tests binary -> the collective it times (nccl-tests src/all_reduce.cu, src/all_gather.cu)
OPS = {"all_reduce_perf": "allreduce", "all_gather_perf": "allgather"}


def _points(cluster: Cluster, op: str, ranks: int) -> list[BusbwPoint]:
    out, size = [], MIN_BYTES
    while size <= MAX_BYTES:
        cost = collective_time_for_size(cluster, op, ranks, size)
        out.append(BusbwPoint(size_bytes=size, busbw_GBps=round(cost.busbw_GBps, 3), algorithm=cost.algorithm))
        size *= 2
    return out


def _group(cluster: Cluster, name: str, ranks: int, nodes: int) -> Group:
    ops = {binary: _points(cluster, op, ranks) for binary, op in OPS.items()} if ranks > 1 else {}
    return Group(name=name, ranks=ranks, nodes=nodes, ops=ops)  # type: ignore[arg-type]


def preflight_expectations(plan: PlanFile, profile: HardwareProfile, title: str) -> Expectations:
    """What every node of ``plan`` should show: GPUs, memory, NICs, GEMM rate, bus bandwidth."""
    job_profile = profile.with_gpus_per_node(plan.gpus_per_node)
    cluster = Cluster.build(job_profile, plan.nodes)
    gpn = plan.gpus_per_node
    groups = [_group(cluster, "node", gpn, 1)]
    if plan.nodes > 1:
        groups.append(_group(cluster, "job", gpn * plan.nodes, plan.nodes))
    gpu = profile.gpu
    return Expectations(
        plan=title, profile=profile.name, vendor=gpu.vendor, gpu_name=gpu.name, nodes=plan.nodes,
        gpus_per_node=gpn, gpu_memory_GiB=gpu.memory_GiB, nics=job_profile.node.nics.count,
        rdma=profile.fabric.kind in RDMA_FABRICS, fabric=profile.fabric.kind,
        gemm=Gemm(peak_TFLOPs=gpu.peak_flops("bf16") / 1e12, matmul_efficiency=gpu.matmul_efficiency),
        groups=groups,
    )


def preflight_json(plan: PlanFile, profile: HardwareProfile, title: str) -> str:
    return json.dumps(preflight_expectations(plan, profile, title).model_dump(mode="json"), indent=2) + "\n"
