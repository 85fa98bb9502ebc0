"""Default pipeline partition for ``estimate``: contiguous ranges of ModelSpec blocks.

A partition is a list of ``pp * virtual_stages`` half-open ``(first, last_exclusive)`` ranges
over ``ModelSpec.blocks``, in model order. With interleaving (v > 1), pipeline rank r holds
the virtual stages r, r + p, r + 2p, ... (Megatron's model chunks).

The default is Megatron's: decoder layers split evenly, the embedding and any vision tower
and projector on the first stage, the final norm and the LM head on the last. When the layers
do not divide (70 layers on 12 stages), the remainder goes to the middle stages first, since
the first and last already carry the extra blocks. The search passes better partitions of its
own (planner/search/partition.py balances measured or modelled costs).
"""

from __future__ import annotations

from planner.errors import UserError, arg
from planner.model.spec import DecoderBlock, ModelSpec

Partition = list[tuple[int, int]]


def layer_counts(layers: int, stages: int) -> list[int]:
    """Decoder layers per stage: even, the remainder to the middle stages, then the ends."""
    if layers < stages:
        raise UserError(f"{layers} decoder layers cannot fill {stages} pipeline stages; lower {arg('pp')} x "
                        f"{arg('virtual_stages')}")
    base, rem = divmod(layers, stages)
    counts = [base] * stages
    order = list(range(1, stages - 1)) + [s for s in (stages - 1, 0) if s not in range(1, stages - 1)]
    order = list(dict.fromkeys(order))
    for s in order[:rem]:
        counts[s] += 1
    return counts


def default_partition(model: ModelSpec, stages: int) -> Partition:
    """Megatron-style contiguous partition of ``model.blocks`` into ``stages`` ranges."""
    blocks = model.blocks
    decoder_idx = [i for i, b in enumerate(blocks) if isinstance(b, DecoderBlock)]
    counts = layer_counts(len(decoder_idx), stages)
    bounds: Partition = []
    start = 0
    taken = 0
    for s, c in enumerate(counts):
        taken += c
        end = len(blocks) if s == stages - 1 else decoder_idx[taken - 1] + 1
        bounds.append((start, end))
        start = end
    return bounds


def check_partition(partition: Partition, blocks: int, stages: int) -> Partition:
    """A given partition must be ``stages`` contiguous, non-empty ranges covering every block."""
    parts = [(int(a), int(b)) for a, b in partition]
    if len(parts) != stages:
        raise UserError(f"the partition has {len(parts)} stages; the plan needs pp x virtual stages = {stages}")
    expected = 0
    for a, b in parts:
        if a != expected or b <= a:
            raise UserError(f"the partition {parts} must be contiguous non-empty [first, last) ranges starting at 0")
        expected = b
    if expected != blocks:
        raise UserError(f"the partition {parts} ends at block {expected}; the model has {blocks} blocks")
    return parts
