"""The reference trainer: ``python -m planner.run.trainer --run-dir DIR ...``.

It trains the planned model (at a reduced ``--scale``) with DeepSpeed on synthetic data and
follows the run directory exactly: ZeRO stage, offload and precision from ``ds_config.json``;
pipeline degree and stage partition, expert-parallel degree, micro-batch, accumulation,
sequence length and recomputation from ``plan.json``; tensor parallel through AutoTP
(``tensor_parallel.autotp_size``). It is started by a launcher (deepspeed, torchrun, SLURM)
once per rank; unknown launcher arguments are ignored.

Outputs: ``<log>.rank<R>.jsonl`` (one line per step: step, loss, step_time_s, tokens_per_s,
peak_memory_bytes, ..., and comm_time_s with ``--metrics-port``), a Prometheus endpoint per rank
on ``--metrics-port`` + local rank when given (planner/run/exporter.py),
``run_info.rank<R>.json`` (what this rank built: pipeline stage, layer range, DeepSpeed's stage
boundaries, parameters), atomic checkpoints, and a progress line per step from rank 0.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import resource
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.emit.plan_file import PlanFile
from planner.errors import UserError
from planner.model.spec import ModelSpec, VisionEmbedBlock
from planner.run.exporter import check_port
from planner.run.metrics import MetricsLog, metrics_path
from planner.run.rundir import (
    CHECKPOINT_DIR,
    DEFAULT_LOG,
    DS_CONFIG_FILE,
    check_reference_trainer,
    read_ds_config,
    read_plan,
    resolve_model,
    write_json_atomic,
)

if TYPE_CHECKING:
    from planner.run.data import SyntheticData
    from planner.run.model_scale import Scale, ScaledModel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m planner.run.trainer", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--model", help="preset name or spec path (default: plan.json's model)")
    p.add_argument("--scale", default="tiny", help="tiny | small | a fraction F in (0, 1]")
    p.add_argument("--steps", type=int, default=10, help="train until this global step")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--checkpoint-dir", type=Path)
    p.add_argument("--checkpoint-copy", type=Path, help="a second directory each published checkpoint is copied to")
    p.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--log", type=Path, help="metrics file; ranks write <stem>.rank<R><suffix>")
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", type=Path)
    p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on PORT + local rank (0, the default: off)")
    # generate passes moe.json for custom entries; the trainer reads the same facts from the ModelSpec
    p.add_argument("--moe-config", type=Path, help=argparse.SUPPRESS)
    # fault injection for supervisor tests: exit abruptly on one rank at a step, or mid-save
    p.add_argument("--fault", choices=["none", "step", "save"], default="none", help=argparse.SUPPRESS)
    p.add_argument("--fault-step", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--fault-rank", type=int, default=0, help=argparse.SUPPRESS)
    args, _unknown = p.parse_known_args(argv)
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: must be at least 1")
    if args.checkpoint_every < 0:
        raise UserError(f"--checkpoint-every {args.checkpoint_every}: must be 0 (never) or positive")
    check_port(args.metrics_port)
    return args


def peak_memory_bytes() -> int:
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _check_degrees(plan: PlanFile, cfg: dict[str, Any], world: int, spec: ModelSpec) -> None:
    if plan.world_size != world:
        raise UserError(f"plan.json: dp*tp*pp = {plan.world_size} ranks but the launcher started {world}; "
                        "launch with as many processes as the plan needs")
    check_reference_trainer(plan, cfg, spec.is_moe)


def _coordinates(engine: Any, plan: PlanFile, rank: int) -> tuple[int, int]:
    """(data-parallel rank, pipeline stage): ranks of one TP group share a data rank, hence batches."""
    if plan.pp > 1:
        return engine.grid.get_data_parallel_id(), engine.stage_id
    if plan.tp > 1:
        from deepspeed.utils import groups

        return groups.get_data_parallel_rank(), 0
    return rank, 0


def _train_step(engine: Any, batches: list, pipelined: bool) -> float:
    """One optimizer step over the accumulation micro-batches; the loss averaged over all ranks."""
    import deepspeed.comm as dist
    import torch

    if pipelined:  # the pipeline engine runs the whole 1F1B schedule and averages the loss itself
        return float(engine.train_batch(iter(batches)).detach().float())
    total = torch.zeros((), device=batches[0][1].device)
    for inputs, labels in batches:
        loss = engine(*inputs, labels)
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    total /= len(batches) * dist.get_world_size()
    dist.all_reduce(total)
    return float(total)


def _release_shm_buffer(rank: int) -> None:
    from planner.run.processes import SHM_DIR, shm_buffer_name

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, shm_buffer_name(addr, port, rank)))


def main(argv: list[str] | None = None) -> int:
    try:
        return train(parse_args(argv))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


class _Phases:
    """Start-up seconds per phase (written to run_info, for the supervisor's hang timeouts)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._mark, 3)
        self._mark = now


@dataclass
class _Model:
    """The model this rank trains, at its scale, and the data it is fed."""

    scale: Scale
    scaled: ScaledModel
    module: Any
    data: SyntheticData
    image_tokens: int


def train(args: argparse.Namespace) -> int:
    """One rank: read the run directory, join the job, build the model and DeepSpeed's engine,
    resume if asked, write run_info, then train to ``--steps``."""
    phases = _Phases()
    run_dir = args.run_dir.resolve()
    plan = read_plan(run_dir)
    cfg = read_ds_config(args.deepspeed_config or run_dir / DS_CONFIG_FILE)
    spec = resolve_model(args.model or plan.model, run_dir)
    seq_len = args.seq_len or plan.seq_len

    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    from planner.run.model_scale import parse_scale

    phases.done("imports")
    scale = parse_scale(args.scale)
    on_cpu = get_accelerator().device_name() == "cpu"
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else None, timeout=_collective_timeout())
    rank, world = dist.get_rank(), dist.get_world_size()
    if on_cpu:  # DeepSpeed never unlinks its CPU all-reduce buffer: this rank's goes when it exits
        atexit.register(_release_shm_buffer, rank)
    phases.done("init_distributed")
    _check_degrees(plan, cfg, world, spec)
    model = _build_model(spec, scale, plan, seq_len, args.seed)
    phases.done("build_model")
    engine = _initialize(model.module, plan, cfg)
    phases.done("deepspeed_initialize")
    dp_rank, stage = _coordinates(engine, plan, rank)
    micro = engine.train_micro_batch_size_per_gpu()
    if micro != plan.micro_batch:
        raise UserError(f"ds_config.json: train_micro_batch_size_per_gpu is {micro} but plan.json has "
                        f"micro_batch={plan.micro_batch}; regenerate the run directory")
    ckpt_dir = (args.checkpoint_dir or run_dir / CHECKPOINT_DIR).resolve()
    resumed_from, start_step = _resume(engine, ckpt_dir, args.checkpoint_copy) if args.resume else (None, 0)
    phases.done("resume")
    write_json_atomic(run_dir / f"run_info.rank{rank}.json", {
        **_run_info(engine, model, plan, spec, rank, world, dp_rank, stage),
        "startup_s": phases.seconds, "resumed_from": resumed_from, "start_step": start_step,
    })
    _train_loop(args, engine, model, plan, rank=rank, dp_rank=dp_rank, dp=world // plan.pp // plan.tp,
                seq_len=seq_len, start_step=start_step, log=metrics_path(args.log or run_dir / DEFAULT_LOG, rank),
                ckpt_dir=ckpt_dir)
    dist.barrier()
    return 0


