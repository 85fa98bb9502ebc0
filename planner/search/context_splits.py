"""The context-parallel splits a search tries: each (cp, cp_comm) is searched on its own and
the plans ranked together (suggest.py), as the precisions are.

Pinned (``Constraints.cp`` / ``cp_comm``): those, each checked (context_parallel.py: one
UserError for a value that can never hold). Left open: cp 1, and cp = 2, 4, 8, ... while a rank
keeps at least ``MIN_TOKENS_PER_RANK`` tokens of its sample, each with the ring (p2p, which only
Megatron-Core runs) and the all-to-all (a2a, every runtime's). Shorter slices leave the ring's
per-step K/V transfer less attention to hide under and the GEMMs smaller; NVIDIA's tuned
Megatron-Bridge recipes use CP 2 at 8,192 tokens and none below
(reference/megatron_bridge_25.11_pretrain.csv). The hierarchical a2a+p2p is tried when pinned.
"""

from __future__ import annotations

from planner.cost.context_parallel import check_context_parallel
from planner.errors import UserError, arg
from planner.model.spec import ModelSpec
from planner.search.space import Constraints

MIN_TOKENS_PER_RANK = 2048
DEFAULT_COMMS = ("p2p", "a2a")


def context_splits(cons: Constraints, model: ModelSpec, seq_len: int, flash_attention: bool,
                   gpus: int) -> list[tuple[int, str]]:
    """The (cp, cp_comm) pairs to search on ``gpus`` GPUs, cp 1 first when it is among them."""
    comms = cons.cp_comm or DEFAULT_COMMS
    if cons.framework is not None and "megatron" not in cons.framework:  # only Megatron-Core runs the ring
        comms = tuple(c for c in comms if c == "a2a") or comms
    if cons.cp is not None:
        bad = [cp for cp in cons.cp if gpus % cp]
        if bad:
            raise UserError(f"{arg('cp')} {','.join(map(str, bad))} cannot divide the {gpus} GPUs; pick a divisor "
                            f"of {gpus}")
        pairs = [(cp, comm) for cp in cons.cp for comm in ((comms[0],) if cp == 1 else comms)]
        for cp, comm in pairs:  # a pinned value that can never hold: its own error
            check_context_parallel(cp=cp, comm=comm, seq_len=seq_len, heads=model.attention_heads,
                                   kv_heads=model.kv_heads, tp=1, a2a_ranks=1 if comm == "p2p" else cp,
                                   flash_attention=flash_attention, is_vlm=model.is_vlm)
        return list(dict.fromkeys(pairs))
    pairs = [(1, "p2p")]
    if model.is_vlm or not flash_attention:
        return pairs
    cp = 2
    while seq_len // cp >= MIN_TOKENS_PER_RANK and seq_len % (2 * cp) == 0 and gpus % cp == 0:
        for comm in comms:
            heads_ok = comm == "p2p" or (model.attention_heads % cp == 0 and model.kv_heads % cp == 0)
            if comm != "a2a+p2p" and heads_ok:
                pairs.append((cp, comm))
        cp *= 2
    return pairs
