"""DualPipeV, DeepSeek's bidirectional pipeline schedule folded into a V: what it runs, where its
bubble goes, what it holds, what it hides.

DualPipe (DeepSeek-V3 technical report, arXiv:2412.19437 Sec 3.2.1) feeds micro-batches from both
ends of the pipeline and overlaps one micro-batch's forward with another's backward, so the
expert all-to-all of each hides under the other's compute. DualPipeV (deepseek-ai/DualPipe, the
"cut-in-half" variant) keeps one copy of the weights: the model is cut into 2 pp chunks and rank
r holds chunks r and 2 pp - 1 - r (a V: the first leg runs down the ranks, the second back up;
rank 0 holds the embedding and the head). PyTorch's ``ScheduleDualPipeV`` (torch 2.13
``distributed/pipelining/schedules.py``) builds the op order ``rank_ops`` restates, and
torchtitan 0.2.2 runs it (``pipeline_parallel_schedule = "DualPipeV"``), with its EP overlap
(``pipeline_parallel_expert_parallel_overlap``, distributed/dual_pipe_v.py: the forward and the
backward of an overlapped pair on two threads, one computing while the other communicates) only
without activation checkpointing. It needs m >= 2 pp micro-batches and eager stage modules
(``_check_torch_compile_compatibility`` refuses compiled ones).

Per rank, with F, B (whole backward) and W (the weight-gradient GEMMs alone) one chunk's seconds:

- the bubble: DeepSeek's (pp - 1)(F&B + B - 3W) with the overlapped pair F&B run as F + B,
  never below (pp - 1) 2F (the warm-up's forwards alone). ``replay`` walks the op order; over
  F, B, W drawn at random (tests/test_dualpipe.py) the closed form is within 2.5% of the
  replayed step at m = 2 pp + 1 and closer as m grows;
- the activations: at its peak rank r holds 2 pp - 1 - r micro-batches of its first chunk and
  r + 1 of its second (the last rank one more of its first): about pp micro-batches of its
  whole stage, as 1F1B's rank 0 does;
- the overlap: ``2m - 3pp + r + 1`` of rank r's 2m chunk-forwards run beside a backward (one fewer
  on the last rank, whose first pair is split to shorten the bubble).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# numpy is imported where it is used: the CLI reads SCHEDULES while it builds its options.
SCHEDULES = ("1f1b", "dualpipev")  # Workload.pp_schedule: looped (1F1B, interleaved by vs) or the V
TORCH_NAME = "DualPipeV"  # torch get_schedule_class's name, torchtitan's pipeline_parallel_schedule

# An op of one rank: ("F" | "B" | "I" | "W", local chunk 0 or 1, micro-batch), or ("FB", (chunk,
# micro-batch) forward, (chunk, micro-batch) backward) for an overlapped pair. "B" is a whole
# backward, "I" its input-gradient part, "W" the weight-gradient part an "I" left for later.
Op = tuple


def chunk_ranks(pp: int) -> list[int]:
    """The rank of each of the 2 pp model chunks: down the ranks, then back up."""
    return list(range(pp)) + list(range(pp - 1, -1, -1))


def rank_chunks(parts: list, pp: int, vs: int, schedule: str, rank: int) -> list:
    """Rank ``rank``'s chunks of a split in model order: every pp-th from its own (looped), or
    chunks r and 2 pp - 1 - r under DualPipeV."""
    if schedule == "dualpipev" and vs == 2 and pp > 1:
        return [parts[rank], parts[2 * pp - 1 - rank]]
    return parts[rank::pp]


def min_microbatches(pp: int) -> int:
    """ScheduleDualPipeV refuses fewer micro-batches than stages (2 pp)."""
    return 2 * pp


def rank_ops(rank: int, pp: int, m: int) -> list[Op]:
    """Rank ``rank``'s ops in ScheduleDualPipeV's order (its eight steps: forwards of the first
    chunk, both chunks' forwards, zero-bubble I/W of the second, the overlapped main phase, the
    second chunk's backwards beside overlapped pairs, both chunks' backwards turning into I's half
    way, then the deferred W's)."""
    ops: list[Op] = []
    done: dict[tuple[int, str], int] = {}
    deferred: list[tuple[int, int]] = []

    def take(c: int, kind: str) -> int:
        done[c, kind] = done.get((c, kind), 0) + 1
        return done[c, kind] - 1

    def fwd(c: int) -> None:
        ops.append(("F", c, take(c, "F")))

    def bwd(c: int, split: bool = False) -> None:
        mb = take(c, "B")
        ops.append(("I" if split else "B", c, mb))
        if split:
            deferred.append((c, mb))

    def weight() -> None:
        if deferred:
            ops.append(("W", *deferred.pop(0)))

    def pair(f: int, b: int) -> None:
        ops.append(("FB", (f, take(f, "F")), (b, take(b, "B"))))
    last = rank == pp - 1
    for _ in range(2 * (pp - rank - 1)):
        fwd(0)
    for _ in range(rank + 1):
        fwd(0)
        fwd(1)
    for _ in range(pp - rank - 1):
        bwd(1, split=True)
        weight()
        fwd(1)
    for i in range(m - 2 * pp + rank + 1):
        if i == 0 and last:
            fwd(0)
            bwd(1)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(pp - rank - 1):
        bwd(1)
        pair(1, 0)
    split, half = False, (rank + 1) // 2
    for i in range(rank + 1):
        split = split or (i == half and rank % 2 == 1)
        bwd(1, split)
        split = split or (i == half and rank % 2 == 0)
        bwd(0, split)
    for _ in range(pp - rank - 1):
        weight()
        bwd(0, split)
    for _ in range(rank + 1):
        weight()
    return ops


def replay(pp: int, m: int, fwd: Sequence[Sequence[float]], bwd: Sequence[Sequence[float]],
           wgrad: Sequence[Sequence[float]]) -> tuple[float, list[tuple[int, int]]]:
    """(step seconds, per rank its peak held (first-chunk, second-chunk) micro-batches) of the
    schedule over each rank's chunk times (``fwd[r][c]``, whole backward ``bwd[r][c]``, its
    weight-gradient part ``wgrad[r][c]``; local chunk 0 is model chunk r, 1 is 2 pp - 1 - r).
    An op starts when its rank is free and its inputs exist; sends are free; an overlapped pair
    takes F + B. RuntimeError if the order deadlocks."""
    model = [(r, 0) for r in range(pp)] + [(r, 1) for r in range(pp - 1, -1, -1)]
    index = {rc: k for k, rc in enumerate(model)}
    rows = [rank_ops(r, pp, m) for r in range(pp)]
    finish: dict[tuple[str, int, int], float] = {}
    at, free = [0] * pp, [0.0] * pp
    held = [[0, 0] for _ in range(pp)]
    peak = [(0, 0)] * pp
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            while at[r] < len(rows[r]):
                step = _op_step(rows[r][at[r]], r, pp, index, fwd, bwd, wgrad)
                needs, seconds, outs, change = step
                if any(d not in finish for d in needs):
                    break
                free[r] = max([free[r], *(finish[d] for d in needs)]) + seconds
                finish.update((o, free[r]) for o in outs)
                for c, delta in change:
                    held[r][c] += delta
                if sum(held[r]) > sum(peak[r]):
                    peak[r] = (held[r][0], held[r][1])
                at[r] += 1
                moved = True
    if any(at[r] < len(rows[r]) for r in range(pp)):
        raise RuntimeError(f"DualPipeV order deadlocks (pp {pp}, {m} micro-batches)")
    return max(free), peak


def _op_step(op: Op, r: int, pp: int, index: dict, fwd, bwd, wgrad):
    """(inputs, seconds, outputs, held-activation changes) of one op of rank r."""
    last = 2 * pp - 1

    def needs_f(k: int, mb: int) -> list:
        return [("F", k - 1, mb)] if k > 0 else []

    def needs_b(k: int, mb: int) -> list:
        return [("F", k, mb)] + ([("I", k + 1, mb)] if k < last else [])

    if op[0] == "FB":
        (cf, mf), (cb, mb) = op[1], op[2]
        kf, kb = index[r, cf], index[r, cb]
        return (needs_f(kf, mf) + needs_b(kb, mb), fwd[r][cf] + bwd[r][cb],
                [("F", kf, mf), ("I", kb, mb), ("W", kb, mb)], [(cf, 1), (cb, -1)])
    kind, c, mb = op
    k = index[r, c]
    if kind == "F":
        return needs_f(k, mb), fwd[r][c], [("F", k, mb)], [(c, 1)]
    if kind == "B":
        return needs_b(k, mb), bwd[r][c], [("I", k, mb), ("W", k, mb)], [(c, -1)]
    if kind == "I":
        return needs_b(k, mb), bwd[r][c] - wgrad[r][c], [("I", k, mb)], []
    return [("I", k, mb)], wgrad[r][c], [("W", k, mb)], [(c, -1)]


def held(rank, pp):
    """Micro-batches of (first, second) chunk activations rank ``rank`` holds at its peak (arrays
    broadcast): 2 pp - 1 - r and r + 1, the last rank one more of its first."""
    return 2 * pp - 1 - rank + (rank == pp - 1), rank + 1


def inflight(rank, pp, stored, stored_second):
    """In-flight micro-batches in units of the rank's whole stage (memory.activation_bytes' unit):
    ``held`` weighted by the two chunks' stored bytes (``stored`` the rank's, ``stored_second`` its
    second chunk's)."""
    import numpy as np

    first, second = held(rank, pp)
    whole = np.maximum(stored, 1e-30)
    return np.where(stored > 0, (first * (stored - stored_second) + second * stored_second) / whole,
                    (first + second) / 2.0)


def merged_share(rank, pp, m):
    """The share of rank ``rank``'s chunk passes that run as an overlapped forward-backward pair."""
    import numpy as np

    pairs = 2 * m - 3 * pp + rank + 1 - (rank == pp - 1)
    return np.clip(pairs / (2.0 * m), 0.0, 1.0)


def bubble(fwd: np.ndarray, bwd: np.ndarray, wgrad: np.ndarray, worst: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Per candidate the bubble over [candidate x rank] arrays of each rank's micro-batch seconds
    forward, backward (all of it) and weight-gradient GEMMs over both chunks: per rank but the
    slowest, one chunk's max(2F, F + 2B - 3W) (the module docstring), zero past ``depth``."""
    import numpy as np

    f, b, w = fwd / 2.0, bwd / 2.0, wgrad / 2.0
    per_rank = np.maximum(2.0 * f, f + 2.0 * b - 3.0 * w)
    ranks = np.arange(per_rank.shape[1])[None, :]
    keep = (ranks < depth[:, None]) & (ranks != worst[:, None])
    return np.where(keep, per_rank, 0.0).sum(axis=1)
