"""The search memoises the framework rules on what they read (space._rule_pattern): over whole
spaces, the candidates it keeps and the count it rejects equal checking every config directly."""

from __future__ import annotations

import itertools

import pytest

from planner.cost.frameworks import check_framework
from planner.cost.parallel import FRAMEWORKS, OFFLOADS, RECOMPUTES, ParallelConfig, Workload
from planner.errors import UserError
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.catalog import load_model
from planner.search.space import Constraints, _settings, _structurally_valid, degree_combinations, divisors, \
    enumerate_space
from planner.search.suggest import _facts, _space


def _direct(model, world: int, gpn: int, gb: int, cons: Constraints, optimizer: str,
            precision: str) -> tuple[set[tuple], int]:
    """Every candidate checked with a real ParallelConfig and check_framework, no memo."""
    degrees, _ = degree_combinations(world, gpn, gb, _facts(model), cons)
    kept, rejected = set(), 0
    for deg in degrees:
        for mb in divisors(gb // deg.dp):
            ga = gb // (deg.dp * mb)
            for st in _settings(cons):
                if not _structurally_valid(deg, st):
                    continue
                z, o, r, sp, f = st
                cfg = ParallelConfig(dp=deg.dp, tp=deg.tp, pp=deg.pp, ep=deg.ep, zero_stage=z, offload=OFFLOADS[o],
                                     micro_batch=mb, grad_accum=ga, recompute=RECOMPUTES[r],
                                     sequence_parallel=bool(sp), virtual_stages=deg.vs, framework=FRAMEWORKS[f])
                try:
                    check_framework(cfg, is_moe=model.is_moe, decoder_layers=model.num_layers, is_vlm=model.is_vlm,
                                    optimizer=optimizer, precision=precision)
                except UserError:
                    rejected += 1
                    continue
                kept.add((deg.dp, deg.tp, deg.pp, deg.ep, deg.vs, z, o, r, sp, f, mb, ga))
    return kept, rejected


@pytest.mark.parametrize("name, nodes, gb, optimizer, precision", [
    ("vl2", 1, 256, "adamw", "bf16"), ("vl2", 2, 96, "adamw", "bf16"), ("llama-3.1-8b", 2, 512, "sgd", "bf16"),
    ("llama-3.1-8b", 1, 60, "adam", "fp16")])
def test_memoised_rules_equal_direct_checks(name: str, nodes: int, gb: int, optimizer: str, precision: str) -> None:
    model = load_model(name)
    cluster = Cluster.build(load_profile("dgx-a100-80g"), nodes)
    cons = Constraints(virtual_stages=(1, 2, 3, 4))
    workload = Workload(global_batch=gb, seq_len=model.train_seq_len, optimizer=optimizer, precision=precision)
    space = _space(model, cluster, workload, cons)
    cols = [space.columns[k] for k in ("dp", "tp", "pp", "ep", "vs", "zero", "offload", "recompute", "sp", "framework",
                                       "micro_batch", "grad_accum")]
    got = {tuple(int(v) for v in row) for row in zip(*cols)}
    assert len(got) == len(space)
    kept, rejected = _direct(model, cluster.num_gpus, cluster.gpus_per_node, gb, cons, optimizer, precision)
    assert got == kept
    assert space.rejected["framework"] == rejected
    # Interleaving is both allowed and refused somewhere, so the exact-pp part of the key is exercised.
    assert (space.columns["vs"] > 1).any() and rejected > 0


def test_read_memo_runs_the_rule_once_per_path_and_agrees_with_it() -> None:
    from planner.search.space import ConfigView, ReadMemo

    calls = []

    def rule(cfg):
        calls.append(1)
        if cfg.framework == "megatron":
            return "no zero 2+" if cfg.zero_stage > 1 else None
        return "no tp with pp" if cfg.tp > 1 and cfg.pp > 1 else None

    memo = ReadMemo(rule)
    configs = [ConfigView(dp=2, tp=tp, pp=pp, ep=1, zero_stage=z, offload="none", micro_batch=mb, grad_accum=1,
                          recompute="none", sequence_parallel=False, virtual_stages=1, framework=f)
               for f in ("megatron", "deepspeed") for tp in (1, 2) for pp in (1, 2) for z in (0, 1, 2, 3)
               for mb in (1, 2, 4)]
    for cfg in configs:
        assert memo.ok(cfg) == (rule(cfg) is None)
    direct = len(configs)
    # megatron: one path per zero stage; deepspeed: tp 1 decides alone, tp 2 needs pp
    assert len(calls) - direct == 4 + 1 + 2
    flip = iter(range(10**6))

    def fickle(cfg):  # reads a different field from one call to the next
        return None if (cfg.tp if next(flip) % 2 else cfg.pp) else "no"

    memo = ReadMemo(fickle)
    memo.ok(configs[0])
    with pytest.raises(RuntimeError, match="must depend only on the fields it reads"):
        memo.ok(configs[-1])
