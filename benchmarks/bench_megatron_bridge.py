"""Predicted vs published tokens/s per GPU on NVIDIA's tuned Megatron-Bridge 25.11 recipes.

    python benchmarks/bench_megatron_bridge.py            # markdown tables + summary
    python benchmarks/bench_megatron_bridge.py --csv      # the pinned table as CSV
    python benchmarks/bench_megatron_bridge.py --no-free  # skip the unpinned plan-quality search

Rows: reference/megatron_bridge_25.11_pretrain.csv (NVIDIA-NeMo/Megatron-Bridge
docs/performance-summary.md, 25.11). For each row this runs ``suggest`` with the row's GPUs,
system, global batch, sequence, precision and layout pinned (tp, pp, cp, vp, ep, micro-batch,
Megatron-Core with its distributed optimizer, or Megatron-FSDP (zero 3) where the row shards
over its whole DP group), letting dsplan choose what the table does not say (recomputation,
sequence parallelism, activation offload), and compares the best plan's tokens/s per GPU with the published one.
MoE rows also run what their recipe sets (``recipe``: no all-to-all overlap, the dispatcher, the
modules selective recomputation runs again).
A row dsplan cannot express yet is listed with the reason. Plan quality: the same search with
only GPUs, batch, sequence and precision fixed, and where NVIDIA's layout ranks in it.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

from planner import api
from planner.errors import UserError

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "megatron_bridge_25.11_pretrain.csv"
# The table's names -> dsplan's (None: no profile / preset yet). On NVL72 a node is a 4-GPU tray:
# the table's "gpus" is trays x 4.
SYSTEMS = {"DGX-H100": "dgx-h100", "DGX-B200": "dgx-b200", "DGX-GB200": "gb200-nvl72", "DGX-GB300": "gb300-nvl72"}
MODELS = {"LLAMA3_8B": "llama-3-8b", "LLAMA3_70B": "llama-3-70b", "LLAMA3.1_405B": "llama-3.1-405b",
          "DeepSeekV3": "deepseek-v3", "GPT-OSS-120B": "gpt-oss-120b", "Qwen3-30B-A3B": "qwen3-30b-a3b",
          "Qwen3-235B-A22B": "qwen3-235b-a22b"}
# Megatron-Bridge's precision names: FP8-CS is current (per-tensor) scaling, FP8-MX is MXFP8.
PRECISIONS = {"BF16": "bf16", "FP8-CS": "fp8-tensorwise", "FP8-MX": "mxfp8", "FP8-DS": "fp8-delayed"}
# What each MoE row's recipe sets beside its layout (Megatron-Bridge scripts/performance/configs/*
# at commit e59a573, Nov 2025, the snapshot nearest the 25.11 table): the expert all-to-all is not
# overlapped (WorkloadBaseConfig.moe_a2a_overlap defaults to False; only H100 DeepSeek-V3, not in
# the table, sets it), DeepSeek-V3 on GB200 / GB300 dispatches with HybridEP
# (moe_flex_dispatcher_backend="hybridep": the flex dispatcher), the others with alltoall; and
# what selective recomputation runs again where the recipe names it (recompute_modules:
# DeepSeek-V3 on B200 / GB200 mla_up_proj, on GB300 Megatron's default core_attn; GPT-OSS-120B
# layernorm and moe_act but on GB300). Where it names none dsplan's auto applies.
FLEX = {("DGX-GB200", "DeepSeekV3"), ("DGX-GB300", "DeepSeekV3")}
RECOMPUTE_MODULES = {("DGX-B200", "DeepSeekV3"): "mla_up_proj", ("DGX-GB200", "DeepSeekV3"): "mla_up_proj",
                     ("DGX-GB300", "DeepSeekV3"): "core_attn",
                     **{(s, "GPT-OSS-120B"): "layernorm,moe_act" for s in ("DGX-B200", "DGX-GB200", "DGX-H100")}}


def recipe(row: dict) -> dict:
    """The row's recipe settings dsplan would otherwise choose or default (above): Llama rows none."""
    if "LLAMA" in row["model"]:
        return {}
    key = (row["system"], row["model"])
    return {"ep_comm_overlap": False, "moe_dispatcher": "flex" if key in FLEX else "alltoall",
            "recompute_modules": RECOMPUTE_MODULES.get(key)}


FREE_TOP = 400  # how deep the unpinned list goes when looking for NVIDIA's layout


def rows(path: Path = REFERENCE) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _int(text: str, default: int = 1) -> int:
    return int(text) if text.strip() else default


def not_expressible(row: dict) -> str | None:
    """Why dsplan cannot price this row yet, or None."""
    if SYSTEMS[row["system"]] is None:
        return f"no {row['system']} profile"
    if MODELS[row["model"]] is None:
        return f"no {row['model']} preset"
    if 0 < _int(row["fsdp"], 0) < int(row["gpus"]) // (_int(row["tp"]) * _int(row["pp"])):
        return "FSDP over part of the DP group (hybrid sharding)"
    return None


