"""``--moe-dispatcher flex``: Megatron-Core's DeepEP / HybridEP dispatcher, which across nodes sends
a token once per destination node over the network and forwards it over NVLink inside the node
(planner/cost/moe_dispatch.py); its pricing, its flags and its errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost.collectives import collective_time
from planner.cost.layers import layer_costs
from planner.cost.moe_dispatch import FLEX_SMS, distinct_nodes, flex_jobs, flex_legs
from planner.cost.parallel import Workload
from planner.emit.megatron_args import megatron_lm_args, megatron_notes
from planner.errors import UserError
from planner.hardware.placement import GroupShape
from planner.model.catalog import load_model
from tests.test_emit_ds_config import make_plan


def _simulated(nodes: int, experts: int, k: int, groups: int = 1, group_topk: int = 0, n: int = 20000) -> float:
    """Distinct nodes per token, counted over random routings: group_topk groups, then k of their experts."""
    rng, per, total = np.random.default_rng(0), experts // nodes, 0
    for _ in range(n):
        picked = rng.choice(groups, group_topk, replace=False) if groups > 1 else [0]
        size = experts // groups if groups > 1 else experts
        pool = np.concatenate([np.arange(g * size, (g + 1) * size) for g in picked])
        total += len(set(rng.choice(pool, k, replace=False) // per))
    return total / n


@pytest.mark.parametrize("case", [(8, 256, 8), (16, 256, 8), (2, 64, 6), (8, 256, 8, 8, 4), (16, 256, 8, 8, 4),
                                  (4, 256, 8, 8, 4), (2, 256, 8, 8, 4)])
def test_distinct_nodes_matches_random_routing(case):
    assert distinct_nodes(*case) == pytest.approx(_simulated(*case), rel=0.01)


def test_node_limited_routing_halves_deepseek_v3s_network_copies():
    """DeepSeek-V3 (256 experts, top 8, 8 groups of which 4) on 8 nodes: 3.63 nodes a token, not
    the 5.3 of uniform routing; a node alone gets 1, and groups that divide nothing fall back to uniform."""
    assert distinct_nodes(8, 256, 8, 8, 4) == pytest.approx(3.629, abs=1e-3)
    assert distinct_nodes(8, 256, 8) == pytest.approx(5.295, abs=1e-3)
    assert distinct_nodes(1, 256, 8, 8, 4) == 1.0
    assert distinct_nodes(6, 192, 8, 8, 4) == distinct_nodes(6, 192, 8)


def test_the_two_legs_of_a_flex_dispatch():
    """EP 64 over 8 nodes of 8: a rail all-to-all over the 8 nodes (8 of them per node sharing its
    NICs), an NVLink all-to-all over the node's 8 ranks; none for an EP group inside one node."""
    rail, node = flex_legs(GroupShape(64, 1, 8, 8, 1))
    assert rail == GroupShape(8, 8, 1, 8, 8) and node == GroupShape(8, 1, 8, 1, 1)
    assert flex_legs(GroupShape(8, 1, 8, 1, 1)) is None


def _v3_moe_layer(flex: bool):
    w = Workload(global_batch=512, seq_len=4096, moe_dispatcher="flex" if flex else "alltoall")
    costs = layer_costs(load_model("deepseek-v3"), w, tp=1, sp=False, ep=64)
    return next(c for c in costs if c.ep_a2a_count)


def test_flex_sends_the_distinct_nodes_copies_over_the_network_and_every_copy_inside():
    layer = _v3_moe_layer(flex=True)
    assert not any(k.startswith("flex_") for k in _v3_moe_layer(flex=False).extra)
    shape = GroupShape(64, 1, 8, 8, 1)
    (rail, rail_ops), (node, node_ops) = flex_jobs([layer], shape)
    assert (rail, node) == flex_legs(shape)
    assert rail_ops == [[("alltoall", pytest.approx(layer.ep_a2a * 3.629 / 8, rel=1e-3))]]
    assert node_ops == [[("alltoall", layer.ep_a2a)]]


def _ep_seconds(dispatcher: str, nodes: int, pp: int, ep: int) -> float:
    plan = api.estimate("deepseek-v3", api.load_cluster("h800", nodes=nodes), tp=1, pp=pp, virtual_stages=1, ep=ep,
                        etp=1, micro_batch=1, framework="megatron", recompute="full", global_batch=64 * nodes,
                        moe_dispatcher=dispatcher, ep_comm_overlap=False)
    return plan.time.ep_comm


