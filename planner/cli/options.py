"""Options shared by commands that take parallel degrees (``suggest``, ``generate``, ``plot``, ``estimate``).

``workload_options`` (the batch, sequence, images, precision, optimizer, attention-kernel and
dropout flags) is defined once for every command that prices plans; ``balancer_option`` once
for the commands that search (``suggest``, ``generate``, ``plot``).

Each degree flag takes one value or a comma list (``--pp 2,4``); ``parse_int_list`` and
``parse_choice_list`` turn the text into a tuple and raise UserError naming the flag, so a
typo exits with status 2 and one message. ``estimate`` wants exactly one value per flag;
``single`` picks it out with the same message style.
"""

from __future__ import annotations

from typing import Sequence

from planner.errors import UserError


def parse_int_list(flag: str, text: str | None, *, minimum: int = 1) -> tuple[int, ...] | None:
    """'2,4' -> (2, 4); None stays None; non-numbers, values below ``minimum`` and values above
    the input's bound (planner/limits.py) are errors."""
    from planner import limits

    if text is None:
        return None
    items = [t.strip() for t in str(text).split(",")]
    if not items or any(not t for t in items):
        raise UserError(f"{flag}: empty value in {limits.shown_text(str(text))}; "
                        "give one number or a comma list such as 2,4")
    name = flag.removeprefix("--").replace("-", "_")
    bounded = name in limits.BOUNDS
    out = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            digits = item.lstrip("+-")
            if digits.isascii() and digits.isdigit():  # more digits than Python reads (4,300)
                if item.startswith("-"):
                    raise UserError(f"{flag}: a {len(digits):,}-digit negative number is below {minimum}; "
                                    f"give values >= {minimum}") from None
                raise UserError(limits.above(name, digits) if bounded else
                                f"{flag}: a {len(digits):,}-digit number is out of range") from None
            raise UserError(f"{flag}: {limits.shown_text(item)} is not a whole number; "
                            "give one number or a comma list such as 2,4") from None
        if value < minimum:
            raise UserError(f"{flag}: {limits.shown(value)} is below {minimum}; give values >= {minimum}")
        if bounded and value > limits.BOUNDS[name].most:
            raise UserError(limits.above(name, value))
        out.append(value)
    return tuple(dict.fromkeys(out))


def seconds_type(low: float, most: float, what: str):
    """A click type for a number of seconds from ``low`` to ``most`` (``what``: why that most,
    planner/limits.py): finite, so ``nan`` and ``inf`` are refused at parse time, where
    click.FloatRange lets them through (nan compares false with every bound)."""
    import math

    import click

    class Seconds(click.ParamType):
        name = "seconds"

        def convert(self, value, param, ctx):
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not (math.isfinite(number) and low <= number <= most):
                from planner.limits import shown_text

                self.fail(f"{shown_text(str(value))} is not a number of seconds from {low:g} to {most:,.0f} "
                          f"({what}); give one in that range", param, ctx)
            return number

    return Seconds()


def parse_choice_list(flag: str, text: str | None, choices: Sequence[str]) -> tuple[str, ...] | None:
    """'none,full' -> ('none', 'full'), each checked against ``choices`` (case-insensitive)."""
    if text is None:
        return None
    from planner.limits import shown_text

    out = []
    for item in (t.strip().lower() for t in str(text).split(",")):
        if item not in choices:
            raise UserError(f"{flag}: unknown value {shown_text(item)}; choose from {', '.join(choices)} "
                            "(one or a comma list)")
        out.append(item)
    return tuple(dict.fromkeys(out))


def single(flag: str, values: tuple | None, default):
    """The one value of a flag that must not be a list (``estimate``)."""
    if values is None:
        return default
    if len(values) != 1:
        raise UserError(f"{flag}: give one value here, not a list ({', '.join(map(str, values))})")
    return values[0]


