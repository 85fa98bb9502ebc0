"""The node checks of ``preflight.sh``: what it measured, against ``preflight.json``.

``preflight.sh`` runs the tools (nvidia-smi, the NIC listing, nccl-tests) and hands their
output here as files; this module compares and prints one line per check, with what to fix
for each failure, and exits 1 when any check failed (2: bad arguments or an unreadable
``preflight.json``). The GEMM burn-in runs here, in torch, on each of the node's GPUs.

    python -m planner.run.preflight --expect preflight.json --gpus gpus.csv --nics 8 \
        --nccl all_reduce_perf:node:ar.txt --gemm
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

from planner.errors import UserError
from planner.run.nccl_tests import NcclTestsOutputError, Result, parse
from planner.run.preflight_spec import BusbwPoint, Check, Expectations, Gpu, Group, read_expectations

NCCL_FIX = ("check the NCCL settings in nccl.env (NCCL_IB_HCA must name the compute HCAs), "
            "`nvidia-smi nvlink -s` / `nvidia-smi topo -m` for a link down or NVSwitch/Fabric Manager "
            "errors, `nvidia-smi -q -d CLOCK,PERFORMANCE` for throttled clocks, and rerun with NCCL_DEBUG=INFO")
NET_FIX = ("check `ibstat` (every port Active at the fabric's rate), NCCL_IB_HCA / NCCL_SOCKET_IFNAME in nccl.env, "
           "and that NCCL_DEBUG=INFO shows NET/IB with GPUDirect RDMA, not NET/Socket")


def read_gpus(text: str) -> list[Gpu]:
    """``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`` lines."""
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 3 or not fields[0].isdigit():
            continue
        try:
            gpus.append(Gpu(int(fields[0]), fields[1], float(fields[2])))
        except ValueError:
            continue
    return gpus


def check_gpus(exp: Expectations, gpus: list[Gpu] | None, local: bool) -> Check:
    want = f"{exp.gpus_per_node} x {exp.gpu_name} with {exp.gpu_memory_GiB:g} GiB"
    if exp.vendor != "nvidia":
        return Check("gpus", "SKIP", f"not checked on {exp.vendor} GPUs (rocm-smi output is not read); "
                     f"expected {want}: look at `rocm-smi --showproductname --showmeminfo vram`")
    if gpus is None:
        if local:
            return Check("gpus", "SKIP", "nvidia-smi not found: no NVIDIA GPU here (--local trains on CPUs)")
        return Check("gpus", "FAIL", f"nvidia-smi not found; the plan expects {want}",
                     "install the NVIDIA driver (nvidia-smi comes with it) or run on a GPU node")
    if len(gpus) < exp.gpus_per_node:
        return Check("gpus", "FAIL", f"nvidia-smi lists {len(gpus)} GPU(s); the plan expects {want}",
                     "check CUDA_VISIBLE_DEVICES, `nvidia-smi -L`, and for a GPU that fell off the bus "
                     "`dmesg | grep -i xid`; drain the node if one is missing")
    floor = exp.gpu_memory_GiB * 1024 * exp.memory_min_fraction
    small = [g for g in gpus if g.memory_MiB < floor]
    if small:
        g = small[0]
        return Check("gpus", "FAIL", f"GPU {g.index} ({g.name}) has {g.memory_MiB:.0f} MiB; the plan expects "
                     f"{exp.gpu_memory_GiB:g} GiB ({exp.gpu_name})",
                     "a MIG slice or another GPU model: `nvidia-smi -mig 0` as root, or regenerate the run "
                     "directory for this hardware (--hardware)")
    return Check("gpus", "PASS", f"{len(gpus)} x {gpus[0].name}, {gpus[0].memory_MiB:.0f} MiB each "
                 f"(expected {exp.gpus_per_node}, >= {floor:.0f} MiB)")


def check_nics(exp: Expectations, found: int | None, local: bool) -> Check:
    if exp.nodes == 1:
        return Check("nics", "SKIP", "not needed: a single-node plan sends nothing over the compute NICs")
    if not exp.rdma:
        return Check("nics", "SKIP", f"not checked on a {exp.fabric} fabric (no RDMA devices to count)")
    if found is None:
        status = "SKIP" if local else "FAIL"
        return Check("nics", status, "no RDMA device listing (/sys/class/infiniband, ibv_devices)",
                     "install rdma-core and the NIC driver (MLNX_OFED / DOCA-OFED)")
    if found < exp.nics:
        return Check("nics", "FAIL", f"{found} RDMA device(s); the plan expects {exp.nics} compute NICs",
                     f"`ibstat` for a port down or a missing HCA; {NET_FIX}")
    return Check("nics", "PASS", f"{found} RDMA device(s) (expected {exp.nics})")


def expected_busbw(points: list[BusbwPoint], size: int) -> float | None:
    """The prediction at ``size``, interpolated in log2(size) between the grid's points;
    None outside the grid (nccl-tests rounds sizes to whole elements per rank)."""
    for lo, hi in zip(points, points[1:]):
        if lo.size_bytes <= size <= hi.size_bytes:
            t = (math.log2(size) - math.log2(lo.size_bytes)) / (math.log2(hi.size_bytes) - math.log2(lo.size_bytes))
            return lo.busbw_GBps + t * (hi.busbw_GBps - lo.busbw_GBps)
    if points and size == points[-1].size_bytes:
        return points[-1].busbw_GBps
    return None


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def check_nccl(exp: Expectations, binary: str, group: Group, result: Result, source: str) -> list[Check]:
    """#wrong, then bus bandwidth against the prediction, then (node group) small-message latency."""
    name = f"{binary} {group.name} ({group.ranks} ranks)"
    out: list[Check] = []
    if result.ranks and result.ranks != group.ranks:
        out.append(Check(f"{name} ranks", "FAIL", f"{source} ran over {result.ranks} GPU(s), not {group.ranks}",
                         "run it with -g GPUS_PER_NODE on one node, or one process per GPU across nodes"))
    wrong = [(r.size_bytes, r.wrong) for r in result.rows if r.wrong]
    if wrong or result.out_of_bounds:
        sizes = ", ".join(f"{_size(s)}: {w}" for s, w in wrong[:4]) or f"{result.out_of_bounds} out of bounds"
        out.append(Check(f"{name} errors", "FAIL", f"wrong results ({sizes}): data corruption on a GPU or link",
                         "look for Xid errors (`dmesg | grep -i xid`) and ECC errors (`nvidia-smi -q -d ECC`), "
                         "rerun with NCCL_DEBUG=WARN; drain the node if it repeats"))
    elif all(r.wrong is None for r in result.rows):
        out.append(Check(f"{name} errors", "SKIP", "#wrong is N/A: the test ran without checking (-c 0)"))
    else:
        out.append(Check(f"{name} errors", "PASS", f"#wrong 0 at all {len(result.rows)} sizes"))
    out.append(_bandwidth(exp, name, group, group.ops.get(binary, []), result))
    if binary == "all_reduce_perf" and group.name == "node":
        out.append(_latency(exp, name, result))
    return out


