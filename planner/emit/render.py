"""Render a plan into the files of a run directory, all in memory.

``render_run_dir`` turns plan + model + hardware profile + launch options into
``{file name: GeneratedFile}``. It writes nothing (planner/emit/write.py writes the result,
atomically, protecting user edits); the one file it reads is a custom entry script, which the
run directory carries as a copy so that every node, and every pod, finds it there.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jinja2
import yaml
from pydantic import BaseModel, ConfigDict, Field

from planner import __version__
from planner.cost.framework_rules import check_framework_for
from planner.cost.notes import batch_notes
from planner.cost.parallel import check_against_model
from planner.emit.container import DEFAULT_IMAGE, runtime_pins
from planner.emit.ds_config import TrainSettings, build_ds_config, build_moe_config
from planner.emit.hosts import Host
from planner.emit.megatron_args import megatron_deepspeed_args, megatron_lm_args, megatron_notes
from planner.emit.monitoring import DASHBOARD_FILE, AlertThresholds, dashboard, predicted_step_time
from planner.emit.nccl import host_threads, nccl_env
from planner.emit.plan_file import PlanFile
from planner.emit.preflight import preflight_json
from planner.emit.resilience import RESTARTS, async_save, collective_timeout_s, resolved_settings
from planner.emit.torchtitan_config import CONFIG_FILE as TORCHTITAN_CONFIG
from planner.emit.torchtitan_config import TORCHTITAN_VERSION, to_toml, torchtitan_job
from planner.errors import UserError, spell
from planner.hardware.profile import RDMA_FABRICS, HardwareProfile
from planner.model.spec import ModelSpec
from planner.resources import templates_dir
from planner.run.exporter import COMM_SHARE, STEP_TIME
from planner.run.preflight_spec import PREFLIGHT_FILE

BUILTIN_ENTRY = "builtin"
# The RDMA resource k8s-job.yaml asks for on an InfiniBand or RoCE fabric: the NVIDIA Network
# Operator's RDMA shared device plugin, as its NicClusterPolicy example names it
# (rdmaSharedDevicePlugin, resourceName "rdma_shared_device_a", prefix "rdma"). One unit gives the
# pod every HCA the plugin's selectors match. `--k8s-rdma NAME=COUNT` names another (e.g. the
# SR-IOV device plugin's per-NIC nvidia.com/hostdev=8), `--k8s-rdma none` asks for none.
DEFAULT_RDMA_RESOURCE = "rdma/rdma_shared_device_a"
# A Kubernetes extended resource name (domain/name) and a scheduler name (a DNS subdomain).
_K8S_RESOURCE = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_K8S_SCHEDULER = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
EXECUTABLE = ("entry.sh", "launch_deepspeed.sh", "launch_torchrun.sh", "slurm.sbatch", "megatron_args.sh",
              "preflight.sh")
# Rendered from templates/<name>.j2, in this order.
TEMPLATED = (
    "entry.sh", "hostfile", "nccl.env", "launch_deepspeed.sh", "launch_torchrun.sh",
    "slurm.sbatch", "k8s-job.yaml", "megatron_args.sh", "preflight.sh", "prometheus-rules.yaml", "Dockerfile",
    "README.md",
)


class GeneratedFile(BaseModel):
    model_config = ConfigDict(frozen=True)

    content: str
    executable: bool = False


class LaunchOptions(BaseModel):
    """How the plan is launched: the entry, its arguments, the hosts, and site settings."""

    model_config = ConfigDict(frozen=True)

    entry: str = BUILTIN_ENTRY  # "builtin" or an absolute path to the user's training script
    entry_args: list[str] = Field(default_factory=list)
    hosts: list[Host] | None = None  # None: placeholder host names in the hostfile
    master_port: int = Field(29500, ge=1024, le=65535)
    image: str = DEFAULT_IMAGE
    k8s_pvc: str = "dsplan-runs"
    k8s_scheduler: str | None = None  # the pods' schedulerName (e.g. volcano); None: the cluster's choice
    k8s_rdma: str | None = None  # "NAME[=COUNT]" or "none"; None: DEFAULT_RDMA_RESOURCE on an RDMA fabric
    ib_hca: str | None = None
    socket_ifname: str | None = None
    settings: TrainSettings = Field(default_factory=TrainSettings)
    alerts: AlertThresholds = Field(default_factory=AlertThresholds)  # prometheus-rules.yaml, the dashboard
    # How the README's notes name the inputs to change (planner/errors.py spell): the CLI passes
    # its flags; None reads the API keywords.
    input_names: dict[str, str] | None = None


def run_name(out_dir: str | Path) -> str:
    """A name valid for SLURM jobs and Kubernetes objects (an RFC 1123 label)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", Path(out_dir).resolve().name.lower()).strip("-")[:50].strip("-")
    return slug if slug and slug[0].isalpha() else f"dsplan-{slug}".strip("-")


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def plan_title(plan: PlanFile, model: ModelSpec) -> str:
    parts = [f"dp{plan.dp}", f"tp{plan.tp}", f"pp{plan.pp}"]
    if plan.ep > 1:
        parts.append(f"ep{plan.ep}")
    return f"{model.name} {'-'.join(parts)} zero{plan.zero_stage} mb{plan.micro_batch}x{plan.grad_accum}"


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def _predictions(plan: PlanFile) -> list[tuple[str, str]]:
    extra = plan.model_extra or {}
    rows: list[tuple[str, str]] = []
    memory = extra.get("memory")
    if isinstance(memory, dict) and isinstance(memory.get("peak_bytes"), (int, float)):
        rows.append(("predicted peak memory per GPU", f"{memory['peak_bytes'] / 2**30:.1f} GiB"))
    if isinstance(extra.get("step_time_s"), (int, float)):
        rows.append(("predicted step time", f"{extra['step_time_s']:.3f} s"))
    if isinstance(extra.get("tokens_per_s"), (int, float)):
        rows.append(("predicted throughput", f"{_count(extra['tokens_per_s'])} tokens/s"))
    if isinstance(extra.get("mfu"), (int, float)):
        rows.append(("predicted MFU", f"{100 * extra['mfu']:.1f}%"))
    ck = extra.get("checkpoint")
    if isinstance(ck, dict) and isinstance(extra.get("goodput"), (int, float)):
        rows.append(("predicted goodput", f"{100 * extra['goodput']:.1f}% of wall time trains, at a job MTBF of "
                                          f"{ck.get('mtbf_hours', 0):,.1f} h"))
    if extra.get("fits") is False:
        rows.append(("fits", "NO: the planner predicts this plan runs out of memory"))
    return rows


