"""``dsplan profile``: measure a model's blocks and the device (planner/run/profile_run.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from planner.cli.output import console, json_option, print_json
from planner.cli.outputs import OutputPath
from planner.errors import UserError

HARDWARE_HELP = ("The hardware profile the measurements stand for (what `--profile` checks against) [default: "
                 "cpu-local on a CPU, the GPU's built-in profile on CUDA; with --hardware-out, that file's].")


@click.command("profile")
@click.option("--model", "model_name", required=True, metavar="NAME|PATH", help="Model preset or config.json.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Where to run the blocks [default: cuda when torch sees a GPU, else cpu].")
@click.option("--micro-batch", type=click.IntRange(1, 4096), default=1, show_default=True,
              help="Samples per block call.")
@click.option("--seq-len", type=click.IntRange(1, 2**20), default=None,
              help="Tokens per sample [default: the model's training length on a GPU, 256 on a CPU].")
@click.option("--scale", default="1", show_default=True,
              help="Model scale: 1 (the real blocks), a fraction, tiny or small (when a block does not fit).")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="Block dtype [default: bf16 on a GPU, fp32 on a CPU, whose bf16 GEMMs run far slower].")
@click.option("--hardware", default=None, metavar="NAME|PATH", help=HARDWARE_HELP)
@click.option("--ranks", type=click.IntRange(1, 64), default=None,
              help="Ranks for the local collectives (1: none) [default: 2 on a CPU, every GPU on CUDA].")
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="CPU threads [default: cores / ranks, as `dsplan run --local` gives each rank].")
@click.option("--warmup", type=click.IntRange(0, 100), default=2, show_default=True, help="Untimed runs first.")
@click.option("--repetitions", type=click.IntRange(1, 1000), default=5, show_default=True,
              help="Timed runs; the median is kept.")
@click.option("--out", "out", required=True, type=OutputPath("file"), help="Where to write profile.json.")
@click.option("--hardware-out", type=OutputPath("file"), default=None,
              help="--device cpu: also write this machine as a hardware profile YAML: GEMM peaks, the ranks' "
                   "copy rates (into mapped and into new memory), gloo's link and its all-gather / reduce-scatter "
                   "shares (then plan with --hardware FILE).")
@click.option("--force", is_flag=True, help="Overwrite --out and --hardware-out if they exist.")
@json_option
def profile_command(as_json: bool, out: str, hardware_out: str | None, force: bool, **opts: Any) -> None:
    """Measure forward, backward and recompute time and activation memory of each distinct
    block of a model, the device's GEMM rate and memory bandwidth, and local collectives.

    `estimate`, `suggest` and `generate` take the result with `--profile FILE`: measured
    block costs replace the analytic ones (carried to other micro-batches, sequences and
    tensor-parallel sizes by the cost model, which says so).

    \b
    Examples:
      dsplan profile --model gpt3-125m --device cpu --out profile.json --hardware-out cpu.yaml
      dsplan profile --model llama-3-8b --device cuda --micro-batch 2 --out llama8b.json
      dsplan estimate --model gpt3-125m --hardware cpu.yaml --profile profile.json --gpus-per-node 2 ...
    """
    targets = [Path(p) for p in (out, hardware_out) if p]
    for path in targets:
        if path.exists() and not force:
            raise UserError(f"{path}: exists; pass --force to overwrite it")
    result, hardware = _run(opts, hardware_out)
    from planner.run.rundir import write_json_atomic

    if hardware is not None:
        import yaml

        from planner.atomic import write_bytes_atomically

        write_bytes_atomically(str(hardware_out), yaml.safe_dump(hardware, sort_keys=False).encode())
    write_json_atomic(Path(out), result.model_dump(mode="json"))
    if as_json:
        print_json(result.model_dump(mode="json"))
    else:
        _render(result, out, hardware_out)


def _run(opts: dict[str, Any], hardware_out: str | None):
    """The measurement (after the cheap checks), and the hardware profile mapping if asked."""
    from planner.api import load_model
    from planner.hardware.load import load_profile
    from planner.run.model_scale import parse_scale

    # The reference trainer has no MTP module: its depth is priced at its layer's measured ratio
    # (measured_blocks.measured_for), and that layer is one of the main model's.
    spec = load_model(opts["model_name"]).with_mtp_layers(0)
    parse_scale(opts["scale"])  # the cheap checks before a device is touched
    if opts["hardware"]:
        load_profile(opts["hardware"])
    device = opts["device"] or _default_device()
    if hardware_out and device != "cpu":
        raise UserError("--hardware-out: writes a CPU hardware profile; use it with --device cpu")
    ranks = opts["ranks"] if opts["ranks"] is not None else None
    cores = os.cpu_count() or 1
    import torch

    from planner.run.profile_run import ProfileRequest

    if device == "cpu":
        torch.set_num_threads(opts["threads"] or max(1, cores // (ranks or 2)))
    name = opts["hardware"] or (Path(hardware_out).stem if hardware_out else None)
    seq = opts["seq_len"] or (spec.train_seq_len if device == "cuda" else min(256, spec.train_seq_len))
    req = ProfileRequest(model=spec, device=device, micro_batch=opts["micro_batch"], seq_len=seq, scale=opts["scale"],
                         precision=opts["precision"], hardware=name, ranks=ranks, warmup=opts["warmup"],
                         repetitions=opts["repetitions"])
    result = _with_progress(req)
    hardware = None
    if hardware_out:
        from planner.run.profile_hardware import cpu_hardware_profile

        hardware = cpu_hardware_profile(result, result.hardware, ranks or 2, cores)
    return result, hardware


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _with_progress(req):
    """run_profile with a progress bar on standard error, one step per measurement."""
    from rich.console import Console
    from rich.progress import Progress

    from planner.run.profile_run import run_profile

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("profiling", total=None)

        def step(what: str) -> None:
            bar.update(task, description=what, advance=1)

        return run_profile(req, step)


def _render(result, out: str, hardware_out: str | None) -> None:
    from rich.table import Table

    table = Table(title=f"{result.model} on {result.device}, {result.dtype}, micro-batch {result.micro_batch} "
                        f"x {result.seq_len} tokens (scale {result.scale})")
    for col in ("block", "kind", "forward ms", "backward ms", "recompute ms", "activations MiB"):
        table.add_column(col, justify="right" if col not in ("kind",) else "left")
    for b in result.blocks:
        table.add_row(str(b.block_index), b.kind, f"{b.forward_s * 1e3:.2f}", f"{b.backward_s * 1e3:.2f}",
                      "-" if b.recompute_s is None else f"{b.recompute_s * 1e3:.2f}",
                      f"{b.activation_bytes / 2**20:.1f}")
    console.print(table)
    rate = result.matmul_flops_per_s()
    console.print(f"GEMM: best {rate / 1e9:.1f} GFLOP/s ({result.dtype}); memory copy "
                  f"{result.memory_bandwidth_GBps:.1f} GB/s; {len(result.collectives)} collective points")
    console.print(f"wrote {out}" + (f" and {hardware_out}" if hardware_out else ""))


commands = [profile_command]
