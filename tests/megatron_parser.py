"""Megatron-LM's own argument parser, run on flags dsplan emits (tests/test_megatron_parser.py).

``check_megatron_args(argv, world_size=...)`` runs, in a fresh interpreter, what Megatron-LM's
``pretrain()`` does with its command line before it touches a GPU or the network:
``megatron.training.arguments.parse_args`` (unknown flags refused), ``validate_args`` and
``core_transformer_config_from_args`` (the TransformerConfig, whose ``__post_init__`` checks the
model/parallel combination again). It returns ``(ok, message)``; on failure the message is
Megatron's own error text and the source line that raised it.

The code is the ``megatron-core`` wheel (it ships megatron/training/), downloaded once with pip
into a cache and unzipped, not installed: the wheel declares Python >= 3.12 and the project runs
3.11, so ``pip install`` would refuse it, but the modules import under 3.11 with the shims below.
The subprocess keeps the shims and Megatron's global state (argparse on sys.argv, its global
args, CUDA monkeypatches) out of the test process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from planner.emit.container import MEGATRON_CORE_VERSION  # the version Dockerfile pins

# Transformer Engine version the shim reports (see _CHILD): the newest minimum this megatron-core
# release tests for (megatron/core/**: is_te_min_version("2.14.0")), so every TE-gated feature
# dsplan may emit is judged as on a current NGC container rather than refused for "no TE".
TE_VERSION = "2.14.0"
# pretrain_gpt.py's args_defaults (Megatron-LM pretrain_gpt.py: pretrain(..., args_defaults=...)).
PRETRAIN_GPT_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}

RESULT_MARK = "@@DSPLAN_MEGATRON_RESULT@@"


class MegatronUnavailable(RuntimeError):
    """The megatron-core wheel could not be downloaded or unpacked."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dsplan-tests"


