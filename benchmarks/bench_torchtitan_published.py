"""Predicted vs published tokens/s per GPU on torchtitan's own benchmark runs (FSDP2 + TP + PP + CP).

    python benchmarks/bench_torchtitan_published.py           # the comparison, then the means
    python benchmarks/bench_torchtitan_published.py --json    # every row as data

Rows: reference/torchtitan_published_throughput.csv, every measurement in pytorch/torchtitan's
benchmarks/ folder: Llama 3.1 8B / 70B / 405B on 8-512 H100 96GB HBM2e (Meta Grand Teton, 500 W;
the ``h100-grand-teton`` profile, which does not price the power cap) and Llama 3.1 8B on 32 / 64
H200 (Trainy; ``hgx-h200``, whose eight 400 Gb/s ConnectX-7 NICs per node are what the source
states). Each expressible row is priced with ``planner.api.estimate(..., framework="torchtitan",
zero=3)`` at the row's own degrees, sequence, batch, recomputation (torchtitan's per-op selective
AC as ``recompute="op"``) and precision. Nothing is fitted: no factor of any kind.

The batch: torchtitan's ``local_batch_size`` is one FSDP rank's samples per step (CP ranks share
them; TPS/GPU in torchtitan's train.py is local batch x sequence / (step x cp x tp x pp), which
is dsplan's tokens/s over all GPUs). Without a pipeline the runs of these files do one forward
and backward per step, so dsplan's micro_batch is the local batch and grad_accum 1. With a
pipeline torchtitan splits the local batch into pipeline micro-batches: at the benchmarked
commit 9dec370 their number is ``experimental.pipeline_parallel_microbatches``, by default the
pp degree (8), so micro_batch = local batch / 8 and grad_accum = 8 (dsplan's micro-batches per
step; later torchtitan sets ``pipeline_parallel_microbatch_size`` instead, the same mapping
read the other way). The interleaved schedule's default is 2 stages per rank
(``generate_split_points``), whose layer split (first and last stage one layer short) is the
split dsplan's even partition gives.

A row dsplan cannot express is printed with every reason. For those rows the benchmark also
prices the nearest layout dsplan can express (async TP as plain TP), which bounds the row only as far as the
model is right, and counts in no mean. torch.compile is priced as the row ran it (``--compile``):
what it covered runs fused kernels, the rest PyTorch's eager ones (planner/cost/eager_kernels.py),
with aten's composite RMSNorm for the December 2024 runs' PyTorch (before 2.8); the means are
also printed for the rows with and without it. An expressible row's caveats name what else its price
leaves out (CP's all-gather rotater priced as a ring, the context raised to the sequence as
torchtitan does). Error = predicted / published - 1: "+" means
dsplan predicts faster than measured.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner import api

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from planner.model.spec import ModelSpec

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "torchtitan_published_throughput.csv"
PROFILES = {"H100 96GB HBM2e (Grand Teton, 500 W)": "h100-grand-teton", "H200 SXM 141GB": "hgx-h200"}
MODELS = {"Llama 3.1 8B": "llama-3.1-8b", "Llama 3.1 70B": "llama-3.1-70b", "Llama 3.1 405B": "llama-3.1-405b"}
FILES = {"benchmarks/llama3_h100_202412_torchtitan.md": "2024-12",
         "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md": "2025-06 async TP",
         "benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md": "2025-06 Trainy H200"}
GPUS_PER_NODE = 8  # every host in the three files has 8 GPUs

# Why dsplan cannot price a row as it ran, one sentence per missing feature (reasons()).
ASYNC_REASON = ("async TP (inductor's micro-pipelined TP over symmetric memory: measured 1.04-1.16x over plain TP "
                "here, which dsplan's TE-userbuffers overlap model would put at 1.24-1.37x; not priced)")
ROWWISE_REASON = "float8 rowwise scaling (dsplan's torchtitan recipes are fp8-tensorwise and mxfp8)"


REASON_TAGS = {ASYNC_REASON: "async TP", ROWWISE_REASON: "rowwise"}
# The rows' activation checkpointing as dsplan's --recompute: torchtitan's per-op selective AC is "op".
RECOMPUTE = {"full": "full", "none": "none", "selective_op": "op"}
# What torch.compile covered, by torchtitan commit: at 9dec370 (December 2024) train.py compiled
# each TransformerBlock only (its ``loss_fn = torch.compile(loss_fn)`` is commented out); from
# 820504e (June 2025) components/loss.py compiles the loss as well.
LOSS_LEFT_EAGER = {"9dec370ad26b5f8e9a7333a0e36165018262644b"}
# PyTorch before 2.8 ran RMSNorm as aten's composite in eager (the fused kernel is
# pytorch/pytorch#153666, May 2025): the December 2024 runs' torch 1963fc8.
COMPOSITE_RMS_NORM = {"1963fc83a1c32e162162e2414f78b043f0674bae"}
CP_ALLGATHER = "the run all-gathers CP's K/V (the default rotater); priced as dsplan's ring"
LONG_CONTEXT = "the sequence is above the preset's context; raised to it, as torchtitan's train.py does"
CAVEAT_TAGS = {CP_ALLGATHER: "CP all-gather", LONG_CONTEXT: "context"}


def rows(path: Path = REFERENCE) -> list[dict[str, str]]:
    """The published rows, as the CSV spells them."""
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def label(row: dict[str, str]) -> str:
    """A short name: source file, table and the table's own row label."""
    table = row["table"] if row["table"].startswith("Table") else row["model"].split()[-1]
    return f"{FILES[row['source_file']]} {table}: {row['row']}"