_LIST_HELP = "one value or a comma list (e.g. 2,4); default: search every valid value"
# (flag, help) of every search axis, in the order --help shows them.
_CONSTRAINT_FLAGS = (
    ("--dp", f"Data-parallel degree: {_LIST_HELP}."),
    ("--tp", f"Tensor-parallel degree: {_LIST_HELP}."),
    ("--pp", f"Pipeline-parallel degree: {_LIST_HELP}."),
    ("--ep", f"Expert-parallel degree: {_LIST_HELP}."),
    ("--etp", "Expert tensor parallelism: 1 (MoE parallel folding: the experts leave TP and their expert-parallel "
     "ranks take the TP ranks too) or tp (the experts share the attention's TP), one or 1,tp, each searched "
     "[default: both for a mixture-of-experts model, on megatron and torchtitan]."),
    ("--cp", "Context-parallel degree (each sample's sequence split over cp ranks): one value or a comma list "
     "[default: 1 and 2, 4, ... while each rank keeps at least 2,048 tokens]."),
    ("--cp-comm", "How context-parallel ranks exchange: p2p (ring, Megatron only), a2a (all-to-all over heads, "
     "Ulysses on DeepSpeed), a2a+p2p (one or a comma list) [default: p2p,a2a]."),
    ("--dp-replicate", "Hybrid sharding: the dp x cp ranks form this many groups that each shard the model "
     "states and replicate each other (Megatron --num-distributed-optimizer-instances with --zero 1/3, torchtitan "
     "HSDP with --zero 3); one value or a comma list, each searched [default: 1, no replication]."),
    ("--zero", "ZeRO stage(s): 0,1,2,3 (megatron: 1 = distributed optimizer, 3 = Megatron-FSDP)."),
    ("--offload", "none, optimizer, optimizer+params (one or a comma list). optimizer: DeepSpeed ZeRO-Offload or "
     "Megatron-Core's optimizer CPU offload (bf16, Adam); optimizer+params: ZeRO-3 only."),
    ("--micro-batch", f"Micro-batch size: {_LIST_HELP}."),
    ("--recompute", "none, selective (Megatron's attention core), full, op (torchtitan's per-op selective "
     "checkpointing): one or a comma list."),
    ("--virtual-stages", "Interleaved pipeline chunks per rank (one or a comma list) [default: 1-8]."),
    ("--framework", "deepspeed, megatron-deepspeed, megatron, torchtitan (one or a comma list) [default: the first "
     "three; torchtitan, PyTorch FSDP2 + TP + PP + CP, is searched only when named]."),
)


EP_OVERLAP_HELP = ("Overlap the expert all-to-alls with another micro-batch's compute where the runtime can "
                   "(Megatron-Core's combined 1F1B, --overlap-moe-expert-parallel-comm --delay-wgrad-compute; "
                   "needs EP > 1, virtual stages when PP > 1, no full recomputation) [default: on].")

MOE_IMBALANCE_HELP = ("MoE routing imbalance: tokens the busiest expert-parallel rank receives over the mean (1 to "
                      "64); its grouped GEMMs, permutes and all-to-alls pace every layer [default: 1.0, the forced "
                      "balance of NVIDIA's published MoE benchmarks].")


MOE_CAPACITY_HELP = ("Capacity-factor token dropping (Megatron-Core's --moe-expert-capacity-factor F with "
                     "--moe-pad-expert-input-to-capacity; DeepSpeed MoE's capacity_factor): every expert takes exactly "
                     "F x its mean tokens, dropped above and padded below [default: dropless, priced at "
                     "--moe-imbalance].")


RECOMPUTE_MODULES_HELP = ("What Megatron's selective recompute (--recompute selective) runs again, a comma list of "
                          "core_attn, layernorm, mla_up_proj, moe_act, mlp, moe, shared_experts (Megatron-Core's "
                          "--recompute-modules; NVIDIA's DeepSeek-V3 recipes use mla_up_proj, GPT-OSS "
                          "layernorm,moe_act) [default: auto: core_attn under unfused attention; with "
                          "FlashAttention, which leaves core_attn nothing to free, the model's layernorm, "
                          "mla_up_proj and moe_act].")


DROPOUT_HELP = ("Model hidden/attention dropout (1-byte masks kept for backward) [default: none, as in Llama, "
                "DeepSeek and Qwen pre-training].")
COMPILE_HELP = ("--framework torchtitan: what torch.compile covers, a comma list of model (each transformer block) "
                "and loss, or none (torchtitan's compile.components). What is left out is priced as PyTorch's eager "
                "kernels, each op a kernel of its own with fp32 upcasts (RoPE, SwiGLU, the cross-entropy); "
                "DualPipeV's stages always run eager [default: model,loss].")
RMS_NORM_KERNEL_HELP = ("Eager RMSNorm (blocks left uncompiled): fused (PyTorch 2.8 and later) or composite (the "
                        "upcast, pow, mean, rsqrt and multiplies of older PyTorch) [default: fused].")