def _bandwidth(exp: Expectations, name: str, group: Group, points: list[BusbwPoint], result: Result) -> Check:
    compared = []
    for row in result.rows:
        want = expected_busbw(points, row.size_bytes) if row.size_bytes >= exp.busbw_min_bytes else None
        if want:
            compared.append((row.busbw_GBps / want, row, want))
    if not compared:
        return Check(f"{name} busbw", "SKIP", f"no row of {_size(exp.busbw_min_bytes)} or more within the "
                     "predicted sizes (run it with -b 8 -e 1G -f 2)")
    ratio, row, want = min(compared, key=lambda c: c[0])
    low = [c for c in compared if c[0] < exp.busbw_min_fraction]
    detail = (f"at {_size(row.size_bytes)} busbw {row.busbw_GBps:.1f} GB/s is {100 * ratio:.0f}% of the predicted "
              f"{want:.1f} GB/s; avg bus bandwidth {result.avg_busbw_GBps:.1f} GB/s")
    if low:
        fix = NET_FIX if group.nodes > 1 else NCCL_FIX
        return Check(f"{name} busbw", "FAIL", f"{detail}; {len(low)} of {len(compared)} sizes below "
                     f"{100 * exp.busbw_min_fraction:.0f}% of dsplan's prediction", fix)
    return Check(f"{name} busbw", "PASS", f"{len(compared)} sizes >= {100 * exp.busbw_min_fraction:.0f}% of the "
                 f"prediction (lowest: {detail})")


