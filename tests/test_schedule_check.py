"""The schedule check: Megatron's interleaved schedule replayed over a plan's own chunks, and the
note suggest, estimate and the run directory's README print when it disagrees with the formula."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.cost import schedule_check as sc
from planner.cost.block_times import BlockTables
from planner.cost.efficiency import device
from planner.cost.estimate import estimate
from planner.cost.parallel import ParallelConfig, Workload
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.catalog import load_model

# llama-3-70b (embedding, 80 decoders, norm, head: 83 blocks) on pp 4 x v 5: a split with the
# optimal slowest chunk that packs five decoders into 15 chunks and one or two into the rest
# (the balancer's max-pack chose it before it spread the chunks evenly, packing._even_ends).
UNEVEN = [(0, 5), (5, 10), (10, 15), (15, 20), (20, 25), (25, 30), (30, 35), (35, 40), (40, 45), (45, 50),
          (50, 55), (55, 60), (60, 65), (65, 70), (70, 75), (75, 77), (77, 78), (78, 79), (79, 80), (80, 83)]
CFG = ParallelConfig(dp=4, tp=4, pp=4, zero_stage=1, micro_batch=1, grad_accum=128, sequence_parallel=True,
                     virtual_stages=5, framework="megatron")
STAGE_BLOCKS = ",".join(f"{a}-{b}" for a, b in UNEVEN)


@pytest.fixture(scope="module")
def setting():
    model = load_model("llama-3-70b")
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 8)
    workload = Workload(global_batch=512, seq_len=model.train_seq_len)
    return model, cluster, workload, BlockTables(model, cluster, workload, device(cluster.profile))


def test_uneven_chunks_replay_slower_than_the_formula_and_get_a_note(setting) -> None:
    model, cluster, workload, ev = setting
    fwd, bwd, _ = sc.chunk_times(ev, CFG, UNEVEN)
    chunk = sorted(f + b for fr, br in zip(fwd, bwd) for f, b in zip(fr, br))
    assert chunk[-1] > 4 * chunk[0]  # 1-layer chunks next to 5-layer ones
    formula, replayed = sc.formula_and_replay(ev, CFG, UNEVEN)
    assert 1.02 < replayed / formula < 1.05
    plan = estimate(model, cluster, workload, CFG, partition=UNEVEN)
    (note,) = sc.schedule_notes(ev, CFG, UNEVEN, plan.step_time_s)
    assert "20 chunks" in note and "more than the pipeline formula" in note and "uneven chunks stall" in note
    assert f"{(replayed - formula) / plan.step_time_s:+.1%}" in note


def test_even_chunks_and_plain_pipelines_get_no_note(setting) -> None:
    model, cluster, workload, ev = setting
    even = estimate(model, cluster, workload, CFG)  # Megatron's even split: four decoders per chunk
    assert sc.schedule_notes(ev, CFG, even.partition, even.step_time_s) == []
    formula, replayed = sc.formula_and_replay(ev, CFG, even.partition)
    assert abs(replayed / formula - 1) < sc.NOTE_GAP
    # 1F1B is not checked, however uneven its stages (the formula is within 0.5% there).
    plain = ParallelConfig(dp=4, tp=4, pp=4, zero_stage=1, micro_batch=1, grad_accum=128, sequence_parallel=True,
                           framework="megatron")
    lopsided = [(0, 10), (10, 30), (30, 60), (60, 83)]
    assert sc.schedule_notes(ev, plain, lopsided, 100.0) == []
    assert sc.formula_and_replay(ev, plain, lopsided) is not None


def test_schedules_too_long_to_replay_are_skipped(setting) -> None:
    _, _, _, ev = setting
    long = CFG.model_copy(update={"grad_accum": sc.MAX_REPLAY_OPS})
    assert sc.formula_and_replay(ev, long, UNEVEN) is None
    assert sc.schedule_notes(ev, long, UNEVEN, 100.0) == []


def test_estimate_suggest_and_the_run_readme_print_the_note(tmp_path: Path) -> None:
    args = ["--model", "llama-3-70b", "--nodes", "8", "--tp", "4", "--pp", "4", "--virtual-stages", "5",
            "--framework", "megatron", "--zero", "1", "--sequence-parallel", "--global-batch", "512"]
    runner = CliRunner()
    uneven = runner.invoke(main, ["estimate", *args, "--stage-blocks", STAGE_BLOCKS, "--allow-oom", "--json"])
    assert uneven.exit_code == 0, uneven.output
    notes = json.loads(uneven.stdout)["notes"]
    assert any("replayed op by op" in n for n in notes)
    even = runner.invoke(main, ["estimate", *args, "--allow-oom", "--json"])
    assert not any("replayed" in n for n in json.loads(even.stdout).get("notes", []))

    # Eight micro-batches on pp 8 x v 2: even chunks, but the ranks with the embedding and the head
    # differ, and with so few micro-batches the schedule overlaps them better than the formula.
    found = runner.invoke(main, ["suggest", "--model", "llama-3.1-70b", "--nodes", "64", "--pp", "8",
                                 "--virtual-stages", "2", "--global-batch", "64", "--top", "2",
                                 "--no-tp-comm-overlap", "--cp", "1", "--json"])
    assert found.exit_code == 0, found.output
    data = json.loads(found.output)
    best = data["plans"][0]
    assert best["virtual_stages"] == 2 and best["grad_accum"] == 8
    (note,) = [n for n in data["notes"] if "replayed op by op" in n]
    assert "less than the pipeline formula" in note and "unequal ranks overlap more" in note
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(best))
    out = tmp_path / "run"
    gen = runner.invoke(main, ["generate", "--plan", str(plan_file), "--out", str(out)])
    assert gen.exit_code == 0, gen.output
    assert "replayed op by op" in (out / "README.md").read_text()
