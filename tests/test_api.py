"""The Python API (planner/api.py): same numbers as the modules and the CLI behind it."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from click.testing import CliRunner

import planner
from planner import api
from planner.cli import main
from planner.cost.estimate import estimate as cost_estimate
from planner.cost.parallel import ParallelConfig
from planner.errors import UserError
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.spec import ModelSpec
from planner.search.space import Constraints
from planner.search.suggest import suggest as search_suggest

GiB = 2**30


def _modules_after(code: str) -> set[str]:
    probe = (code + "; import sys; print(','.join(sorted(m for m in "
             "('torch', 'deepspeed', 'matplotlib', 'pandas', 'planner.api') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(filter(None, out.stdout.strip().split(",")))


def test_import_planner_is_cheap_and_api_loads_lazily():
    assert _modules_after("import planner") == set()
    # The API itself pulls in neither plotting nor tables nor the training stack.
    assert _modules_after(
        "from planner import load_model, load_cluster, estimate, suggest, records, to_dataframe") == {"planner.api"}


def test_lazy_exports_are_the_api_functions():
    assert planner.estimate is api.estimate
    assert planner.suggest is api.suggest
    assert planner.load_model is api.load_model
    assert set(api.__all__) <= set(dir(planner))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        planner.nope  # noqa: B018


def test_load_model_cluster_and_hardware():
    vl2 = api.load_model("vl2")
    assert isinstance(vl2, ModelSpec) and vl2.name == "deepseek-vl2"
    assert api.load_model(vl2) is vl2
    cluster = api.load_cluster("dgx-a100-80g", nodes=4)
    assert (cluster.nodes, cluster.gpus_per_node, cluster.num_gpus) == (4, 8, 32)
    assert api.load_cluster(nodes=2, gpus_per_node=4).num_gpus == 8
    assert api.load_hardware("h100").gpu.memory_GiB == 80
    with pytest.raises(UserError, match="no-such-model|unknown"):
        api.load_model("no-such-model")
    with pytest.raises(UserError, match="^nodes: need a whole number >= 1, got 0$"):
        api.load_cluster(nodes=0)
    with pytest.raises(UserError, match="gpus_per_node"):
        api.load_cluster(nodes=1, gpus_per_node=0)
    with pytest.raises(UserError, match="gpus_per_node: need a whole number from 1 to 576"):
        api.load_cluster(nodes=1, gpus_per_node=100_000)


def test_make_workload_defaults_follow_the_model_and_the_cli():
    vl2 = api.load_model("vl2")
    wl = api.make_workload(vl2, gpus=64)
    assert wl.seq_len == vl2.train_seq_len == 4096
    assert wl.global_batch % 64 == 0
    assert 0.75 * 4e6 <= wl.global_batch * wl.seq_len <= 1.5 * 4e6
    assert (wl.images_per_sample, wl.tiles_per_image) == (vl2.vision.default_images_per_sample,
                                                          vl2.vision.default_tiles_per_image)
    dense = api.make_workload("llama-3-8b", global_batch=96, seq_len=2048)
    assert (dense.global_batch, dense.seq_len, dense.images_per_sample, dense.tiles_per_image) == (96, 2048, 0, 0)
    with pytest.raises(UserError, match="not a vision-language model"):
        api.make_workload("llama-3-8b", images_per_sample=1)
    with pytest.raises(UserError, match="exceeds deepseek-vl2's 9 local tiles"):
        api.make_workload(vl2, tiles_per_image=12)
    with pytest.raises(UserError, match="^global_batch: need a whole number >= 1, got 0$"):
        api.make_workload(vl2, global_batch=0)


def test_estimate_matches_the_cost_model_and_the_cli():
    vl2 = api.load_model("vl2")
    cluster = api.load_cluster(nodes=8)
    plan = api.estimate(vl2, cluster, zero=2, micro_batch=2)
    # Defaults: dp fills the 64 GPUs, accumulation = batch / (micro-batch x dp).
    wl = api.make_workload(vl2, gpus=64)
    cfg = ParallelConfig(dp=64, zero_stage=2, micro_batch=2, grad_accum=wl.global_batch // 128)
    direct = cost_estimate(vl2, Cluster.build(load_profile("dgx-a100-80g"), 8), wl, cfg)
    assert plan.cfg == cfg
    assert plan.step_time_s == pytest.approx(direct.step_time_s, rel=1e-12)
    assert plan.memory.peak == pytest.approx(direct.memory.peak, rel=1e-12)

    result = CliRunner().invoke(main, ["estimate", "--model", "vl2", "--nodes", "8", "--zero", "2",
                                       "--micro-batch", "2", "--global-batch", str(wl.global_batch), "--json"])
    assert result.exit_code == 3, result.output  # priced all the same, though it does not fit (status 3)
    cli = json.loads(result.stdout)
    assert cli["step_time_s"] == pytest.approx(plan.step_time_s, rel=1e-12)
    assert cli["memory"]["peak_bytes"] == pytest.approx(plan.memory.peak, rel=1e-12)


def test_estimate_defaults_and_bad_input():
    plan = api.estimate("llama-3-8b", api.load_cluster(nodes=1),
                        workload=api.make_workload("llama-3-8b", global_batch=64))
    assert (plan.cfg.dp, plan.cfg.tp, plan.cfg.pp, plan.cfg.zero_stage, plan.cfg.grad_accum) == (8, 1, 1, 1, 8)
    cluster = api.load_cluster(nodes=1)
    with pytest.raises(UserError, match="tp 3 x pp 1 = 3 does not divide the 8 GPUs"):
        api.estimate("llama-3-8b", cluster, tp=3)
    with pytest.raises(UserError, match="invalid plan: .*optimizer offload needs ZeRO"):
        api.estimate("llama-3-8b", cluster, zero=0, offload="optimizer")
    with pytest.raises(UserError, match="micro_batch: need a whole number >= 1, got 0"):
        api.estimate("llama-3-8b", cluster, micro_batch=0)
    with pytest.raises(UserError, match="does not divide the 32 attention heads"):
        api.estimate("llama-3-8b", api.load_cluster(nodes=1, gpus_per_node=6), tp=6)


def test_record_is_flat_and_carries_the_plan_numbers():
    plan = api.estimate("llama-3-8b", api.load_cluster(nodes=1), tp=2, pp=2, zero=1, micro_batch=2,
                        framework="megatron-deepspeed")
    row = api.record(plan)
    data = plan.to_json()
    assert all(isinstance(v, (int, float, str, bool)) for v in row.values()), {k: type(v) for k, v in row.items()}
    for key in ("dp", "tp", "pp", "zero_stage", "micro_batch", "grad_accum", "fits", "tokens_per_s", "mfu",
                "step_time_s"):
        assert row[key] == data[key]
    assert row["peak_bytes"] == data["memory"]["peak_bytes"]
    assert row["peak_gib"] == pytest.approx(data["memory"]["peak_bytes"] / GiB)
    assert row["pp_bubble_s"] == data["time"]["pp_bubble_s"] > 0
    assert sum(row[k] for k in ("compute_s", "recompute_s", "tp_comm_s", "pp_bubble_s", "pp_comm_s", "dp_comm_s",
                                "ep_comm_s", "optimizer_s")) == pytest.approx(row["step_time_s"])
    assert row["stages"] == 2
    assert row["label"] == "tp2 pp2 dp2 z1 mb2"
    assert api.records([plan, data]) == [row, row]


def test_suggest_is_the_search_with_the_api_workload():
    vl2 = api.load_model("vl2")
    cluster = api.load_cluster(nodes=1)
    found = api.suggest(vl2, cluster, top=3, framework="deepspeed", zero=[1, 3])
    wl = api.make_workload(vl2, gpus=8)
    direct = search_suggest(vl2, "dgx-a100-80g", 1, global_batch=wl.global_batch, top=3,
                            constraints=Constraints(framework=("deepspeed",), zero=(1, 3)))
    assert [p.plan.tokens_per_s for p in found.plans] == [p.plan.tokens_per_s for p in direct.plans]
    assert found.evaluated == direct.evaluated and found.rejected == direct.rejected
    tps = [p.plan.tokens_per_s for p in found.plans]
    assert tps == sorted(tps, reverse=True) and len(tps) == 3
    assert all(p.plan.fits and p.plan.cfg.zero_stage in (1, 3) and p.plan.cfg.framework == "deepspeed"
               for p in found.plans)
    rows = api.records(found.plans)
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert rows[0]["tokens_per_s"] == tps[0]


def test_suggest_bad_input():
    cluster = api.load_cluster(nodes=1)
    with pytest.raises(UserError, match="unknown search constraint.*colour"):
        api.suggest("llama-3-8b", cluster, colour="red")
    with pytest.raises(UserError, match="^tp 3 cannot divide the 8 GPUs"):
        api.suggest("llama-3-8b", cluster, tp=3)
    with pytest.raises(UserError, match="no plan fits"):
        api.suggest("llama-2-70b", cluster, zero=0, offload="none", recompute="none", micro_batch=1, tp=1, pp=1)
    assert api.constraints(tp=8, pp=[2, 4], allow_tp_across_nodes=1) == Constraints(tp=(8,), pp=(2, 4),
                                                                                    allow_tp_across_nodes=True)


def test_to_dataframe():
    found = api.suggest("llama-3-8b", api.load_cluster(nodes=1), top=2, framework="deepspeed")
    df = api.to_dataframe(found)
    assert len(df) == 2
    assert list(df["tokens_per_s"]) == [p.plan.tokens_per_s for p in found.plans]
    assert list(api.to_dataframe(api.records(found.plans))["label"]) == list(df["label"])


def test_to_dataframe_without_pandas_names_the_fix():
    code = ("import sys; sys.modules['pandas'] = None\n"
            "from planner import to_dataframe\nfrom planner.errors import UserError\n"
            "try:\n    to_dataframe([])\nexcept UserError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "needs pandas: pip install pandas" in out.stdout


def test_with_fabric_builds_a_modified_copy():
    base = api.load_hardware("dgx-a100-80g")
    ndr = api.with_fabric(base, fabric="ndr", oversubscription=2)
    assert (ndr.fabric.kind, ndr.node.nics.speed_gbit, ndr.fabric.oversubscription) == ("infiniband_ndr", 400.0, 2.0)
    assert ndr.name == "dgx-a100-80g+ndr+2:1"
    assert (base.fabric.kind, base.node.nics.speed_gbit, base.fabric.oversubscription) == ("infiniband_hdr", 200.0, 1.0)
    assert ndr.gpu == base.gpu
    assert api.with_fabric("dgx-a100-80g", nic_gbit=100, name="slow").node.nics.speed_gbit == 100.0
    with pytest.raises(UserError, match="fabric 'token-ring' is unknown"):
        api.with_fabric(base, fabric="token-ring")
    with pytest.raises(UserError, match="oversubscription"):
        api.with_fabric(base, oversubscription=0.5)


def test_fabric_changes_data_parallel_time_across_the_spine():
    # 32 DGX A100s span two leaf blocks of a 40-port fabric, so DP rings cross the spine:
    # a 2:1 taper halves the uplinks and slows the gradient traffic; NDR speeds it up.
    def dp_time(**fabric):
        return api.estimate("llama-3-8b", api.load_cluster(api.with_fabric("dgx-a100-80g", **fabric), 32),
                            zero=1).time.dp_comm

    full, tapered, ndr = dp_time(fabric="hdr"), dp_time(fabric="hdr", oversubscription=2), dp_time(fabric="ndr")
    assert tapered > 1.5 * full > 0
    assert ndr < full
    assert math.isfinite(tapered)


def test_docstring_examples_run():
    """The examples in the API and sweep docstrings are the documentation: keep them true."""
    import doctest

    import planner.api_records
    import planner.explore

    for module in (api, planner.explore):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__
        assert result.attempted >= 10, module.__name__
    assert doctest.testmod(planner.api_records, optionflags=doctest.ELLIPSIS).failed == 0
