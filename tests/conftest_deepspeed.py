"""Helpers for the real-DeepSpeed trainer tests: hand-built ModelSpecs, run dirs, launchers.

The specs are small but shaped like the real families (GQA llama, MoE with shared experts,
a DeepSeek-VL2-like SigLIP tower + projector + dense-then-MoE decoder), so the trainer's
scaling and block mapping are exercised on the same structures the catalog produces.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from planner.emit.plan_file import plan_from_dict
from planner.model.spec import (
    Attention,
    DecoderBlock,
    DenseMLP,
    EmbeddingBlock,
    LMHeadBlock,
    ModelSpec,
    MoEMLP,
    NormBlock,
    ProjectorBlock,
    VisionBlock,
    VisionEmbedBlock,
    VisionTiling,
)
from planner.run.processes import remove_shm_buffers
from tests.handwritten_run_dir import default_ds_config, write_run_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
DEEPSPEED = str(Path(sys.executable).with_name("deepspeed"))
LAUNCH_TIMEOUT_S = 600  # the first run in a fresh cache JIT-builds DeepSpeed's comm op (~3 minutes)


def llama_like(layers: int = 8) -> ModelSpec:
    """Llama-3-8B's shape (GQA 32/8, SwiGLU 14336, 128k vocab) with fewer layers."""
    attn = Attention(kind="gqa", heads=32, kv_heads=8, head_dim=128)
    dec = DecoderBlock(hidden=4096, attention=attn, mlp=DenseMLP(ffn=14336))
    blocks = [EmbeddingBlock(vocab=128256, hidden=4096), *[dec] * layers, NormBlock(hidden=4096),
              LMHeadBlock(vocab=128256, hidden=4096)]
    return ModelSpec(name="llama-like", family="llama", max_seq_len=8192, train_seq_len=8192, blocks=blocks)


def moe_like(layers: int = 6) -> ModelSpec:
    """DeepSeek-V2-Lite's shape: MLA, a dense first layer, then 64 routed + 2 shared experts."""
    from planner.model.spec import MLA

    attn = Attention(kind="mla", heads=16, kv_heads=16, head_dim=192,
                     mla=MLA(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))
    dense = DecoderBlock(hidden=2048, attention=attn, mlp=DenseMLP(ffn=10944))
    moe = DecoderBlock(hidden=2048, attention=attn,
                       mlp=MoEMLP(routed_experts=64, top_k=6, expert_ffn=1408, shared_experts=2, shared_ffn=2816))
    blocks = [EmbeddingBlock(vocab=102400, hidden=2048), dense, *[moe] * (layers - 1), NormBlock(hidden=2048),
              LMHeadBlock(vocab=102400, hidden=2048)]
    return ModelSpec(name="moe-like", family="deepseek-v2", max_seq_len=4096, train_seq_len=4096, blocks=blocks)


def vl2_like(vit_layers: int = 6, layers: int = 4) -> ModelSpec:
    """DeepSeek-VL2-tiny's shape: SigLIP-so400m tower, 2x2 projector, MHA decoder, dense then MoE."""
    attn = Attention(kind="mha", heads=10, kv_heads=10, head_dim=128)
    dense = DecoderBlock(hidden=1280, attention=attn, mlp=DenseMLP(ffn=6848))
    moe = DecoderBlock(hidden=1280, attention=attn,
                       mlp=MoEMLP(routed_experts=64, top_k=6, expert_ffn=896, shared_experts=2, shared_ffn=1792))
    vit = VisionBlock(hidden=1152, heads=16, mlp=4304, act="gelu_tanh")
    blocks = [VisionEmbedBlock(hidden=1152, patch_size=14, learned_positions=729), *[vit] * vit_layers,
              NormBlock(hidden=1152, norm="layernorm"),
              ProjectorBlock(in_dim=1152, merge=4, mlp_hidden=1280, out_dim=1280, extra_vectors=2),
              EmbeddingBlock(vocab=129280, hidden=1280), dense, *[moe] * (layers - 1), NormBlock(hidden=1280),
              LMHeadBlock(vocab=129280, hidden=1280)]
    vision = VisionTiling(tile_px=384, patches_per_tile=729, tokens_per_tile=196, global_view=True,
                          max_local_tiles=9, default_images_per_sample=1, default_tiles_per_image=1)
    return ModelSpec(name="vl2-like", family="deepseek-vl2", max_seq_len=4096, train_seq_len=4096,
                     blocks=blocks, vision=vision)


def make_run_dir(path: Path, spec: ModelSpec, ds_overrides: dict[str, Any] | None = None, **plan: Any) -> Path:
    """Write the spec next to a plan.json / ds_config.json pair, the way generate will."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.json").write_text(spec.model_dump_json())
    full = {"model": "model.json", "dp": 2, "tp": 1, "pp": 1, "ep": 1, "zero_stage": 1, "micro_batch": 2,
            "grad_accum": 1, "seq_len": 32, "recompute": "none", "stage_blocks": [[0, len(spec.blocks)]],
            "images_per_sample": 0, "tiles_per_image": 0}
    full.update(plan)
    # plan.json's schema (planner.emit.plan_file) also wants the cluster shape and the global batch
    full.setdefault("nodes", 1)
    full.setdefault("gpus_per_node", full["dp"] * full["tp"] * full["pp"] // full["nodes"])
    full.setdefault("global_batch", full["micro_batch"] * full["grad_accum"] * full["dp"])
    cfg = default_ds_config(plan_from_dict(full))
    for key, value in (ds_overrides or {}).items():
        cfg[key] = value
    return write_run_dir(path, full, cfg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_args(run_dir: Path, *extra: str) -> list[str]:
    return ["-m", "planner.run.trainer", "--run-dir", str(run_dir), "--deepspeed_config",
            str(run_dir / "ds_config.json"), *extra]


def launcher_env() -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_group(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own and kill the whole session when it ends or times
    out: the launcher's ranks must not outlive a failed test (an orphan rank waiting on a
    build lock or a collective keeps spinning and holds the lock for the next run)."""
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=launcher_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        proc.communicate()
        raise
    finally:
        _kill_session(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_deepspeed(run_dir: Path, *extra: str, num_procs: int = 2, check: bool = True) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus N --module planner.run.trainer ...`` on this machine's CPUs."""
    port = free_port()
    cmd = [DEEPSPEED, "--num_gpus", str(num_procs), "--master_port", str(port), "--module",
           "planner.run.trainer", "--run-dir", str(run_dir), "--deepspeed_config", str(run_dir / "ds_config.json"),
           *extra]
    proc = run_group(cmd, LAUNCH_TIMEOUT_S)
    # Shared-memory buffers the job left (the trainer removes its own at a clean exit; a rank
    # that crashes on purpose cannot): counted for the tests, then removed.
    proc.shm_left = remove_shm_buffers("127.0.0.1", port)  # type: ignore[attr-defined]
    (run_dir / "launcher.log").write_text(proc.stdout + proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"launcher exited {proc.returncode}; tail:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


def read_metrics(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    path = run_dir / f"metrics.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_info(run_dir: Path, rank: int) -> dict[str, Any]:
    return json.loads((run_dir / f"run_info.rank{rank}.json").read_text())
