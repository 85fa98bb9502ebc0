"""Layer-partition balancers: greedy follows its rule, optimal is exact (vs brute force)."""

from __future__ import annotations

import random

import pytest

from planner.search.partition import (
    StageMemory,
    balance,
    fits_within,
    greedy_partition,
    optimal_partition,
)
from tests.partition_oracle import brute_force_partition


def vl2_like_costs() -> list[float]:
    """Hand-made DeepSeek-VL2-like per-layer times (ms): ViT tower, projector, dense, MoE.

    27 SigLIP blocks at 729 tokens per tile x 3 tiles are cheap per layer, the projector is
    tiny, the first decoder layer is dense (wide FFN), the 29 MoE layers are the bulk, and the
    last one carries the 129k-vocabulary head.
    """
    vit = [1.9] * 27
    projector = [0.4]
    dense = [6.1]
    moe = [4.3] * 29
    moe[-1] += 5.2  # LM head on the last layer
    return vit + projector + dense + moe


def test_greedy_follows_its_rule_on_a_hand_example() -> None:
    # total 12, 3 stages, target 4: [3] + 1 -> 4 ok, + 2 -> 6 > 4 closes; [2, 2] -> 4; [4]
    part = greedy_partition([3, 1, 2, 2, 4], 3)
    assert part.counts == (2, 2, 1)
    assert part.stage_costs == (4.0, 4.0, 4.0)


def test_greedy_spreads_equal_layers_evenly() -> None:
    # Llama 3.1 405B's 126 equal layers on 32 stages: the target moves to what is left over
    # the stages left (123/31, then 120/30 = 4), so no stage gets the shortfall of the others.
    part = greedy_partition([1.0] * 126, 32)
    assert part.counts == (3, 3) + (4,) * 30
    assert part.bottleneck == optimal_partition([1.0] * 126, 32).bottleneck == 4.0


def test_greedy_keeps_one_layer_per_stage() -> None:
    part = greedy_partition([1, 1, 1, 1, 1, 100], 4)
    # The heavy last layer never passes the target before the end: the rule forces closes
    # so that each of the last three stages still gets one layer.
    assert part.counts == (3, 1, 1, 1)


def test_optimal_beats_or_equals_greedy_on_vl2_like_costs() -> None:
    costs = vl2_like_costs()
    for stages in (2, 3, 4, 6, 8, 12, 16):
        g = greedy_partition(costs, stages)
        o = optimal_partition(costs, stages)
        assert o.bottleneck <= g.bottleneck + 1e-12
        assert sum(o.counts) == len(costs) and len(o.counts) == stages
    # Where it matters: at 8 stages greedy is strictly worse on this profile.
    assert optimal_partition(costs, 8).bottleneck < greedy_partition(costs, 8).bottleneck


def test_optimal_bottleneck_on_vl2_like_costs_is_the_known_value() -> None:
    costs = vl2_like_costs()
    total = sum(costs)
    o = optimal_partition(costs, 4)
    bf = brute_force_partition(costs, 4)
    assert bf is not None
    assert o.bottleneck == pytest.approx(bf.bottleneck, rel=1e-12)
    assert o.bottleneck >= total / 4


@pytest.mark.parametrize("seed", range(25))
def test_optimal_is_exact_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(3, 11)
    stages = rng.randint(1, min(n, 5))
    costs = [rng.choice([0.5, 1.0, 2.0, 3.5, 7.0]) * rng.uniform(0.8, 1.2) for _ in range(n)]
    o = optimal_partition(costs, stages)
    bf = brute_force_partition(costs, stages)
    assert bf is not None
    assert o.bottleneck == pytest.approx(bf.bottleneck, rel=1e-12)
    assert greedy_partition(costs, stages).bottleneck >= bf.bottleneck - 1e-12