def _notes(plan: PlanFile, model: ModelSpec, profile: HardwareProfile) -> list[str]:
    """The search's line on why this plan ranks where it does, then the batch notes
    (planner/cost/notes.py), when the plan file carries the predictions they read, and the
    schedule note of an interleaved plan (planner/cost/schedule_check.py), as suggest and
    estimate print them."""
    extra = plan.model_extra or {}
    out = []
    if isinstance(extra.get("why"), str) and extra["why"]:
        rank = extra.get("id")
        out.append(f"Ranked #{rank} by the search, below #1: {extra['why']}" if isinstance(rank, int) and rank > 1
                   else f"Why this plan: {extra['why']}")
    if isinstance(extra.get("time"), dict) and isinstance(extra.get("step_time_s"), (int, float)):
        try:
            out += batch_notes({**extra, **plan.model_dump()}, plan.seq_len)
        except (TypeError, ValueError):  # a hand-edited plan.json with odd predictions: no notes
            pass
        if plan.virtual_stages > 1 and plan.stage_blocks:
            from planner.cost.schedule_check import plan_schedule_notes
            from planner.hardware.cluster import Cluster

            cluster = Cluster.build(profile.with_gpus_per_node(plan.gpus_per_node), plan.nodes)
            out += plan_schedule_notes(model, cluster, plan.workload(), plan.parallel_config(),
                                       [tuple(b) for b in plan.stage_blocks], float(extra["step_time_s"]))
    return out


