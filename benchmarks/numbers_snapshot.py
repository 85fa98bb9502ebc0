"""Every number dsplan prints for a fixed set of cases, as one JSON document: run it before and
after a change that must not move any number, and compare the two.

    python benchmarks/numbers_snapshot.py --out before.json
    ... change the code ...
    python benchmarks/numbers_snapshot.py --compare before.json

Cases: ``dsplan suggest --json`` over every model family (dense, MoE, MLA, vision-language,
ALiBi), each objective, both balancers, pins, three GPU profiles, an input error and a search
where nothing fits; ``dsplan estimate --json`` on single plans; and the two accuracy
benchmarks' ``--json`` (Megatron-LM Table 1 and the published runs). Timing fields
(``search.elapsed_s``, ``cpu_s``, ``setup_cpu_s``) are dropped. ``--compare`` walks both
documents and reports every number that differs by more than ``--rel`` (default 1e-9) and
every other difference; it exits 1 when there is one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SUGGEST = [
    ["--model", "vl2", "--nodes", "8"],
    ["--model", "llama-3.1-405b", "--nodes", "2048"],
    ["--model", "llama-3.1-405b", "--nodes", "2048", "--global-batch", "2048"],
    ["--model", "deepseek-v3", "--nodes", "128"],
    ["--model", "llama-3-8b", "--nodes", "1", "--objective", "memory", "--top", "8"],
    ["--model", "llama-2-70b", "--nodes", "4", "--objective", "cost"],
    ["--model", "gpt3-175b", "--nodes", "16", "--balancer", "greedy"],
    ["--model", "mixtral-8x7b", "--nodes", "2", "--framework", "deepspeed"],
    ["--model", "qwen2-vl-7b", "--nodes", "2", "--tp", "2", "--pp", "2"],
    ["--model", "bloom-176b", "--nodes", "48", "--framework", "deepspeed"],
    ["--model", "deepseek-v2-lite", "--nodes", "1", "--zero", "1,2", "--offload", "optimizer"],
    ["--model", "qwen2.5-7b", "--hardware", "dgx-h100", "--nodes", "2", "--precision", "fp16"],
    ["--model", "llama-3.1-8b", "--hardware", "mi300x", "--nodes", "1", "--micro-batch", "2", "--recompute", "full"],
    ["--model", "gpt3-1.3b", "--nodes", "1", "--optimizer", "sgd", "--framework", "megatron", "--pp", "2",
     "--virtual-stages", "2"],
    ["--model", "vl2", "--nodes", "8", "--top", "10", "--objective", "memory", "--balancer", "greedy"],
    ["--model", "llama-3.1-70b", "--hardware", "hgx-h200", "--nodes", "4", "--zero", "3", "--framework", "deepspeed"],
    ["--model", "llama-3-8b", "--nodes", "1", "--tp", "3"],  # an input error
    ["--model", "llama-3.1-405b", "--nodes", "1"],  # nothing fits
]

ESTIMATE = [
    ["--model", "llama-3-8b", "--tp", "2", "--micro-batch", "2", "--global-batch", "512"],
    ["--model", "llama-2-70b", "--nodes", "16", "--tp", "8", "--pp", "4", "--framework", "megatron", "--zero", "1",
     "--sequence-parallel", "--recompute", "selective", "--global-batch", "1024"],
    ["--model", "vl2", "--nodes", "8", "--ep", "8", "--zero", "1", "--global-batch", "1024"],
    ["--model", "deepseek-v3", "--nodes", "128", "--tp", "2", "--pp", "8", "--virtual-stages", "4", "--ep", "64",
     "--framework", "megatron", "--zero", "1", "--global-batch", "4096", "--seq-len", "4096"],
    ["--model", "gpt3-175b", "--nodes", "4", "--zero", "3", "--offload", "optimizer+params", "--recompute", "full",
     "--global-batch", "64", "--precision", "fp16", "--no-flash-attention", "--dropout"],
    ["--model", "llama-3.1-8b", "--nodes", "2", "--pp", "4", "--framework", "megatron-deepspeed", "--tp", "2",
     "--global-batch", "256", "--stage-blocks", "0-9,9-17,17-25,25-35"],
    ["--model", "mixtral-8x7b", "--nodes", "2", "--ep", "8", "--zero", "2", "--global-batch", "256",
     "--recompute", "full", "--framework", "deepspeed"],
]

BENCHMARKS = ["bench_megatron_table1.py", "bench_published_runs.py"]
TIMING = {"elapsed_s", "cpu_s", "setup_cpu_s"}


def _dsplan() -> list[str]:
    return [sys.executable, "-m", "planner"]


def _run(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    out: dict = {"exit": proc.returncode}
    try:
        out["json"] = json.loads(proc.stdout) if proc.stdout.strip() else None
    except json.JSONDecodeError:
        out["stdout"] = proc.stdout
    if proc.returncode:
        out["stderr"] = proc.stderr.strip().splitlines()[-1:] if proc.stderr else []
    return out


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in TIMING}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def snapshot() -> dict:
    doc: dict = {"suggest": {}, "estimate": {}, "benchmarks": {}}
    for args in SUGGEST:
        doc["suggest"][" ".join(args)] = _strip(_run(_dsplan() + ["suggest", *args, "--json"]))
    for args in ESTIMATE:
        doc["estimate"][" ".join(args)] = _strip(_run(_dsplan() + ["estimate", *args, "--json"]))
    for name in BENCHMARKS:
        doc["benchmarks"][name] = _run([sys.executable, str(HERE / name), "--json"])
    return doc


def differences(a, b, rel: float, path: str = "") -> list[str]:
    """Every place where ``a`` and ``b`` differ: numbers beyond ``rel``, anything else at all."""
    if isinstance(a, bool) or isinstance(b, bool) or not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        if isinstance(a, dict) and isinstance(b, dict):
            out = [f"{path}/{k}: only in one" for k in sorted(set(a) ^ set(b))]
            for k in a.keys() & b.keys():
                out += differences(a[k], b[k], rel, f"{path}/{k}")
            return out
        if isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                return [f"{path}: {len(a)} items vs {len(b)}"]
            return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, rel, f"{path}[{i}]")]
        return [] if a == b else [f"{path}: {a!r} vs {b!r}"]
    if a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rel * max(abs(a), abs(b))):
        return []
    return [f"{path}: {a!r} vs {b!r}"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the snapshot here")
    parser.add_argument("--compare", help="compare with a snapshot written earlier")
    parser.add_argument("--rel", type=float, default=1e-9, help="relative tolerance for numbers")
    args = parser.parse_args(argv)
    doc = snapshot()
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1, sort_keys=True))
    if args.compare:
        diffs = differences(json.loads(Path(args.compare).read_text()), doc, args.rel)
        for line in diffs:
            print(line)
        cases = sum(len(v) for v in doc.values())
        print(f"{cases} cases, {len(diffs)} differences beyond rel {args.rel:g}")
        return 1 if diffs else 0
    if not args.out:
        print(json.dumps(doc, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