def test_flex_pays_off_across_nodes_only():
    """EP 64 over 8 H800 nodes: each token crosses the network to 3.6 nodes instead of 7 of its 8
    copies, so the exposed all-to-all shrinks; EP 8 inside one node is priced as the all-to-all."""
    across = _ep_seconds("flex", 64, 8, 64) / _ep_seconds("alltoall", 64, 8, 64)
    assert 0.4 < across < 0.75
    assert _ep_seconds("flex", 32, 32, 8) == pytest.approx(_ep_seconds("alltoall", 32, 32, 8))


def test_the_rail_leg_is_the_network_all_to_all_of_the_distinct_copies():
    """Per block, the flex price is the slower of the two legs, each a plain all-to-all."""
    cluster = api.load_cluster("h800", nodes=8)
    layer, shape = _v3_moe_layer(flex=True), GroupShape(64, 1, 8, 8, 1)
    (rail, [[(_, rail_bytes)]]), (node, [[(_, node_bytes)]]) = flex_jobs([layer], shape)
    t_rail = collective_time(cluster, "alltoall", rail, rail_bytes).time_s
    t_node = collective_time(cluster, "alltoall", node, node_bytes).time_s
    t_a2a = collective_time(cluster, "alltoall", shape, layer.ep_a2a).time_s
    assert t_rail > t_node and max(t_rail, t_node) < t_a2a


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize(("args", "says"), [
    (["--hardware", "dgx-h100", "--framework", "deepspeed"], "framework deepspeed runs its own all-to-all"),
    (["--hardware", "dgx-a100-80g", "--framework", "megatron"], "need NVIDIA Hopper or newer"),
    (["--hardware", "l40s-pcie", "--framework", "megatron"], "NVLink inside the node"),
    (["--hardware", "dgx-h100", "--framework", "megatron", "--ep", "1", "--pp", "4"], "--ep 2 or more"),
])
def test_a_flex_plan_no_runtime_or_gpu_can_run_is_one_error(args, says):
    r = _run("estimate", "--model", "mixtral-8x7b", "--nodes", "2", "--ep", "8", *args, "--moe-dispatcher", "flex")
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output
    assert "--moe-dispatcher alltoall" in r.output


def test_an_unknown_dispatcher_is_refused():
    r = _run("estimate", "--model", "mixtral-8x7b", "--moe-dispatcher", "deepep")
    assert r.exit_code == 2 and "'deepep' is not one of 'alltoall', 'allgather', 'flex'" in r.output
    with pytest.raises(UserError, match="moe_dispatcher.*deepep.*alltoall or allgather or flex"):
        api.make_workload("mixtral-8x7b", moe_dispatcher="deepep")


@pytest.mark.parametrize(("hardware", "backend"), [("dgx-h100", "deepep"), ("dgx-b200", "hybridep"),
                                                   ("gb200-nvl72", "hybridep")])
def test_flex_is_emitted_with_the_gpus_backend(hardware, backend):
    plan, model = make_plan("mixtral-8x7b", 2, framework="megatron", ep=8, grad_accum=4, hardware=hardware,
                            moe_dispatcher="flex", gpus_per_node=4 if "nvl72" in hardware else 8)
    flags = [x for a in megatron_lm_args(model, plan) for x in (a.flag, a.value) if x is not None]
    assert flags[flags.index("--moe-token-dispatcher-type") + 1] == "flex"
    assert flags[flags.index("--moe-flex-dispatcher-backend") + 1] == backend
    assert flags[flags.index("--moe-flex-dispatcher-num-sms") + 1] == str(FLEX_SMS[backend])  # as priced
    assert any("DeepEP" in n for n in megatron_notes(model, plan))
    plain, _ = make_plan("mixtral-8x7b", 2, framework="megatron", ep=8, grad_accum=4, hardware=hardware,
                         gpus_per_node=4 if "nvl72" in hardware else 8)
    assert "--moe-flex-dispatcher-backend" not in [a.flag for a in megatron_lm_args(model, plain)]
    assert not any("DeepEP" in n for n in megatron_notes(model, plain))


def test_suggest_and_generate_carry_the_dispatcher_into_the_plan(tmp_path):
    out = tmp_path / "run"
    r = _run("generate", "--model", "mixtral-8x7b", "--hardware", "dgx-h100", "--nodes", "2", "--framework",
             "megatron", "--moe-dispatcher", "flex", "--out", str(out))
    assert r.exit_code == 0, r.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["moe_dispatcher"] == "flex" and plan["ep"] > 1
    assert "--moe-token-dispatcher-type flex" in (out / "megatron_args.sh").read_text()
    again = _run("generate", "--plan", str(out / "plan.json"), "--moe-dispatcher", "alltoall", "--out",
                 str(tmp_path / "again"))
    assert again.exit_code == 2 and "--moe-dispatcher" in again.output