PP_SCHEDULE_HELP = ("The pipeline schedule of plans with --pp > 1: 1f1b (1F1B, interleaved 1F1B when a rank holds "
                    "--virtual-stages chunks) or dualpipev (DeepSeek's DualPipeV as torchtitan runs it: two chunks "
                    "per rank in a V, at least 2 x pp micro-batches, its expert all-to-alls overlapped with the "
                    "other pass's compute where no activation checkpointing runs; --framework torchtitan) "
                    "[default: 1f1b].")


MTBF_HELP = ("The job's mean time between failures, in hours; sets the checkpoint interval (Young/Daly) and the "
             "goodput [default: from the hardware profile's per-GPU and per-node failure rates, scaled by the "
             "job's size].")

PAO_HELP = ("Megatron-Core's precision-aware optimizer (TE's FusedAdam, --use-precision-aware-optimizer) with bf16 "
            "Adam moments and, in bf16 or delayed FP8, 16-bit master-weight remainders: 6 instead of 12 bytes of "
            "optimizer state per parameter. Needs --framework megatron, --zero 1, adam/adamw, no offload; suggest "
            "then searches only those [default: off].")


ZEROPP_HELP = ("DeepSpeed ZeRO++ on ZeRO-3, a comma list: qwz (int8 weight all-gathers), hpz (a 16-bit secondary "
               "weight partition per node, gathered inside the node after the step's first forward; costs 2 bytes "
               "per parameter / GPUs per node), qgz (int4 gradients in two all-to-alls). Needs --framework deepspeed "
               "--zero 3; suggest then searches only those. suggest and generate also take auto: none, each "
               "alone and all three, each searched and ranked together [default: none].")


MTP_HELP = ("Multi-token-prediction depths trained beside the model (DeepSeek-V3's MTP module: one more MoE layer, "
            "a projection and the shared head per depth, on the last pipeline stage; Megatron-Core --mtp-num-layers); "
            "0 plans the main model only [default: the model's own, 1 for deepseek-v3].")


FP8_GATHER_HELP = (
    "Under an FP8 recipe that allows it (tensorwise, delayed, mxfp8), keep the weights only in FP8 and "
    "all-gather them so (Megatron-Core --fp8-param-gather with the distributed optimizer, as NVIDIA's "
    "Megatron-Bridge recipes do; torchtitan's FSDP2 under tensorwise float8: enable_fsdp_float8_all_gather) "
    "[default: on]."
)


def _pp_schedule_option(many: bool):
    """--pp-schedule: one schedule, or for a search (``many``) a comma list of them, each searched."""
    import click

    from planner.cost.dualpipe import SCHEDULES

    if many:
        return click.option("--pp-schedule", default=None, metavar="NAME[,NAME]",
                            help=f"{PP_SCHEDULE_HELP} suggest and generate take a comma list, each searched.")
    return click.option("--pp-schedule", type=click.Choice(SCHEDULES), default=None, help=PP_SCHEDULE_HELP)


def _kernel_options():
    """--flash-attention and --flash-version (the attention kernel and its FlashAttention generation),
    --compile and --rms-norm-kernel (what torchtitan compiles, and the eager RMSNorm's PyTorch)."""
    import click

    return (click.option("--flash-attention/--no-flash-attention", default=None,
                         help="Attention kernel: FlashAttention (no s^2 scores kept) or the unfused kernels of "
                              "Korthikanti et al. [default: FlashAttention]."),
            click.option("--flash-version", type=click.IntRange(1, 2), default=None,
                         help="The FlashAttention generation the stack runs: 2 (FlashAttention-2, PyTorch SDPA's "
                              "flash backend) or 1 (flash-attn 1.x, or its Triton port: llm-foundry's attn_impl: "
                              "triton), priced at half FlashAttention-2's rate (Dao 2023). Megatron-Core's TE "
                              "attention (--te-attention) runs neither [default: 2]."),
            click.option("--compile", "compile", default=None, metavar="LIST", help=COMPILE_HELP),
            click.option("--rms-norm-kernel", type=click.Choice(["fused", "composite"]), default=None,
                         help=RMS_NORM_KERNEL_HELP))