def _build_model(spec: ModelSpec, scale: Scale, plan: PlanFile, seq_len: int, seed: int) -> _Model:
    """The scaled model (a pipeline module when pp > 1) and its synthetic data, same weights on every rank."""
    import torch

    from planner.run.data import SyntheticData
    from planner.run.model_builder import ReferenceForCausalLM, build_pipeline, tiles_per_sample
    from planner.run.model_scale import scale_spec

    scaled = scale_spec(spec, scale, plan.stage_blocks or None, tp=plan.tp, ep=plan.ep)
    small = scaled.spec
    tiles = tiles_per_sample(small, plan.images_per_sample, plan.tiles_per_image)
    image_tokens = tiles * small.vision.tokens_per_tile if small.vision else 0
    if image_tokens >= seq_len:
        raise UserError(f"plan.json: {image_tokens} image tokens at scale {scale.name} do not fit seq_len "
                        f"{seq_len}; raise --seq-len")
    embed = next((b for b in small.blocks if isinstance(b, VisionEmbedBlock)), None)
    data = SyntheticData(vocab=small.vocab, seq_len=seq_len, micro_batch=plan.micro_batch,
                         image_tokens=image_tokens, tiles=tiles,
                         patches_per_tile=small.vision.patches_per_tile if small.vision else 0,
                         patch_pixels=embed.patch_pixels if embed else 0, seed=seed)
    torch.manual_seed(seed)  # identical initial weights on every rank
    if plan.pp > 1:
        module = build_pipeline(small, scaled.parts, ep_size=plan.ep, tiles=tiles, recompute=plan.recompute, seed=seed,
                                capacity=plan.moe_imbalance)
    else:
        module = ReferenceForCausalLM(small, ep_size=plan.ep, tiles=tiles, recompute=plan.recompute,
                                      capacity=plan.moe_imbalance)
    return _Model(scale=scale, scaled=scaled, module=module, data=data, image_tokens=image_tokens)


