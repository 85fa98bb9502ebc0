"""``dsplan estimate``: memory and step time of one parallel plan.

Thin: parse the flags, call ``planner.api.estimate`` (which fills the defaults and checks every
rule: planner/cost/degrees.py), print rich tables or JSON. Heavy modules are imported inside the
command so ``dsplan --help`` stays fast.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from planner.cli.fit import DOES_NOT_FIT_EXIT, allow_oom_option, warn_does_not_fit
from planner.cli.flags import cli_text
from planner.cli.hardware import hardware_option
from planner.cli.options import calibration_option, layer_profile_option, workload_options
from planner.cli.output import attention_words, console, human_bytes, human_time, json_option, print_json
from planner.errors import UserError


@click.command("estimate")
@click.option("--model", "model_name", required=True, metavar="NAME|PATH",
              help="Model preset (see `dsplan models`) or a config.json.")
@hardware_option
@calibration_option
@click.option("--nodes", type=int, default=1, show_default=True, help="Number of nodes.")
@click.option("--gpus-per-node", type=int, default=None,
              help="GPUs per node, 1-576 [default: from the hardware profile].")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel degree.")
@click.option("--dp", type=int, default=None, help="Data-parallel degree [default: GPUs / (tp x pp)].")
@click.option("--ep", type=int, default=1, show_default=True,
              help="Expert-parallel degree (ranks taken from the DP group).")
@click.option("--etp", type=int, default=None,
              help="Expert tensor-parallel degree, 1 or tp: at 1 the experts leave TP and expert parallelism "
                   "takes the TP ranks too, ep dividing tp x dp x cp (Megatron-Core --expert-tensor-parallel-size, "
                   "torchtitan expert_tensor_parallel_degree) [default: tp].")
@click.option("--cp", type=int, default=1, show_default=True,
              help="Context-parallel degree: each sample's sequence split over cp ranks (Megatron-Core "
                   "--context-parallel-size; DeepSpeed Ulysses with --cp-comm a2a).")
@click.option("--cp-comm", type=click.Choice(["p2p", "a2a", "a2a+p2p"]), default="p2p", show_default=True,
              help="How context-parallel ranks exchange attention inputs: p2p (ring of K/V chunks, overlapped "
                   "with attention), a2a (all-to-all over heads, Ulysses), a2a+p2p (a2a inside a node, ring across).")
@click.option("--dp-replicate", type=int, default=1, show_default=True,
              help="Hybrid sharding: the dp x cp ranks form this many groups, each sharding the model states, "
                   "that replicate each other (megatron --zero 1/3: --num-distributed-optimizer-instances; "
                   "torchtitan --zero 3: HSDP).")
@click.option("--zero", "zero_stage", type=click.IntRange(0, 3), default=None,
              help="ZeRO stage; with --framework megatron, 1 is the distributed optimizer and 3 Megatron-FSDP "
                   "[default: 1 when dp > 1, else 0].")
@click.option("--offload", type=click.Choice(["none", "optimizer", "optimizer+params"]), default="none",
              show_default=True,
              help="optimizer: DeepSpeed ZeRO-Offload or Megatron-Core's optimizer CPU offload (bf16, Adam); "
                   "optimizer+params: ZeRO-3 only.")
@click.option("--micro-batch", type=int, default=1, show_default=True, help="Samples per micro-batch per GPU.")
@workload_options("Samples per optimizer step [default: about 4M tokens, a multiple of micro-batch x dp with at "
                  "least pp micro-batches].")
@click.option("--recompute", type=click.Choice(["none", "selective", "full", "op"]), default="none", show_default=True,
              help="Activation recomputation: selective is Megatron's (the modules --recompute-modules names), full "
                   "every transformer layer, op torchtitan's per-op selective checkpointing (keeps every other "
                   "matmul's output and the attention's).")
@click.option("--activation-offload", type=click.IntRange(min=0), default=0, show_default=True, metavar="LAYERS",
              help="Decoder layers whose activations go to host memory in the forward and come back for the "
                   "backward, the first LAYERS of the model's (Megatron-Core --cpu-offloading-num-layers through "
                   "Transformer Engine; framework megatron, pp 1, recompute none).")
@click.option("--sequence-parallel", is_flag=True, help="Megatron sequence parallelism (needs tp > 1).")
@click.option("--virtual-stages", type=int, default=None,
              help="Pipeline chunks per rank: interleaved 1F1B's, or DualPipeV's two [default: 1; 2 under "
                   "--pp-schedule dualpipev with --pp > 1].")
@click.option("--framework", type=click.Choice(["deepspeed", "megatron-deepspeed", "megatron", "torchtitan"]),
              default="deepspeed", show_default=True,
              help="The runtime; torchtitan: PyTorch FSDP2 (--zero 3) + TP + PP + CP, its own model flavors only.")
@click.option("--stage-blocks", default=None, metavar="A-B,B-C,...",
              help="Explicit pipeline partition: half-open block ranges, pp x virtual-stages of them "
                   "[default: even split].")
@layer_profile_option
@allow_oom_option("Exit with status 0 when the plan does not fit in memory (the warning stays).")
@json_option
def estimate_command(as_json: bool, allow_oom: bool, **opts: Any) -> None:
    """Memory per GPU and step time of one plan.

    A plan that does not fit in memory is still priced and printed, with
    `warning: plan does not fit: ...` on stderr and exit status 3 (0 with --allow-oom);
    `generate --plan` and `run` refuse such a plan unless given --allow-oom too.

    \b
    Examples:
      dsplan estimate --model llama-3-8b --nodes 1 --tp 2 --micro-batch 1 --global-batch 512
      dsplan estimate --model llama-2-70b --nodes 16 --tp 8 --pp 4 --framework megatron \\
          --zero 1 --sequence-parallel --recompute selective --global-batch 1024 --json
      dsplan estimate --model llama-3-8b --nodes 2 --tp 2 --calibration calibration.yaml
    """
    plan = run_estimate(**opts)
    if as_json:
        print_json(plan.to_json())
    else:
        render(plan)
    if not plan.fits:
        warn_does_not_fit(plan.why_not())
        if not allow_oom:
            sys.exit(DOES_NOT_FIT_EXIT)


def run_estimate(model_name: str, hardware: str, nodes: int, gpus_per_node: int | None, zero_stage: int | None,
                 stage_blocks: str | None, calibration: str | None = None, **knobs: Any):
    """Flags to Plan through ``planner.api.estimate`` (defaults, rules and notes live there)."""
    from planner import api

    model = api.load_model(model_name)
    cluster = api.load_cluster(hardware, nodes, gpus_per_node=gpus_per_node, calibration=calibration)
    partition = _parse_stage_blocks(stage_blocks) if stage_blocks else None
    return api.estimate(model, cluster, partition=partition, zero=zero_stage, **knobs)


def _parse_stage_blocks(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        a, sep, b = item.strip().partition("-")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise UserError(f"--stage-blocks: cannot read {item!r}; write half-open block ranges like 0-12,12-25")
        out.append((int(a), int(b)))
    return out


# -- human output --------------------------------------------------------------------------


def render(plan) -> None:
    """The plan in two lines, its memory and time tables, and its notes (names and notes are
    data, escaped, never read as rich markup)."""
    from rich.markup import escape

    from planner.cost.eager_kernels import eager_words
    from planner.cost.memory import group_to_set

    c, w = plan.cfg, plan.workload
    verdict = "[green]fits[/green]" if plan.fits else f"[red]does not fit[/red]: {escape(plan.why_not())}"
    virtual = ""
    if w.pp_schedule == "dualpipev" and c.pp > 1:
        virtual = " (DualPipeV: 2 chunks a rank in a V)"
    elif c.virtual_stages > 1:  # a micro-batch count pp does not divide runs with a larger group (cost/memory.py)
        g = group_to_set(c.pp, c.virtual_stages, c.grad_accum)
        virtual = f" (v {c.virtual_stages}" + (f", micro-batch group {g}" if g else "") + ")"
    console.print(f"[bold]{escape(plan.model)}[/bold] on {plan.nodes} x {plan.gpus_per_node} {escape(plan.hardware)} "
                  f"({plan.gpus} GPUs), {c.framework}: dp {c.dp} x tp {c.tp} x pp {c.pp}" + virtual
                  + (f", ep {c.ep}" if c.ep > 1 else "") + (" (etp 1: experts off TP)" if c.etp < c.tp else "")
                  + (f", cp {c.cp} ({c.cp_comm})" if c.cp > 1 else "") + f", ZeRO-{c.zero_stage}"
                  + (f" in {c.dp_replicate} replicated groups of {c.dp_shard}" if c.dp_replicate > 1 else "")
                  + (f", offload {c.offload}" if c.offload != "none" else "") + (", SP" if c.sequence_parallel else "")
                  + f", recompute {c.recompute}"
                  + (f" ({', '.join(w.recompute_modules)})" if c.recompute == "selective" else "")
                  + (f", activations of {c.activation_offload} layers offloaded" if c.activation_offload else ""))
    console.print(f"batch {w.global_batch} x {w.seq_len} tokens = micro-batch {c.micro_batch} "
                  f"x accumulation {c.grad_accum} x dp {c.dp}; {w.precision_name}, {w.optimizer}"
                  + attention_words(w.flash_attention, w.flash_version)
                  + (f", {eager}" if (eager := eager_words(w.compile, w.rms_norm_kernel,
                                                          w.pp_schedule == "dualpipev")) else "")
                  + (f", {w.mtp_layers} multi-token-prediction depth(s)" if w.mtp_layers else "") + f"; {verdict}")
    _render_memory(plan)
    _render_time(plan)
    for line in plan.notes:
        console.print(f"[bold]note[/bold]: {escape(cli_text(line))}")


def _render_memory(plan) -> None:
    """Memory per GPU by pipeline rank: a table, or one line per rank on a narrow terminal."""
    from rich import box
    from rich.measure import Measurement
    from rich.table import Table

    # Light borders and wrapping block ranges: the ten columns fit an 80-column terminal.
    mem = Table(title="Memory per GPU in GiB (peak, by pipeline rank)", title_justify="left", box=box.SIMPLE_HEAD,
                pad_edge=False, show_edge=False, collapse_padding=True)
    for col in ("rank", "blocks", "layers", "weights", "grads", "optim", "activ", "buffers", "overhead", "peak"):
        mem.add_column(col, justify="right")
    cap = plan.capacity_bytes
    for s in plan.stages:
        m = s.memory
        peak = _gib(m.peak)
        mem.add_row(str(s.rank), ", ".join(f"{a}-{b}" for a, b in s.chunks), str(s.decoder_layers), _gib(m.weights),
                    _gib(m.grads), _gib(m.optimizer), _gib(m.activations), _gib(m.buffers), _gib(m.overhead),
                    peak if m.peak <= cap else f"[red]{peak}[/red]")
    if console.width >= Measurement.get(console, console.options.update_width(10_000), mem).maximum:
        console.print(mem)
    else:  # too narrow for the table: one line per rank, so no number is cut short
        console.print("Memory per GPU in GiB (peak, by pipeline rank)")
        for s in plan.stages:
            m = s.memory
            peak = _gib(m.peak) if m.peak <= cap else f"[red]{_gib(m.peak)}[/red]"
            console.print(f"  rank {s.rank}: blocks {', '.join(f'{a}-{b}' for a, b in s.chunks)} ({s.decoder_layers} "
                          f"layers); weights {_gib(m.weights)}, grads {_gib(m.grads)}, optim {_gib(m.optimizer)}, "
                          f"activ {_gib(m.activations)}, buffers {_gib(m.buffers)}, overhead {_gib(m.overhead)}; "
                          f"peak {peak}")
    console.print(f"GPU memory {human_bytes(cap)}"
                  + (f"; host memory per node for offload {human_bytes(plan.cpu_bytes_per_node)}"
                     if plan.offloads else ""))


def _render_time(plan) -> None:
    """The exposed step time by the parts that apply to the plan, and the throughput."""
    from rich.table import Table

    from planner.cli.output import checkpoint_line, time_parts

    t = plan.time
    total = t.total
    tt = Table(title="Step time (exposed)", title_justify="left")
    tt.add_column("part")
    tt.add_column("time", justify="right")
    tt.add_column("share", justify="right")
    for part in time_parts(plan.cfg):
        value = getattr(t, part)
        tt.add_row(_PART_NAMES.get(part, part), human_time(value), f"{value / total:.1%}")
    tt.add_row("[bold]step[/bold]", f"[bold]{human_time(total)}[/bold]", "100%")
    console.print(tt)
    console.print(f"{plan.tokens_per_s:,.0f} tokens/s, {plan.tflops_per_gpu:.1f} model TFLOP/s per GPU, "
                  f"MFU {plan.mfu:.1%}")
    if plan.checkpoint is not None:
        console.print(checkpoint_line(plan.checkpoint, total, plan.tokens_per_s))


_PART_NAMES = {"tp_comm": "TP comm", "pp_bubble": "PP bubble", "pp_comm": "PP comm", "dp_comm": "DP comm",
               "ep_comm": "EP comm", "cp_comm": "CP comm", "act_offload": "activation offload"}


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


commands = [estimate_command]