def workload_options(global_batch_help: str, precision_list: bool = False):
    """Every workload flag, defined once for ``estimate``, ``suggest``, ``generate`` and ``plot``:
    --global-batch (help per command), --seq-len, --images-per-sample, --tiles-per-image,
    --precision, --optimizer, --flash-attention, --flash-version, --tp-comm-overlap, --te-attention,
    --ep-comm-overlap, --moe-imbalance,
    --moe-dispatcher, --moe-capacity-factor, --recompute-modules, --fp8-param-gather, --precision-aware-optimizer,
    --zeropp, --dropout, --mtbf-hours, --mtp-layers, --pp-schedule, --compile, --rms-norm-kernel (--no-...)
    Each defaults to None (the API fills the model's and the planner's defaults, named in the
    help), so a command can tell a flag given from one left out (``generate --plan`` refuses
    them; ``suggest`` repeats the ones given in its next step)."""
    import click

    from planner.cost.moe_dispatch import DISPATCHER_HELP, DISPATCHERS
    from planner.cost.precision import PRECISION_HELP, PRECISIONS

    decorators = [
        click.option("--global-batch", type=int, default=None, help=global_batch_help),
        click.option("--seq-len", type=int, default=None,
                     help="Tokens per sample [default: the model's training sequence length]."),
        click.option("--images-per-sample", type=int, default=None,
                     help="Vision-language models: images per sample [default: the model's]."),
        click.option("--tiles-per-image", type=int, default=None,
                     help="Vision-language models: local tiles per image [default: the model's]."),
        (click.option("--precision", default=None, metavar="NAME[,NAME...]",
                      help=f"{PRECISION_HELP} One or a comma list, each searched; recipes the GPU cannot run are "
                           "left out [default: bf16].")
         if precision_list else
         click.option("--precision", type=click.Choice(PRECISIONS, case_sensitive=False), default=None,
                      help=f"{PRECISION_HELP} [default: bf16]")),
        click.option("--optimizer", type=click.Choice(["adamw", "adam", "sgd"]), default=None,
                     help="Optimizer [default: adamw]."),
        *_kernel_options(),
        click.option("--tp-comm-overlap/--no-tp-comm-overlap", default=None,
                     help="Overlap tensor-parallel collectives with the GEMMs where the runtime can (Megatron-Core "
                          "with Transformer Engine, --tp-comm-overlap, under sequence parallelism) [default: on]."),
        click.option("--te-attention/--no-te-attention", default=None,
                     help="Megatron-Core's attention through Transformer Engine (cuDNN fused attention, "
                          "Hopper-native); off: FlashAttention-2's level, as the other runtimes [default: on]."),
        click.option("--ep-comm-overlap/--no-ep-comm-overlap", default=None, help=EP_OVERLAP_HELP),
        click.option("--moe-imbalance", type=float, default=None, metavar="F", help=MOE_IMBALANCE_HELP),
        click.option("--moe-dispatcher", type=click.Choice(DISPATCHERS), default=None, help=DISPATCHER_HELP),
        click.option("--moe-capacity-factor", type=float, default=None, metavar="F", help=MOE_CAPACITY_HELP),
        click.option("--recompute-modules", default=None, metavar="LIST", help=RECOMPUTE_MODULES_HELP),
        click.option("--fp8-param-gather/--no-fp8-param-gather", default=None, help=FP8_GATHER_HELP),
        click.option("--precision-aware-optimizer/--no-precision-aware-optimizer", default=None, help=PAO_HELP),
        click.option("--zeropp", "zero_pp", default=None, metavar="LIST", help=ZEROPP_HELP),
        click.option("--dropout/--no-dropout", default=None, help=DROPOUT_HELP),
        click.option("--mtbf-hours", type=float, default=None, metavar="H", help=MTBF_HELP),
        click.option("--mtp-layers", type=int, default=None, metavar="N", help=MTP_HELP),
        _pp_schedule_option(precision_list),
    ]

    def apply(command):
        for decorate in reversed(decorators):
            command = decorate(command)
        return command

    return apply


def workload_from_options(opts: dict) -> dict:
    """The workload flags given, as ``planner.api`` keywords (those left out are absent, so the
    API's defaults apply). The flags above are the API's WORKLOAD_KEYS, one each."""
    from planner.api import WORKLOAD_KEYS
    from planner.cost.precision import PRECISIONS

    out = {k: opts[k] for k in WORKLOAD_KEYS if opts.get(k) is not None}
    if "precision" in out:  # one name, or a tuple of them (suggest and generate search each)
        names = parse_choice_list("--precision", out["precision"], PRECISIONS) or ()
        out["precision"] = names[0] if len(names) == 1 else names
    if "pp_schedule" in out:
        from planner.cost.dualpipe import SCHEDULES

        names = parse_choice_list("--pp-schedule", out["pp_schedule"], SCHEDULES) or ()
        out["pp_schedule"] = names[0] if len(names) == 1 else names
    return out


PROFILE_HELP = ("Measured block costs from `dsplan profile` (profile.json) in place of the analytic ones, carried "
                "to the plan's micro-batch, sequence and tensor parallelism by the cost model.")


