"""How fast ``dsplan suggest`` is, timed as whole processes (start-up and imports included).

    python benchmarks/bench_suggest_speed.py [--repeat 3]

For each case: the best wall-clock time of ``repeat`` runs, the CPU time of that run
(user + system of the child, so a busy machine does not flatter or punish the number), the
candidates the search evaluated (``evaluated`` in --json: every candidate of the space, scored
in full or ruled out by a proven bound) and how many it evaluated in full, and candidates per
second per core (candidates / CPU seconds). Targets (issue 5): vl2 on 8 nodes under 1 s,
llama-3.1-405b on 2048 nodes under 3 s, at least 100,000 candidates per second per core.

A second table times the vectorised evaluation alone, in this process and without the
branch-and-bound pruning: every candidate of the space evaluated in full (block tables,
both balancers, per-rank tables, memory and step time), CPU seconds per candidate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

CASES = [
    ("vl2 on 8 nodes", ["--model", "vl2", "--nodes", "8"], 1.0),
    ("llama-3.1-405b on 2048 nodes", ["--model", "llama-3.1-405b", "--nodes", "2048"], 3.0),
]


def command() -> list[str]:
    """The ``dsplan`` script next to this interpreter, else ``python -m planner``."""
    script = os.path.join(os.path.dirname(sys.executable), "dsplan")
    if os.path.exists(script):
        return [script]
    found = shutil.which("dsplan")
    return [found] if found else [sys.executable, "-m", "planner"]


def run_once(args: list[str]) -> tuple[float, float, dict]:
    before = os.times()
    start = time.perf_counter()
    proc = subprocess.run([*command(), "suggest", *args, "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = os.times()
    if proc.returncode != 0:
        raise SystemExit(f"dsplan suggest {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return wall, cpu, json.loads(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    opts = parser.parse_args()
    # Wall times depend on what else runs: say how busy the machine was.
    print(f"load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min) on {os.cpu_count()} cores")
    print(f"{'case':<30} {'wall s':>8} {'cpu s':>7} {'target':>7} {'candidates':>11} {'in full':>8} "
          f"{'cand/s/core':>12} {'search s':>9}")
    ok = True
    for name, args, target in CASES:
        runs = [run_once(args) for _ in range(opts.repeat)]
        wall, cpu, data = min(runs, key=lambda r: r[0])
        n = data["evaluated"]
        full = data["search"]["fully_evaluated"]
        rate = n / cpu if cpu > 0 else float("inf")
        meets = wall < target and rate >= 1e5
        ok &= meets
        print(f"{name:<30} {wall:>8.2f} {cpu:>7.2f} {target:>6.1f}s {n:>11,} {full:>8,} {rate:>12,.0f} "
              f"{data['search']['elapsed_s']:>9.2f} {'ok' if meets else 'MISSED'}")
    print()
    print(f"{'full evaluation, no pruning':<30} {'candidates':>11} {'cpu s':>7} {'cand/s/core':>12}")
    for name, args, _ in CASES:
        n, cpu = full_evaluation(args[1], int(args[3]))
        print(f"{name:<30} {n:>11,} {cpu:>7.2f} {n / cpu:>12,.0f}")
    return 0 if ok else 1


def full_evaluation(model_name: str, nodes: int) -> tuple[int, float]:
    """CPU seconds to evaluate every candidate of the default search in full."""
    from planner.cost.parallel import Workload
    from planner.hardware.cluster import Cluster
    from planner.hardware.load import load_profile
    from planner.model.catalog import load_model
    from planner.search.evaluate import Evaluator
    from planner.search.space import Constraints, default_global_batch
    from planner.search.suggest import _space, _vision_defaults

    model = load_model(model_name)
    cluster = Cluster.build(load_profile("dgx-a100-80g"), nodes)
    gb = default_global_batch(model.train_seq_len, cluster.num_gpus)
    images, tiles = _vision_defaults(model, None, None)
    workload = Workload(global_batch=gb, seq_len=model.train_seq_len, images_per_sample=images, tiles_per_image=tiles)
    start = time.process_time()
    space = _space(model, cluster, gb, Constraints())
    ev = Evaluator(model, cluster, workload)
    rows, _ = ev.evaluate(ev.prepare(space))
    return len(rows), time.process_time() - start


if __name__ == "__main__":
    sys.exit(main())