def _initialize(module: Any, plan: PlanFile, cfg: dict[str, Any]) -> Any:
    """DeepSpeed's engine for ``module`` with the run directory's config."""
    import deepspeed

    params = [p for p in module.parameters() if p.requires_grad]
    if plan.tp > 1 and cfg.get("train_batch_size") == plan.micro_batch * plan.grad_accum * plan.dp:
        # DeepSpeed's batch check (config.py) divides by the whole world when AutoTP builds its
        # groups later; let it derive the global batch from micro-batch and accumulation instead.
        cfg = {k: v for k, v in cfg.items() if k != "train_batch_size"}
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=params, config=cfg)
    return engine


def _collective_timeout() -> timedelta:
    """The process groups' timeout generate chose for the plan (nccl.env's DSPLAN_COLLECTIVE_TIMEOUT_S),
    else DeepSpeed's default of 600 s."""
    value = os.environ.get("DSPLAN_COLLECTIVE_TIMEOUT_S", "")
    return timedelta(seconds=int(value) if value.isdigit() and int(value) > 0 else 600)


def _resume(engine: Any, ckpt_dir: Path, copy_dir: Path | None = None) -> tuple[str | None, int]:
    """(the tag loaded, the step it saved) from the newest readable checkpoint; (None, 0) when there is none."""
    from planner.run import checkpoint

    loaded = checkpoint.load(engine, ckpt_dir, copy_dir)
    if loaded is None:
        return None, 0
    tag, state = loaded
    return tag, int(state["step"])


def _run_info(engine: Any, model: _Model, plan: PlanFile, spec: ModelSpec, rank: int, world: int, dp_rank: int,
              stage: int) -> dict[str, Any]:
    """What this rank built: its coordinates, layers, parameters, experts and optimizer."""
    from deepspeed.moe.layer import MoE

    module, scaled = model.module, model.scaled
    small = scaled.spec
    return {
        "rank": rank, "world_size": world, "dp_rank": dp_rank, "pipeline_stage": stage,
        "pipeline_parts": list(getattr(engine.module, "parts", scaled.parts)),
        "planned_parts": scaled.parts, "layer_origin_blocks": scaled.origin,
        "local_layers": [getattr(engine.module, "_local_start", 0),
                         getattr(engine.module, "_local_stop", None) or len(small.blocks)],
        "layer_kinds": [b.kind for b in small.blocks], "params_on_rank": sum(p.numel() for p in module.parameters()),
        "moe_local_experts": [m.num_local_experts for m in module.modules() if isinstance(m, MoE)],
        "ep_size": plan.ep, "tp_size": plan.tp, "recompute": plan.recompute,
        "model": spec.name, "scale": model.scale.name, "zero_stage": engine.zero_optimization_stage(),
        "optimizer": type(engine.optimizer).__name__,
        "basic_optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
        "image_tokens": model.image_tokens,
    }


