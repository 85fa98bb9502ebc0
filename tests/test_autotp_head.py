"""The reference trainer's model under DeepSpeed AutoTP (2 CPU ranks, gloo): the vocabulary
projection is split by vocabulary like the decoder's column-parallel layers (transformers'
``lm_head: colwise_rep``), not left whole on every TP rank, and the loss is the unsharded
model's to float rounding. Real DeepSpeed, real processes; nothing recorded."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from planner.model.load import load_model
from planner.run.model_scale import parse_scale, scale_spec
from planner.run.profile_device import free_port

pytest.importorskip("deepspeed")


def _spec():
    return scale_spec(load_model("gpt3-125m"), parse_scale("0.125")).spec


def _worker(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed

    from planner.run.model_builder import ReferenceForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    spec = _spec()
    torch.manual_seed(7)
    whole = ReferenceForCausalLM(spec)
    torch.manual_seed(7)
    sharded = ReferenceForCausalLM(spec)
    tokens = torch.randint(0, spec.vocab, (2, 32), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(tokens, -1, dims=1)
    with torch.no_grad():
        expected = whole(tokens, labels).item()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "tensor_parallel": {"autotp_size": 2},
           "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=sharded, model_parameters=list(sharded.parameters()), config=cfg)
    with torch.no_grad():
        got = engine(tokens, labels).item()
    head = engine.module.model.layers[-1].lm_head
    out.append((rank, expected, got, tuple(head.weight.shape), type(head).__name__))


def test_autotp_splits_the_lm_head_by_vocabulary_and_keeps_the_loss():
    spec = _spec()
    with mp.Manager() as manager:
        out = manager.list()
        mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
        rows = sorted(out)
    for _, expected, got, shape, kind in rows:
        assert got == pytest.approx(expected, rel=1e-5)
        assert shape == (spec.vocab // 2, spec.hidden), kind  # half the vocabulary on each rank


# -- what the cost model prices for it --------------------------------------------------------


def test_autotp_prices_the_whole_vocabulary_as_deepspeed_runs_it():
    """Llama 3 8B, TP 2, 4,096 tokens. Megatron (vocabulary-parallel) and DeepSpeed AutoTP
    (frameworks.Traits.vocab_parallel false) differ in the embedding and the head only:
    - AutoTP keeps the 128,256 x 4,096 table whole on each rank and looks up alone (no reduction);
    - its head's logits are all-gathered whole (s x v x 2 bytes) and the cross-entropy runs on
      all of them: 4 s v of fp32 kept, and the loss's traffic over v, not v / 2."""
    from planner.cost.layers import layer_costs
    from planner.cost.parallel import Workload

    model, s = load_model("llama-3-8b"), 4096
    w = Workload(global_batch=1, seq_len=s)
    megatron = layer_costs(model, w, tp=2)
    autotp = layer_costs(model, w, tp=2, vocab_parallel=False)
    v, h = model.vocab, model.hidden
    assert autotp[0].params_rank - megatron[0].params_rank == v * h / 2
    assert megatron[0].tp_fwd and not autotp[0].tp_fwd
    assert autotp[-1].tp_fwd == (("allgather", s * v * 2),)
    assert autotp[-1].act["none"] - megatron[-1].act["none"] == 4.0 * s * v / 2
    assert autotp[-1].hbm_fwd == pytest.approx(2 * megatron[-1].hbm_fwd)
    assert autotp[1:-1] == megatron[1:-1]  # the transformer layers are the same


def test_a_deepspeed_tp_plan_holds_the_whole_embedding():
    """The same plan on DeepSpeed and on Megatron-DeepSpeed (Megatron's vocabulary-parallel mpu,
    the same engine): rank 0's 16-bit weights differ by the half table AutoTP does not split."""
    from planner import api

    cluster = api.load_cluster("dgx-a100-80g")
    knobs = dict(tp=2, pp=1, zero=1, micro_batch=1, global_batch=64, seq_len=4096)
    ds = api.estimate("llama-3-8b", cluster, framework="deepspeed", **knobs)
    mds = api.estimate("llama-3-8b", cluster, framework="megatron-deepspeed", **knobs)
    spec = load_model("llama-3-8b")
    assert ds.stages[0].memory.weights - mds.stages[0].memory.weights == pytest.approx(
        2 * spec.vocab * spec.hidden / 2, rel=1e-6)