def reasons(row: dict[str, str]) -> list[str]:
    """Every reason dsplan cannot price this row as it ran (empty: expressible)."""
    out = []
    if row["async_tp"] == "on":
        out.append(ASYNC_REASON)
    if row["float8_recipe"] == "rowwise":
        out.append(ROWWISE_REASON)
    return out


def caveats(row: dict[str, str]) -> list[str]:
    """What an expressible row's price leaves out without being refused for it."""
    out = []
    if row["cp_rotate_method"] == "allgather":
        out.append(CP_ALLGATHER)
    if int(row["seq_len"]) > api.load_model(MODELS[row["model"]]).max_seq_len:
        out.append(LONG_CONTEXT)
    return out


def knobs(row: dict[str, str], recompute: str | None = None) -> dict[str, Any]:
    """The row as ``estimate`` keywords (module docstring: the batch mapping)."""
    pp, local = int(row["pp"]), int(row["local_batch_size"])
    micro = local // int(row["pp_microbatches"]) if pp > 1 else local
    tp = int(row["tp"])
    precision = "fp8-tensorwise" if row["float8"] == "on" else "bf16"
    return {"framework": "torchtitan", "zero": 3, "dp": int(row["fsdp"]), "tp": tp, "pp": pp, "cp": int(row["cp"]),
            "virtual_stages": int(row["pp_stages_per_rank"] or 1), "micro_batch": micro,
            "recompute": recompute or RECOMPUTE[row["activation_checkpointing"]], "sequence_parallel": tp > 1,
            "precision": precision, "global_batch": int(row["global_batch_size"]), "seq_len": int(row["seq_len"]),
            "fp8_param_gather": row["fsdp_float8_all_gather"] == "on",  # FSDP2's float8 all-gather, as the row ran
            "compile": compiled(row), "rms_norm_kernel": "composite" if row["torch_commit"] in COMPOSITE_RMS_NORM
            else "fused"}


def compiled(row: dict[str, str]) -> str:
    """What torch.compile covered in the row's run (``--compile``)."""
    if row["torch_compile"] != "on":
        return "none"
    return "model" if row["torchtitan_commit"] in LOSS_LEFT_EAGER else "model,loss"


def model(row: dict[str, str]) -> ModelSpec:
    """The row's preset as torchtitan built it: its train.py sets the model's max_seq_len to the
    training sequence (``model_config.max_seq_len = job_config.training.seq_len`` at 9dec370), so
    the 262,144-token rows run a Llama 3.1 8B / 405B whose context is that long."""
    spec = api.load_model(MODELS[row["model"]])
    seq = int(row["seq_len"])
    return spec if seq <= spec.max_seq_len else spec.model_copy(update={"max_seq_len": seq})


