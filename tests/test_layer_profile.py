"""``dsplan profile`` measures a model's blocks for real, and ``--profile`` prices plans with them.

The profile runs here on the CPU (a quarter-width gpt3-125m, a few repetitions): every number
below is measured afresh, none recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner import api
from planner.cost.measured_blocks import block_signature, load_layer_profile, measured_for
from planner.errors import UserError

DSPLAN = [sys.executable, "-m", "planner"]


def _dsplan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*DSPLAN, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("profile")
    done = _dsplan("profile", "--model", "gpt3-125m", "--device", "cpu", "--seq-len", "128", "--micro-batch", "2",
                   "--warmup", "1", "--repetitions", "3", "--out", "p.json", "--hardware-out", "box.yaml", cwd=where)
    assert done.returncode == 0, done.stderr
    return where


def test_every_distinct_block_is_measured_once_with_its_costs(profiled):
    prof = load_layer_profile(profiled / "p.json")
    spec = api.load_model("gpt3-125m")
    assert [b.kind for b in prof.blocks] == ["embedding", "decoder", "norm", "lm_head"]
    assert {block_signature(b) for b in spec.blocks} == {b.signature for b in prof.blocks}
    decoder = prof.blocks[1]
    assert decoder.backward_s > decoder.forward_s > 0  # two GEMMs per forward one
    assert decoder.recompute_s is not None and decoder.recompute_s > 0.3 * decoder.forward_s
    assert prof.blocks[0].recompute_s is None  # only transformer layers are checkpointed
    # the decoder keeps at least its inputs of 2 x 128 tokens x 768 fp32 for the four GEMMs, and
    # less than the analytic count with no FlashAttention (scores 12 heads x 128^2 per sample)
    assert 4 * 2 * 128 * 768 * 4 < decoder.activation_bytes < 40 * 2 * 128 * 768 * 4
    assert prof.matmul_flops_per_s() > 1e9
    assert prof.memory_bandwidth_GBps > 0.5
    assert {c.op for c in prof.collectives} == {"allreduce", "allgather", "reducescatter"}
    # the two ranks copied at once (they share the host's memory), into mapped and into new memory
    assert prof.rank_copy_GBps > 0.5 and prof.alloc_copy_GBps > 0.1
    assert prof.hardware == "box" and prof.dtype == "fp32" and prof.micro_batch == 2 and prof.seq_len == 128


def test_the_hardware_profile_carries_the_measured_rates(profiled):
    """--hardware-out: each rank's copy rate with both copying (the HBM a CPU rank gets), the rate
    into new memory, and gloo's all-gather / reduce-scatter as shares of its all-reduce's bus
    bandwidth, each fitted from the collectives the profile measured."""
    from planner.run.profile_device import fit_link

    prof = load_layer_profile(profiled / "p.json")
    box = api.load_hardware(str(profiled / "box.yaml"))
    assert box.gpu.vendor == "cpu"
    assert box.gpu.hbm_GBps == pytest.approx(prof.rank_copy_GBps, rel=1e-3)
    assert box.gpu.alloc_copy_GBps == pytest.approx(prof.alloc_copy_GBps, rel=1e-3)
    points = list(prof.collectives)
    for op in ("allgather", "reducescatter"):
        want = min(4.0, fit_link(points, op)[1] / fit_link(points, "allreduce")[1])
        assert box.node.intra.op_share[op] == pytest.approx(want, rel=1e-3)


def test_at_the_profiles_own_point_the_prediction_is_the_measurement(profiled):
    prof = load_layer_profile(profiled / "p.json")
    cluster = api.load_cluster(str(profiled / "box.yaml"), gpus_per_node=1)
    plan = api.estimate("gpt3-125m", cluster, global_batch=2, micro_batch=2, seq_len=128, precision="fp32",
                        layer_profile=str(profiled / "p.json"))
    spec = api.load_model("gpt3-125m")
    by_sig = {b.signature: b for b in prof.blocks}
    measured = sum(by_sig[block_signature(b)].forward_s + by_sig[block_signature(b)].backward_s for b in spec.blocks)
    assert plan.time.compute == pytest.approx(measured, rel=1e-6)
    assert plan.to_json()["layer_profile"]["device"] == prof.device


def test_at_the_profiles_own_point_the_activations_are_the_measured_ones(profiled):
    """Each block keeps what the profile saw kept for backward (saved tensors, fp32 here) at its
    micro-batch; another micro-batch scales it by the analytic shape, every block by its own level."""
    prof = load_layer_profile(profiled / "p.json")
    cluster = api.load_cluster(str(profiled / "box.yaml"), gpus_per_node=1)
    spec = api.load_model("gpt3-125m")
    by_sig = {b.signature: b for b in prof.blocks}
    measured = sum(by_sig[block_signature(b)].activation_bytes for b in spec.blocks)
    knobs = dict(global_batch=4, seq_len=128, precision="fp32", layer_profile=str(profiled / "p.json"))
    plan = api.estimate("gpt3-125m", cluster, micro_batch=2, **knobs)
    # (the final norm's few saved fp32 statistics, which the analytic count has at none, stay none)
    assert plan.memory.activations == pytest.approx(measured, rel=1e-4)
    plain = api.estimate("gpt3-125m", cluster, micro_batch=2, **{**knobs, "layer_profile": None})
    assert plain.memory.activations != pytest.approx(measured, rel=0.05)  # the analytic count differs
    double = api.estimate("gpt3-125m", cluster, micro_batch=4, **knobs)
    assert double.memory.activations == pytest.approx(2 * plan.memory.activations, rel=1e-9)  # linear in b


def test_other_micro_batches_scale_each_blocks_measurement_by_its_analytic_shape(profiled):
    from planner.cost import efficiency as eff
    from planner.cost.block_times import BlockTables

    cluster = api.load_cluster(str(profiled / "box.yaml"), gpus_per_node=1)
    plain = api.make_workload("gpt3-125m", gpus=1, global_batch=2, seq_len=128, precision="fp32")
    measured = plain.model_copy(update={"layer_profile": load_layer_profile(profiled / "p.json")})
    spec, dev = api.load_model("gpt3-125m"), eff.device(cluster.profile, "fp32")
    with_p = BlockTables(spec, cluster, measured, dev).table(1, 0, 1, (2, 4, 8))
    without = BlockTables(spec, cluster, plain, dev).table(1, 0, 1, (2, 4, 8))
    for name in ("fwd", "bwd"):
        ratio = getattr(with_p, name) / getattr(without, name)  # [micro-batch, block]
        assert ratio == pytest.approx(ratio[0:1].repeat(3, axis=0), rel=1e-9)  # one level per block
    assert with_p.fwd[0].sum() == pytest.approx(sum(b.forward_s for b in measured.layer_profile.blocks)
                                                + 11 * measured.layer_profile.blocks[1].forward_s, rel=1e-9)


def test_a_profile_of_another_model_or_system_is_refused(profiled):
    path = str(profiled / "p.json")
    cluster = api.load_cluster(str(profiled / "box.yaml"), gpus_per_node=1)
    with pytest.raises(UserError, match="measured model gpt3-125m, not gpt3-350m"):
        api.estimate("gpt3-350m", cluster, global_batch=2, micro_batch=2, seq_len=128, layer_profile=path)
    with pytest.raises(UserError, match="measured for hardware box"):
        api.estimate("gpt3-125m", api.load_cluster("dgx-a100-80g"), global_batch=8, micro_batch=1, seq_len=128,
                     layer_profile=path)


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "cannot read it as JSON"),
    ('{"format": "other"}', "not a dsplan layer profile"),
    ('{"format": "dsplan-layer-profile/1", "model": "x"}', "write it again with `dsplan profile`"),
])
def test_bad_profile_files_exit_2_with_one_message(tmp_path, content, message):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    done = _dsplan("estimate", "--model", "gpt3-125m", "--profile", str(path), cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_profile_refuses_to_overwrite_without_force(profiled):
    done = _dsplan("profile", "--model", "gpt3-125m", "--device", "cpu", "--out", "p.json", cwd=profiled)
    assert done.returncode == 2 and "exists; pass --force" in done.stderr
    assert json.loads((profiled / "p.json").read_text())["model"] == "gpt3-125m"


def test_profile_output_paths_too_long_for_the_filesystem_exit_2(tmp_path):
    """Found by tests/test_fuzz_inputs.py: --out and --hardware-out were plain click paths, so a
    name over the filesystem's limit raised OSError with a traceback."""
    long = "p" * 300 + ".json"
    for flag in ("--out", "--hardware-out"):
        args = ["--out", long] if flag == "--out" else ["--out", "p.json", "--hardware-out", long]
        done = _dsplan("profile", "--model", "gpt3-125m", "--device", "cpu", *args, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert f"cannot write {flag}" in done.stderr and "give a shorter path" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_profile_on_cuda_without_a_gpu_says_so(tmp_path):
    done = _dsplan("profile", "--model", "gpt3-125m", "--device", "cuda", "--out", "p.json", cwd=tmp_path)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
    assert not (tmp_path / "p.json").exists()


def test_the_pipeline_balancer_balances_the_measured_costs(profiled):
    """The same model and layout, with its embedding measured 40 times heavier: the optimal
    balancer moves decoder layers off the first stage to even the measured stages out."""
    prof = load_layer_profile(profiled / "p.json")
    decoder = prof.blocks[1]
    heavy = prof.model_copy(update={"blocks": (prof.blocks[0].model_copy(update={
        "forward_s": 40 * decoder.forward_s, "backward_s": 40 * decoder.backward_s}), *prof.blocks[1:])})
    cluster = api.load_cluster(str(profiled / "box.yaml"))
    common = {"seq_len": 128, "precision": "fp32", "global_batch": 8, "pp": 2, "micro_batch": 1, "top": 1,
              "framework": "deepspeed"}

    def first_stage_blocks(profile) -> int:
        best = api.suggest("gpt3-125m", cluster, layer_profile=profile, **common).plans[0].plan
        return best.partition[0][1] - best.partition[0][0]

    assert first_stage_blocks(heavy) < first_stage_blocks(prof)


def test_an_mtp_depth_runs_at_its_layers_measured_ratio(profiled):
    """The profiler builds no MTP module: with --mtp-layers 1 the depth (one more decoder layer,
    the projection and the head again) is priced at its layer's measured / analytic ratio."""
    prof = load_layer_profile(profiled / "p.json")
    spec = api.load_model("gpt3-125m")
    with_mtp = spec.with_mtp_layers(1)
    index = measured_for(prof, with_mtp, "box")
    decoder = next(i for i, b in enumerate(spec.blocks) if b.kind == "decoder")
    assert index[-1] == index[decoder] and len(index) == len(spec.blocks) + 1
    cluster = api.load_cluster(str(profiled / "box.yaml"), gpus_per_node=1)
    kw = dict(global_batch=2, micro_batch=2, seq_len=128, precision="fp32", framework="megatron",
              layer_profile=str(profiled / "p.json"))
    plain, mtp = api.estimate("gpt3-125m", cluster, **kw), api.estimate("gpt3-125m", cluster, mtp_layers=1, **kw)
    assert mtp.time.compute > plain.time.compute + (prof.blocks[1].forward_s + prof.blocks[1].backward_s) * 0.99
