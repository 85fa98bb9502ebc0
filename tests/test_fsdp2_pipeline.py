"""FSDP2 under a pipeline (torchtitan): torch.distributed.pipelining runs every backward with
resharding and gradient sync off and reduces once at the end, and torchtitan's default policy
does not reshard after forward under PP. So the stage is gathered once a step and reduced once,
whatever the micro-batches, and it holds its 16-bit weights and fp32 accumulated gradients whole
(frameworks.Traits.fsdp_pp_keeps_stage_gathered)."""

from __future__ import annotations

import pytest

from planner import api

MODEL = "llama-3.1-8b"


def _plan(pp: int, global_batch: int, nodes: int = 16, nic_gbit: float = 25.0):
    cluster = api.load_cluster(api.with_fabric("dgx-a100-80g", nic_gbit=nic_gbit), nodes=nodes)
    return api.estimate(MODEL, cluster, framework="torchtitan", zero=3, pp=pp, tp=1, micro_batch=1,
                        global_batch=global_batch, seq_len=512, recompute="full")


def test_under_a_pipeline_the_stage_is_gathered_and_reduced_once_a_step():
    # On a slow fabric the per-block gathers outlast compute: without a pipeline every micro-batch
    # pays them again (twice the micro-batches, twice the exposed DP time); with one, once.
    flat, flat2 = _plan(1, 256), _plan(1, 512)
    piped, piped2 = _plan(2, 256), _plan(2, 512)
    assert flat.time.dp_comm > 0 and flat2.time.dp_comm == pytest.approx(2 * flat.time.dp_comm, rel=0.02)
    assert piped2.cfg.grad_accum == 2 * piped.cfg.grad_accum
    assert piped.time.dp_comm > 0 and piped2.time.dp_comm == pytest.approx(piped.time.dp_comm, rel=1e-9)


def test_under_a_pipeline_the_stage_holds_its_weights_and_fp32_gradients_whole():
    """FSDP2 keeps fp32 shards (4/N bytes of weights and of gradients per parameter, torchtitan's
    training.mixed_precision_param bf16 gathers); under PP the stage adds 2 bytes of gathered
    weights and 4 of fp32 accumulated gradients per parameter: grads - weights = 2 x its params."""
    plan = _plan(2, 256, nodes=2, nic_gbit=400)
    n = plan.cfg.dp_shard
    for stage in plan.stages:
        params = (stage.memory.grads - stage.memory.weights) / 2
        assert params > 1e9  # a stage of Llama 3.1 8B holds some 4B parameters
        assert stage.memory.weights == pytest.approx(4 * params / n + 2 * params, rel=1e-9)
    flat = _plan(1, 256, nodes=2, nic_gbit=400)
    assert flat.stages[0].memory.weights < 0.5 * plan.stages[0].memory.weights  # two live blocks only