def _hosts(plan: PlanFile, options: LaunchOptions) -> list[Host]:
    if options.hosts is not None:
        return options.hosts
    if plan.nodes == 1:
        return [Host(name="localhost", slots=plan.gpus_per_node)]
    return [Host(name=f"node{i}", slots=plan.gpus_per_node) for i in range(plan.nodes)]


class RdmaRequest(BaseModel):
    model_config = ConfigDict(frozen=True)

    resource: str
    count: int


def parse_k8s_rdma(text: str, source: str = "--k8s-rdma") -> RdmaRequest | None:
    """``NAME[=COUNT]`` (an extended resource such as rdma/rdma_shared_device_a, COUNT >= 1,
    default 1) or ``none``."""
    if text == "none":
        return None
    name, _, count = text.partition("=")
    if not _K8S_RESOURCE.fullmatch(name) or (count and not (count.isdigit() and int(count) >= 1)):
        raise UserError(
            f"{source} {text!r}: expected an extended resource name with an optional count, e.g. "
            f"{DEFAULT_RDMA_RESOURCE} or nvidia.com/hostdev=8, or 'none'"
        )
    return RdmaRequest(resource=name, count=int(count) if count else 1)


def check_k8s_scheduler(text: str, source: str = "--k8s-scheduler") -> str:
    if not _K8S_SCHEDULER.fullmatch(text):
        raise UserError(f"{source} {text!r}: not a valid scheduler name (lower-case letters, digits, '-' and '.'), "
                        "e.g. volcano")
    return text


def rdma_request(profile: HardwareProfile, options: LaunchOptions) -> RdmaRequest | None:
    """What each pod asks of the RDMA device plugin: none on a plain Ethernet fabric."""
    if options.k8s_rdma is not None:
        return parse_k8s_rdma(options.k8s_rdma)
    if profile.fabric.kind not in RDMA_FABRICS:
        return None
    return RdmaRequest(resource=DEFAULT_RDMA_RESOURCE, count=1)


# Files a run directory holds besides the templated ones; a custom entry's copy may not take their names.
_OTHER_FILES = ("ds_config.json", "plan.json", "moe.json", TORCHTITAN_CONFIG, ".dsplan-manifest.json", "metrics.jsonl",
                "report.json", PREFLIGHT_FILE, DASHBOARD_FILE)


class EntryScript(BaseModel):
    """A custom entry as the run directory holds it: ``name`` relative to the run directory, and
    the ``text`` of the copy to write there."""

    model_config = ConfigDict(frozen=True)

    name: str
    text: str | None = None  # the copy to write; None when the script lives in the run directory
    source_dir: str | None = None  # the original's directory, for the modules beside it (copies only)


def entry_script(entry: str, out_dir: str | Path) -> EntryScript:
    """Where entry.sh finds a custom entry: the launchers run it from the run directory, so it need
    not exist at the same path on every node, or in a pod at all. A script outside the run
    directory is copied in; one inside it is run where it is (never copied over itself, nor removed
    as a stale copy when the entry changes)."""
    path = Path(entry)
    source = f"--entry {entry}"
    try:
        inside = path.resolve().relative_to(Path(out_dir).resolve()).as_posix()
    except ValueError:
        inside = None
    name = inside or path.name
    if name in TEMPLATED or name in _OTHER_FILES or name.startswith("."):
        raise UserError(f"{source}: the run directory has its own {name}; rename your script (e.g. train.py)")
    if inside is not None:
        return EntryScript(name=inside)
    try:
        with open(path, encoding="utf-8", newline="") as f:  # byte for byte: no newline translation
            text = f.read()
    except FileNotFoundError:
        raise UserError(f"{source}: no such file; give your training script, "
                        "or 'builtin' for dsplan's trainer") from None
    except UnicodeDecodeError:
        raise UserError(f"{source}: not a UTF-8 text file; give your training script (a .py file)") from None
    except OSError as err:
        raise UserError(f"{source}: cannot read it ({err.strerror or err.__class__.__name__})") from None
    return EntryScript(name=name, text=text, source_dir=str(path.parent))