def ensure_megatron(cache_dir: Path | None = None) -> Path:
    """The directory holding the unzipped megatron-core wheel (its ``megatron/`` package),
    downloaded on first use. Raises MegatronUnavailable with pip's output on failure."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"megatron-core-{MEGATRON_CORE_VERSION}"
    if (target / "megatron" / "training" / "arguments.py").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mcore-", dir=root))
    try:
        # --python-version 3.12: the wheel's Requires-Python; --no-deps: only its own files.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--python-version", "3.12",
               "--only-binary", ":all:", f"megatron-core=={MEGATRON_CORE_VERSION}", "-d", str(work / "dl")]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        wheels = sorted((work / "dl").glob("megatron_core-*.whl")) if r.returncode == 0 else []
        if not wheels:
            raise MegatronUnavailable(
                f"could not download megatron-core=={MEGATRON_CORE_VERSION} (needed to check the emitted "
                f"Megatron-LM flags with Megatron's own parser):\n$ {' '.join(cmd)}\nexit {r.returncode}\n"
                f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(work / "pkg")
        try:
            os.replace(work / "pkg", target)  # atomic: a parallel worker may have won the race
        except OSError:
            if not (target / "megatron" / "training" / "arguments.py").is_file():
                raise
    except (OSError, zipfile.BadZipFile, subprocess.TimeoutExpired) as e:
        raise MegatronUnavailable(f"could not unpack megatron-core=={MEGATRON_CORE_VERSION}: {e!r}") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


@dataclass
class ArgsCheck:
    """One command line to check: the flags, and the job rank 0 of it runs in."""

    argv: list[str]
    world_size: int  # WORLD_SIZE: validate_args divides it by tp x pp x cp
    env: dict[str, str] = field(default_factory=dict)  # the ranks' environment (the run directory's nccl.env)
    gpu_arch: tuple[int, int] = (9, 0)  # compute capability of the plan's GPU (9.0: Hopper)


# Environment of the test process that must not decide a case: the launcher's rank variables,
# and what nccl.env sets (each case passes its own).
_SCRUBBED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "CUDA_DEVICE_MAX_CONNECTIONS", "NVTE_CPU_OFFLOAD_V1", "NCCL_PROTO", "NCCL_GRAPH_REGISTER",
                 "CUDA_GRAPHS_USE_NODE_PRIORITY", "PYTORCH_CUDA_ALLOC_CONF")


# The child interpreter. It imports megatron once (about 10 s, nearly all of it torch and
# megatron.core module imports), then forks once per case, so each case starts from the same
# freshly imported state and none sees another's arguments or global variables.
_CHILD = r'''
import io, json, os, sys, traceback, types, typing, warnings

spec = json.loads(sys.stdin.read())

def finish(results):
    print("\n" + spec["mark"] + json.dumps(results), flush=True)
    sys.exit(0)

# Shim 1: typing.override is new in Python 3.12 (the wheel's Requires-Python); megatron/training/
# models/gpt.py and hybrid.py, which arguments.py imports, do `from typing import override` and use
# it as a plain decorator. typing_extensions' is the same function.
if not hasattr(typing, "override"):
    try:
        from typing_extensions import override
    except ImportError:
        def override(f):
            return f
    typing.override = override

# Shim 2, only where triton is not installed (a CPU-only machine need not have it): megatron.core
# guards its `import triton`s, except megatron/core/transformer/moe/ops/paged_stash.py, two
# @triton.jit kernels that megatron/core/transformer/moe/paged_stash.py imports (and with it
# the MoE layers transformer_config pulls in). Argument handling never runs them, so that one
# module is replaced by its three names. (A stub `triton` in sys.modules would not do: torch's
# inductor, which megatron.core.utils imports, then takes it for a real triton and fails.)
try:
    import triton  # noqa: F401
except ImportError:
    ops = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
    ops.GLOBAL_BLOCK_SIZE = 1024
    ops.paged_stash_copy_kernel = ops.paged_stash_pop_kernel = None  # kernels: need triton and a GPU
    sys.modules[ops.__name__] = ops

sys.path.insert(0, spec["megatron_root"])
warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" and the like

import torch

try:
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.argument_utils import core_transformer_config_from_args
    import megatron.core.utils as mcore_utils
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
except BaseException:
    finish([{"ok": False, "message": "importing megatron failed:\n" + traceback.format_exc()}] * len(spec["cases"]))

# Shim 3: Transformer Engine is not installed (it needs CUDA), so megatron.core.utils has cached
# TE version 0.0.0, and validate_args' / TransformerConfig's is_te_min_version(...) checks would
# refuse every TE feature (FP8 recipes, ...). Report the TE version of a current container; the
# checks themselves still run.
from packaging.version import Version
mcore_utils._te_version = Version(spec["te_version"])

# Shim 4: TE's fused RoPE kernel. Without TE, rope_utils' import of it fell back to None and
# TransformerConfig.__post_init__ refuses Megatron's default --apply-rope-fusion ("apply_rope_fusion
# is not available. Please install TE >= 1.4."); with TE it is there. Never called here.
def _te_fused_rope(*args, **kwargs):
    raise RuntimeError("dsplan test shim: TE fused RoPE is not available on CPU")
if rope_utils.fused_apply_rotary_pos_emb is None:
    rope_utils.fused_apply_rotary_pos_emb = _te_fused_rope
if rope_utils.fused_apply_rotary_pos_emb_thd is None:
    rope_utils.fused_apply_rotary_pos_emb_thd = _te_fused_rope

def run_case(case):
    # Shim 5: the plan's GPU. validate_args asks torch for it (arguments.py:
    # torch.cuda.get_device_capability() under --moe-grouped-gemm; get_device_arch_version() ->
    # torch.cuda.get_device_properties(0).major for the CUDA_DEVICE_MAX_CONNECTIONS and FSDP
    # rules); a CPU-only torch raises there.
    major, minor = case["gpu_arch"]
    torch.cuda.get_device_capability = lambda device=None: (major, minor)
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        major=major, minor=minor, name="dsplan-test-shim", total_memory=80 << 30, multi_processor_count=132)
    os.environ.update(case["env"])
    sys.argv = ["pretrain_gpt.py"] + case["argv"]
    out = io.StringIO()
    sys.stdout = sys.stderr = out  # argparse's errors and Megatron's print_rank_0 output
    stage = "parse_args"
    try:
        args = parse_args(ignore_unknown_args=False)
        stage = "validate_args"
        validate_args(args, spec["defaults"])
        stage = "core_transformer_config_from_args"
        config = core_transformer_config_from_args(args)
    except SystemExit as e:  # argparse's parser.error() printed "<prog>: error: ..." and exited
        errors = [ln for ln in out.getvalue().splitlines() if ": error: " in ln]
        return {"ok": False, "message": f"{stage}: " + (errors[-1] if errors else f"exit {e.code}"),
                "output": "" if errors else output_tail(out.getvalue())}
    except BaseException as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/megatron/" in f.filename]
        where = "".join(f"\n  {f.filename[len(spec['megatron_root']):].lstrip('/')}:{f.lineno}"
                        f" in {f.name}: {f.line}" for f in frames[-3:])
        return {"ok": False, "message": f"{stage}: {type(e).__name__}: {e}{where}",
                "output": output_tail(out.getvalue())}
    return {"ok": True, "output": "",
            "message": f"world {args.world_size} = dp {args.data_parallel_size} x tp "
                       f"{config.tensor_model_parallel_size} x pp {config.pipeline_model_parallel_size} x cp "
                       f"{config.context_parallel_size} (ep {config.expert_model_parallel_size}); "
                       f"{type(config).__name__} built"}

def output_tail(text):
    # Megatron's output without its dump of every argument (validate_args' _print_args), which
    # the failure message would otherwise be mostly made of.
    head, sep, rest = text.partition("------------------------ arguments ------------------------")
    if sep:
        text = head + rest.partition("-------------------- end of arguments ---------------------")[2]
    return text.strip()[-1500:]

results = []
for case in spec["cases"]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            result = run_case(case)
        except BaseException:
            result = {"ok": False, "message": "harness error:\n" + traceback.format_exc(), "output": ""}
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(result))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    results.append(json.loads(data) if data else
                   {"ok": False, "message": f"the case's process died (wait status {status})", "output": ""})
finish(results)
'''


def check_many(cases: list[ArgsCheck], *, megatron_root: Path | None = None, timeout: float = 600,
               defaults: dict | None = None) -> list[tuple[bool, str]]:
    """Run Megatron-LM's parse_args(ignore_unknown_args=False), validate_args(args, defaults) and
    core_transformer_config_from_args(args) on each case's flags, as rank 0 of its job, in one
    subprocess (a fork per case). Returns (ok, message) per case; the message of a failure is
    Megatron's error and the lines of megatron/ that raised it."""
    root = megatron_root if megatron_root is not None else ensure_megatron()
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env.update({"CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"})  # never touch a real GPU
    spec = {
        "mark": RESULT_MARK, "megatron_root": str(root), "te_version": TE_VERSION,
        "defaults": dict(PRETRAIN_GPT_DEFAULTS if defaults is None else defaults),
        # parse_args takes args.rank / args.world_size from RANK / WORLD_SIZE (arguments.py parse_args).
        "cases": [{"argv": list(c.argv), "gpu_arch": list(c.gpu_arch),
                   "env": {**c.env, "WORLD_SIZE": str(c.world_size), "RANK": "0", "LOCAL_RANK": "0"}}
                  for c in cases],
    }
    try:
        r = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(spec), capture_output=True, text=True,
                           env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return [(False, f"Megatron's argument check timed out after {timeout} s\n{e.stdout}\n{e.stderr}")] * len(cases)
    for line in reversed(r.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return [(bool(x["ok"]), x["message"] + (f"\n--- Megatron's output (tail) ---\n{x.get('output')}"
                                                    if x.get("output") else ""))
                    for x in json.loads(line[len(RESULT_MARK):])]
    died = (f"Megatron's argument check died (exit {r.returncode})\n--- stdout ---\n{r.stdout[-4000:]}"
            f"\n--- stderr ---\n{r.stderr[-4000:]}")
    return [(False, died)] * len(cases)


def check_megatron_args(argv: list[str], *, world_size: int, env: dict[str, str] | None = None,
                        gpu_arch: tuple[int, int] = (9, 0), megatron_root: Path | None = None) -> tuple[bool, str]:
    """check_many for one command line."""
    return check_many([ArgsCheck(list(argv), world_size, dict(env or {}), gpu_arch)], megatron_root=megatron_root)[0]