def layer_profile_option(command):
    """--profile FILE: dsplan profile's measurements (planner/cost/measured_blocks.py)."""
    import click

    return click.option("--profile", "layer_profile", default=None, metavar="FILE", help=PROFILE_HELP)(command)


def calibration_option(command):
    """--calibration FILE, for ``estimate``, ``suggest`` and ``generate``."""
    import click

    return click.option(
        "--calibration", default=None, metavar="FILE",
        help="A calibration.yaml written by `dsplan calibrate` for this hardware profile: its fitted factors "
             "(GEMM, HBM, network, overlap) replace the profile's calibration section [default: the profile's "
             "own, 1.0 in the built-in ones].")(command)


def balancer_option(command):
    """--balancer greedy|optimal."""
    import click

    return click.option("--balancer", type=click.Choice(["greedy", "optimal"]), default="optimal", show_default=True,
                        help="Pipeline layer-partition balancer.")(command)


def objective_option(command):
    """--objective, for suggest and for generate's search (planner/search/rank.py OBJECTIVES)."""
    import click

    return click.option(
        "--objective", type=click.Choice(["throughput", "memory", "cost", "goodput"]), default="throughput",
        show_default=True,
        help="Rank by tokens/s, by lowest peak memory, by GPU-hours per token, or by useful tokens/s "
             "(tokens/s x goodput: checkpoint stalls, failures and restarts paid; see --mtbf-hours).")(command)


def constraint_options(command):
    """The search-axis flags shared by ``suggest``, ``generate`` and ``plot`` (one definition)."""
    import click

    decorators = [click.option(flag, default=None, help=text) for flag, text in _CONSTRAINT_FLAGS]
    decorators.append(click.option("--sequence-parallel/--no-sequence-parallel", default=None,
                                   help="Pin sequence parallelism on or off [default: try both]."))
    decorators.append(click.option("--allow-tp-across-nodes", is_flag=True,
                                   help="Let tensor parallelism span nodes (off by default: TP wants NVLink)."))
    decorators.append(click.option(
        "--activation-offload", type=click.Choice(["auto", "none"]), default=None,
        help="auto: a plan that runs out of memory may offload the activations of as few decoder layers as make it "
             "fit to host memory, where the runtime can (Megatron-Core --cpu-offloading-num-layers: framework "
             "megatron, pp 1, recompute none), priced with its copies over the host link; none: never "
             "[default: auto]."))
    for decorate in reversed(decorators):
        command = decorate(command)
    return command


def _expert_tp(values: tuple[str, ...] | None) -> tuple[int | str, ...] | None:
    return None if values is None else tuple(1 if v == "1" else v for v in values)


def axes_from_options(opts: dict) -> dict:
    """The search-axis flags, parsed, as ``planner.api.suggest`` keywords (tuples; None: not
    pinned). The API checks the values (planner/api.py ``constraints``)."""
    from planner.cost.parallel import CP_COMMS, FRAMEWORKS, OFFLOADS, RECOMPUTES

    sp = opts.get("sequence_parallel")
    return {
        "dp": parse_int_list("--dp", opts.get("dp")), "tp": parse_int_list("--tp", opts.get("tp")),
        "pp": parse_int_list("--pp", opts.get("pp")), "ep": parse_int_list("--ep", opts.get("ep")),
        "cp": parse_int_list("--cp", opts.get("cp")),
        "cp_comm": parse_choice_list("--cp-comm", opts.get("cp_comm"), CP_COMMS),
        "dp_replicate": parse_int_list("--dp-replicate", opts.get("dp_replicate")),
        "etp": _expert_tp(parse_choice_list("--etp", opts.get("etp"), ("1", "tp"))),
        "zero": parse_int_list("--zero", opts.get("zero"), minimum=0),
        "offload": parse_choice_list("--offload", opts.get("offload"), OFFLOADS),
        "micro_batch": parse_int_list("--micro-batch", opts.get("micro_batch")),
        "recompute": parse_choice_list("--recompute", opts.get("recompute"), RECOMPUTES),
        "virtual_stages": parse_int_list("--virtual-stages", opts.get("virtual_stages")),
        "framework": parse_choice_list("--framework", opts.get("framework"), FRAMEWORKS),
        "sequence_parallel": None if sp is None else bool(sp),
        "allow_tp_across_nodes": bool(opts.get("allow_tp_across_nodes")),
        "activation_offload": opts.get("activation_offload") != "none",
    }