def check_plan_against_model(plan: PlanFile, model: ModelSpec) -> None:
    """The degree rules that need the model (TP divides heads, EP divides experts, stages cover the blocks)."""
    cfg = plan.parallel_config()
    check_against_model(cfg, heads=model.attention_heads, kv_heads=model.kv_heads,
                        routed_experts=model.routed_experts, blocks=len(model.blocks))
    check_framework_for(cfg, model, optimizer=plan.optimizer, precision=plan.precision,
                        precision_aware_optimizer=plan.precision_aware_optimizer, zero_pp=plan.zero_pp,
                        ep_overlap=plan.ep_comm_overlap, dispatcher=plan.moe_dispatcher,
                        modules=plan.recompute_modules, pp_schedule=plan.pp_schedule, compiled=plan.compile)
    if plan.stage_blocks is not None:
        first, last = plan.stage_blocks[0][0], plan.stage_blocks[-1][1]
        if (first, last) != (0, len(model.blocks)):
            raise UserError(
                f"plan: stage_blocks cover blocks {first}..{last}, but {model.name} has blocks 0..{len(model.blocks)}; "
                "plan again for this model"
            )
    elif plan.pp > 1:
        raise UserError(f"plan: pp={plan.pp} needs stage_blocks (the layer partition over pipeline stages)")


def render_run_dir(
    plan: PlanFile, model: ModelSpec, profile: HardwareProfile, options: LaunchOptions, out_dir: str | Path = "run"
) -> dict[str, GeneratedFile]:
    """Every file of the run directory, rendered and checked in memory."""
    if plan.gpus_per_node > profile.gpus_per_node:
        raise UserError(
            f"plan: {plan.gpus_per_node} GPUs per node, but hardware profile {profile.name} has {profile.gpus_per_node}"
        )
    model = plan.workload().trained(model)  # with the plan's multi-token-prediction depths
    check_plan_against_model(plan, model)
    options = options.model_copy(update={"settings": resolved_settings(plan, options.settings)})
    ds_config = build_ds_config(plan, model, options.settings)
    moe = build_moe_config(plan, model)
    hosts = _hosts(plan, options)
    script = None if options.entry == BUILTIN_ENTRY else entry_script(options.entry, out_dir)
    context = _context(plan, model, profile, options, out_dir, hosts, script, moe=moe is not None)
    env = _environment()
    files: dict[str, GeneratedFile] = {
        "ds_config.json": GeneratedFile(content=json.dumps(ds_config, indent=2) + "\n"),
        "plan.json": GeneratedFile(content=json.dumps(plan.to_json(), indent=2) + "\n"),
        PREFLIGHT_FILE: GeneratedFile(content=preflight_json(plan, profile, plan_title(plan, model))),
    }
    if plan.framework == "torchtitan":
        files[TORCHTITAN_CONFIG] = GeneratedFile(content=to_toml(torchtitan_job(plan, model, options.settings)))
    board = dashboard(context["plan_title"], context["run_name"], options.alerts, predicted_step_time(plan))
    files[DASHBOARD_FILE] = GeneratedFile(content=json.dumps(board, indent=2) + "\n")
    if moe is not None:
        files["moe.json"] = GeneratedFile(content=json.dumps(moe, indent=2) + "\n")
    if script is not None and script.text is not None:
        files[script.name] = GeneratedFile(content=script.text)
    for template in TEMPLATED:
        text = env.get_template(f"{template}.j2").render(context)
        files[template] = GeneratedFile(content=text, executable=template in EXECUTABLE)
    _self_check(files)
    return files


