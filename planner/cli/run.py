"""``dsplan run DIR``: run a generated run directory, supervise it, compare measured with predicted."""

from __future__ import annotations

import sys
from typing import Any

import click

from planner.cli.fit import allow_oom_option, check_fits, warn_does_not_fit
from planner.cli.options import seconds_type
from planner.cli.output import console, err_console, human_bytes, human_time, json_option, print_json
from planner.limits import MAX_GRACE_S, MAX_TIMEOUT_S

INTERRUPTED_EXIT = 130


@click.command("run", context_settings={"max_content_width": 100})
@click.argument("run_dir", metavar="DIR")
@click.option("--launcher", type=click.Choice(["deepspeed", "torchrun", "slurm"]), default="deepspeed",
              show_default=True,
              help="Which launch script of DIR to run (slurm: `sbatch --wait slurm.sbatch`).")
@click.option("--local", is_flag=True,
              help="Run the plan on this machine's CPUs: DS_ACCELERATOR=cpu, gloo, a tiny-scale model, "
                   "one launcher per node.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Train until this step [default: the run directory's].")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=None,
              help="Save a checkpoint every N steps, so restarts resume [default: the run directory's].")
@click.option("--scale", default=None,
              help="Reference trainer's model scale: tiny, small or a fraction [--local default: tiny].")
@click.option("--resume", is_flag=True, help="Start from the latest good checkpoint in DIR/checkpoints.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Restart a failed or hung job this many times, resuming from the last good checkpoint.")
@click.option("--hang-timeout", type=seconds_type(1, MAX_TIMEOUT_S, "a week"), default=600.0, show_default=True,
              help="Seconds without a new step or log line before the job counts as hung (1 to 604800, a week).")
@click.option("--startup-timeout", type=seconds_type(1, MAX_TIMEOUT_S, "a week"), default=1800.0, show_default=True,
              help="Like --hang-timeout, until the first step of each start (DeepSpeed may compile ops "
                   "silently for minutes; 1 to 604800).")
@click.option("--grace", type=seconds_type(0, MAX_GRACE_S, "an hour"), default=15.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when stopping the job (0 to 3600).")
@click.option("--preflight", is_flag=True,
              help="Run DIR/preflight.sh first (GPUs, NICs, a GEMM burn-in, nccl-tests against the predicted bus "
                   "bandwidth) and stop with exit status 2 if a check fails. On this node; under --launcher slurm, "
                   "on every node; a multi-node plan started here checks this node only.")
@click.option("--dry-run", is_flag=True, help="Print the commands and environment it would run; run nothing.")
@allow_oom_option("Run a plan that plan.json predicts does not fit in GPU memory (a warning instead of a refusal).")
@json_option
def run_command(run_dir: str, launcher: str, local: bool, steps: int | None, checkpoint_every: int | None,
                scale: str | None, resume: bool, max_restarts: int, hang_timeout: float, startup_timeout: float,
                grace: float, preflight: bool, dry_run: bool, allow_oom: bool, as_json: bool) -> None:
    """Run the launch script of a run directory (from `dsplan generate`), stream its logs with
    rank prefixes, restart it from the last good checkpoint when a rank dies or hangs, and write
    DIR/report.json: measured step time, tokens/s, peak memory per rank and loss beside the plan's
    predictions.

    \b
    Examples:
      dsplan run runs/llama8b
      dsplan run runs/llama8b --local --steps 20 --checkpoint-every 5 --max-restarts 2
      dsplan run runs/vl2 --launcher slurm --dry-run
      dsplan run runs/llama8b --preflight
    """
    from planner.emit.plan_file import fit_problem
    from planner.run.job import build_job, check_runnable
    from planner.run.rundir import PLAN_FILE, REPORT_FILE

    job = build_job(run_dir, launcher=launcher, local=local, steps=steps, checkpoint_every=checkpoint_every,
                    resume=resume, scale=scale, preflight=preflight)
    oom = fit_problem(job.info.plan)
    if dry_run:
        if oom:
            warn_does_not_fit(oom)
        _print_dry_run(job, as_json)
        return
    check_fits(oom, str(job.info.path / PLAN_FILE), allow_oom, "run", "regenerate the run directory with a plan "
               "that fits")
    check_runnable(job)
    if preflight:
        _preflight(job, as_json)
    every = checkpoint_every if checkpoint_every is not None else job.info.checkpoint_every
    if max_restarts and job.info.builtin and not every:
        err_console.print("note: the run saves no checkpoints (--checkpoint-every 0), so a restart starts again "
                          "from step 0; pass --checkpoint-every N to resume instead", soft_wrap=True)

    from planner.run.report import build_report, write_report
    from planner.run.supervisor import Supervisor

    stream = sys.stderr if as_json else sys.stdout
    progress = _Progress(job.target_steps)

    def echo(line: str) -> None:
        progress.print(line, stream)

    supervisor = Supervisor(job, max_restarts=max_restarts, hang_timeout_s=hang_timeout,
                            startup_timeout_s=startup_timeout, grace_s=grace, echo=echo, on_step=progress.update)
    with progress:
        result = supervisor.run()
    report = build_report(job, result)
    write_report(job.info.path / REPORT_FILE, report)
    if as_json:
        print_json(report)
    else:
        _print_summary(report, job.info.path / REPORT_FILE)
    if result.status == "interrupted":
        sys.exit(INTERRUPTED_EXIT)
    if result.status != "completed":
        sys.exit(1)


def _preflight(job: Any, as_json: bool) -> None:
    """preflight.sh's lines on stdout (stderr under --json, which keeps stdout for the report)."""
    from planner.run.preflight_run import run_preflight

    run_preflight(job, lambda line: click.echo(line, file=sys.stderr if as_json else sys.stdout))


class _Progress:
    """A rich progress bar of steps on stderr, only when stderr is a terminal."""

    def __init__(self, total: int | None):
        self.bar = None
        if err_console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=err_console, transient=True)
            self.task = self.bar.add_task("steps", total=total)

    def __enter__(self) -> "_Progress":
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, step: int, total: int | None) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, total=total)

    def print(self, line: str, stream: Any) -> None:
        if self.bar is not None and stream is sys.stderr:
            self.bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            click.echo(line, file=stream)