def layout(row: dict) -> dict:
    """The row's layout as dsplan's pins: FSDP over the whole DP group is Megatron-FSDP (ZeRO-3),
    else the distributed optimizer (ZeRO-1), as the recipes run; MoE rows with expert TP 1 (the
    one row with TP 2, H100 Qwen3-235B at EP 32 over 16 DP ranks, can run no other way: its EP
    takes the TP ranks; at TP 1 the two are the same)."""
    pins = {"tp": _int(row["tp"]), "pp": _int(row["pp"]), "virtual_stages": _int(row["vp"]), "ep": _int(row["ep"]),
            "cp": _int(row["cp"]), "micro_batch": _int(row["micro_batch"]), "zero": 3 if _int(row["fsdp"], 0) else 1}
    return {**pins, "etp": 1} if "LLAMA" not in row["model"] else pins


def _search(row: dict, pins: dict, top: int):
    gpus, per = int(row["gpus"]), api.load_hardware(SYSTEMS[row["system"]]).gpus_per_node
    cluster = api.load_cluster(SYSTEMS[row["system"]], nodes=max(gpus // per, 1), gpus_per_node=min(gpus, per))
    t0 = time.perf_counter()
    out = api.suggest(MODELS[row["model"]], cluster, global_batch=int(row["global_batch"]),
                      seq_len=int(row["seq_len"]), precision=PRECISIONS[row["precision"]], top=top,
                      mtp_layers=mtp_layers(row), **recipe(row), **pins)
    return out, time.perf_counter() - t0, gpus


def mtp_layers(row: dict) -> int:
    """The multi-token-prediction depths the row trains: the table says "with MTP" (one, the
    model's own) or "without MTP" for DeepSeek-V3; the other models have none."""
    return 1 if "with MTP" in row["notes"] else 0


def pinned(row: dict) -> dict:
    """The row with the layout pinned: predicted vs published tokens/s per GPU."""
    out, seconds, gpus = _search(row, {**layout(row), "framework": "megatron"}, 1)
    if not out.plans:
        return {"predicted": None, "error": "no plan fits the pinned layout", "seconds": seconds}
    plan = out.plans[0].plan
    predicted = plan.tokens_per_s / gpus
    published = float(row["tokens_per_s_per_gpu"])
    return {"predicted": predicted, "ratio": predicted / published, "seconds": seconds,
            "chosen": f"recompute {plan.cfg.recompute}{', sp' if plan.cfg.sequence_parallel else ''}"
                      + (f", cp {plan.cfg.cp_comm}" if plan.cfg.cp > 1 else "")
                      + (f", {plan.cfg.activation_offload} layers offloaded" if plan.cfg.activation_offload else "")}


def free(row: dict) -> dict:
    """Plan quality: dsplan's own best plan and where NVIDIA's layout ranks among its plans."""
    out, seconds, gpus = _search(row, {}, FREE_TOP)
    want = layout(row)
    rank = next((i + 1 for i, rp in enumerate(out.plans)
                 if rp.plan.cfg.framework == "megatron"
                 and all(getattr(rp.plan.cfg, "zero_stage" if k == "zero" else k) == v for k, v in want.items())),
                None)
    best = out.plans[0].plan
    c = best.cfg
    _, user_seconds, _ = _search(row, {}, 5)  # as a user runs it: the first five plans
    return {"rank": rank, "best": f"{c.framework} tp{c.tp} pp{c.pp}x{c.virtual_stages} ep{c.ep} cp{c.cp} "
                                  f"mb{c.micro_batch} z{c.zero_stage}"
                                  + (f" act{c.activation_offload}" if c.activation_offload else ""),
            "best_tokens": best.tokens_per_s / gpus, "seconds": seconds, "user_seconds": user_seconds}


# The two MoE suggest runs, printed beside what published fine-grained MoE training reaches.
# DeepSeek-V3 also with the flex dispatcher (DeepEP), whose node-limited sends its own run used, and
# on torchtitan with DualPipeV at DeepSeek-V3's own batch (15,360 x 4,096 tokens, its report), without
# the MTP module torchtitan does not build: (model, hardware, nodes, suggest's keywords).
FLEX_DISPATCH = {"moe_dispatcher": "flex"}
DUALPIPEV = {"framework": "torchtitan", "pp_schedule": "dualpipev", "mtp_layers": 0, "global_batch": 15360,
             "seq_len": 4096}
MOE_SUGGEST = (("vl2", "dgx-a100-80g", 8, {}), ("deepseek-v3", "h800", 256, {}),
               ("deepseek-v3", "h800", 256, FLEX_DISPATCH), ("deepseek-v3", "h800", 256, DUALPIPEV))
_FLAGS = {"moe_dispatcher": "--moe-dispatcher", "framework": "--framework", "pp_schedule": "--pp-schedule",
          "mtp_layers": "--mtp-layers", "global_batch": "--global-batch", "seq_len": "--seq-len"}
# DeepSeek-V3 report (arXiv 2412.19437): 180K H800 GPU-hours per trillion tokens at 37B activated,
# i.e. 6 x 37e9 x 1e12 / (180e3 x 3600) = 343 TFLOP/s per GPU, 35% of H800's 989 dense bf16; the
# Megatron-Bridge MoE rows above: 12-38% of bf16 peak on H100, 40-50% on Blackwell.
PUBLISHED_MOE = "published: DeepSeek-V3 on 2,048 H800 ~35% of bf16 peak; Megatron-Bridge MoE 12-38% (H100)"


def moe_suggest_mfu() -> list[str]:
    """``dsplan suggest`` plan #1 of each MOE_SUGGEST run: its MFU and layout."""
    lines = []
    for model, hardware, nodes, keywords in MOE_SUGGEST:
        plan = api.suggest(model, api.load_cluster(hardware, nodes), top=1, **keywords).plans[0].plan
        c = plan.cfg
        flag = "".join(f" {_FLAGS[k]} {v}" for k, v in keywords.items())
        lines.append(f"suggest --model {model} --hardware {hardware} --nodes {nodes}{flag}: MFU {plan.mfu:.1%} "
                     f"({c.framework} tp{c.tp} pp{c.pp}x{c.virtual_stages} ep{c.ep} mb{c.micro_batch} "
                     f"recompute {c.recompute}; exposed EP {plan.time.ep_comm:.2f} of {plan.step_time_s:.2f} s)")
    return lines + [PUBLISHED_MOE]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", action="store_true", help="print the pinned comparison as CSV")
    parser.add_argument("--no-free", action="store_true", help="skip the unpinned plan-quality search")
    args = parser.parse_args(argv)
    table = []
    for row in rows():
        name = f"{row['system']} {row['model']} {row['gpus']} GPUs {row['precision']}"
        why = not_expressible(row)
        entry = {"row": name, "published": float(row["tokens_per_s_per_gpu"]), "not_expressible": why or ""}
        if why is None:
            try:
                entry |= pinned(row)
                if not args.no_free:
                    entry |= {f"free_{k}": v for k, v in free(row).items()}
            except UserError as err:
                entry["error"] = str(err)
        table.append(entry)
    if args.csv:
        keys = sorted({k for e in table for k in e}, key=lambda k: (k != "row", k))
        writer = csv.DictWriter(sys.stdout, fieldnames=keys)
        writer.writeheader()
        writer.writerows(table)
        return 0
    print("| row | published tok/s/GPU | predicted | predicted/published | dsplan chose | NVIDIA's layout ranks | "
          "dsplan's best (tok/s/GPU) | suggest s (top 5) |")
    print("|---|---:|---:|---:|---|---:|---|---:|")
    for e in table:
        if e["not_expressible"] or e.get("predicted") is None:
            print(f"| {e['row']} | {e['published']:.0f} | - | - | not expressible: "
                  f"{e['not_expressible'] or e.get('error')} | | | |")
            continue
        free_part = (f"{e.get('free_rank') or f'>{FREE_TOP}'} | {e['free_best']} ({e['free_best_tokens']:.0f}) | "
                     f"{e['free_user_seconds']:.2f}" if "free_best" in e else f" | | {e['seconds']:.2f}")
        print(f"| {e['row']} | {e['published']:.0f} | {e['predicted']:.0f} | {e['ratio']:.2f} | {e['chosen']} | "
              f"{free_part} |")
    priced = [e for e in table if e.get("predicted") is not None]
    dense = [e for e in priced if "LLAMA" in e["row"]]
    print(f"\nexpressible: {len(priced)} of {len(table)} rows; dense (Llama 3) {len(dense)} of "
          f"{sum('LLAMA' in e['row'] for e in table)}")
    moe = [e for e in priced if "LLAMA" not in e["row"]]
    for name, group, within in (("dense", dense, 0.10), ("MoE", moe, 0.15)):
        if group:
            errors = [abs(e["ratio"] - 1) for e in group]
            print(f"{name} rows: mean |error| {statistics.mean(errors):.1%}, worst {max(errors):.1%}, "
                  f"within {within:.0%}: {sum(err <= within for err in errors)} of {len(group)}")
    print(f"MoE rows expressible: {len(moe)} of {sum('LLAMA' not in e['row'] for e in table)}")
    user = [e["free_user_seconds"] for e in priced if "free_user_seconds" in e]
    if user:
        print(f"suggest unpinned, first 5 plans: slowest {max(user):.2f} s, over 1 s: {sum(t > 1 for t in user)} of "
              f"{len(user)} (the list {FREE_TOP} deep above: slowest {max(e['free_seconds'] for e in priced):.2f} s)")
    print("\n" + "\n".join(moe_suggest_mfu()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
