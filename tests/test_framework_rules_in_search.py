"""The search asks the framework rules once per pattern of what they read (rule_patterns.rule_pattern),
in their vector form (framework_rules.first_broken): over whole spaces, the candidates it keeps and the
count it rejects equal checking every config directly with check_framework."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from planner.cost.framework_rules import RULES, ConfigColumns, RunFacts, check_framework, first_broken, model_facts
from planner.cost.parallel import FRAMEWORKS, OFFLOADS, RECOMPUTES, ParallelConfig, Workload
from planner.errors import UserError, spell
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.catalog import load_model
from planner.search.request import candidate_space, space_facts
from planner.search.space import Constraints, allowed_settings, degree_combinations, divisors


def _direct(model, world: int, gpn: int, gb: int, cons: Constraints, optimizer: str,
            precision: str) -> tuple[set[tuple], int]:
    """Every candidate checked with a real ParallelConfig and check_framework, no memo."""
    degrees, _ = degree_combinations(world, gpn, gb, space_facts(model), cons)
    kept, rejected = set(), 0
    for deg in degrees:
        for mb in divisors(gb // deg.dp):
            ga = gb // (deg.dp * mb)
            for st in allowed_settings(cons):
                if st[3] and deg.tp == 1:  # sequence parallel means nothing without tp > 1: not a candidate
                    continue
                z, o, r, sp, f = st
                cfg = ParallelConfig(dp=deg.dp, tp=deg.tp, pp=deg.pp, ep=deg.ep, zero_stage=z, offload=OFFLOADS[o],
                                     micro_batch=mb, grad_accum=ga, recompute=RECOMPUTES[r],
                                     sequence_parallel=bool(sp), virtual_stages=deg.vs, framework=FRAMEWORKS[f])
                try:
                    check_framework(cfg, **model_facts(model), optimizer=optimizer, precision=precision)
                except UserError:
                    rejected += 1
                    continue
                kept.add((deg.dp, deg.tp, deg.pp, deg.ep, deg.vs, z, o, r, sp, f, mb, ga))
    return kept, rejected


@pytest.mark.parametrize("name, nodes, gb, optimizer, precision", [
    ("vl2", 1, 256, "adamw", "bf16"), ("vl2", 2, 96, "adamw", "bf16"), ("llama-3.1-8b", 2, 512, "sgd", "bf16"),
    ("llama-3.1-8b", 1, 60, "adam", "fp16"), ("bloom-176b", 2, 64, "adamw", "bf16")])
def test_memoised_rules_equal_direct_checks(name: str, nodes: int, gb: int, optimizer: str, precision: str) -> None:
    model = load_model(name)
    cluster = Cluster.build(load_profile("dgx-a100-80g"), nodes)
    cons = Constraints(virtual_stages=(1, 2, 3, 4))
    workload = Workload(global_batch=gb, seq_len=model.train_seq_len, optimizer=optimizer, precision=precision)
    space = candidate_space(model, cluster, workload, cons)
    cols = [space.columns[k] for k in ("dp", "tp", "pp", "ep", "vs", "zero", "offload", "recompute", "sp", "framework",
                                       "micro_batch", "grad_accum")]
    got = {tuple(int(v) for v in row) for row in zip(*cols)}
    assert len(got) == len(space)
    kept, rejected = _direct(model, cluster.num_gpus, cluster.gpus_per_node, gb, cons, optimizer, precision)
    assert got == kept
    assert space.rejected["framework"] == rejected
    if model.positions.kind == "alibi":  # DeepSpeed and BigScience's Megatron-DeepSpeed build BLOOM, never interleaved
        mds = space.columns["framework"] == FRAMEWORKS.index("megatron-deepspeed")
        assert set(space.columns["framework"].tolist()) == {FRAMEWORKS.index(f) for f in ("deepspeed",
                                                                                           "megatron-deepspeed")}
        assert not space.columns["sp"][mds].any() and rejected > 0  # the fork has no sequence parallelism
        return
    # Interleaving is both allowed and refused somewhere, so the exact-pp part of the key is exercised.
    assert (space.columns["vs"] > 1).any() and rejected > 0


@pytest.mark.parametrize("facts", [RunFacts(False, 24, False, "adamw", "bf16"),
                                   RunFacts(True, 30, False, "sgd", "bf16"),
                                   RunFacts(False, 30, True, "adamw", "fp16"), RunFacts(True, 24, True, "adam", "fp32"),
                                   RunFacts(True, 27, False, "adamw", "bf16", mla=True),
                                   RunFacts(False, 70, False, "adamw", "bf16", positions="alibi")])
def test_runnable_mask_equals_check_framework_config_by_config(facts: RunFacts) -> None:
    """The rule table's vector form (the search's filter) and its scalar form (the messages)."""
    configs = []
    for f, tp, pp, ep, z, o, r, sp, vs, ga in itertools.product(
            FRAMEWORKS, (1, 2, 8), (1, 2, 4), (1, 2), (0, 1, 2, 3), OFFLOADS, RECOMPUTES, (False, True), (1, 2, 3),
            (1, 4)):
        try:
            configs.append(ParallelConfig(dp=4, tp=tp, pp=pp, ep=ep, zero_stage=z, offload=o, micro_batch=1,
                                          grad_accum=ga, recompute=r, sequence_parallel=sp, virtual_stages=vs,
                                          framework=f))
        except Exception:  # combinations ParallelConfig itself forbids
            continue
    expected, messages = [], []
    for cfg in configs:
        try:
            check_framework(cfg, is_moe=facts.is_moe, decoder_layers=facts.decoder_layers, is_vlm=facts.is_vlm,
                            optimizer=facts.optimizer, precision=facts.precision, mla=facts.mla,
                            positions=facts.positions)
            expected.append(True)
            messages.append(None)
        except UserError as err:
            expected.append(False)
            messages.append(str(err))
    cols = ConfigColumns(**{name: np.array([getattr(c, name) for c in configs])
                            for name in ConfigColumns.__slots__})
    broken = first_broken(cols, facts)
    got = broken < 0
    assert got.tolist() == expected
    assert 0 < sum(expected) < len(expected)
    # The index first_broken gives is the rule whose message check_framework raises.
    named = [None if k < 0 else spell(RULES[k].message(cfg, facts)) for k, cfg in zip(broken.tolist(), configs)]
    assert named == messages
    assert len({m for m in messages if m}) > 10  # many different rules are exercised


@pytest.mark.parametrize("name, gb", [("llama-3.1-8b", 64), ("deepseek-v2-lite", 48)])
def test_torchtitans_rules_in_the_search_equal_direct_checks(name: str, gb: int) -> None:
    """torchtitan refuses TP or PP without FSDP2 over more than one rank (dp x cp = 1), a fact of dp
    the rule patterns must see; interleaving with fewer micro-batches than stages is priced."""
    model = load_model(name)
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 1)
    cons = Constraints(virtual_stages=(1, 2), framework=("torchtitan",))
    space = candidate_space(model, cluster, Workload(global_batch=gb, seq_len=4096), cons)
    cols = [space.columns[k] for k in ("dp", "tp", "pp", "ep", "vs", "zero", "offload", "recompute", "sp", "framework",
                                       "micro_batch", "grad_accum")]
    got = {tuple(int(v) for v in row) for row in zip(*cols)}
    kept, rejected = _direct(model, cluster.num_gpus, cluster.gpus_per_node, gb, cons, "adamw", "bf16")
    assert got == kept and space.rejected["framework"] == rejected
    assert not any(dp == 1 and (tp > 1 or pp > 1) for dp, tp, pp, *_ in got)