def _print_dry_run(job: Any, as_json: bool) -> None:
    from planner.run.processes import free_port

    port = free_port() if job.local is not None else None
    commands = job.commands(0, port)
    files = sorted(str(job.info.path / rel) for rel in job.files)
    if as_json:
        print_json({"run_dir": str(job.info.path), "launcher": job.launcher, "local": job.local is not None,
                    "local_adaptation": job.local.to_json() if job.local is not None else None,
                    "commands": [c.to_json() for c in commands], "files": files,
                    "restart_env": {"DSPLAN_RESUME": "1"}})
        return
    click.echo(f"# dsplan run {job.info.path}: would start {len(commands)} process(es) (nothing was run)")
    if job.local is not None:
        lp = job.local
        click.echo(f"# --local: {lp.processes} CPU process(es), {lp.nodes} simulated node(s), scale {lp.scale}, "
                   f"seq_len {lp.seq_len} (plan: {lp.planned_seq_len})")
    if job.preflight:
        where = " on every node (slurm.sbatch, DSPLAN_PREFLIGHT=1)" if job.launcher == "slurm" else " on this node"
        click.echo(f"# --preflight: would first run ./preflight.sh{where}")
    click.echo("# would write: " + ", ".join(files))
    for command in commands:
        click.echo(command.shell())
    click.echo("# restarts add DSPLAN_RESUME=1" + (" and a new MASTER_PORT" if job.local is not None else ""))


def _fmt(metric: str, value: Any) -> str:
    if value is None:
        return "-"
    if "memory" in metric:
        return human_bytes(value)
    if metric == "goodput":
        return f"{100 * value:.1f}%"
    if metric.endswith("_s") and "per_s" not in metric:
        return human_time(value)
    return f"{value:,.0f}"


def _print_summary(report: dict[str, Any], path: Any) -> None:
    """The comparison table, the restarts and the report's path (text that is data, never rich markup)."""
    from rich.table import Table

    table = Table(title=f"{report['status']}: {report['steps']['last'] or 0}/{report['steps']['target'] or '?'} steps, "
                        f"{len(report['restarts'])} restart(s)")
    for column in ("metric", "measured", "predicted", "error"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for row in report["comparison"]:
        err = row["relative_error"]
        table.add_row(row["metric"], _fmt(row["metric"], row["measured"]), _fmt(row["metric"], row["predicted"]),
                      "-" if err is None else f"{100 * err:+.0f}%")
    console.print(table)
    for restart in report["restarts"]:
        console.print(f"restart {restart['attempt']}: {restart['reason']} (resumed from step "
                      f"{restart['resumed_from_step'] if restart['resumed_from_step'] is not None else 0})",
                      soft_wrap=True, markup=False)
    if report["note"]:
        console.print(f"note: {report['note']}", soft_wrap=True, markup=False)
    console.print(f"report: {path}", soft_wrap=True, markup=False)


commands = [run_command]
