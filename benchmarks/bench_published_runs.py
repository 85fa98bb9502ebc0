"""Accuracy beyond the calibration table: dsplan's step time against published training runs.

bench_megatron_table1.py is where the two global efficiency factors were fitted; these runs
were not used to fit anything. Each row is a published iteration time (or TFLOP/s converted
with the source's own formula) for a fully stated layout, priced with ``estimate``:

- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198), Tables 3 and 5: GPT 22B-1T on A100-80GB, TP 8, iteration time with full
  recomputation and with sequence parallelism + selective recomputation (2022 Megatron-LM:
  fp16, no FlashAttention, dropout; pipeline sends scatter/gathered as in Narayanan et al. 2021).
- Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B"
  (arXiv:2201.11990), sec. 2.4: 530B, TP 8 x PP 35 on 280/350/420 DGX A100 nodes, batch 1920
  x 2048, 60.1 / 50.2 / 44.4 s per iteration (Megatron-DeepSpeed). The paper does not state the
  micro-batch; the three times imply it (``mtnlg_micro_batch``): 2.
- Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4: 405B, TP 8 x PP 16 on 8,192 and
  16,384 H100 at 8K tokens, 430 / 400 TFLOP/s per GPU. The virtual-stage count is not stated
  (4 assumed); the FLOP formula is not stated (dsplan's model FLOPs used); Meta's own pipeline
  schedule holds fewer micro-batches than Megatron-Core's, so dsplan says these layouts do not
  fit in 80 GiB without recomputation.

- MosaicML llm-foundry, scripts/train/benchmarking/README.md ("MPT Training Benchmarks", tables
  "H100 80GB BF16" and "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"; read at commit
  061f2c7c of mosaicml/llm-foundry): MPT 1B-30B on one node of 8 GPUs, FSDP FULL_SHARD (priced as
  DeepSpeed ZeRO-3), amp_bf16, the stated micro-batch, gradient accumulation, global batch and
  activation checkpointing (full, per block), tokens/s. The runs of sweep.sh: llm-foundry
  v0.0.4, PyTorch 2.0.1 + CUDA 11.8, MPT's Triton FlashAttention. The MPT shapes (d_model,
  heads, layers; vocab 50368; 4x GELU MLP with biases, LayerNorm, tied head) reproduce the
  table's NumParams exactly, learned positions included (NumParams grows by d_model per token
  of SeqLen: these benchmark configs did not use ALiBi; positions cost no compute in dsplan
  either way). Published step time = GlobalBatchSize (T) / Throughput (T/s). A100 and H100 rows
  share model and sequence; the layouts are the source's own, so they differ where it did.
  Attention: every MPT benchmark config sets attn_impl: triton, the FlashAttention-1 Triton port
  (llmfoundry/models/layers/flash_attn_triton.py), priced as FlashAttention-1 (--flash-version 1).
- MosaicML "nodes": every row of the same README on more than one node (16-128 GPUs), the FSDP
  runs across nodes: the "A100 40GB with 1600 Gbps node-node interconnect (RoCE)" table (bf16,
  mixed precision PURE; priced on dgx-a100-40g, whose 8 x 200 Gb/s per node is the same 1,600
  Gbps), the A100 80GB table's two 70B rows and the "H100 80GB BF16" table's rows (dgx-h100: the
  README does not say the H100 cluster's network). MPT 125M / 350M / 760M / 70B shapes from
  scripts/train/yamls/pretrain/mpt-*.yaml at the same commit.

Error = published time / predicted time - 1: "+" means dsplan predicts faster than measured.

Usage: python benchmarks/bench_published_runs.py [--json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_megatron_table1 import megatron_gpt  # noqa: E402

from planner.cost.estimate import estimate  # noqa: E402
from planner.cost.parallel import ParallelConfig, Workload  # noqa: E402
from planner.hardware.cluster import Cluster  # noqa: E402
from planner.hardware.load import load_profile  # noqa: E402
from planner.model.catalog import load_model  # noqa: E402

# Korthikanti et al. 2022 Table 3 (model, layout) and Table 5 (seconds per iteration).
KORTHIKANTI = [
    # name, hidden, heads, layers, pp, global batch, micro-batch, virtual stages, selective s, full s
    ("22B", 6144, 64, 48, 1, 4, 4, 1, 1.10, 1.42),
    ("175B", 12288, 96, 96, 8, 64, 1, 3, 13.75, 18.13),
    ("530B", 20480, 128, 105, 35, 280, 1, 3, 37.83, 49.05),
    ("1T", 25600, 160, 128, 64, 512, 1, 1, 71.49, 94.42),
]
MTNLG = [(280, 60.1), (350, 50.2), (420, 44.4)]  # DGX nodes, seconds per iteration (Smith et al. 2022)
MTNLG_SAMPLES = [1920 * 35 // nodes for nodes, _s in MTNLG]  # per pipeline: 1920 over dp = nodes x 8 / (8 x 35)
LLAMA3 = [(1024, 430.0), (2048, 400.0)]  # H100 nodes, TFLOP/s per GPU (Dubey et al. 2024, Table 4)

# MosaicML llm-foundry "MPT Training Benchmarks": (d_model, n_heads, n_layers) of the MPT configs.
MPT_SHAPES = {"125M": (768, 12, 12), "350M": (1024, 16, 24), "760M": (1536, 12, 24), "1B": (2048, 16, 24),
              "3B": (2560, 20, 32), "7B": (4096, 32, 32), "13B": (5120, 40, 40), "30B": (7168, 56, 48),
              "70B": (8192, 64, 80)}
MOSAIC = [
    # gpu, model, seq, GPUs, micro-batch, grad accum, global batch, tokens/s, activation checkpointing, NumParams
    ("H100", "1B", 2048, 8, 14, 1, 112, 363645, False, 1315950592),
    ("A100", "1B", 2048, 8, 14, 4, 448, 164109, False, 1315950592),
    ("H100", "1B", 4096, 8, 7, 4, 224, 308282, False, 1320144896),
    ("A100", "1B", 4096, 8, 7, 4, 224, 142457, False, 1320144896),
    ("H100", "3B", 4096, 8, 5, 6, 240, 167712, False, 2657080320),
    ("A100", "3B", 4096, 8, 5, 6, 240, 75658, False, 2657080320),
    ("H100", "7B", 2048, 8, 6, 1, 48, 85144, False, 6658859008),
    ("A100", "7B", 2048, 8, 6, 2, 96, 37130, False, 6658859008),
    ("H100", "7B", 4096, 8, 16, 2, 256, 68893, True, 6667247616),
    ("A100", "7B", 4096, 8, 16, 2, 256, 29472, True, 6667247616),
    ("H100", "13B", 2048, 8, 2, 1, 16, 38336, False, 12853954560),
    ("A100", "13B", 2048, 8, 2, 3, 48, 18097, False, 12853954560),
    ("H100", "13B", 4096, 8, 10, 3, 240, 37740, True, 12864440320),
    ("A100", "13B", 4096, 8, 10, 3, 240, 16482, True, 12864440320),
    ("H100", "30B", 2048, 8, 3, 21, 504, 16022, True, 29975214080),
    ("A100", "30B", 2048, 8, 3, 21, 504, 7330, True, 29975214080),
    ("H100", "30B", 4096, 8, 1, 21, 168, 14419, True, 29989894144),
    ("A100", "30B", 4096, 8, 1, 21, 168, 6513, True, 29989894144),
]
# Every row of the same tables on more than one node (16-128 GPUs, FSDP FULL_SHARD across nodes): the
# A100 40GB table ("bf16", MP mode PURE), the A100 80GB table's 70B rows and the H100 BF16 table.
MOSAIC_NODES = [
    ("A100 40GB", "70B", 2048, 128, 4, 1, 512, 48194, True, 64862437376),
    ("A100 40GB", "70B", 2048, 64, 2, 1, 128, 17672, True, 64862437376),
    ("A100 40GB", "30B", 2048, 128, 6, 1, 768, 110803, True, 29975214080),
    ("A100 40GB", "30B", 2048, 32, 4, 1, 128, 27431, True, 29975214080),
    ("A100 40GB", "13B", 2048, 128, 16, 1, 2048, 252444, True, 12853954560),
    ("A100 40GB", "13B", 2048, 64, 16, 1, 1024, 126479, True, 12853954560),
    ("A100 40GB", "13B", 2048, 32, 14, 1, 448, 63946, True, 12853954560),
    ("A100 40GB", "13B", 2048, 16, 10, 1, 160, 31900, True, 12853954560),
    ("A100 40GB", "7B", 2048, 128, 18, 1, 2304, 463749, True, 6658859008),
    ("A100 40GB", "7B", 2048, 64, 18, 1, 1152, 234614, True, 6658859008),
    ("A100 40GB", "7B", 2048, 32, 18, 1, 576, 119202, True, 6658859008),
    ("A100 40GB", "7B", 2048, 16, 16, 1, 256, 58322, True, 6658859008),
    ("A100 40GB", "3B", 2048, 128, 6, 1, 768, 1220885, False, 2651837440),
    ("A100 40GB", "3B", 2048, 64, 6, 1, 384, 623167, False, 2651837440),
    ("A100 40GB", "3B", 2048, 32, 6, 1, 192, 317261, False, 2651837440),
    ("A100 40GB", "3B", 2048, 16, 5, 1, 80, 156013, False, 2651837440),
    ("A100 40GB", "1B", 2048, 128, 10, 1, 1280, 2386897, False, 1315950592),
    ("A100 40GB", "1B", 2048, 64, 10, 1, 640, 1216104, False, 1315950592),
    ("A100 40GB", "1B", 2048, 32, 10, 1, 320, 497782, False, 1315950592),
    ("A100 40GB", "1B", 2048, 16, 8, 1, 128, 305372, False, 1315950592),
    ("A100 40GB", "760M", 2048, 128, 12, 1, 1536, 3704382, False, 760470528),
    ("A100 40GB", "760M", 2048, 64, 12, 1, 768, 1878030, False, 760470528),
    ("A100 40GB", "760M", 2048, 32, 12, 1, 384, 948745, False, 760470528),
    ("A100 40GB", "760M", 2048, 16, 12, 1, 192, 473723, False, 760470528),
    ("A100 40GB", "350M", 2048, 128, 18, 1, 2304, 6647647, False, 355985408),
    ("A100 40GB", "350M", 2048, 64, 18, 1, 1152, 3372118, False, 355985408),
    ("A100 40GB", "350M", 2048, 32, 18, 1, 576, 1721978, False, 355985408),
    ("A100 40GB", "350M", 2048, 16, 18, 1, 288, 886622, False, 355985408),
    ("A100 40GB", "125M", 2048, 128, 26, 1, 3328, 15863837, False, 125311488),
    ("A100 40GB", "125M", 2048, 64, 26, 1, 1664, 8015010, False, 125311488),
    ("A100 40GB", "125M", 2048, 32, 26, 1, 832, 4067922, False, 125311488),
    ("A100 40GB", "125M", 2048, 16, 26, 1, 416, 2088560, False, 125311488),
    ("A100", "70B", 2048, 64, 8, 4, 2048, 26274, True, 64862437376),
    ("A100", "70B", 2048, 32, 2, 16, 1024, 11962, True, 64862437376),
    ("H100", "70B", 2048, 64, 8, 4, 2048, 66523, True, 64862437376),
    ("H100", "70B", 2048, 32, 2, 16, 1024, 28242, True, 64862437376),
    ("H100", "30B", 2048, 32, 14, 3, 1344, 73860, True, 29975214080),
    ("H100", "30B", 2048, 16, 10, 3, 480, 36209, True, 29975214080),
    ("H100", "13B", 2048, 64, 2, 1, 128, 307209, False, 12853954560),
    ("H100", "13B", 2048, 32, 2, 1, 64, 153960, False, 12853954560),
    ("H100", "13B", 2048, 16, 2, 1, 32, 76280, False, 12853954560),
    ("H100", "3B", 2048, 64, 6, 3, 1152, 1441663, False, 2651837440),
    ("H100", "3B", 2048, 32, 6, 3, 576, 736701, False, 2651837440),
    ("H100", "3B", 2048, 16, 10, 3, 480, 386285, False, 2651837440),
    ("H100", "1B", 2048, 64, 20, 1, 1280, 2841754, False, 1315950592),
    ("H100", "1B", 2048, 32, 20, 1, 640, 1444183, False, 1315950592),
    ("H100", "1B", 2048, 16, 20, 1, 320, 736596, False, 1315950592),
    ("H100", "760M", 2048, 32, 24, 1, 768, 2175091, False, 760470528),
    ("H100", "760M", 2048, 16, 24, 1, 384, 1096819, False, 760470528),
]
MOSAIC_PROFILES = {"H100": "dgx-h100", "A100": "dgx-a100-80g", "A100 40GB": "dgx-a100-40g"}


def _row(source: str, case: str, layout: str, gpus: int, published_s: float, plan) -> dict:
    return {"source": source, "case": case, "layout": layout, "gpus": gpus, "published_step_s": published_s,
            "predicted_step_s": plan.step_time_s, "error": published_s / plan.step_time_s - 1, "fits": plan.fits,
            "peak_GiB": plan.memory.peak / 2**30}


def korthikanti() -> list[dict]:
    out = []
    profile = load_profile("dgx-a100-80g")
    for name, h, a, layers, pp, gb, mb, v, selective_s, full_s in KORTHIKANTI:
        model = megatron_gpt(h, a, layers)
        cluster = Cluster.build(profile, 8 * pp // profile.gpus_per_node)
        # Megatron-LM of 2022: unfused attention, dropout, and no TE userbuffers TP overlap.
        wl = Workload(global_batch=gb, seq_len=2048, precision="fp16", flash_attention=False, dropout=True,
                      tp_comm_overlap=False)
        for mode, sp, published in (("selective", True, selective_s), ("full", False, full_s)):
            cfg = ParallelConfig(dp=1, tp=8, pp=pp, micro_batch=mb, grad_accum=gb // mb, recompute=mode,
                                 sequence_parallel=sp, virtual_stages=v, framework="megatron", zero_stage=0)
            plan = estimate(model, cluster, wl, cfg, pp_send="scatter_gather")
            label = "SP + selective" if sp else "full recompute"
            out.append(_row("Korthikanti 2022 T5", f"{name} {label}", f"tp8 pp{pp}" + (f" v{v}" if v > 1 else ""),
                            8 * pp, published, plan))
    return out


def mtnlg_micro_batch() -> int:
    """The micro-batch MT-NLG's three published times imply, whatever dsplan predicts.

    Under 1F1B a step is (m + p - 1) micro-batch slots plus what is paid once per step, so the
    published time against samples per pipeline (1920 / dp) is a line whose slope is the time per
    sample and whose intercept holds the bubble, (p - 1) slots of micro-batch x that time, plus
    the once-per-step rest (>= 0). The micro-batch is then at most intercept / ((p - 1) x slope):
    1.9 from 60.1 / 50.2 / 44.4 s, so 2 (a micro-batch of 1 leaves 6 s per step unexplained)."""
    slope, intercept = np.polyfit(MTNLG_SAMPLES, [s for _n, s in MTNLG], 1)
    return max(1, round(intercept / (34 * slope)))


def mtnlg() -> list[dict]:
    out = []
    profile = load_profile("dgx-a100-80g")
    model = megatron_gpt(20480, 128, 105, vocab=50257)
    wl = Workload(global_batch=1920, seq_len=2048, precision="fp16", flash_attention=False, dropout=True,
                  tp_comm_overlap=False)
    mb = mtnlg_micro_batch()
    for nodes, published in MTNLG:
        dp = nodes * 8 // (8 * 35)
        cfg = ParallelConfig(dp=dp, tp=8, pp=35, micro_batch=mb, grad_accum=1920 // dp // mb, recompute="full",
                             framework="megatron-deepspeed", zero_stage=1)
        plan = estimate(model, Cluster.build(profile, nodes), wl, cfg)
        out.append(_row("MT-NLG 2022", f"530B on {nodes * 8} GPUs", f"tp8 pp35 dp{dp} mb{mb}", nodes * 8, published,
                        plan))
    return out


def llama3() -> list[dict]:
    out = []
    profile = load_profile("dgx-h100")
    model = load_model("llama-3.1-405b")
    for nodes, tflops in LLAMA3:
        gpus = nodes * 8
        dp = gpus // (8 * 16)
        # Meta's own training stack, priced as Megatron-Core without Transformer Engine's kernels:
        # no userbuffers TP overlap, FlashAttention-2's Hopper level for attention.
        wl = Workload(global_batch=2048, seq_len=8192, tp_comm_overlap=False, te_attention=False)
        cfg = ParallelConfig(dp=dp, tp=8, pp=16, micro_batch=1, grad_accum=2048 // dp, recompute="none",
                             sequence_parallel=True, virtual_stages=4, framework="megatron", zero_stage=1)
        plan = estimate(model, Cluster.build(profile, nodes), wl, cfg)
        published_s = plan.model_flops_per_step / (tflops * 1e12 * gpus)  # the TFLOP/s in dsplan's FLOP count
        out.append(_row("Llama 3 2024 T4", f"405B on {gpus} H100", f"tp8 pp16 v4 dp{dp}", gpus, published_s, plan))
    return out


def mosaic(table: list[tuple] = MOSAIC, source: str = "MosaicML llm-foundry") -> list[dict]:
    """The MPT runs of ``table``: FSDP FULL_SHARD priced as ZeRO-3, MPT's Triton FlashAttention as
    FlashAttention-1 (every benchmark config sets attn_impl: triton)."""
    out = []
    for gpu, name, seq, gpus, mb, ga, gb, tokens_s, ckpt, params in table:
        hidden, heads, layers = MPT_SHAPES[name]
        model = megatron_gpt(hidden, heads, layers, vocab=50368, seq=seq)
        assert model.total_params() == params, (name, seq, model.total_params(), params)
        profile = load_profile(MOSAIC_PROFILES[gpu])
        wl = Workload(global_batch=gb, seq_len=seq, precision="bf16", flash_version=1)
        cfg = ParallelConfig(dp=gpus, tp=1, pp=1, micro_batch=mb, grad_accum=ga, recompute="full" if ckpt else "none",
                             framework="deepspeed", zero_stage=3)
        plan = estimate(model, Cluster.build(profile, gpus // profile.gpus_per_node), wl, cfg)
        layout = f"z3 mb{mb} ga{ga}" + (" ckpt" if ckpt else "")
        out.append(_row(source, f"{name} s{seq} {gpu}", layout, gpus, gb * seq / tokens_s, plan))
    return out


def mosaic_nodes() -> list[dict]:
    """MosaicML's runs on 2-16 nodes (FSDP across nodes)."""
    return mosaic(MOSAIC_NODES, "MosaicML nodes")


