"""Context parallelism: what splitting each sample's sequence over ``cp`` ranks costs and needs.

Every block sees seq_len / cp tokens of a sample (layers.layer_costs), and attention reads the
whole context, causally balanced so each rank does 1/cp of its work (Megatron-Core hands a rank
chunks i and 2cp - 1 - i of 2cp; layer_cost.AttnCore.context). What the ranks exchange per
attention, as ``ParallelConfig.cp_comm`` chooses (Megatron-Core ``--cp-comm-type``,
Transformer Engine's context-parallel attention):

- ``p2p``: a ring. In each of cp steps a rank attends to the K/V chunk it holds while passing
  it on; cp - 1 steps send (K, V) forward, and backward passes (K, V) and their gradients
  (twice the bytes). A step's transfer hides under that step's attention (1/cp of it): only the
  excess shows.
- ``a2a``: all-to-alls over heads (DeepSpeed Ulysses, Megatron "a2a"): Q, K and V before the
  attention and the output after it, each rank then attending with heads / cp over the whole
  sequence; backward mirrors them. Nothing overlaps them.
- ``a2a+p2p``: a2a among the CP ranks on one node, a p2p ring among the node groups
  (Megatron's ``--hierarchical-context-parallel-sizes``, which dsplan sets to that split).

Ranks are laid out TP innermost, then CP (Megatron's tp-cp-ep-dp-pp order), so a CP group
stays inside a node when tp x cp fits in it. Context-parallel ranks hold the same weights, so
dense gradients reduce and ZeRO shards over dp x cp ranks (ParallelConfig.dp_ranks).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from planner.cost.collectives import collective_time_array
from planner.errors import UserError, arg
from planner.hardware.cluster import Cluster
from planner.hardware.placement import GroupShape, strided_shape


class CpGroups(NamedTuple):
    """The process groups one TP width's context-parallel attention talks over: the ring
    (``ring_size`` ranks) and the all-to-all (``a2a_size`` ranks); a size 1 has nothing."""

    ring: GroupShape
    a2a: GroupShape

    @property
    def ring_size(self) -> int:
        return self.ring.size

    @property
    def a2a_size(self) -> int:
        return self.a2a.size


def cp_groups(cluster: Cluster, tp: int, cp: int, comm: str) -> CpGroups:
    """The ring and all-to-all groups of ``comm`` for CP groups of ``cp`` ranks ``tp`` apart."""
    one = strided_shape(cluster, 1, 1, "cp")
    whole = strided_shape(cluster, tp, cp, "cp")
    if cp == 1:
        return CpGroups(one, one)
    if comm == "p2p":
        return CpGroups(whole, one)
    if comm == "a2a":
        return CpGroups(one, whole)
    inner = whole.ranks_per_node  # a2a among a node's CP ranks, the ring across nodes
    return CpGroups(strided_shape(cluster, tp * inner, cp // inner, "cp"), strided_shape(cluster, tp, inner, "cp"))


def cp_seconds(cluster: Cluster, groups: CpGroups, kv: np.ndarray, qkv: np.ndarray, out: np.ndarray,
               attn_f: np.ndarray, attn_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exposed seconds of context-parallel attention forward and backward, elementwise over
    [micro-batch, block] arrays: ``kv`` the bytes of a ring step's K/V chunk, ``qkv`` and
    ``out`` of the all-to-alls before and after the attention, ``attn_f`` / ``attn_b`` the
    attention core's seconds (which a ring step's transfer hides under, 1/ring of them a step)."""
    fwd, bwd = np.zeros_like(attn_f), np.zeros_like(attn_b)
    n = groups.ring_size
    if n > 1:
        steps = float(n - 1)
        fwd = fwd + steps * np.maximum(0.0, collective_time_array(cluster, "p2p", groups.ring, kv) - attn_f / n)
        bwd = bwd + steps * np.maximum(0.0, collective_time_array(cluster, "p2p", groups.ring, 2.0 * kv) - attn_b / n)
    if groups.a2a_size > 1:
        a2a = (collective_time_array(cluster, "alltoall", groups.a2a, qkv)
               + collective_time_array(cluster, "alltoall", groups.a2a, out))
        fwd, bwd = fwd + a2a, bwd + a2a
    return fwd, bwd


def check_context_parallel(*, cp: int, comm: str, seq_len: int, heads: int, kv_heads: int, tp: int,
                           a2a_ranks: int, flash_attention: bool, is_vlm: bool) -> None:
    """The rules context parallelism needs of the sequence, the heads and the kernels: one
    UserError naming the input and the fix. ``a2a_ranks``: the ranks the all-to-all splits
    heads over (CpGroups.a2a_size)."""
    if cp == 1:
        return
    c = arg("cp")
    if is_vlm:
        raise UserError(f"{c} {cp}: context parallelism is not modelled for vision-language models (the vision "
                        f"tower's tokens are not split); use {c} 1")
    if not flash_attention:
        raise UserError(f"{c} {cp} needs fused (flash) attention: Transformer Engine's context-parallel attention "
                        f"is built on it; use {arg('flash_attention')} or {c} 1")
    chunks = cp if comm == "a2a" else 2 * cp  # the ring's causal balancing cuts 2 x cp chunks
    if seq_len % chunks:
        raise UserError(f"{arg('seq_len')} {seq_len} does not split into {chunks} equal chunks for {c} {cp} "
                        f"({arg('cp_comm')} {comm}); pick a sequence length divisible by {chunks} or another {c}")
    for what, n in (("attention heads", heads), ("KV heads", kv_heads)):
        if a2a_ranks > 1 and n % (tp * a2a_ranks):
            raise UserError(f"{c} {cp} with {arg('cp_comm')} {comm} splits the {n} {what} over {arg('tp')} {tp} x "
                            f"{a2a_ranks} all-to-all ranks, which does not divide them; use {arg('cp_comm')} p2p "
                            f"or a smaller {c}")