def _latency(exp: Expectations, name: str, result: Result) -> Check:
    small = [r for r in result.rows if r.size_bytes <= exp.small_allreduce_max_bytes]
    if not small:
        return Check(f"{name} latency", "SKIP", f"no all-reduce of {_size(exp.small_allreduce_max_bytes)} or less "
                     "(run it with -b 8)")
    row = small[0]
    detail = f"{_size(row.size_bytes)} all-reduce takes {row.time_us:.1f} us (limit {exp.small_allreduce_max_us:g} us)"
    if row.time_us > exp.small_allreduce_max_us:
        return Check(f"{name} latency", "FAIL", detail,
                     "GPUs without P2P over NVLink go through host memory: `nvidia-smi topo -p2p r`, "
                     "NCCL_P2P_DISABLE / NCCL_SHM_DISABLE must not be set, and the CPUs must not be busy")
    return Check(f"{name} latency", "PASS", detail)


def nccl_checks(exp: Expectations, spec: str) -> list[Check]:
    """``BINARY:GROUP:FILE`` (the output of one nccl-tests run) compared with the group's prediction."""
    binary, group_name, path = _split_spec(spec)
    group = exp.group(group_name)
    if group is None:
        raise UserError(f"--nccl {spec}: preflight.json has no {group_name!r} group "
                        f"(it has {', '.join(g.name for g in exp.groups)})")
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise UserError(f"--nccl {spec}: cannot read {path} ({err.strerror})") from None
    try:
        result = parse(text, f"{binary} output {path}")
    except NcclTestsOutputError as err:
        return [Check(f"{binary} {group_name}", "FAIL", str(err),
                      f"run `{binary} -b 8 -e 1G -f 2 -g {group.ranks}` by hand and read its errors")]
    return check_nccl(exp, binary, group, result, path)


def _split_spec(spec: str) -> tuple[str, str, str]:
    parts = spec.split(":", 2)
    if len(parts) != 3 or not all(parts):
        raise UserError(f"--nccl {spec}: expected BINARY:GROUP:FILE, e.g. all_reduce_perf:node:ar.txt")
    return parts[0], parts[1], parts[2]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planner.run.preflight", description=__doc__.split("\n")[0])
    parser.add_argument("--expect", required=True, help="the run directory's preflight.json")
    parser.add_argument("--gpus", help="nvidia-smi --query-gpu=index,name,memory.total CSV; omit: no nvidia-smi")
    parser.add_argument("--nics", type=int, help="RDMA devices found on this node; omit: no listing")
    parser.add_argument("--nccl", action="append", default=[], metavar="BINARY:GROUP:FILE")
    parser.add_argument("--skip", action="append", default=[], metavar="CHECK:WHY", help="a check not run, and why")
    parser.add_argument("--gemm", action="store_true", help="run the bf16 GEMM burn-in on every GPU")
    parser.add_argument("--local", action="store_true", help="a --local (CPU) run: missing GPUs are no failure")
    args = parser.parse_args(argv)
    try:
        checks = run_checks(args)
    except UserError as err:
        print(f"preflight: error: {err}", file=sys.stderr)
        return 2
    for check in checks:
        print(check.line(), flush=True)
    failed = [c.name for c in checks if c.status == "FAIL"]
    print(f"preflight: {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}", flush=True)
    return 1 if failed else 0


def run_checks(args: argparse.Namespace) -> list[Check]:
    exp = read_expectations(args.expect)
    gpus = None
    if args.gpus is not None:
        try:
            gpus = read_gpus(Path(args.gpus).read_text(encoding="utf-8", errors="replace"))
        except OSError as err:
            raise UserError(f"--gpus {args.gpus}: cannot read it ({err.strerror})") from None
    checks = [check_gpus(exp, gpus, args.local), check_nics(exp, args.nics, args.local)]
    if args.gemm:
        from planner.run.gemm_burn import gemm_checks

        checks += gemm_checks(exp, gpus, args.local)
    for spec in args.nccl:
        checks += nccl_checks(exp, spec)
    for skip in args.skip:
        name, _, why = skip.partition(":")
        checks.append(Check(name, "SKIP", why or "skipped"))
    return checks


if __name__ == "__main__":
    sys.exit(main())
