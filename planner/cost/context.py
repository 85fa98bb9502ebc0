"""What the cost model reads besides the model and the candidates: the cluster, the workload
and the GPU's numbers, as one frozen value."""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost import frameworks as fw
from planner.cost.efficiency import Device, device
from planner.cost.layout import Layout, layout
from planner.cost.moe_dispatch import check_dispatcher
from planner.cost.parallel import FRAMEWORKS, Workload
from planner.hardware.cluster import Cluster


def workload_device(cluster: Cluster, workload: Workload) -> Device:
    """The GPU as this workload runs it: its precision, recipe and FlashAttention generation."""
    return device(cluster.profile, workload.precision, workload.recipe, workload.flash_version)


@dataclass(frozen=True)
class CostContext:
    cluster: Cluster
    workload: Workload
    dev: Device

    @classmethod
    def of(cls, cluster: Cluster, workload: Workload) -> "CostContext":
        check_dispatcher(workload.moe_dispatcher, cluster.profile)
        return cls(cluster, workload, workload_device(cluster, workload))

    def layout(self, tp: int, ep: int, dp: int, pp: int, rep: int = 1, etp: int | None = None) -> Layout:
        return layout(self.cluster, tp, ep, dp, pp, rep, etp)

    def grad_bytes(self, framework: int, zero: int = 0) -> int:
        """Bytes per gradient element on the wire: fp32 for fp32 training and for Megatron's
        fp32 main_grad buffer under bf16 (frameworks.Traits.fp32_grad_buffer), else 2.
        Megatron-FSDP (megatron, ZeRO-3) accumulates and reduces in the parameters' own dtype
        (--megatron-fsdp-main-grads-dtype and --megatron-fsdp-grad-comm-dtype default "auto");
        torchtitan's FSDP2 reduce-scatters fp32 (training.mixed_precision_reduce)."""
        precision = self.workload.precision
        name = FRAMEWORKS[framework]
        fp32_buffer = fw.traits(name).fp32_grad_buffer and not (zero == 3 and name == "megatron")
        return 4 if (precision == "fp32" or (fp32_buffer and precision == "bf16")) else 2
