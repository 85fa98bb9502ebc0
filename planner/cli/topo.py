"""``dsplan topo``: the cluster's topology, one collective's predicted cost, or a drawing."""

from __future__ import annotations

import click
from rich.table import Table

from planner import limits
from planner.cli.hardware import hardware_option
from planner.cli.output import console, human_bytes, human_time, json_option, print_json
from planner.cli.outputs import OutputPath
from planner.hardware.load import load_profile
from planner.units import parse_size

# Listed here so `--help` needs no numpy/networkx import (the CLI loads every command module).
OPS = ("allreduce", "reducescatter", "allgather", "alltoall", "p2p", "broadcast")


@click.command(
    "topo",
    help="""Show a cluster's topology, predict one collective on it, or draw it.

    \b
    Examples:
      dsplan topo --hardware dgx-a100-80g --nodes 4
      dsplan topo --nodes 2 --collective allreduce --group-size 16 --bytes 1GiB --json
      dsplan topo --hardware hgx-h200 --collective allreduce --bytes 256MiB --no-nvls
      dsplan topo --nodes 2 --draw topo.png --dot topo.dot
      dsplan topo --hardware gb200-nvl72 --nodes 36 --collective allreduce --group-size 64
    \b
    On NVL72 profiles a node is one compute tray (4 GPUs) and 18 trays share one NVLink
    domain: groups inside a domain are priced on NVLink, groups across domains on the NICs.
    """,
)
@hardware_option
@click.option("--nodes", type=int, default=1, show_default=True,
              help="Number of nodes (NVL72: compute trays of 4 GPUs; at most 2^20 GPUs in all).")
@click.option("--collective", metavar="OP", help=f"Predict one collective: {', '.join(OPS)}.")
@click.option("--group-size", type=int, help="Ranks in the group (consecutive ranks, TP-style). Default: one node.")
@click.option("--bytes", "size", default=None,
              help="Buffer size as nccl-tests counts it (KiB/MiB/GiB, at most 1TiB) [default: 1GiB]; alone, predicts "
                   "an all-reduce.")
@click.option("--no-nvls", is_flag=True, help="Disable NVLink SHARP (as NCCL_NVLS_ENABLE=0).")
@click.option("--draw", "draw_path", type=OutputPath("file", ".png"), help="Write a PNG drawing (needs matplotlib).")
@click.option("--dot", "dot_path", type=OutputPath("file", ".dot"), help="Write a Graphviz .dot file.")
@json_option
def topo(hardware: str, nodes: int, collective: str | None, group_size: int | None, size: str | None,
         no_nvls: bool, draw_path: str | None, dot_path: str | None, as_json: bool) -> None:
    from planner.cost.collectives import collective_time_for_size, normalize_op
    from planner.hardware.cluster import Cluster

    cluster = Cluster.build(load_profile(hardware), nodes)  # checks nodes as every command does
    written = []
    if dot_path:
        from planner.hardware.draw import write_dot

        written.append(str(write_dot(cluster, dot_path)))
    if draw_path:
        from planner.hardware.draw import write_png

        written.append(str(write_png(cluster, draw_path)))
    if collective is not None or group_size is not None or size is not None:
        op = normalize_op(collective or "allreduce")
        nbytes = limits.count("bytes", parse_size(size or "1GiB", "--bytes"))
        group = cluster.gpus_per_node if group_size is None else limits.count("group_size", group_size)
        cost = collective_time_for_size(cluster, op, group, nbytes, nvls=False if no_nvls else None)
        if as_json:
            print_json(cost.as_dict() | {"hardware": cluster.profile.name, "nodes": nodes})
        else:
            _print_cost(cluster, cost)
    elif as_json:
        print_json(cluster.summary() | ({"written": written} if written else {}))
    else:
        _print_summary(cluster)
    if not as_json:
        for path in written:
            console.print(f"wrote {path}")


def _print_summary(cluster) -> None:
    s = cluster.summary()
    table = Table(title=f"{s['hardware']}: {s['nodes']} node(s)", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("GPUs", f"{s['gpus']} ({s['gpus_per_node']} per node)")
    table.add_row("intra-node", f"{s['intra_node_fabric']}, {s['intra_bw_per_gpu_GBps']:g} GB/s per GPU per direction"
                  + (", NVLS" if s["nvls"] else ""))
    if s["nvlink_domain_nodes"] > 1:
        seg = s["segment_nodes"]
        taken = (f"the job takes {seg} nodes of each of {s['nvlink_domains']} (Slurm --segment={seg})"
                 if s["nvlink_domains"] > 1 else "the job fits in one")
        table.add_row("NVLink domain", f"{s['nvlink_domain_nodes']} nodes ({s['nvlink_domain_gpus']} GPUs) on one "
                      f"NVLink switch fabric; {taken}; groups inside one are priced on NVLink")
    table.add_row("links by type", ", ".join(f"{k}: {v}" for k, v in sorted(s["links_by_type"].items())))
    table.add_row("NICs", f"{s['nics_per_node']} x {s['nic_GBps']:g} GB/s per node; "
                          f"{s['nic_bw_per_gpu_GBps']:g} GB/s per GPU")
    table.add_row("node bisection", f"{s['intra_node_bisection_GBps']:g} GB/s")
    table.add_row("network bisection", f"{s['bisection_bw_GBps']:g} GB/s" if s["nodes"] > 1 else "- (one node)")
    table.add_row("fabric", f"{s['fabric']}, {'rail-optimized' if s['rail_optimized'] else 'not rail-optimized'}")
    core = ""
    if s["levels"] == 3:
        added = " added" if cluster.profile.fabric.levels < 3 else ""
        core = f", a core layer{added} ({cluster.nodes} nodes over pods of {s['nodes_per_pod']})"
    table.add_row("switches", f"{s['leaf_switches']} leaf ({s['nodes_per_leaf']} nodes per leaf block), "
                              f"{s['spine_switches']} spine{core}")
    table.add_row("oversubscription", f"{s['oversubscription']:g}:1")
    console.print(table)


def _print_cost(cluster, cost) -> None:
    table = Table(title=f"{cost.op} over {cost.group_size} ranks, {human_bytes(cost.nbytes)} "
                        f"on {cluster.profile.name} x{cluster.nodes}")
    for col in ("time", "algbw GB/s", "busbw GB/s", "algorithm", "latency", "bottleneck"):
        table.add_column(col)
    table.add_row(human_time(cost.time_s), f"{cost.algbw_GBps:.1f}", f"{cost.busbw_GBps:.1f}", cost.algorithm,
                  human_time(cost.latency_s), cost.bottleneck or "-")
    console.print(table)


commands = [topo]