def _train_loop(args: argparse.Namespace, engine: Any, model: _Model, plan: PlanFile, *, rank: int, dp_rank: int,
                dp: int, seq_len: int, start_step: int, log: Path, ckpt_dir: Path) -> None:
    """Steps ``start_step + 1 .. args.steps``: one metrics line each, checkpoints every ``--checkpoint-every``."""
    from deepspeed.accelerator import get_accelerator

    from planner.run import checkpoint

    metrics = MetricsLog(log)
    monitor = _Monitor(args.metrics_port, rank, args.local_rank) if args.metrics_port else None
    device = get_accelerator().current_device_name()
    grad_accum = engine.gradient_accumulation_steps()
    tokens_per_step = engine.train_micro_batch_size_per_gpu() * grad_accum * dp * seq_len
    for step in range(start_step + 1, args.steps + 1):
        if args.fault == "step" and step == args.fault_step and rank == args.fault_rank:
            os._exit(17)
        if monitor is not None:
            monitor.comm.take()  # what ran between steps (a checkpoint's collectives) is no step's
        start = time.perf_counter()
        batches = [model.data.batch(step, m, dp_rank) for m in range(grad_accum)]
        batches = [(tuple(t.to(device) for t in inputs), labels.to(device)) for inputs, labels in batches]
        loss = _train_step(engine, batches, pipelined=plan.pp > 1)
        elapsed = time.perf_counter() - start
        record = {"step": step, "rank": rank, "loss": loss, "step_time_s": elapsed,
                  "tokens_per_s": tokens_per_step / elapsed, "tokens": tokens_per_step,
                  "peak_memory_bytes": peak_memory_bytes(), "time": time.time()}
        if monitor is not None:
            record["comm_time_s"] = monitor.observe(step, elapsed, record["tokens_per_s"])
        metrics.write(record)
        if rank == 0:
            print(f"step {step}/{args.steps} loss {record['loss']:.4f} step_time {elapsed:.3f}s "
                  f"tokens/s {record['tokens_per_s']:.0f} peak_mem {record['peak_memory_bytes'] / 2**20:.0f}MiB",
                  flush=True)
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            if args.fault == "save" and step == args.fault_step:
                engine.save_checkpoint(str(ckpt_dir), tag=checkpoint.tag_for(step), save_latest=False)
                os._exit(18)  # files written, never published
            checkpoint.save(engine, ckpt_dir, step, {"step": step, "tokens_per_step": tokens_per_step},
                            args.checkpoint_copy)
    if monitor is not None:
        monitor.close()


class _Monitor:
    """``--metrics-port``: this rank's Prometheus endpoint and the communication timer it reports."""

    def __init__(self, port: int, rank: int, local_rank: int | None) -> None:
        from planner.run.exporter import CommTimer, TrainerMetrics

        local = int(os.environ.get("LOCAL_RANK", local_rank or 0))  # the launchers set LOCAL_RANK
        self.metrics = TrainerMetrics(port, rank, local)
        self.comm = CommTimer()

    def observe(self, step: int, step_time_s: float, tokens_per_s: float) -> float:
        """Publish one step; returns its communication seconds."""
        comm_s = self.comm.take()
        self.metrics.observe(step, step_time_s, tokens_per_s, comm_s)
        return comm_s

    def close(self) -> None:
        self.metrics.close()


if __name__ == "__main__":
    sys.exit(main())
