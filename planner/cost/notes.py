"""Notes on a plan: what limits it that no other layout of the same batch would fix.

Pure functions over a plan's JSON (``Plan.to_json()``, a plan.json, a suggest row), so the
search (the best plan), ``estimate`` and the run directory's README all say the same thing.
"""

from __future__ import annotations

import math

from planner.errors import Message, arg

# The share of the step past which a plan gets a note: beyond it the batch, not the
# layout, is what holds the step back.
NOTE_SHARE = 0.25
# The share the note's batch brings it under.
NOTE_TARGET = 0.2


def batch_notes(plan: dict, tokens_per_sample: int) -> list[Message]:
    """What limits ``plan`` that no layout of this batch can fix, and what would.

    Two parts of a step do not grow with the micro-batches per step (m): the pipeline bubble
    (1F1B: pp - 1 idle slots against m + pp - 1; v interleaved chunks divide it by v) and the
    data-parallel traffic left exposed after the last micro-batch's backward (not ZeRO-3's,
    which gathers every layer for each micro-batch). With few micro-batches they dominate.
    Each note names a global batch (micro_batch x dp x m', m' a whole multiple of today's m,
    so every layout that divides today's batch divides it) that brings its part under a fifth
    of the step for this layout. Each note is a Message: the batch it names is the input
    ``global_batch``, which the CLI spells as its flag."""
    out = []
    t, step = plan["time"], plan["step_time_s"]
    pp, vs, m = plan["pp"], plan.get("virtual_stages", 1), plan["grad_accum"]
    if step <= 0:
        return out
    per_sample = plan["micro_batch"] * plan["dp"]

    def batch(need: int) -> str:
        gb = per_sample * need
        return (f"{arg('global_batch')} {gb} ({gb * tokens_per_sample / 1e6:.1f}M tokens) gives this layout {need} "
                "micro-batches")

    runs = f"{m} micro-batch{'es' if m != 1 else ''} per step"
    bubble = t.get("pp_bubble_s", 0.0)
    if pp > 1 and bubble / step > NOTE_SHARE:
        # (pp - 1) / (v m' + pp - 1) <= 1/5 at m' = 4 (pp - 1) / v; interleaved, m' divisible
        # by pp keeps Megatron's default micro-batch group, which holds the fewest activations
        # (memory.microbatch_group).
        unit = math.lcm(m, pp) if vs > 1 else m
        need = math.ceil(math.ceil(4 * (pp - 1) / vs) / unit) * unit
        line = (f"the pipeline bubble is {bubble / step:.0%} of the step: each pipeline runs {runs} over {pp} "
                "stages, so the batch, not the layout, holds it back")
        if need > m:
            line += f"; {batch(need)} and a bubble under 20% (re-run with it: more activations stay in flight)"
        out.append(Message(line))
    dp = t.get("dp_comm_s", 0.0)
    # Under ZeRO-3 the exposed traffic is per micro-batch (every layer's weights are gathered
    # for each one), so it grows with m like compute and no batch hides it.
    if dp / step > NOTE_SHARE and plan.get("zero_stage") != 3:
        # What grows with m: every per-micro-batch part; what does not: the bubble, the
        # optimizer step and the exposed DP traffic itself. dp / (fixed + k grows) <= 1/5.
        grows = sum(t.get(k, 0.0) for k in ("compute_s", "recompute_s", "tp_comm_s", "ep_comm_s", "pp_comm_s",
                                               "cp_comm_s"))
        fixed = step - grows
        k = max(2, math.ceil((dp / NOTE_TARGET - fixed) / grows)) if grows > 0 else 0
        line = (f"exposed data-parallel communication is {dp / step:.0%} of the step: each rank runs {runs}, "
                "so the gradient reduction hides behind too little backward")
        if k:
            line += f"; {batch(k * m)} and brings it under 20% of the step (re-run with it)"
        out.append(Message(line))
    return out
