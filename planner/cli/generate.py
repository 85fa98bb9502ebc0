"""``dsplan generate``: write a run directory (DeepSpeed config, launch scripts) for one plan.

The plan comes from ``--plan plan.json``, or from the search (the K-th ranked plan for the same
flags as ``suggest``). Everything is rendered and checked in memory first; only then is the
directory written, atomically, without touching files the user edited (``--force`` to replace).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from planner import limits
from planner.cli.fit import allow_oom_option, check_fits
from planner.cli.flags import FLAGS, cli_text
from planner.cli.options import (
    balancer_option,
    calibration_option,
    constraint_options,
    layer_profile_option,
    objective_option,
    workload_options,
)
from planner.cli.output import console, err_console, json_option, print_json
from planner.cli.outputs import OutputPath
from planner.errors import UserError, whole_number
from planner.limits import path_kind, shown_path

if TYPE_CHECKING:
    from planner.model.spec import ModelSpec

# Flags that shape (or pick from) the search; with --plan they would be silently ignored, so
# they are refused. Each defaults to None, so any value given on the command line counts.
_SEARCH_FLAGS = (
    "rank", "global_batch", "seq_len", "images_per_sample", "tiles_per_image", "precision", "optimizer",
    "flash_attention", "dropout", "tp_comm_overlap", "te_attention", "fp8_param_gather",
    "precision_aware_optimizer", "ep_comm_overlap", "moe_imbalance", "mtbf_hours", "mtp_layers", "layer_profile", "dp",
    "tp", "pp",
    "ep", "zero", "zero_pp",
    "offload",
    "micro_batch", "recompute", "virtual_stages", "framework", "sequence_parallel", "cp", "cp_comm", "dp_replicate",
    "etp", "activation_offload", "moe_dispatcher", "moe_capacity_factor", "recompute_modules", "pp_schedule",
    "compile", "rms_norm_kernel", "flash_version",
)


def _every(ctx: click.Context, param: click.Parameter, value: str) -> int | None:
    """``--checkpoint-every``: a whole number of steps, or auto (None: the plan's interval)."""
    if value == "auto":
        return None
    if not value.isdigit():
        raise click.BadParameter(f"{value!r}: give a whole number of steps (0: never) or auto")
    return int(value)


def _copy_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    from planner.emit.resilience import check_copy_dir

    try:
        return check_copy_dir(value)
    except UserError as err:
        raise click.BadParameter(str(err).removeprefix(f"--checkpoint-copy {value}: ")) from None


@click.command("generate", context_settings={"max_content_width": 100})
@click.option("--model", "model", default=None, metavar="NAME|PATH",
              help="Model preset or config.json [default with --plan: the plan's model].")
@click.option("--hardware", default=None, metavar="NAME|PATH",
              help="Hardware profile [default: the plan's, else dgx-a100-80g].")
@calibration_option
@click.option("--nodes", type=int, default=None, help="Number of nodes [default: the plan's, else 1].")
@click.option("--gpus-per-node", type=int, default=None,
              help="GPUs per node, 1-576 [default: from the hardware profile].")
@click.option("--plan", "plan_path", default=None, metavar="FILE",
              help="Use this plan.json (from `dsplan estimate --json` or `suggest --json`).")
@click.option("--rank", type=int, default=None,
              help="Without --plan: use the K-th best plan of the search (with --entry builtin, of the plans "
                   "the reference trainer runs) [default: 1].")
@workload_options("Samples per optimizer step [default: about 4M tokens, rounded to what divides].",
                  precision_list=True)
@constraint_options
@balancer_option
@layer_profile_option
@objective_option
@click.option("--out", "out_dir", required=True, type=OutputPath("dir"),
              help="Run directory to write (created if missing).")
@click.option("--entry", default="builtin", show_default=True, metavar="builtin|SCRIPT",
              help="What each rank runs: dsplan's reference trainer, or your training script, copied into DIR "
                   "(a megatron plan's gets megatron_args.sh's flags; a deepspeed plan's --deepspeed_config; a "
                   "torchtitan plan's --job.config_file torchtitan.toml, builtin = python -m torchtitan.train). "
                   "For builtin the search keeps to plans the trainer runs: virtual stages 1, tensor "
                   "parallelism only under framework deepspeed.")
@click.option("--hosts", default=None, metavar="H1,H2,...", help="Host names, one per node, comma-separated.")
@click.option("--hostfile", "hostfile_path", default=None, metavar="FILE",
              help="A hostfile ('host slots=N' lines), one host per node.")
@click.option("--steps", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Optimizer steps (schedule length; builtin trainer's run).")
@click.option("--checkpoint-every", default="auto", show_default=True, metavar="N|auto", callback=_every,
              help="Save a checkpoint every N steps (0: never); auto: the plan's interval, Daly's optimum for "
                   "its save time and the job's MTBF (plan.json's checkpoint.interval_steps).")
@click.option("--checkpoint-copy", default=None, metavar="PATH", callback=_copy_dir,
              help="A second checkpoint location (an absolute path every node mounts): the builtin trainer copies "
                   "each published checkpoint there and a restart falls back to it.")
@click.option("--master-port", type=click.IntRange(1024, 65535), default=29500, show_default=True,
              help="Rendezvous port on the first node.")
@click.option("--image", default=None,
              help="Container image for k8s-job.yaml [default: the NGC PyTorch image the run directory's Dockerfile "
                   "builds on; build that Dockerfile (runtime and dsplan pinned) and name the result here].")
@click.option("--k8s-pvc", default="dsplan-runs", show_default=True,
              help="PersistentVolumeClaim holding run directories (k8s-job.yaml).")
@click.option("--k8s-scheduler", default=None, metavar="NAME",
              help="schedulerName for k8s-job.yaml's pods, e.g. volcano "
                   "[default: left to the cluster or the training-operator's gang scheduler].")
@click.option("--k8s-rdma", default=None, metavar="RESOURCE[=N]|none",
              help="RDMA device resource each pod of k8s-job.yaml asks for, e.g. nvidia.com/hostdev=8 "
                   "[default on an InfiniBand/RoCE profile: rdma/rdma_shared_device_a=1, "
                   "the NVIDIA Network Operator's shared RDMA plugin].")
@click.option("--ib-hca", default=None, help="NCCL_IB_HCA for nccl.env, e.g. mlx5_0,mlx5_1 [default: mlx5].")
@click.option("--socket-ifname", default=None, help="NCCL_SOCKET_IFNAME for nccl.env, e.g. eth0 [default: ^lo,docker].")
@click.option("--force", is_flag=True, help="Replace files in DIR that differ from what dsplan generated last time.")
@allow_oom_option("Write a --plan that does not fit in memory (a warning instead of a refusal).")
@json_option
@click.argument("entry_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ENTRY ARGS...]")
def generate_command(as_json: bool, entry_args: tuple[str, ...], **opts: Any) -> None:
    """Write a run directory for a plan: ds_config.json, launch scripts for DeepSpeed, torchrun,
    SLURM and Kubernetes, Megatron-LM flags, NCCL settings, plan.json and a README.

    \b
    Examples:
      dsplan generate --model vl2 --nodes 8 --out runs/vl2 --hosts node1,node2,node3,node4,node5,node6,node7,node8
      dsplan estimate --model llama-3.1-8b --nodes 1 --tp 2 --pp 1 --micro-batch 1 --global-batch 64 --json > plan.json
      dsplan generate --plan plan.json --out runs/llama8b --entry train.py -- --data /data/tokens --tag "first run"
      dsplan generate --plan plan.json --calibration calibration.yaml --out runs/llama8b

    Arguments after `--` are passed, quoted, to the entry on every rank. With --calibration, the
    plan (a --plan file too) is priced by the calibrated cost model, and plan.json says which factors.
    """
    from planner.emit.ds_config import TrainSettings
    from planner.emit.plan_file import fit_problem
    from planner.emit.render import DEFAULT_IMAGE, LaunchOptions, render_run_dir
    from planner.emit.write import write_run_dir
    from planner.hardware.load import load_profile

    if opts["hosts"] is not None and opts["hostfile_path"] is not None:
        raise UserError("--hosts and --hostfile: give one of them, not both")
    entry = resolve_entry(opts["entry"])
    plan, model = _choose_plan(opts)
    profile = load_profile(opts["hardware"] or plan.hardware)
    if opts["calibration"] is not None:
        profile, plan = _calibrated(opts, plan, model, profile)
    oom = fit_problem(plan.to_json())  # the search's plans fit; a --plan file may not
    check_fits(oom, f"--plan {opts['plan_path']}", opts["allow_oom"], "write",
               "pick a plan that fits (`dsplan suggest`, or `dsplan estimate` other degrees)")
    hosts = _hosts(opts, plan)
    options = LaunchOptions(
        entry=entry,
        entry_args=list(entry_args),
        hosts=hosts,
        master_port=opts["master_port"],
        image=opts["image"] or DEFAULT_IMAGE,
        k8s_pvc=_k8s_name(opts["k8s_pvc"]),
        k8s_scheduler=opts["k8s_scheduler"],
        k8s_rdma=opts["k8s_rdma"],
        ib_hca=opts["ib_hca"],
        socket_ifname=opts["socket_ifname"],
        settings=TrainSettings(steps=opts["steps"], checkpoint_every=opts["checkpoint_every"],
                               checkpoint_copy=opts["checkpoint_copy"]),
        input_names=FLAGS,
    )
    files = render_run_dir(plan, model, profile, options, opts["out_dir"])
    report = write_run_dir(opts["out_dir"], files, force=opts["force"])
    # torchtitan's builtin entry is its own trainer (entry.sh), not dsplan's reference trainer.
    note = _trainer_note(files, model) if entry == "builtin" and plan.framework != "torchtitan" else None
    if as_json:
        warnings = ([f"plan does not fit: {oom}"] if oom else []) + ([note] if note else [])
        print_json({**report.model_dump(), "files": sorted(files), "plan": plan.to_json(), "warnings": warnings})
        return
    _print_written(report, plan, note)


def _calibrated(opts: dict[str, Any], plan, model, profile):
    """The profile with --calibration's factors, and the plan priced under them: a --plan file's
    predictions replaced (its degrees, batch and partition kept), the search's already made so.
    plan.json records the factors and the file."""
    from planner.api import with_calibration
    from planner.calibrate import price
    from planner.cli.flags import cli_data
    from planner.emit.plan_file import plan_from_dict

    profile = with_calibration(profile, opts["calibration"])
    data = plan.to_json()
    if opts["plan_path"] is not None:
        priced = cli_data(price(plan, model, profile).to_json())
        data = {**data, **priced, "model": plan.model, "hardware": plan.hardware}  # the file, where --hardware gave one
    data["calibration"] = {**profile.calibration.model_dump(), "file": str(opts["calibration"])}
    return profile, plan_from_dict(data, f"--plan {opts['plan_path']}")


def _print_written(report, plan, note: str | None) -> None:
    """What was written, the plan in one line, and the next command to run (the path shell-quoted
    there, and never read as rich markup anywhere)."""
    from rich.markup import escape

    from planner.cost.memory import group_to_set

    out = escape(report.out_dir)
    console.print(f"[bold]{out}[/bold]: {len(report.written)} file(s) written, {len(report.unchanged)} unchanged"
                  + (f", {len(report.removed)} stale removed" if report.removed else "")
                  + (f", {len(report.temporaries_removed)} left-over temporary file(s) of an interrupted write removed"
                     if report.temporaries_removed else ""), soft_wrap=True)
    if report.replaced_edits:
        console.print(f"  replaced your edits (--force): {escape(', '.join(report.replaced_edits))}")
    console.print(f"  plan: {plan.framework}, DP {plan.dp} x TP {plan.tp} x PP {plan.pp}"
                  + (f" ({plan.virtual_stages} virtual stages per rank"
                     + (f", micro-batch group {g}"
                        if (g := group_to_set(plan.pp, plan.virtual_stages, plan.grad_accum)) else "")
                     + ")" if plan.virtual_stages > 1 else "")
                  + (f", EP {plan.ep}" if plan.ep > 1 else "")
                  + (" (experts off TP, ETP 1)" if plan.ep > 1 and (plan.etp or plan.tp) < plan.tp else "")
                  + (f", CP {plan.cp}" if plan.cp > 1 else "")
                  + f", ZeRO-{plan.zero_stage}"
                  + (f" in {plan.dp_replicate} replicated groups" if plan.dp_replicate > 1 else "")
                  + f", micro-batch {plan.micro_batch} x {plan.grad_accum} = {plan.global_batch}")
    quoted = shlex.quote(report.out_dir)
    readme = shlex.quote(os.path.join(report.out_dir, "README.md"))
    if note:  # the default entry cannot run it: point at Megatron-LM's script, not at the launcher
        console.print(f"  [yellow]note:[/yellow] {escape(note)}", soft_wrap=True)
        console.print(f"  next: dsplan generate ... --out {quoted} --entry pretrain_gpt.py -- ARGS  (see {readme})",
                      soft_wrap=True, markup=False)
        return
    launch = "./launch_deepspeed.sh" if plan.nodes == 1 else "./launch_deepspeed.sh ssh"
    if plan.framework == "torchtitan":  # its parser refuses the DeepSpeed launcher's --local_rank
        launch = "./launch_torchrun.sh" if plan.nodes == 1 else "NODE_RANK=<i> ./launch_torchrun.sh"
    console.print(f"  next: cd {quoted} && {launch}    (or: dsplan run {quoted}; see {readme})", soft_wrap=True,
                  markup=False)


def _trainer_note(files: dict, model: "ModelSpec") -> str | None:
    """Why the reference trainer (the default entry) would refuse this plan, if it would: the
    run directory is still worth having (configs, Megatron flags), so this is a note, not an error."""
    from planner.emit.plan_file import plan_from_dict
    from planner.run.rundir import check_reference_trainer

    try:
        check_reference_trainer(plan_from_dict(json.loads(files["plan.json"].content), "plan.json"),
                                json.loads(files["ds_config.json"].content), model.is_moe)
    except UserError as err:
        return f"the default entry cannot run this plan: {cli_text(err)}"
    return None


def resolve_entry(text: str) -> str:
    """'builtin', or the absolute path of a readable training script."""
    if text == "builtin":
        return text
    path = Path(text).expanduser()
    kind = path_kind(path)
    if kind is None:
        raise UserError(f"--entry {shown_path(text)}: no such file; give your training script, or 'builtin' for "
                        "dsplan's trainer")
    if kind != "file":
        raise UserError(f"--entry {text}: not a file; give your training script (a .py file)")
    if not os.access(path, os.R_OK):
        raise UserError(f"--entry {text}: cannot read it (permission denied)")
    return str(path.resolve())


def _k8s_name(text: str) -> str:
    from planner.emit.hosts import is_valid_host

    if not is_valid_host(text) or "." in text or text.lower() != text:
        raise UserError(f"--k8s-pvc {text!r}: not a valid Kubernetes name (lower-case letters, digits, hyphens)")
    return text


def _hosts(opts: dict[str, Any], plan):
    from planner.emit.hosts import parse_hosts, read_hostfile, select_hosts

    if opts["hosts"] is not None:
        source, hosts = "--hosts", parse_hosts(opts["hosts"])
    elif opts["hostfile_path"] is not None:
        source, hosts = f"--hostfile {opts['hostfile_path']}", read_hostfile(opts["hostfile_path"])
    else:
        return None
    chosen = select_hosts(hosts, plan.nodes, plan.gpus_per_node, source)
    if len(hosts) > plan.nodes:
        err_console.print(f"note: {source} lists {len(hosts)} hosts; the plan uses the first {plan.nodes}")
    return chosen


def _with_hardware_file(plan, hardware: str | None):
    """``plan`` naming the hardware profile file ``--hardware`` gave (resolved), so that the run
    directory's plan.json leads `dsplan run` and `dsplan calibrate` to the same file."""
    from planner.limits import path_kind

    if hardware is None or path_kind(Path(hardware).expanduser()) != "file":
        return plan
    return plan.model_copy(update={"hardware": str(Path(hardware).expanduser().resolve())})


def _choose_plan(opts: dict[str, Any]):
    """The plan (validated PlanFile) and the ModelSpec it trains."""
    from planner.emit.plan_file import load_plan_file, plan_from_dict
    from planner.model.load import load_model

    if opts["nodes"] is not None:  # the check every command makes (with --plan too)
        whole_number("nodes", opts["nodes"])
    if opts["plan_path"] is not None:
        given = [f"--{'no-' if opts[k] is False else ''}{k.replace('_', '-')}" for k in _SEARCH_FLAGS
                 if opts.get(k) is not None]
        if given:
            raise UserError(f"--plan fixes every degree and batch size; drop {', '.join(given)} "
                            "(or drop --plan to search)")
        plan = load_plan_file(opts["plan_path"])
        model = load_model(plan.model)
        if opts["model"] is not None:
            wanted = load_model(opts["model"])
            if wanted.name != model.name:
                raise UserError(
                    f"--plan {opts['plan_path']}: the plan was made for model {model.name}, "
                    f"not {wanted.name} (--model); plan again for this model or drop --model"
                )
        if opts["nodes"] is not None and opts["nodes"] != plan.nodes:
            raise UserError(f"--plan {opts['plan_path']}: the plan is for {plan.nodes} node(s), "
                            f"not --nodes {opts['nodes']}")
        gpus = opts["gpus_per_node"]
        if gpus is not None and gpus != plan.gpus_per_node:
            raise UserError(f"--plan {opts['plan_path']}: the plan is for {plan.gpus_per_node} GPUs per node, not "
                            f"--gpus-per-node {gpus}")
        return _with_hardware_file(plan, opts["hardware"]), model
    if opts["model"] is None:
        raise UserError("--model: required unless --plan is given (e.g. --model vl2, or --plan plan.json)")
    if opts["rank"] is None:
        opts["rank"] = 1
    if opts["rank"] < 1:
        raise UserError(f"--rank {opts['rank']}: ranks start at 1 (the best plan)")
    limits.count("rank", opts["rank"])
    model = load_model(opts["model"])
    data = _plan_from_search(opts, model)
    data.setdefault("model", model.name)
    return plan_from_dict(data, f"search plan #{opts['rank']}"), model


def _plan_from_search(opts: dict[str, Any], model) -> dict[str, Any]:
    """The rank-K plan of ``dsplan suggest`` for the same flags, as a plan dict; for the reference
    trainer (``--entry builtin``), the rank-K plan of those it runs (planner/cli/trainer_plans.py)."""
    from planner.api import DEFAULT_HARDWARE
    from planner.cli.flags import cli_data
    from planner.cli.suggest import run_suggest
    from planner.cli.trainer_plans import trainer_search

    search_opts = {k: v for k, v in opts.items() if k in _SUGGEST_KEYS}
    search_opts["model"] = model
    search_opts["hardware"] = opts["hardware"] or DEFAULT_HARDWARE
    search_opts["nodes"] = 1 if opts["nodes"] is None else opts["nodes"]
    need = max(opts["rank"], 2)  # a runner-up, so plan #1 says why it won (README, plan.json)
    if opts["entry"] == "builtin" and opts.get("framework") != "torchtitan":  # torchtitan: its own trainer
        result = trainer_search(search_opts, model.is_moe, need)
        kind = "that fit and the reference trainer (--entry builtin) runs"
    else:
        result = run_suggest({**search_opts, "top": need})
        kind = "that fit"
    if len(result.plans) < opts["rank"]:
        raise UserError(f"--rank {opts['rank']}: the search found only {len(result.plans)} plan(s) {kind}; "
                        "pick a smaller --rank")
    data = cli_data(result.plans[opts["rank"] - 1].to_json())
    data.setdefault("hardware", search_opts["hardware"])
    data.setdefault("nodes", search_opts["nodes"])
    return data


_SUGGEST_KEYS = (
    "model", "hardware", "nodes", "gpus_per_node", "global_batch", "seq_len", "images_per_sample", "tiles_per_image",
    "precision", "optimizer", "flash_attention", "dropout", "tp_comm_overlap", "te_attention", "fp8_param_gather",
    "precision_aware_optimizer", "ep_comm_overlap", "moe_imbalance", "mtbf_hours", "mtp_layers", "layer_profile", "dp",
    "tp", "pp",
    "ep", "zero", "zero_pp",
    "offload",
    "micro_batch", "recompute", "virtual_stages", "framework", "sequence_parallel", "allow_tp_across_nodes",
    "balancer", "objective", "cp", "cp_comm", "dp_replicate", "etp", "calibration", "activation_offload",
    "moe_dispatcher", "moe_capacity_factor", "recompute_modules", "pp_schedule", "compile", "rms_norm_kernel",
    "flash_version",
)


commands = [generate_command]
