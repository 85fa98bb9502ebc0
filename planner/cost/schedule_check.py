"""Megatron's pipeline schedule replayed over one plan's own chunks: where the closed form is off.

The cost model prices a pipeline as m x T_w + (S - T_w) / v (step_time.pipeline: T_w the
slowest rank's micro-batch over all its chunks, S the sum over ranks). That is exact for equal
chunks. The balancer spreads chunks evenly (packing._even_ends), and on the benchmarked
plans the replay is then within 1% (benchmarks/bench_pipeline_schedule.py), but uneven
chunks (a user's --stage-blocks: llama-3-70b's pp 4 x v 5 with 1- to 5-layer chunks replays
3.5% slower) and interleaved plans with few micro-batches (llama-3.1-70b, 8 on pp 8 x v 2:
5.5% faster) still part from it. Replaying Megatron's op order
(planner/cost/schedule_replay.py) costs O(pp x v x m) Python steps, too slow for every
candidate of a search but cheap for the plan a user is shown, so ``suggest``'s best plan,
``estimate`` and the run directory's README say when the replay disagrees.
"""

from __future__ import annotations

import numpy as np

from planner.cost import dualpipe
from planner.cost.block_times import BlockTables
from planner.cost.context import workload_device
from planner.cost.frameworks import tp_style
from planner.cost.memory import microbatch_group
from planner.cost.parallel import RECOMPUTES, ParallelConfig, Workload
from planner.cost.schedule_replay import replay
from planner.cost.step_time import pipeline
from planner.hardware.cluster import Cluster
from planner.model.spec import ModelSpec

# The replay walks every op; schedules of more ops (2 x pp x v x m) are not checked (a 405b
# plan has 4,096).
MAX_REPLAY_OPS = 40_000
# The share of the step past which the replay's difference gets a note.
NOTE_GAP = 0.01


def chunk_times(tables: BlockTables, cfg: ParallelConfig, partition: list[tuple[int, int]],
                vshape: bool = False) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """Per rank and chunk on it (model chunk k runs on rank k mod pp as its chunk k // pp; under
    DualPipeV, ``vshape``, chunks r and 2 pp - 1 - r), one micro-batch's forward, backward and
    weight-gradient GEMM seconds from the block tables: backward with recomputation, TP, EP and
    CP traffic split evenly between the two."""
    table = tables.table(cfg.tp, tp_style(cfg.framework, cfg.tp, cfg.sequence_parallel), cfg.ep, (cfg.micro_batch,))
    bi, mode = table.b_index(cfg.micro_batch), RECOMPUTES.index(cfg.recompute)
    comm = (table.tp[mode, bi] + table.ep[mode, bi] + table.cp[mode, bi]) / 2
    blocks = (table.fwd[bi] + comm, table.bwd[bi] + table.rc[mode, bi] + comm, table.wg[bi])
    out = [[[0.0] * cfg.virtual_stages for _ in range(cfg.pp)] for _ in blocks]
    ranks = dualpipe.chunk_ranks(cfg.pp) if vshape else [k % cfg.pp for k in range(len(partition))]
    for k, (a, e) in enumerate(partition):
        for per_rank, block in zip(out, blocks):
            per_rank[ranks[k]][k // cfg.pp] = float(np.sum(block[a:e]))
    return out[0], out[1], out[2]


def formula_and_replay(tables: BlockTables, cfg: ParallelConfig,
                       partition: list[tuple[int, int]]) -> tuple[float, float] | None:
    """(closed-form, replayed) seconds of the pipeline's compute and bubble over the same chunk
    times, sends free; None without a pipeline or past MAX_REPLAY_OPS."""
    out = _replayed(tables, cfg, partition)
    return None if out is None else out[:2]


def _replayed(tables: BlockTables, cfg: ParallelConfig,
              partition: list[tuple[int, int]]) -> tuple[float, float, list[float]] | None:
    """``formula_and_replay`` and every chunk's forward-plus-backward seconds."""
    pp, v, m = cfg.pp, cfg.virtual_stages, cfg.grad_accum
    vshape = tables.runs.workload.pp_schedule == "dualpipev"
    if pp == 1 or 2 * pp * v * m > MAX_REPLAY_OPS or len(partition) != pp * v or (v > 1 and m < pp and not vshape):
        return None  # Megatron's interleaved order needs m >= pp (PyTorch's runs fewer: not replayed)
    fwd, bwd, wgrad = chunk_times(tables, cfg, partition, vshape)
    totals = np.array([[sum(f) + sum(b) for f, b in zip(fwd, bwd)]])
    worst, bubble = pipeline(totals, np.array([pp]), np.array([float(v)]))  # the model's own formula
    if vshape:
        bubble = dualpipe.bubble(*(np.array([[sum(x) for x in t]]) for t in (fwd, bwd, wgrad)), worst, np.array([pp]))
        replayed = dualpipe.replay(pp, m, fwd, bwd, wgrad)[0]
    else:
        replayed = replay(pp, v, m, microbatch_group(pp, m) if v > 1 else pp, fwd, bwd)[0]
    chunks = [f + b for fr, br in zip(fwd, bwd) for f, b in zip(fr, br)]
    return m * float(totals[0, worst[0]]) + float(bubble[0]), replayed, chunks


def schedule_notes(tables: BlockTables, cfg: ParallelConfig, partition: list[tuple[int, int]],
                   step_s: float) -> list[str]:
    """A note when Megatron's interleaved schedule, replayed over this plan's chunks, differs
    from the pipeline formula by more than NOTE_GAP of the step. Only interleaved plans: on
    1F1B the formula is within 0.5% of the replay on every benchmarked plan."""
    if cfg.virtual_stages == 1 or step_s <= 0:
        return []
    out = _replayed(tables, cfg, partition)
    if out is None:
        return []
    formula, replayed, chunks = out
    gap = replayed - formula
    if abs(gap) <= NOTE_GAP * step_s:
        return []
    if gap > 0:
        why = ("uneven chunks stall the schedule, which the formula does not see; an even split or fewer virtual "
               "stages may run faster")
    else:
        why = "unequal ranks overlap more with few micro-batches than the formula assumes"
    name = ("DualPipeV" if tables.runs.workload.pp_schedule == "dualpipev" and cfg.pp > 1
            else "Megatron's interleaved schedule")
    return [f"{name}, replayed op by op over this plan's {len(chunks)} chunks "
            f"({min(chunks) * 1e3:.0f}-{max(chunks) * 1e3:.0f} ms each per micro-batch), takes {abs(gap):.3g} s "
            f"{'more' if gap > 0 else 'less'} than the pipeline formula: {gap / step_s:+.1%} on the predicted "
            f"step ({why})"]


def plan_schedule_notes(model: ModelSpec, cluster: Cluster, workload: Workload, cfg: ParallelConfig,
                        partition: list[tuple[int, int]], step_s: float) -> list[str]:
    """``schedule_notes`` of one plan, with the block tables of its own configuration."""
    if cfg.virtual_stages == 1:
        return []
    tables = BlockTables(model, cluster, workload, workload_device(cluster, workload),
                         cfg.cp, cfg.cp_comm)
    return schedule_notes(tables, cfg, partition, step_s)