def price(row: dict[str, str], recompute: str | None = None) -> dict[str, Any]:
    """One estimate of the row's layout: tokens/s per GPU, fit and peak memory."""
    gpus = int(row["gpus"])
    cluster = api.load_cluster(PROFILES[row["gpu"]], nodes=gpus // GPUS_PER_NODE)
    plan = api.estimate(model(row), cluster, **knobs(row, recompute))
    return {"predicted": plan.tokens_per_s / gpus, "fits": plan.fits, "peak_GiB": plan.memory.peak / 2**30,
            "step_s": plan.step_time_s, "notes": list(plan.notes)}


def stand_ins(row: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The nearest expressible layout of a refused row, by name: async TP priced as plain TP (dsplan
    prices torchtitan's TP so in any case, so it needs no knob). None for rowwise scaling:
    tensorwise is no bound on it (the async-TP tables have rowwise slower than tensorwise and
    near bf16)."""
    if row["float8_recipe"] == "rowwise":
        return {}
    return {"plain TP": price(row)} if row["async_tp"] == "on" else {}


def compare(row: dict[str, str]) -> dict[str, Any]:
    """The row's comparison: published against predicted, or why it cannot be priced."""
    published = float(row["tokens_per_s_per_gpu"])
    entry: dict[str, Any] = {"row": label(row), "gpus": int(row["gpus"]), "published": published,
                             "published_GiB": float(row["memory_GiB"]) if row["memory_GiB"] else None,
                             "torch_compile": row["torch_compile"] == "on", "not_expressible": reasons(row),
                             "caveats": caveats(row)}
    if entry["not_expressible"]:
        entry["stand_ins"] = {k: v | {"ratio": v["predicted"] / published} for k, v in stand_ins(row).items()}
        return entry
    got = price(row)
    return entry | got | {"error": got["predicted"] / published - 1}


def layout(row: dict[str, str]) -> str:
    """The degrees as one short string."""
    parts = [f"fsdp{row['fsdp']}"] + [f"{k}{row[k]}" for k in ("tp", "pp", "cp") if row[k] != "1"]
    if row["pp_stages_per_rank"] == "2":
        parts[-1] += "x2"
    return " ".join(parts) + f" s{int(row['seq_len']) // 1024}k b{row['local_batch_size']}"


def mean_line(name: str, group: list[dict[str, Any]]) -> str:
    """Mean and worst |error| over a group of priced rows, or that it has none."""
    if not group:
        return f"{name}: no expressible row"
    errors = [abs(e["error"]) for e in group]
    return (f"{name}: mean |error| {statistics.mean(errors):.1%}, worst {max(errors):.1%} over {len(group)} rows "
            f"(within 10%: {sum(err <= 0.10 for err in errors)})")


def _legend(tags: dict[str, str]) -> None:
    """Each short tag the table used, with its sentence."""
    for tag, text in tags.items():
        print(f"  {tag}: {text}")


def print_priced(table: list[dict[str, Any]], data: list[dict[str, str]]) -> None:
    """The expressible rows: published against predicted, with each row's caveats as tags."""
    print(f"{'row':<52} {'layout':<19} {'published':>9} {'predicted':>9} {'error':>7} {'fits':>4} "
          f"{'GiB':>5} {'pub GiB':>7}  caveats")
    for e, row in zip(table, data):
        if not e["not_expressible"]:
            pub = f"{e['published_GiB']:.1f}" if e["published_GiB"] else "-"
            tags = ", ".join(CAVEAT_TAGS[c] for c in e["caveats"])
            print(f"{e['row']:<52} {layout(row):<19} {e['published']:>9.1f} {e['predicted']:>9.1f} "
                  f"{e['error']:>+7.1%} {'yes' if e['fits'] else 'no':>4} {e['peak_GiB']:>5.1f} {pub:>7}  {tags}")
    _legend({tag: text for text, tag in CAVEAT_TAGS.items()})


def print_refused(table: list[dict[str, Any]]) -> None:
    """The rows dsplan cannot express, with what they lack and their stand-ins (in no mean)."""
    print("\nnot expressible; stand-ins: predicted tok/s/GPU (/ published), in no mean")
    print(f"{'row':<52} {'published':>9}  {'missing':<30} stand-ins")
    for e in table:
        if e["not_expressible"]:
            stand = "; ".join(f"{k} {v['predicted']:.0f} ({v['ratio']:.2f}{'' if v['fits'] else ', does not fit'})"
                              for k, v in e["stand_ins"].items()) or "-"
            missing = ", ".join(REASON_TAGS[r] for r in e["not_expressible"])
            print(f"{e['row']:<52} {e['published']:>9g}  {missing:<30} {stand}")
    _legend({tag: text for text, tag in REASON_TAGS.items()})


def print_means(table: list[dict[str, Any]]) -> None:
    """Mean |error| over the expressible rows, all of them and split by torch.compile."""
    priced = [e for e in table if not e["not_expressible"]]
    print(f"\nexpressible: {len(priced)} of {len(table)} rows")
    print(mean_line("all expressible rows", priced))
    print(mean_line("without torch.compile", [e for e in priced if not e["torch_compile"]]))
    print(mean_line("with torch.compile", [e for e in priced if e["torch_compile"]]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print every row as JSON")
    args = parser.parse_args(argv)
    data = rows()
    table = [compare(row) for row in data]
    if args.json:
        print(json.dumps(table, indent=2))
    else:
        print_priced(table, data)
        print_refused(table)
        print_means(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