def all_rows() -> list[dict]:
    """Every published run this benchmark prices (planner/accuracy.py's MODEL_ERROR is their mean)."""
    return korthikanti() + mtnlg() + llama3() + mosaic() + mosaic_nodes()


def main(argv: list[str]) -> int:
    rows = all_rows()
    if "--json" in argv:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'source':<20} {'case':<26} {'layout':<18} {'GPUs':>6} {'published s':>11} {'predicted s':>11} "
          f"{'error':>7} {'fits':>5}")
    for r in rows:
        print(f"{r['source']:<20} {r['case']:<26} {r['layout']:<18} {r['gpus']:>6} {r['published_step_s']:>11.2f} "
              f"{r['predicted_step_s']:>11.2f} {r['error']:>+7.1%} {'yes' if r['fits'] else 'no':>5}")
    print()
    for name, group in _groups(rows).items():
        errors = [abs(r["error"]) for r in group]
        print(f"{name + ':':<34} mean |error| {sum(errors) / len(errors):.1%}, worst {max(errors):.1%} over "
              f"{len(group)} runs (within 10%: {sum(e <= 0.10 for e in errors)})")
    return 0


def _groups(rows: list[dict]) -> dict[str, list[dict]]:
    """Every run, each source, and MosaicML's by GPU and by activation checkpointing."""
    groups: dict[str, list[dict]] = {"all runs": rows}
    for r in rows:
        groups.setdefault(r["source"], []).append(r)
    for r in rows:
        if r["source"].startswith("MosaicML"):
            gpu = r["case"].split(" ", 2)[2]
            groups.setdefault(f"MosaicML {gpu}, {'ckpt' if 'ckpt' in r['layout'] else 'no ckpt'}", []).append(r)
    return groups


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