# -- the allgather dispatcher -------------------------------------------------------------------


def _moe_layer(model: str, dispatcher: str, ep: int, tp: int = 1, sp: bool = False, etp: int | None = None):
    w = Workload(global_batch=8, seq_len=4096, moe_dispatcher=dispatcher)
    spec = load_model(model)
    costs = layer_costs(spec, w, tp=tp, sp=sp, ep=ep, etp=etp)
    return next(c for c, b in zip(costs, spec.blocks) if b.kind == "decoder" and b.mlp.kind == "moe")


def test_allgather_gathers_the_groups_tokens_whatever_the_routing():
    """Megatron-Core's MoEAllGatherTokenDispatcher: every token of the experts' TP x EP group to
    every rank of it (a gathered buffer of G x tokens held x h x 2 bytes), then one reduce-scatter
    of the same back; the all-to-all moves each rank's k copies instead."""
    s, h = 4096, load_model("deepseek-v2-lite").hidden
    gather = _moe_layer("deepseek-v2-lite", "allgather", ep=4)
    a2a = _moe_layer("deepseek-v2-lite", "alltoall", ep=4)
    assert gather.extra.get("ep_gather") == 1.0 and "ep_gather" not in a2a.extra
    assert (gather.ep_a2a, gather.ep_a2a_count) == (4 * s * h * 2, 1)
    assert (a2a.ep_a2a, a2a.ep_a2a_count) == (6 * s * h * 2, 2)  # top-6 copies, dispatch and combine
    assert gather.gemms == a2a.gemms  # the local experts see the same copies
    # under TP 2 with sequence parallelism and the experts on TP too (expert TP 2): the group is
    # 2 x 4 ranks holding half the tokens each, and the experts' own TP pair is gone
    folded = _moe_layer("deepseek-v2-lite", "allgather", ep=4, tp=2, sp=True, etp=2)
    assert folded.ep_a2a == 8 * (s / 2) * h * 2
    plain = _moe_layer("deepseek-v2-lite", "alltoall", ep=4, tp=2, sp=True, etp=2)
    assert len(folded.tp_fwd) < len(plain.tp_fwd)


def test_allgather_pays_where_the_group_is_small_beside_top_k():
    """Exposed EP time, the overlap off for both: DeepSeek-V2-Lite (top-6) on EP 2 moves 2 tokens'
    worth per token with allgather against 6 copies with the all-to-all; Mixtral (top-2) on EP 8
    the other way round. The step prices exactly the gather and reduce-scatter over the group."""
    from planner.cost.collectives import collective_seconds
    from planner.hardware.placement import contiguous_shape

    node = api.load_cluster("dgx-h100")

    def ep_time(model: str, ep: int, dispatcher: str) -> float:
        return api.estimate(model, node, tp=1, pp=1, ep=ep, framework="megatron", micro_batch=1, global_batch=16,
                            seq_len=4096, moe_dispatcher=dispatcher, ep_comm_overlap=False).time.ep_comm

    assert ep_time("deepseek-v2-lite", 2, "allgather") < 0.7 * ep_time("deepseek-v2-lite", 2, "alltoall")
    assert ep_time("mixtral-8x7b", 8, "allgather") > 2 * ep_time("mixtral-8x7b", 8, "alltoall")
    spec = load_model("mixtral-8x7b")
    nbytes = 8 * 4096 * spec.hidden * 2
    group = contiguous_shape(node, 8)
    one = sum(collective_seconds(node, op, group, nbytes) for op in ("allgather", "reducescatter"))
    micro = 16 // 8  # micro-batches per rank
    assert ep_time("mixtral-8x7b", 8, "allgather") == pytest.approx(micro * 2 * spec.num_layers * one, rel=1e-9)


def test_allgather_runs_without_the_expert_overlap():
    """Megatron-Core overlaps the expert exchange with alltoall and flex only."""
    assert Workload(global_batch=8, seq_len=4096, moe_dispatcher="allgather").ep_comm_overlap is False
    assert Workload(global_batch=8, seq_len=4096, moe_dispatcher="alltoall").ep_comm_overlap is True


