"""Candidates grouped by what their split and rank tables depend on.

A pipeline split depends on (tp, sp, ep, micro-batch, recompute, pp, virtual stages); a rank
table on those and on how the framework sends across stages and on dp (the ZeRO-3 rows). The
candidates sharing all of them (every ZeRO stage and offload of one layout) form one key, and
the search splits and tabulates once per key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from planner.cost import frameworks as fw
from planner.cost.parallel import FRAMEWORKS
from planner.search.space import Space

_WHOLE_VOCAB = np.array([not fw.traits(f).vocab_parallel for f in FRAMEWORKS])


class Key(NamedTuple):
    """What one key's candidates share (recompute and framework as index codes; ``sp`` the TP
    style, frameworks.TP_STYLES: 1 sequence parallel, 2 AutoTP's whole vocabulary)."""

    tp: int
    sp: int
    ep: int
    micro_batch: int
    recompute: int
    pp: int
    vs: int
    dp: int
    framework: int

    @property
    def group(self) -> tuple[int, int, int]:
        """The block-table group (tp, sp, ep)."""
        return (self.tp, self.sp, self.ep)

    @property
    def split(self) -> tuple[int, int, int, int, int, int, int]:
        """What the pipeline split depends on."""
        return (self.tp, self.sp, self.ep, self.micro_batch, self.recompute, self.pp, self.vs)


KEY_COLUMNS = Key._fields


@dataclass(frozen=True)
class KeyedSpace:
    """A space with its candidates grouped by ``Key``."""

    space: Space
    keys: np.ndarray  # [key, KEY_COLUMNS]
    inverse: np.ndarray  # candidate -> key
    micro: dict[tuple[int, int, int], tuple[int, ...]]  # micro-batch sizes per (tp, sp, ep)
    order: np.ndarray  # candidates sorted by key
    starts: np.ndarray  # order[starts[k]:starts[k + 1]] are the candidates of key k
    zero3: np.ndarray  # per key: whether any of its candidates uses ZeRO-3 (needs the per-block collectives)

    @property
    def columns(self) -> dict[str, np.ndarray]:
        return self.space.columns

    def key(self, g: int) -> Key:
        return Key._make(self.keys[g].tolist())

    def key_of(self, i: int) -> Key:
        """Candidate ``i``'s key."""
        return self.key(int(self.inverse[i]))

    def members(self, g: int) -> np.ndarray:
        """The candidates of key ``g``."""
        return self.order[self.starts[g]:self.starts[g + 1]]


def group_by_key(space: Space) -> KeyedSpace:
    """Group the candidates of ``space`` by key: one stable sort of a mixed-radix code per
    candidate (what np.unique does inside), whose order is also the candidates sorted by key."""
    c = space.columns
    style = fw.tp_styles(_WHOLE_VOCAB[c["framework"]], c["tp"], c["sp"])
    cols = [c["tp"], style, *(c[k] for k in ("ep", "micro_batch", "recompute", "pp", "vs", "dp", "framework"))]
    n = len(space)
    if not n:
        return KeyedSpace(space, np.zeros((0, len(cols)), dtype=np.int64), np.zeros(0, dtype=np.intp), {},
                          np.zeros(0, dtype=np.intp), np.zeros(1, dtype=np.int64), np.zeros(0, dtype=bool))
    # One int64 per row (mixed radix, Horner's scheme) so the grouping is a 1-D sort, not a row lexsort.
    digits = cols
    radix = [int(col.max()) + 1 for col in digits]
    if math.prod(radix) >= 2**63:  # a code would overflow (a million GPUs, a 2**24 batch): code each
        # column by its rank among its distinct values, which keeps the order and needs far fewer digits
        digits = [np.unique(col, return_inverse=True)[1].reshape(col.shape) for col in cols]
        radix = [int(col.max()) + 1 for col in digits]
    code = digits[0].astype(np.int64)
    for col, r in zip(digits[1:], radix[1:]):
        code *= r
        code += col
    order = np.argsort(code, kind="stable")
    new = np.empty(n, dtype=bool)
    new[0] = True
    sorted_code = code[order]
    np.not_equal(sorted_code[1:], sorted_code[:-1], out=new[1:])
    cuts = np.flatnonzero(new)
    inverse = np.empty(n, dtype=np.intp)
    inverse[order] = np.cumsum(new) - 1
    first = order[cuts]
    keys = np.stack([col[first] for col in cols], axis=1)
    # Keys are sorted by their code, whose leading digits are (tp, sp, ep): each group's keys
    # form one run, met in sorted order.
    group = sorted_code[cuts] // math.prod(radix[3:])
    runs = np.concatenate(([0], np.flatnonzero(np.diff(group)) + 1, [len(keys)]))
    micro = {tuple(int(x) for x in keys[a, :3]): tuple(sorted(set(keys[a:b, 3].tolist())))
             for a, b in zip(runs[:-1], runs[1:]) if b > a}
    starts = np.concatenate((cuts, [n]))
    zero3 = np.logical_or.reduceat((c["zero"] == 3)[order], cuts)
    return KeyedSpace(space, keys, inverse, micro, order, starts, zero3)