def test_optimal_spreads_the_slack_evenly_over_the_stages() -> None:
    """Of the splits with the optimal bottleneck, the balancer takes the most even one: a
    Llama-like model (embedding, 80 equal decoders, a heavier head) in 20 chunks gets chunks
    of four decoders and one of five, not fifteen of five and crumbs of one or two at the end,
    which Megatron's interleaved schedule runs 3.5% slower than its formula
    (test_schedule_check.py). Every stage still meets the optimal bottleneck."""
    costs = [0.02] + [0.3] * 80 + [0.33]
    o = optimal_partition(costs, 20)
    assert o.bottleneck == pytest.approx(1.5)  # four decoders and the head (1.53) do not fit under it
    assert sorted(o.counts)[1] >= 4 and max(o.counts) == 5  # nothing under four decoders but the head's chunk
    assert max(o.stage_costs) - min(o.stage_costs) <= 0.3 + 1e-9
    # Equal costs split as evenly as the count allows.
    assert optimal_partition([1.0] * 10, 4).counts in {(3, 2, 3, 2), (2, 3, 2, 3), (3, 3, 2, 2), (2, 2, 3, 3),
                                                        (3, 2, 2, 3), (2, 3, 3, 2)}


@pytest.mark.parametrize("seed", range(200))
def test_even_split_meets_the_optimal_bottleneck_on_random_costs(seed: int) -> None:
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 12)
    stages = rng.randint(1, n)
    costs = [rng.choice([rng.random(), 1.0, 0.5, 10 * rng.random(), 0.0]) for _ in range(n)]
    o = optimal_partition(costs, stages)
    bf = brute_force_partition(costs, stages)
    assert len(o.counts) == stages and min(o.counts) >= 1 and sum(o.counts) == n
    assert o.bottleneck == pytest.approx(bf.bottleneck, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(25))
def test_optimal_with_memory_is_exact_against_brute_force(seed: int) -> None:
    rng = random.Random(1000 + seed)
    n = rng.randint(4, 10)
    stages = rng.randint(2, min(n, 4))
    costs = [rng.uniform(0.5, 5.0) for _ in range(n)]
    # Memory grows with cheap layers (a wide embedding-like layer), so time and memory disagree.
    state = [rng.uniform(1.0, 6.0) for _ in range(n)]
    act = [rng.uniform(0.1, 1.0) for _ in range(n)]
    inflight = [stages - s for s in range(stages)]  # 1F1B
    base = [1.0] * stages
    capacity = rng.uniform(0.4, 0.9) * (sum(state) + stages * sum(act))
    memory = StageMemory(state=state, act=act, inflight=inflight, base=base, capacity=capacity)
    o = optimal_partition(costs, stages, memory)
    bf = brute_force_partition(costs, stages, memory)
    if bf is None:
        assert not o.fits
        assert not fits_within(costs, stages, memory, sum(costs))
        return
    assert o.fits
    assert o.bottleneck == pytest.approx(bf.bottleneck, rel=1e-12)
    for s, (a, b) in enumerate(o.bounds):
        assert memory.stage_bytes(s, a, b) <= capacity * (1 + 1e-12)
    # One pack answers "does a split within memory reach this bottleneck?" exactly: yes at the
    # optimum, no just below it, and at every limit as brute force would.
    assert fits_within(costs, stages, memory, bf.bottleneck)
    assert not fits_within(costs, stages, memory, bf.bottleneck * (1 - 1e-6))
    for limit in (rng.uniform(0.5, 1.5) * bf.bottleneck for _ in range(5)):
        assert fits_within(costs, stages, memory, limit) == (limit >= bf.bottleneck * (1 - 1e-12))



