"""``dsplan hardware``: list the built-in hardware profiles, or show one in full."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from planner.cli.output import console, json_option, print_json
from planner.hardware.load import DEFAULT_PROFILE, list_profiles, load_profile
from planner.hardware.profile import HardwareProfile

# For commands that take a machine type (suggest, estimate, topo, ...).
hardware_option = click.option(
    "--hardware",
    "hardware",
    default=DEFAULT_PROFILE,
    show_default=True,
    metavar="NAME|PATH",
    help="Hardware profile: a built-in name (see `dsplan hardware`) or a path to your own YAML file.",
)

# Short names for the table (the JSON keeps the schema's values).
_INTRA_NAMES = {
    "nvswitch": "NVSwitch", "nvlink_mesh": "NVLink", "pcie": "PCIe", "xgmi_mesh": "xGMI", "infinity_fabric": "IF",
}
_FABRIC_NAMES = {
    "infiniband_hdr": "IB HDR", "infiniband_ndr": "IB NDR", "infiniband_xdr": "IB XDR", "roce": "RoCE",
    "ethernet": "Ethernet",
}


def summary(profile: HardwareProfile) -> dict[str, Any]:
    """One row of ``dsplan hardware --json``: the numbers people compare machines by."""
    gpu, node = profile.gpu, profile.node
    return {
        "name": profile.name,
        "default": profile.name == DEFAULT_PROFILE,
        "description": profile.description,
        "gpu": gpu.name,
        "vendor": gpu.vendor,
        "gpus_per_node": node.gpus,
        "memory_GiB": gpu.memory_GiB,
        "bf16_TFLOPs": gpu.peak_flops("bf16") / 1e12,
        "hbm_GBps": gpu.hbm_GBps,
        "intra_kind": node.intra.kind,
        "intra_bw_GBps": node.intra.bw_GBps,
        "nvlink_domain_nodes": node.nvlink_domain_nodes,
        "nvlink_domain_gpus": profile.nvlink_domain_gpus,
        "nics_per_node": node.nics.count,
        "nic_speed_gbit": node.nics.speed_gbit,
        "nic_bw_per_gpu_GBps": profile.nic_bw_per_gpu / 1e9,
        "fabric": profile.fabric.kind,
    }


def derived(profile: HardwareProfile) -> dict[str, Any]:
    """Facts computed from the profile that the planner uses (SI units in bytes and FLOP/s too)."""
    gpu, node = profile.gpu, profile.node
    nic_node = node.nics.count * node.nics.bw_bytes_per_s
    return {
        "gpu_memory_bytes": gpu.memory_bytes,
        "bf16_flops": gpu.peak_flops("bf16"),
        "bf16_achievable_flops": gpu.peak_flops("bf16") * gpu.matmul_efficiency,
        "node_memory_GiB": gpu.memory_GiB * node.gpus,
        "node_bf16_TFLOPs": gpu.peak_flops("bf16") * node.gpus / 1e12,
        "nic_bw_per_gpu_GBps": profile.nic_bw_per_gpu / 1e9,
        "nic_bw_per_node_GBps": nic_node / 1e9,
        "intra_to_inter_bw_ratio": node.intra.bw_GBps * 1e9 / profile.nic_bw_per_gpu,
        "flops_per_hbm_byte": gpu.peak_flops("bf16") / (gpu.hbm_GBps * 1e9),
    }


def _intra_name(row: dict[str, Any]) -> str:
    """The intra-node column's fabric: NVL<GPUs> for an NVLink domain of several nodes (NVL72)."""
    if row["nvlink_domain_nodes"] > 1:
        return f"NVL{row['nvlink_domain_gpus']}"
    return _INTRA_NAMES[row["intra_kind"]]


@click.group(
    "hardware",
    invoke_without_command=True,
    help="""List the built-in hardware profiles, or show one in full.

    \b
    Examples:
      dsplan hardware                         table of built-in profiles
      dsplan hardware --json                  the same as JSON
      dsplan hardware show dgx-h100           every field of one profile
      dsplan hardware show ./my-cluster.yaml  check and print your own profile
    \b
    Describe your own cluster in YAML (schema: hardware_profiles/README.md) and pass
    its path anywhere a command takes --hardware.""",
)
@json_option
@click.pass_context
def hardware(ctx: click.Context, as_json: bool) -> None:
    if ctx.invoked_subcommand is not None:
        return
    profiles = [load_profile(name) for name in list_profiles()]
    if as_json:
        print_json([summary(p) for p in profiles])
        return
    table = Table(
        title="Hardware profiles",
        caption=f"* default: {DEFAULT_PROFILE}. "
                "Per GPU: GiB, dense bf16 TFLOP/s, HBM and intra-node GB/s per direction; "
                "NVL72: one NVLink domain of 72 GPUs over several nodes",
        box=None, padding=(0, 1, 0, 0), pad_edge=False, header_style="bold underline",
    )
    widest_name = max(len(p.name) for p in profiles) + 2
    for column, justify in (
        ("name", "left"), ("GPUs", "left"), ("GiB", "right"), ("bf16 TF", "right"),
        ("HBM", "right"), ("intra-node", "left"), ("NICs", "left"), ("fabric", "left"),
    ):
        # Names and numbers never shrink; on a narrow terminal the descriptive columns wrap.
        fixed = column == "name" or justify == "right"
        table.add_column(column, justify=justify, no_wrap=fixed,  # type: ignore[arg-type]
                         overflow="ellipsis" if fixed else "fold",
                         min_width=widest_name if column == "name" else (7 if fixed else None))
    for p in profiles:
        row = summary(p)
        table.add_row(
            row["name"] + (" *" if row["default"] else ""),
            f"{row['gpus_per_node']}x {row['gpu']}",
            f"{row['memory_GiB']:g}",
            f"{row['bf16_TFLOPs']:g}",
            f"{row['hbm_GBps']:g}",
            f"{_intra_name(row)} {row['intra_bw_GBps']:g}",
            f"{row['nics_per_node']}x{row['nic_speed_gbit']:g}G",
            _FABRIC_NAMES[row["fabric"]],
        )
    console.print(table)


@hardware.command(
    "show",
    help="""Print every field of one hardware profile, plus derived numbers.

    \b
    NAME_OR_PATH is a built-in profile name (case-insensitive; aliases such as h100,
    h200, a100 work) or a path to a profile YAML file.
    \b
    Examples:
      dsplan hardware show dgx-a100-80g
      dsplan hardware show h200 --json
      dsplan hardware show ./my-cluster.yaml""",
)
@click.argument("name_or_path", metavar="NAME_OR_PATH")
@json_option
def show(name_or_path: str, as_json: bool) -> None:
    profile = load_profile(name_or_path)
    if as_json:
        print_json({**profile.model_dump(mode="json"), "derived": derived(profile)})
        return
    console.print(f"[bold]{profile.name}[/bold]  {profile.description}")
    for title, section in (("gpu", profile.gpu), ("node", profile.node), ("fabric", profile.fabric)):
        console.print(_section_table(title, section.model_dump(mode="json")))
    console.print(_section_table("derived", derived(profile)))
    if profile.sources:
        console.print("[bold]sources[/bold]")
        for source in profile.sources:
            console.print(f"  - {source}")


def _section_table(title: str, data: dict[str, Any]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column("field")
    table.add_column("value")
    for key, value in _flatten(data):
        table.add_row(key, _format(value))
    return table


def _flatten(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            rows.extend(_flatten(value, f"{prefix}{key}."))
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) >= 1e6 else f"{value:g}"
    if value is None:
        return "-"
    return str(value)


commands = [hardware]