def _context(plan: PlanFile, model: ModelSpec, profile: HardwareProfile, options: LaunchOptions,
             out_dir: str | Path, hosts: list[Host], script: EntryScript | None, *, moe: bool) -> dict[str, Any]:
    """What the templates see: the plan, its launch settings, hosts, environment and flags."""
    settings = options.settings
    scheduler = None if options.k8s_scheduler is None else check_k8s_scheduler(options.k8s_scheduler)
    k8s_roles = [("Master", 1)] + ([("Worker", plan.nodes - 1)] if plan.nodes > 1 else [])
    return {
        "plan": plan,
        "model": model,
        "profile": profile,
        "job_profile": profile.for_job(plan.nodes),
        "settings": settings,
        "plan_title": plan_title(plan, model),
        "run_name": run_name(out_dir),
        "run_dir_hint": shlex.quote(str(Path(out_dir))),
        "version": __version__,
        "params": _count(model.total_params()),
        "predictions": _predictions(plan),
        "notes": [spell(line, options.input_names) for line in _notes(plan, model, profile)],
        "builtin": options.entry == BUILTIN_ENTRY,
        "entry": options.entry,  # the user's path; entry.sh runs script.name in the run directory
        "script": script,
        "entry_args": options.entry_args,
        "moe": moe,
        "container": {"base_image": DEFAULT_IMAGE, "pins": runtime_pins(plan, options.entry == BUILTIN_ENTRY)},
        "resilience": {"timeout_s": collective_timeout_s(plan), "async": async_save(plan), "restarts": RESTARTS},
        "t": options.alerts, "m": {"step_time": STEP_TIME, "comm_share": COMM_SHARE},
        "predicted_step_time": predicted_step_time(plan), "tdp_W": profile.gpu.tdp_W,
        "torchtitan_version": TORCHTITAN_VERSION,
        "hosts": hosts,
        "hosts_given": options.hosts is not None or plan.nodes == 1,
        "first_host": hosts[0].name,
        "master_port": options.master_port,
        "env": nccl_env(profile, plan, ib_hca=options.ib_hca, socket_ifname=options.socket_ifname),
        "omp_threads": host_threads(profile, plan),
        "lm_args": megatron_lm_args(model, plan, settings, plan.gpus_per_node * profile.node.nvlink_domain_nodes),
        "ds_args": megatron_deepspeed_args(model, plan),
        "lm_notes": megatron_notes(model, plan),
        # the pods see the run directory under its own name (the object name is a sanitised label)
        "k8s": {"roles": k8s_roles, "image": options.image, "pvc": options.k8s_pvc, "mount": "/workspace/runs",
                "dir": Path(out_dir).resolve().name,
                "gpu_resource": "amd.com/gpu" if profile.gpu.vendor == "amd" else "nvidia.com/gpu",
                "scheduler": scheduler, "rdma": rdma_request(profile, options),
                "rdma_fabric": profile.fabric.kind in RDMA_FABRICS,
                # /dev/shm (NCCL's intra-node buffers, data-loader workers) is host memory: cap it at a
                # quarter of the node's
                "shm_GiB": max(1, int(profile.node.host_memory_GiB // 4))},
    }


def _self_check(files: dict[str, GeneratedFile]) -> None:
    """Catch a broken render before anything is written (a bug, not a user error)."""
    for name, generated in files.items():
        if name.endswith(".json"):
            json.loads(generated.content)
    rules = yaml.safe_load(files["prometheus-rules.yaml"].content)
    assert rules["groups"][0]["rules"], "prometheus-rules.yaml rendered no rule"
    job = yaml.safe_load(files["k8s-job.yaml"].content)
    assert job["kind"] == "PyTorchJob", "k8s-job.yaml did not render a PyTorchJob"
