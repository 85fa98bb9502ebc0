"""NCCL (and torch.distributed) environment for the hardware profile's fabric.

The run directory's ``nccl.env`` exports each variable only when the user has not set it
already, so a site's own settings win. Values come from the profile (fabric kind, GPUDirect
RDMA, NVLink SHARP) or from the user (HCA list, socket interface) and are checked against a
conservative character set before they are written into a shell file.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

from planner.cost.paid import runs_ep_overlap
from planner.emit.plan_file import PlanFile
from planner.emit.resilience import TIMEOUT_MARGIN, collective_timeout_s
from planner.errors import UserError
from planner.hardware.profile import HardwareProfile

_SAFE_VALUE = re.compile(r"[A-Za-z0-9_.,:^=/+-]+")


class EnvVar(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    value: str
    why: str


def check_env_value(value: str, source: str) -> str:
    if not _SAFE_VALUE.fullmatch(value):
        raise UserError(
            f"{source}: {value!r} has characters that are not allowed in an environment value; "
            "use letters, digits and _ . , : ^ = / + -"
        )
    return value


def nccl_env(
    profile: HardwareProfile,
    plan: PlanFile,
    *,
    ib_hca: str | None = None,
    socket_ifname: str | None = None,
) -> list[EnvVar]:
    """The variables for ``nccl.env``, in the order they are written."""
    fabric = profile.fabric.kind
    nics = profile.node.nics
    env: list[EnvVar] = []

    def add(name: str, value: str, why: str) -> None:
        env.append(EnvVar(name=name, value=value, why=why))

    ifname = check_env_value(socket_ifname, "--socket-ifname") if socket_ifname else "^lo,docker"
    add("NCCL_SOCKET_IFNAME", ifname, "interfaces for NCCL's bootstrap and socket transport ('^' excludes prefixes)")
    if fabric == "ethernet":
        add("NCCL_IB_DISABLE", "1", "plain Ethernet fabric: no verbs devices, use sockets")
    else:
        add("NCCL_IB_DISABLE", "0", f"{fabric} fabric: use the verbs (IB/RoCE) transport")
        hca = check_env_value(ib_hca, "--ib-hca") if ib_hca else "mlx5"
        add(
            "NCCL_IB_HCA",
            hca,
            f"HCAs for the compute fabric ({nics.count} per node in the profile); a prefix matches every port, "
            "list the compute HCAs (e.g. mlx5_0,mlx5_1) when storage HCAs share the prefix",
        )
        # 4.096 us x 2^22 ~ 17 s before a verbs retry: survives fabric congestion at scale.
        add("NCCL_IB_TIMEOUT", "22", "verbs timeout exponent (4.096 us x 2^22 per retry)")
        add("NCCL_IB_RETRY_CNT", "7", "verbs retries before NCCL reports a network error")
        if fabric == "roce":
            add("NCCL_IB_GID_INDEX", "3", "RoCE v2 over IPv4 uses GID index 3 on ConnectX NICs")
        if nics.gpudirect_rdma:
            # PXB, not PIX: on DGX/HGX boards the GPU and its NIC meet behind a PCIe switch
            # hierarchy (nvidia-smi topo -m shows PXB); PIX would turn GPUDirect RDMA off there.
            add("NCCL_NET_GDR_LEVEL", "PXB", "GPUDirect RDMA between a GPU and a NIC behind the same PCIe switches")
        else:
            add("NCCL_NET_GDR_LEVEL", "LOC", "the profile has no GPUDirect RDMA: stage through host memory")
    if profile.node.intra.nvls:
        add("NCCL_NVLS_ENABLE", "1", "NVLink SHARP in-switch reductions (NVSwitch gen 3)")
    if plan.framework == "megatron" and plan.zero_stage == 3:
        # Megatron-LM asserts Megatron-FSDP runs with more than one queue (arguments.py), so its
        # prefetched all-gathers and reduce-scatters run beside compute; 32 is CUDA's most.
        add("CUDA_DEVICE_MAX_CONNECTIONS", "32", "Megatron-FSDP overlaps its collectives on several hardware queues")
    elif runs_ep_overlap(plan.framework, plan.ep, plan.pp, plan.virtual_stages, plan.recompute, plan.ep_comm_overlap):
        # the combined 1F1B's all-to-alls run on their own stream beside the other micro-batch's compute
        add("CUDA_DEVICE_MAX_CONNECTIONS", "32", "Megatron's expert all-to-all overlap runs on its own hardware queue")
    elif plan.framework != "deepspeed" and (plan.tp > 1 or plan.cp > 1):
        # Megatron-LM orders TP / CP communication and compute on one stream queue; it asserts this.
        add("CUDA_DEVICE_MAX_CONNECTIONS", "1", "Megatron tensor/context parallel overlap needs one hardware queue")
    threads = host_threads(profile, plan)
    if threads:
        add("OMP_NUM_THREADS", str(threads),
            f"the CPU optimizer's threads per rank: the node's {profile.node.cpu_cores} "
            f"cores over its {plan.gpus_per_node} ranks (torchrun would give each rank 1)")
    env += _torch_distributed_env(plan)
    add("NCCL_DEBUG", "WARN", "NCCL prints warnings and errors only (INFO when debugging)")
    return env


def _torch_distributed_env(plan: PlanFile) -> list[EnvVar]:
    """How a failed or stuck collective ends the job, and how long one may wait (resilience.py)."""
    return [EnvVar(name=n, value=v, why=w) for n, v, w in (
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "a failed or timed-out collective aborts the job instead of hanging"),
        ("TORCH_NCCL_BLOCKING_WAIT", "0", "the watchdog times collectives out without blocking the host on each "
         "(blocking wait would serialise the CPU with every kernel)"),
        ("DSPLAN_COLLECTIVE_TIMEOUT_S", str(collective_timeout_s(plan)),
         f"the process groups' timeout: {TIMEOUT_MARGIN} x the longest wait the plan predicts (a step, a "
         "synchronous save's barrier, a restore), at least PyTorch's 600 s (dsplan's trainer; Megatron-LM gets "
         "--distributed-timeout-minutes, torchtitan comm.train_timeout_seconds)"),
        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000", "PyTorch's NCCL flight recorder keeps the last 2000 collectives"),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", "a timed-out collective dumps the flight recorder (which rank was late)"),
    )]


def host_threads(profile: HardwareProfile, plan: PlanFile) -> int | None:
    """OpenMP threads per rank for a plan that steps its optimizer on the host, else None.

    DeepSpeedCPUAdam and torch's fused CPU AdamW are OpenMP loops, and the cost model prices
    them at the whole node's rate (profile ``cpu_adam_GBps``), so each of a node's ranks gets
    its share of the cores. torchrun sets OMP_NUM_THREADS=1 for every rank unless it is set
    already (torch/distributed/run.py), which would leave the host step ~cores/GPUs slower
    than planned; the DeepSpeed launcher sets it only with --bind_cores_to_rank."""
    if plan.offload == "none":
        return None
    return max(1, profile.node.cpu_cores // plan.gpus_per_node)
