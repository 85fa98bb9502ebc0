"""HardwareProfile: one machine type and the fabric between machines.

Units live in field names: ``_GBps`` is gigabytes (1e9 bytes) per second per direction,
``_gbit`` gigabits per second per port, ``_us`` microseconds, ``_GiB`` 2**30 bytes,
``_TFLOPs`` 1e12 FLOP/s. The cost model converts to SI (bytes, seconds, FLOP/s) through the
properties at the bottom of each class. The schema is documented for users in
hardware_profiles/README.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner import limits
from planner.errors import UserError, arg

GiB = 2**30

# Every number of a profile is bounded (planner/limits.py says why each bound is where it is):
# a count of 2**64 NICs or a 1e300 GB/s link is a typo, refused at load, not a graph that never
# finishes building or an overflow deep in the cost model.
Rate = Annotated[float, Field(gt=0, le=limits.MAX_RATE)]  # GB/s, Gb/s, TFLOP/s
Latency = Annotated[float, Field(gt=0, le=limits.MAX_LATENCY_US)]  # microseconds
Memory = Annotated[float, Field(gt=0, le=limits.MAX_MEMORY_GIB)]  # GiB
PerNode = Annotated[int, Field(gt=0, le=limits.MAX_GPUS_PER_NODE)]  # GPUs, links: at most a node's GPUs


class _Strict(BaseModel):
    # allow_inf_nan=False: YAML's .inf / .nan are floats, and PositiveFloat takes .inf; refused
    # here, at load, as one message naming the field, not later deep inside the cost model.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def _empty_list() -> list:
    """An empty list, as a plain function for ``default_factory`` (keeps start-up short)."""
    return []


class GPU(_Strict):
    name: str
    vendor: Literal["nvidia", "amd", "cpu", "other"] = "nvidia"  # cpu: a CPU process per rank (cpu-local)
    memory_GiB: Memory
    peak_TFLOPs: dict[Literal["bf16", "fp16", "fp8", "fp4", "tf32", "fp32"], Rate]  # dense, no sparsity
    hbm_GBps: Rate
    # A copy into memory allocated for it (read + write bytes): a GPU's caching allocator hands back
    # memory already mapped, so None (= hbm_GBps); a CPU process's large allocation is fresh pages
    # that the copy faults in as it first touches them (dsplan profile measures it, cpu-local).
    alloc_copy_GBps: Rate | None = None
    # Largest fraction of peak a well-shaped bf16 GEMM reaches (MAMF; reference/
    # mamf_max_achievable_matmul_measured.csv). The cost model scales it down for small shapes.
    matmul_efficiency: float = Field(0.8, gt=0, le=1)
    # The same for the low-precision formats where it was measured (H100 fp8: 70.9%); a format
    # missing here takes matmul_efficiency (fp8: times efficiency.FP8_MAMF_RATIO, Hopper's measured ratio).
    matmul_efficiency_low: dict[Literal["fp8", "fp4"], Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=dict)
    # Where FlashAttention's head-dim curve levels off, as a fraction of peak (efficiency.
    # flash_efficiency); None: the GEMM's MAMF. Hopper sets it lower: FlashAttention-2 does
    # not use wgmma/TMA there and reaches 35% of H100 peak (Shah et al. 2024).
    flash_attention_efficiency: float | None = Field(None, gt=0, le=1)
    tdp_W: Annotated[float, Field(gt=0, le=1e6)] | None = None

    @property
    def memory_bytes(self) -> float:
        return self.memory_GiB * GiB

    def peak_flops(self, dtype: str) -> float:
        """Dense peak in FLOP/s for a dtype (fp16 and bf16 share a rate when only one is given)."""
        if dtype in self.peak_TFLOPs:
            return self.peak_TFLOPs[dtype] * 1e12  # type: ignore[index]
        for alias in ("bf16", "fp16"):
            if dtype in ("bf16", "fp16") and alias in self.peak_TFLOPs:
                return self.peak_TFLOPs[alias] * 1e12  # type: ignore[index]
        raise KeyError(f"{self.name} has no peak rate for {dtype}")


class IntraNode(_Strict):
    """How the GPUs of one node talk to each other."""

    kind: Literal["nvswitch", "nvlink_mesh", "pcie", "xgmi_mesh", "infinity_fabric"]
    bw_GBps: Rate  # per GPU, per direction, to the fabric (NVSwitch) or summed over links (mesh)
    latency_us: Latency = 2.0
    links_per_gpu: PerNode | None = None  # mesh fabrics: point-to-point links from each GPU
    nvls: bool = False  # NVLink SHARP in-switch reduction (H100/H200 NVSwitch gen 3)
    gpus_per_pcie_switch: PerNode | None = None  # pcie: GPUs sharing one PCIe switch
    # Measured bus bandwidth of an op as a share of the all-reduce's, where the collective library is
    # not NCCL (gloo on a cpu-local profile runs its all-gather and reduce-scatter well below its
    # all-reduce): written by dsplan profile; empty means NCCL, whose algorithms price each op.
    op_share: dict[Literal["reducescatter", "allgather"], Annotated[float, Field(gt=0, le=4)]] = Field(
        default_factory=dict)


class NIC(_Strict):
    count: int = Field(gt=0, le=limits.MAX_NICS_PER_NODE)  # NICs per node used for the compute fabric
    speed_gbit: Rate  # per NIC, per direction
    gpus_per_nic: PerNode = 1  # GPU affinity: GPUs behind the same PCIe switch as one NIC
    latency_us: Latency = 5.0
    gpudirect_rdma: bool = True
    # An all-to-all through these NICs: the cost of each peer's message (the transport's: verbs, or
    # libfabric for EFA) and the share of line rate kept with every rank receiving from every peer at
    # once. None: dsplan's defaults (nccl_algorithms.ALLTOALL_PEER_S, NET_EFFICIENCY), for a fabric
    # without a measured all-to-all.
    alltoall_peer_us: Latency | None = None
    alltoall_efficiency: float | None = Field(None, gt=0, le=1)

    @property
    def bw_bytes_per_s(self) -> float:
        return self.speed_gbit * 1e9 / 8


# The most GPUs one node may hold (planner/limits.py): the intra-node router prices every pair
# of a node's GPUs, so an absurd count (100000 for 1000) would run for hours instead of failing.
MAX_GPUS_PER_NODE = limits.MAX_GPUS_PER_NODE


class Node(_Strict):
    gpus: int = Field(gt=0, le=MAX_GPUS_PER_NODE)
    intra: IntraNode
    nics: NIC
    pcie_gen: Literal[3, 4, 5, 6] = 4
    pcie_GBps: Rate  # host <-> one GPU, per direction (offload traffic)
    # GPUs behind one uplink to the CPU (a PCIe switch's x16 port; DGX A100: four switches for eight
    # GPUs), which share it when they copy to or from host memory at once.
    gpus_per_host_link: int = Field(1, ge=1, le=MAX_GPUS_PER_NODE)
    host_memory_GiB: Memory
    cpu_cores: int = Field(128, gt=0, le=limits.MAX_CPU_CORES)
    cpu_adam_GBps: Rate = 20.0  # DeepSpeedCPUAdam parameter throughput per node (bytes of fp32 params/s)
    storage_GBps: Rate = 2.0  # local NVMe (checkpoints go to the shared filesystem: HardwareProfile.storage)
    # Nodes whose GPUs share one NVLink switch fabric (GB200 NVL72: 18 compute trays of 4 GPUs);
    # 1: the NVLink domain is the node. Collectives inside a domain are priced on NVLink, host
    # facts (memory, CPU, offload link) stay per node.
    nvlink_domain_nodes: int = Field(1, ge=1, le=MAX_GPUS_PER_NODE)

    @property
    def host_Bps(self) -> float:
        """Bytes per second each GPU moves to or from host memory while every GPU of the node does
        (offloaded states and activations, checkpoint copies): its link, or its share of an uplink."""
        return self.pcie_GBps * 1e9 / self.gpus_per_host_link


# The fabrics NCCL reaches over verbs (InfiniBand, RoCE): RDMA devices for k8s-job.yaml, NICs to
# count for preflight.sh.
RDMA_FABRICS = ("infiniband_hdr", "infiniband_ndr", "infiniband_xdr", "roce")


class Fabric(_Strict):
    """The network between nodes, modelled as a fat-tree (leaf and spine)."""

    kind: Literal["infiniband_hdr", "infiniband_ndr", "infiniband_xdr", "roce", "ethernet"]
    levels: Literal[1, 2, 3] = 2
    switch_radix: int = Field(40, ge=2, le=limits.MAX_SWITCH_RADIX)  # a leaf needs a port down and one up
    oversubscription: float = Field(1.0, ge=1.0, le=limits.MAX_OVERSUBSCRIPTION)  # leaf downlinks : uplinks
    rail_optimized: bool = True
    latency_us: Latency = 1.0  # per switch hop
    sharp: bool = False  # in-network reduction (IB SHARP)


class Storage(_Strict):
    """The shared filesystem checkpoints go to, as each node and the whole cluster reach it.

    Defaults: a GDS read "at over 40 GBps" per DGX H100 node over the storage fabric (NVIDIA DGX
    SuperPOD H100 reference architecture); writes at half that (an assumption: parallel
    filesystems write slower than they read, measure yours with fio or ior); Meta's Tectonic
    under Llama 3 "a sustainable throughput of 2 TB/s and a peak throughput of 7 TB/s" for 16,384
    GPUs (Dubey et al. 2024, Sec. 3.3.1), the cluster-wide caps."""

    write_GBps_per_node: Rate = 20.0
    read_GBps_per_node: Rate = 40.0
    aggregate_write_GBps: Rate = 2000.0
    aggregate_read_GBps: Rate = 7000.0


class Reliability(_Strict):
    """How often the job's parts fail and how long a restart takes, before the checkpoint is read.

    Defaults from Llama 3's 54-day pre-training snapshot on 16,384 H100s (Dubey et al. 2024, Sec.
    3.3.4): 419 unexpected interruptions, 58.7% of them GPU faults (GPU, HBM3, SRAM, GSP, NVLink):
    246 over 16,384 x 1,296 GPU-hours is one per 86,000 GPU-hours; the other 173 (host,
    network, software) over 2,048 nodes x 1,296 hours one per 15,300 node-hours. Together: one
    interruption per 3.1 hours for that job, as the paper reports ("every three hours")."""

    gpu_mtbf_hours: Annotated[float, Field(gt=0, le=1e9)] = 86_000.0
    node_mtbf_hours: Annotated[float, Field(gt=0, le=1e9)] = 15_300.0
    # Requeue, container start, process-group and NCCL set-up, data-loader warm-up: an assumed
    # 5 minutes (the checkpoint read is priced on its own, from Storage).
    restart_s: Annotated[float, Field(ge=0, le=86_400)] = 300.0


Factor = Annotated[float, Field(ge=limits.MIN_CALIBRATION_FACTOR, le=limits.MAX_CALIBRATION_FACTOR)]


class Calibration(_Strict):
    """The cost model's global efficiency factors, fitted to runs measured on this system
    (``dsplan calibrate``): multipliers on the achieved rates the published figures give, 1.0
    where nothing was fitted. One set per system, never per run (docs/accuracy.md)."""

    gemm: Factor = 1.0  # GEMM and attention-kernel rate (efficiency.GEMM_SUSTAINED x this)
    hbm: Factor = 1.0  # memory-bound kernels' bandwidth (efficiency.HBM_EFFICIENCY x this)
    network: Factor = 1.0  # collectives' bandwidth (nccl_algorithms.candidates)
    overlap: Annotated[float, Field(ge=0, le=1)] = 1.0  # share of the backward that hides data-parallel traffic
    fitted_on: list[str] = Field(default_factory=_empty_list)  # the runs the factors were fitted on

    @property
    def identity(self) -> bool:
        return (self.gemm, self.hbm, self.network, self.overlap) == (1.0, 1.0, 1.0, 1.0)


class HardwareProfile(_Strict):
    name: str
    description: str = ""
    gpu: GPU
    node: Node
    fabric: Fabric
    storage: Storage = Storage()
    reliability: Reliability = Reliability()
    calibration: Calibration = Calibration()
    sources: list[str] = Field(default_factory=_empty_list)

    @model_validator(mode="after")
    def _check(self) -> "HardwareProfile":
        count, gpus = self.node.nics.count, self.node.gpus
        if gpus % count and count % gpus:
            raise ValueError(f"node.nics.count ({count}) and node.gpus ({gpus}) must divide one another")
        domain = self.node.nvlink_domain_nodes
        if domain > 1 and self.node.intra.kind != "nvswitch":
            raise ValueError(f"node.nvlink_domain_nodes {domain} needs node.intra.kind nvswitch (a multi-node NVLink "
                             f"domain is an NVLink switch fabric), got {self.node.intra.kind}; set it to 1")
        if domain * gpus > MAX_GPUS_PER_NODE:
            raise ValueError(f"node.nvlink_domain_nodes {domain} x node.gpus {gpus} = {domain * gpus} GPUs in one "
                             f"NVLink domain, above the largest announced ({MAX_GPUS_PER_NODE}, NVIDIA's NVL576)")
        return self

    @property
    def gpus_per_node(self) -> int:
        return self.node.gpus

    def for_job(self, nodes: int) -> "HardwareProfile":
        """This profile as a job of ``nodes`` sees it: on a multi-node NVLink domain larger than one
        rack's worth of nodes, the job takes the same number of trays from each domain, the largest
        that divides ``nodes`` (a rack at most). NVIDIA's Megatron-Bridge launcher asks Slurm for
        exactly that (``--segment``, scripts/performance/utils/executors.py), and ``generate``'s
        SLURM script asks for it too, so no process group straddles a partial domain."""
        domain = self.node.nvlink_domain_nodes
        if nodes <= domain:
            return self
        segment = next(d for d in range(domain, 0, -1) if nodes % d == 0)
        return self.model_copy(update={"node": self.node.model_copy(update={"nvlink_domain_nodes": segment})})

    @property
    def nvlink_domain_gpus(self) -> int:
        """GPUs that reach each other over NVLink: the node's, times the nodes of its domain."""
        return self.node.gpus * self.node.nvlink_domain_nodes

    def with_gpus_per_node(self, gpus: int) -> "HardwareProfile":
        """This profile with ``gpus`` GPUs per node (the input ``gpus_per_node``). The NICs stay
        when the counts divide one another, else one per GPU."""
        if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS_PER_NODE:
            raise UserError(f"{arg('gpus_per_node')}: need a whole number from 1 to {MAX_GPUS_PER_NODE} "
                            f"(the largest NVLink domain), got {limits.shown(gpus)}")
        if gpus == self.node.gpus:
            return self
        nics = self.node.nics
        count = nics.count if (gpus % nics.count == 0 or nics.count % gpus == 0) else gpus
        node = self.node.model_copy(update={"gpus": gpus, "nics": nics.model_copy(update={"count": count})})
        return self.model_copy(update={"node": node})

    @property
    def nic_bw_per_gpu(self) -> float:
        """Inter-node bytes/s per GPU per direction when every GPU of a node sends at once."""
        n = self.node.nics
        return n.count * n.bw_bytes_per_s / self.node.gpus
