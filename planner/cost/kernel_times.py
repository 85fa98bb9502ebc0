"""Per-block kernel seconds over many micro-batch sizes at once: each block's GEMMs and its
attention core, priced with planner/cost/efficiency.py's kernels (block_times.py adds the
memory-bound work and the collectives)."""

from __future__ import annotations

import numpy as np

from planner.cost import efficiency as eff
from planner.cost.layer_cost import LayerCost


def attention_seconds(costs: list[LayerCost], bs: np.ndarray, dev: eff.Device) -> tuple[np.ndarray, np.ndarray]:
    """[b, block] attention-core seconds forward and backward (step_time.attention_time over many b).

    FlashAttention blocks sharing a head dim and causality go through one ``flash_time`` call
    per direction; both directions come from one walk over the blocks.
    """
    out = np.zeros((len(bs), len(costs)))
    back = np.zeros_like(out)
    flash: dict[tuple[int, bool], list[int]] = {}
    for j, c in enumerate(costs):
        a = c.attn
        if a is None or a.seqs == 0 or a.seq == 0:
            continue
        if a.flash:
            flash.setdefault((a.qk_dim, a.causal), []).append(j)
        else:
            batch = a.heads * a.seqs * bs
            fwd = eff.gemm_time(a.seq, a.seq, a.qk_dim, dev, batch) + eff.gemm_time(a.seq, a.v_dim, a.seq, dev, batch)
            out[:, j] = fwd
            back[:, j] = 2.0 * fwd
    for (qk, causal), idx in flash.items():
        flops = np.array([costs[j].attn.flops for j in idx])[None, :] * bs[:, None]  # type: ignore[union-attr]
        out[:, idx] = eff.flash_time(flops, qk, causal, dev, False)
        back[:, idx] = eff.flash_time(flops, qk, causal, dev, True)
    return out, back


def gemm_seconds(costs: list[LayerCost], bs: np.ndarray, dev: eff.Device, which: str = "gemms") -> np.ndarray:
    """[b, block] seconds of every block's GEMMs (``which``: another tuple of a block's GEMMs) at
    each micro-batch size."""
    rows = [(j, g.tokens, g.n, g.k, g.batch, g.low) for j, c in enumerate(costs)
            for g in (c.rerun.gemms if which == "rerun_gemms" else getattr(c, which))]
    out = np.zeros((len(bs), len(costs)))
    if not rows:
        return out
    idx, tokens, n, k, batch, low = (np.array(col, dtype=float) for col in zip(*rows))
    m = tokens[None, :] * bs[:, None]
    t = eff.gemm_time(m, n[None, :], k[None, :], dev, batch[None, :])
    if dev.low is not None and low.any():  # the recipe's GEMMs at its format's rate and operand bytes
        t = np.where(low[None, :] > 0, eff.gemm_time(m, n[None, :], k[None, :], dev.low, batch[None, :],
                                                     dev.low_bytes), t)
    # Per (micro-batch, block) cell, its GEMMs summed in order: one bincount for every size.
    at = (np.arange(len(bs))[:, None] * len(costs) + idx.astype(np.int64)[None, :]).ravel()
    return np.bincount(at, weights=t.ravel(), minlength=out.size).reshape(out.shape)