@pytest.mark.parametrize("seed", range(40))
def test_memory_limited_split_has_the_longest_last_stages(seed: int) -> None:
    """Among the optimal splits that fit, the balancer returns the one whose last stage is
    longest, then the one before it, and so on (early 1F1B stages hold the most micro-batches,
    so they stay as light as the bottleneck allows): checked against every split."""
    from itertools import combinations

    rng = random.Random(5000 + seed)
    n = rng.randint(4, 11)
    stages = rng.randint(2, min(n, 5))
    costs = [float(rng.choice([1, 2, 3])) if seed % 2 else rng.uniform(0.5, 5.0) for _ in range(n)]  # ties too
    state = [rng.uniform(1.0, 6.0) for _ in range(n)]
    act = [rng.uniform(0.1, 1.0) for _ in range(n)]
    memory = StageMemory(state=state, act=act, inflight=[stages - s for s in range(stages)], base=[1.0] * stages,
                         capacity=rng.uniform(0.5, 1.0) * (sum(state) + stages * sum(act)))
    o = optimal_partition(costs, stages, memory)
    best = None
    for cuts in combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        counts = tuple(bounds[k + 1] - bounds[k] for k in range(stages))
        if any(memory.stage_bytes(s, bounds[s], bounds[s + 1]) > memory.capacity for s in range(stages)):
            continue
        bottleneck = max(sum(costs[bounds[k]:bounds[k + 1]]) for k in range(stages))
        key = (round(bottleneck, 9), tuple(-c for c in reversed(counts)))
        if best is None or key < best[0]:
            best = (key, counts)
    if best is None:
        assert not o.fits
        return
    assert o.fits and o.counts == best[1]

def test_memory_limit_moves_layers_off_the_crowded_first_stage() -> None:
    costs = [1.0] * 8
    # Without memory: 4 + 4. The first stage holds 2 in-flight micro-batches, so with a tight
    # capacity it can only take 3 layers of activations.
    memory = StageMemory(state=[1.0] * 8, act=[1.0] * 8, inflight=[2, 1], base=[0.0, 0.0], capacity=10.5)
    assert optimal_partition(costs, 2).counts == (4, 4)
    part = optimal_partition(costs, 2, memory)
    assert part.counts == (3, 5)
    assert part.bottleneck == 5.0


def test_nothing_fits_returns_time_optimal_marked_unfit() -> None:
    memory = StageMemory(state=[10.0] * 4, act=[0.0] * 4, inflight=[2, 1], base=[0.0, 0.0], capacity=5.0)
    part = optimal_partition([1.0, 2.0, 3.0, 4.0], 2, memory)
    assert not part.fits
    assert part.bottleneck == 6.0  # (1, 2, 3) | (4)


def test_balance_dispatch_and_bad_input() -> None:
    assert balance([1, 2, 3], 2, "greedy").counts == greedy_partition([1, 2, 3], 2).counts
    assert balance([1, 2, 3], 2).bottleneck == 3.0
    with pytest.raises(ValueError):
        balance([1, 2], 3)
    with pytest.raises(ValueError):
        balance([1, 2], 1, "fastest")


@pytest.mark.parametrize("seed", range(30))
def test_time_pack_fits_equals_pack_ends(seed: int) -> None:
    """The time-only search's pack that only says whether it fits agrees with ``_pack_ends``,
    ties and zero costs included."""
    import numpy as np

    from planner.search.packing import _sums_within, _time_pack_fits
    from planner.search.packing import cost_profile as _cost_profile
    from planner.search.packing import pack_ends as _pack_ends

    rng = random.Random(seed)
    n = rng.randint(1, 130)
    pick = rng.choice(("uniform", "repeated", "zeros"))
    if pick == "uniform":
        costs = [rng.uniform(0.0, 3.0) for _ in range(n)]
    elif pick == "repeated":
        costs = [rng.choice((0.0, 0.1, 1.7, 2.9)) for _ in range(n)]
    else:
        costs = [0.0] * n
    arr, prefix, largest, total = _cost_profile(tuple(costs))
    for stages in {1, 2, max(1, n // 3), n}:
        for limit in _sums_within(arr, -1.0, total + 1.0) + [-1.0, total * 0.5, float(np.nextafter(total, 0))]:
            assert _time_pack_fits(prefix, limit, stages) == (_pack_ends(prefix, limit, stages, None) is not None)