def test_allgather_on_a_runtime_without_it_is_one_clear_error():
    r = CliRunner().invoke(main, ["estimate", "--model", "mixtral-8x7b", "--ep", "8", "--framework", "deepspeed",
                                  "--moe-dispatcher", "allgather"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "allgather is Megatron-Core's" in r.output and "--framework megatron" in r.output


# -- the SMs the flex kernels hold ----------------------------------------------------------------


def test_overlapped_flex_dispatch_takes_its_sms_from_the_compute_beside_it():
    """A layer pair under the combined 1F1B takes max(compute + share x all-to-alls, all-to-alls),
    the share being the SMs the dispatch kernels hold (DeepEP's 20 of an H100's 132)."""
    from planner.cost.comm_overlap import overlapped_ep

    ep = np.full((1, 5, 1, 2), 4.0)  # [group, mode, b, block]: 4 ms of all-to-alls
    fwd, bwd = np.full((1, 1, 2), 3.0), np.full((1, 1, 2), 6.0)  # 9 ms of compute hides all of it
    share = np.array([[FLEX_SMS["deepep"] / 132, 0.0]])
    out = overlapped_ep(ep, fwd, bwd, share)
    assert out[0, 0, 0, 0] == pytest.approx(4.0 * 20 / 132)  # the compute slowed while they run
    assert out[0, 0, 0, 1] == 0.0  # NCCL's all-to-all: no reserved SMs priced
    short = overlapped_ep(ep, fwd / 4, bwd / 4, share)  # 2.25 ms of compute: the all-to-alls bound
    assert short[0, 0, 0, 0] == pytest.approx(4.0 - 2.25)


# -- capacity-factor token dropping ------------------------------------------------------------------


def test_a_capacity_factor_prices_every_expert_at_it_whatever_the_routing():
    """Padded to capacity, each expert takes exactly F x its mean tokens: the grouped GEMMs and the
    all-to-all bytes follow F, not the routing's imbalance (and not 1.0 on one EP rank either)."""
    def moe(imbalance: float, capacity: float | None, ep: int = 8):
        w = Workload(global_batch=8, seq_len=4096, moe_imbalance=imbalance, moe_capacity_factor=capacity)
        spec = load_model("mixtral-8x7b")
        costs = layer_costs(spec, w, tp=1, ep=ep)
        return next(c for c, b in zip(costs, spec.blocks) if b.kind == "decoder" and b.mlp.kind == "moe")

    dropless, capped, padded = moe(1.5, None), moe(1.5, 1.25), moe(1.0, 1.25)
    assert capped.ep_a2a == pytest.approx(dropless.ep_a2a * 1.25 / 1.5)
    assert capped.ep_a2a == padded.ep_a2a and capped.gemms == padded.gemms  # the routing no longer matters
    # on one EP rank too: every expert padded to 1.25 x its mean tokens (dropless there: 1.0)
    one, one_dropless = moe(1.0, 1.25, ep=1), moe(1.0, None, ep=1)
    grouped = [next(g for g in c.gemms if g.batch > 1) for c in (one, one_dropless)]  # the local experts' GEMM
    assert grouped[0].tokens == pytest.approx(1.25 * grouped[1].tokens)


def test_a_capacity_factor_is_written_for_megatron_and_deepspeed():
    plan, model = make_plan("mixtral-8x7b", 2, framework="megatron", ep=8, grad_accum=4, moe_capacity_factor=1.25)
    flags = [x for a in megatron_lm_args(model, plan) for x in (a.flag, a.value) if x is not None]
    assert flags[flags.index("--moe-expert-capacity-factor") + 1] == "1.25"
    assert "--moe-pad-expert-input-to-capacity" in flags
    plain, _ = make_plan("mixtral-8x7b", 2, framework="megatron", ep=8, grad_accum=4)
    assert "--moe-expert-capacity-factor" not in [a.flag for a in megatron_lm_args(model, plain)]
    from planner.emit.ds_config import build_moe_config

    ds, _ = make_plan("mixtral-8x7b", 2, framework="deepspeed", ep=8, grad_accum=4, moe_capacity_factor=1.25)
    assert build_moe_config(ds, model)["deepspeed_moe"]["capacity_factor"] == 1.25


@pytest.mark.parametrize(("flags", "words"), [
    (["--moe-capacity-factor", "0"], ["--moe-capacity-factor", "above 0", "dropless"]),
    (["--moe-capacity-factor", "1.2", "--moe-dispatcher", "flex", "--framework", "megatron"],
     ["--moe-capacity-factor with --moe-dispatcher flex", "alltoall or allgather"]),
])
def test_a_capacity_factor_the_plan_cannot_take_is_one_clear_error(flags, words):
    r = _run("estimate", "--model", "mixtral-8x7b", "--nodes", "2", "--ep", "8", *flags)
    assert r.exit_code == 2 and "Traceback" not in r.output
    for w in words:
        assert w in r.output, r.output
