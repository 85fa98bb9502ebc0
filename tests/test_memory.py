"""Memory model: ZeRO formulas, per-runtime bytes per parameter, pipeline in-flight activations."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from planner.cost import memory as mem
from planner.cost.parallel import FRAMEWORKS


def test_zero_paper_fig1_example(reference_dir):
    """Rajbhandari et al. SC20 Fig. 1: 7.5B parameters, Nd = 64, K = 12."""
    rows = {r["case"]: r["value"] for r in csv.DictReader(open(reference_dir / "zero_memory_formulas.csv"))}
    assert "baseline 120 GB; Pos 31.4 GB; Pos+g 16.6 GB" in rows["7.5B, Nd=64"]
    psi, nd = 7.5e9, 64
    assert mem.zero_paper_bytes(psi, nd, 0) == 120e9
    assert mem.zero_paper_bytes(psi, nd, 1) / 1e9 == pytest.approx(31.4, abs=0.05)
    assert mem.zero_paper_bytes(psi, nd, 2) / 1e9 == pytest.approx(16.6, abs=0.05)
    assert mem.zero_paper_bytes(psi, nd, 3) == 1.875e9


@pytest.mark.parametrize("psi,nd", [(1e9, 8), (7.5e9, 64), (175e9, 1024), (3e6, 3)])
def test_zero_paper_formulas_term_by_term(psi, nd):
    """The four rows of zero_memory_formulas.csv with K = 12."""
    k = 12
    assert mem.zero_paper_bytes(psi, nd, 0) == (2 + 2 + k) * psi
    assert mem.zero_paper_bytes(psi, nd, 1) == 2 * psi + 2 * psi + k * psi / nd
    assert mem.zero_paper_bytes(psi, nd, 2) == 2 * psi + (2 + k) * psi / nd
    assert mem.zero_paper_bytes(psi, nd, 3) == (2 + 2 + k) * psi / nd


def test_megatron_distributed_optimizer_bytes():
    """Megatron docs: bf16 params with fp32 grads take 18 bytes, 6 + 12/d distributed."""
    for d in (1, 8, 64):
        w, g, o, cpu = mem.bytes_per_param("megatron", 1, "none", d, "bf16")
        assert w + g + o == pytest.approx(6 + 12 / d) and cpu == 0
    w, g, o, _ = mem.bytes_per_param("megatron", 0, "none", 64, "bf16")
    assert w + g + o == 18
    w, g, o, _ = mem.bytes_per_param("megatron", 1, "none", 8, "fp16")
    assert w + g + o == pytest.approx(4 + 16 / 8)


def test_expert_parameters_shard_over_expert_data_parallel():
    """Dense states shard over dp, experts over dp/ep (ZeRO-2: 2 + 18/N each)."""
    s = mem.model_states(1e9, 4e9, framework="deepspeed", zero=2, offload="none", dp=16, ep=4)
    assert s.gpu == pytest.approx(1e9 * (2 + 18 / 16) + 4e9 * (2 + 18 / 4))


def test_offload_moves_states_to_cpu():
    s = mem.model_states(1e9, 0, framework="deepspeed", zero=3, offload="optimizer+params", dp=8, ep=1,
                         live_layer_params=1e7)
    assert s.gpu == 4e7 and s.cpu == pytest.approx(18 * 1e9 / 8)
    node = mem.cpu_bytes_per_node(s.cpu, 8)
    assert node == pytest.approx(18 * 1e9 * 1.5)  # DeepSpeed's additional_buffer_factor


@pytest.mark.parametrize("p,v,m", [(4, 1, 16), (8, 2, 48), (16, 2, 144), (35, 3, 280), (4, 3, 28)])
def test_first_stage_holds_korthikanti_multiple(p, v, m):
    """Rank 0 holds p micro-batches of L/p layers (Eq. 5) times (1 + (p-1)/(p v)) interleaved."""
    layers = 8 * p * v
    per_layer = 1.0
    stage = layers / p * per_layer
    held = mem.inflight_microbatches(0, p, v, m) * stage
    expected = layers * per_layer * (1 + (p - 1) / (p * v)) if v > 1 else layers * per_layer
    assert held == pytest.approx(expected)
    # later ranks hold fewer; the last holds one micro-batch (1F1B)
    if v == 1:
        assert mem.inflight_microbatches(p - 1, p, v, m) == 1
    assert mem.inflight_microbatches(p - 1, p, v, m) < mem.inflight_microbatches(0, p, v, m)


def test_inflight_capped_by_microbatches():
    assert mem.inflight_microbatches(0, 8, 1, 3) == 3
    assert mem.inflight_microbatches(0, 1, 1, 64) == 1


def test_deepspeed_buckets_and_allowances():
    """overlap_comm keeps 4.5x both buckets in 16-bit elements (DeepSpeed docs)."""
    deepspeed, megatron = FRAMEWORKS.index("deepspeed"), FRAMEWORKS.index("megatron")
    big = mem.buffer_bytes(np.array(deepspeed), np.array(2), 1e10, groups=1)
    assert big == pytest.approx(mem.NCCL_BYTES_PER_GROUP + 4.5 * 2 * (2e8 + 2e8))
    assert mem.buffer_bytes(np.array(megatron), np.array(1), 1e10, groups=2) == 2 * mem.NCCL_BYTES_PER_GROUP
    # ZeRO-3 keeps the prefetch and reduce buckets; a small stage holds no more than itself.
    assert mem.buffer_bytes(np.array(deepspeed), np.array(3), 1e6, groups=0) == pytest.approx(2 * 1e6 + 2 * 1e6)
    assert mem.buffer_bytes(np.array(deepspeed), np.array(3), np.inf, groups=0) == pytest.approx(2 * 5e7 + 2 * 2e8)
    assert mem.overhead_bytes(10 * 2**30) == pytest.approx(2**30 + 0.05 * 10 * 2**30)
