"""The one builder of a ParallelConfig from what a user gave, and the one default global batch.

``ParallelConfig`` (parallel.py) checks the rules among its own fields when it is built; this
is where the inputs a user leaves out are filled and the degrees are checked against the
cluster, the same way for the CLI, the Python API, ``suggest`` and ``generate`` (in the spirit
of torchtitan's ParallelDims, whose data-parallel degree left at -1 takes the rest of the
world):

- dp fills the cluster: GPUs / (tp x pp), and dp x tp x pp must be the GPU count;
- the ZeRO stage is 1 (DeepSpeed ZeRO-1, Megatron's distributed optimizer) when dp > 1, else 0;
- accumulation is global batch / (micro-batch x dp), which must divide evenly;
- the global batch, when not given, is ``default_global_batch``: about 4M tokens per step,
  rounded for the search so that many data-parallel sizes of the cluster divide it, and for
  one plan so that its micro-batch x dp divides it with at least pp micro-batches per step.

Every failure is one UserError naming the input (planner/errors.py ``arg``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from planner.cost.parallel import ParallelConfig, replicates_evenly
from planner.errors import UserError, arg, whole_number

if TYPE_CHECKING:
    from planner.hardware.cluster import Cluster

# ~4M tokens per optimizer step: Llama 2 and Llama 3 pre-training (Touvron et al. 2023, sec. 2.2;
# Dubey et al. 2024, sec. 3.4.1).
TARGET_TOKENS_PER_STEP = 4e6


def default_global_batch(seq_len: int, world: int, target_tokens: float = TARGET_TOKENS_PER_STEP, *,
                         unit: int = 1, min_microbatches: int = 1) -> int:
    """About ``target_tokens`` per step: a multiple of ``unit`` samples (a plan's micro-batch x
    dp: what one accumulation step takes), at least ``min_microbatches`` of them (a pipeline's
    pp, so every stage has work).

    Among such batches within 0.75x-1.5x of the target, take the one sharing the largest
    factor with the GPU count ``world`` (so every DP size that divides the GPUs divides it),
    then the one with the most factors of two (more micro-batch choices), then the closest.
    When no multiple of ``unit`` lies in that window, the smallest one allowed above it.
    With ``unit`` 1 and one micro-batch this is the search's default."""
    target = max(1, round(target_tokens / seq_len))
    lo, hi = max(1, int(target * 0.75)), max(1, int(target * 1.5))
    first = max(min_microbatches, -(-lo // unit))  # units in the smallest batch allowed
    last = max(first, hi // unit)

    def key(units: int) -> tuple[int, int, int]:
        b = units * unit
        twos = (b & -b).bit_length() - 1
        return (math.gcd(b, world), twos, -abs(b - target))

    return unit * int(max(range(first, last + 1), key=key))


def check_world(cluster: "Cluster", dp: int, tp: int, pp: int, cp: int = 1) -> None:
    """dp x tp x pp (x cp) must be the cluster's GPU count."""
    world = cluster.num_gpus
    if dp * tp * pp * cp != world:
        names, values = ("dp x tp x pp", f"{dp} x {tp} x {pp}") if cp == 1 else (
            "dp x tp x pp x cp", f"{dp} x {tp} x {pp} x {cp}")
        raise UserError(f"{names} = {values} = {dp * tp * pp * cp} but the cluster has {world} GPUs "
                        f"({cluster.nodes} nodes x {cluster.gpus_per_node}); make the degrees multiply to {world}")


def data_parallel(cluster: "Cluster", tp: int, pp: int, dp: int | None = None, cp: int = 1) -> int:
    """``dp``, or when it is None the GPUs / (tp x pp x cp) that fill the cluster; checked."""
    world = cluster.num_gpus
    if dp is None:
        if world % (tp * pp * cp):
            shown = f"{arg('tp')} {tp} x {arg('pp')} {pp}" + (f" x {arg('cp')} {cp}" if cp > 1 else "")
            raise UserError(f"{shown} = {tp * pp * cp} does not divide the {world} GPUs "
                            f"({cluster.nodes} nodes x {cluster.gpus_per_node}); pick degrees whose product divides "
                            f"{world}")
        dp = world // (tp * pp * cp)
    check_world(cluster, whole_number("dp", dp), tp, pp, cp)
    return dp


def grad_accum_for(global_batch: int, micro_batch: int, dp: int) -> int:
    """Micro-batches per step per DP rank; UserError unless the batch divides evenly."""
    if global_batch % (micro_batch * dp):
        raise UserError(
            f"{arg('global_batch')} {global_batch} is not divisible by {arg('micro_batch')} {micro_batch} x dp {dp} = "
            f"{micro_batch * dp}; pick a global batch that is a multiple of {micro_batch * dp}")
    return global_batch // (micro_batch * dp)


def build_parallel_config(cluster: "Cluster", *, global_batch: int | None = None, seq_len: int | None = None,
                          tp: int = 1, pp: int = 1, dp: int | None = None, ep: int = 1, zero: int | None = None,
                          offload: str = "none", micro_batch: int = 1, recompute: str = "none",
                          sequence_parallel: bool = False, virtual_stages: int = 1,
                          framework: str = "deepspeed", cp: int = 1, cp_comm: str = "p2p",
                          dp_replicate: int = 1, etp: int | None = None, activation_offload: int = 0) -> ParallelConfig:
    """The ParallelConfig of the given degrees on ``cluster``, defaults filled (module
    docstring): dp, the ZeRO stage, accumulation, and, when ``global_batch`` is None, the
    batch of ``default_global_batch`` for ``seq_len`` tokens per sample (read
    ``samples_per_step`` for it). Each broken rule is one UserError."""
    from pydantic import ValidationError

    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp), ("micro_batch", micro_batch),
                        ("virtual_stages", virtual_stages), ("dp_replicate", dp_replicate)):
        whole_number(name, value)
    if isinstance(activation_offload, bool) or not isinstance(activation_offload, int) or activation_offload < 0:
        raise UserError(f"{arg('activation_offload')}: a count of decoder layers (0 or more), got "
                        f"{activation_offload!r}")
    if etp is not None and whole_number("etp", etp) not in (1, tp):
        raise UserError(f"{arg('etp')} {etp}: the experts' tensor parallelism is 1 (folded into expert parallelism) "
                        f"or the attention's {arg('tp')} {tp}; pick 1 or {tp}")
    fold = tp // (tp if etp is None else etp)
    if zero is not None and (isinstance(zero, bool) or zero not in (0, 1, 2, 3)):
        raise UserError(f"{arg('zero')}: stages are 0, 1, 2 or 3, got {zero!r}")
    dp = data_parallel(cluster, tp, pp, dp, cp)
    if global_batch is None:
        if seq_len is None:
            raise TypeError("build_parallel_config: give global_batch or seq_len (for the default batch)")
        global_batch = default_global_batch(seq_len, cluster.num_gpus, unit=micro_batch * dp, min_microbatches=pp)
    grad_accum = grad_accum_for(whole_number("global_batch", global_batch), micro_batch, dp)
    if ep >= 1 and (dp * cp * fold) % ep == 0 and not replicates_evenly(dp, cp, ep, dp_replicate, fold):
        raise UserError(f"{arg('dp_replicate')} {dp_replicate}: hybrid sharding needs it to divide {arg('dp')} {dp} "
                        f"and the expert replicas ({dp * cp * fold // ep}), leaving at least 2 ranks per sharding "
                        f"group; pick a divisor of {math.gcd(dp, dp * cp * fold // ep)} that does, or 1")
    try:
        zero = (1 if dp * cp > 1 else 0) if zero is None else zero
        return ParallelConfig(dp=dp, tp=tp, pp=pp, ep=ep, zero_stage=zero,
                              offload=offload, micro_batch=micro_batch, grad_accum=grad_accum, recompute=recompute,
                              sequence_parallel=sequence_parallel, virtual_stages=virtual_stages,
                              framework=framework, cp=cp, cp_comm=cp_comm,  # type: ignore[arg-type]
                              dp_replicate=dp_replicate, etp=etp, activation_offload=activation_offload)
    except ValidationError as err:
        raise UserError(rule_message("plan", err)) from None


def rule_message(what: str, err: Exception) -> str:
    """The broken rules of a ParallelConfig/Workload ValidationError, without pydantic's framing."""
    parts = []
    for item in err.errors():  # type: ignore[attr-defined]
        msg = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
        loc = ".".join(str(x) for x in item.get("loc", ()))
        parts.append(f"{loc}: {msg}" if loc else msg)
    return f"invalid {what}: " + "; ".join(parts)
