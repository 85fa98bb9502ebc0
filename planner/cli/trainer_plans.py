"""The search ``dsplan generate`` runs for the reference trainer (``--entry builtin``): only plans it runs.

What the trainer runs is stated once, in planner/run/rundir.py (``trainer_refusal``): virtual
stages 1, and tensor parallelism only as DeepSpeed's AutoTP (framework deepspeed, no pipeline
stages, no MoE layers). Where a rule is a pin it becomes one (``--virtual-stages 1``; ``--tp 1``
for an MoE model or when the frameworks pinned exclude deepspeed; ``--framework deepspeed
--pp 1`` when every ``--tp`` pinned exceeds 1), and pins that leave the trainer nothing are
refused before the search, naming the flags. What is left, tensor parallelism under deepspeed
only, is no product of pins, so the search's ranked list is filtered by the rule
(``planner.search.suggest.restrict``), asking for more plans until enough survive: the plans
kept are exactly the best the trainer runs.
"""

from __future__ import annotations

from typing import Any

from planner.cli.flags import cli_text
from planner.cli.options import parse_choice_list, parse_int_list
from planner.cost.parallel import FRAMEWORKS
from planner.errors import UserError, marked
from planner.run.rundir import TRAINER_TP_FRAMEWORK, TRAINER_VIRTUAL_STAGES, trainer_refusal

GROWTH = 8  # each further search asks for this many times more plans
MAX_TOP = 4096  # beyond this many plans, a rank the trainer runs is not worth the search time
_OTHER_ENTRY = "or pass --entry SCRIPT (e.g. Megatron-LM's pretrain_gpt.py) to search every plan"


def _no_dualpipe(opts: dict[str, Any]) -> None:
    if "dualpipev" in str(opts.get("pp_schedule") or "").lower().split(","):
        raise UserError("--pp-schedule dualpipev: the reference trainer (--entry builtin) pipelines with DeepSpeed's "
                        "PipelineModule (1F1B); DualPipeV is torchtitan's: add --framework torchtitan, "
                        f"{_OTHER_ENTRY}")


def trainer_pins(opts: dict[str, Any], is_moe: bool) -> list[str]:
    """Pin ``opts`` (the search flags, as given) to what the trainer runs; returns the pins added
    (``--virtual-stages 1``, ...) for messages. A UserError when the user's pins exclude it all."""
    added: list[str] = []

    def pin(key: str, value: str) -> None:
        if opts.get(key) is None:
            added.append(f"--{key.replace('_', '-')} {value}")
        opts[key] = value

    _no_dualpipe(opts)
    vs = parse_int_list("--virtual-stages", opts.get("virtual_stages"))
    if vs is not None and TRAINER_VIRTUAL_STAGES not in vs:
        raise UserError(f"--virtual-stages {opts['virtual_stages']}: the reference trainer (--entry builtin) runs "
                        "one contiguous pipeline chunk per stage (DeepSpeed's PipelineModule); pin "
                        f"--virtual-stages {TRAINER_VIRTUAL_STAGES}, {_OTHER_ENTRY}")
    pin("virtual_stages", str(TRAINER_VIRTUAL_STAGES))
    cp = parse_int_list("--cp", opts.get("cp"))
    if cp is not None and 1 not in cp:
        raise UserError(f"--cp {opts['cp']}: the reference trainer (--entry builtin) has no context-parallel "
                        f"attention; pin --cp 1, {_OTHER_ENTRY}")
    pin("cp", "1")
    if opts.get("ep_comm_overlap"):
        raise UserError("--ep-comm-overlap: the reference trainer (--entry builtin) runs DeepSpeed MoE, without "
                        f"Megatron-Core's expert all-to-all overlap; drop it, {_OTHER_ENTRY}")
    opts["ep_comm_overlap"] = False  # priced as the trainer runs its all-to-alls: exposed
    if opts.get("activation_offload") == "auto":
        raise UserError("--activation-offload auto: the reference trainer (--entry builtin) keeps its activations on "
                        f"the GPU (the offload is Transformer Engine's, under Megatron-Core); drop it, {_OTHER_ENTRY}")
    opts["activation_offload"] = "none"
    rep = parse_int_list("--dp-replicate", opts.get("dp_replicate"))
    if rep is not None:  # unpinned, the search is at 1 already
        if 1 not in rep:
            raise UserError(f"--dp-replicate {opts['dp_replicate']}: the reference trainer (--entry builtin) shards "
                            f"over every DP rank (DeepSpeed's ZeRO), not in replicated groups; pin --dp-replicate 1, "
                            f"{_OTHER_ENTRY}")
        opts["dp_replicate"] = "1"
    tp = parse_int_list("--tp", opts.get("tp"))
    frameworks = parse_choice_list("--framework", opts.get("framework"), FRAMEWORKS)
    no_autotp = is_moe or (frameworks is not None and TRAINER_TP_FRAMEWORK not in frameworks)
    if no_autotp:
        if tp is not None and 1 not in tp:
            if is_moe:
                raise UserError(f"--tp {opts['tp']}: the reference trainer (--entry builtin) shards tensors only with "
                                f"DeepSpeed's AutoTP, which does not run on an MoE model; pin --tp 1, {_OTHER_ENTRY}")
            ds = TRAINER_TP_FRAMEWORK
            raise UserError(f"--tp {opts['tp']} with --framework {opts['framework']}: the reference trainer (--entry "
                            f"builtin) shards tensors only with DeepSpeed's AutoTP (--framework {ds}); pin --tp 1 or "
                            f"--framework {ds}, {_OTHER_ENTRY}")
        pin("tp", "1")
    elif tp is not None and 1 not in tp:
        pp = parse_int_list("--pp", opts.get("pp"))
        if pp is not None and 1 not in pp:
            raise UserError(f"--tp {opts['tp']} with --pp {opts['pp']}: the reference trainer (--entry builtin) runs "
                            f"tensor parallelism (DeepSpeed's AutoTP) only without pipeline stages; pin --tp 1 or "
                            f"--pp 1, {_OTHER_ENTRY}")
        pin("framework", TRAINER_TP_FRAMEWORK)
        pin("pp", "1")
    return added


def trainer_search(opts: dict[str, Any], is_moe: bool, need: int):
    """The search of ``opts`` (``run_suggest``'s options, ``top`` aside) restricted to the plans the
    trainer runs, with at least ``need`` of them where that many fit."""
    from planner.cli.suggest import run_suggest
    from planner.search.suggest import NoPlanFits, restrict

    opts = dict(opts)
    added = trainer_pins(opts, is_moe)

    def runs(ranked: Any) -> bool:
        c = ranked.plan.cfg
        return trainer_refusal(c.framework, c.tp, c.pp, c.virtual_stages, is_moe, c.cp, c.dp_replicate,
                               c.activation_offload) is None

    top = need
    while True:
        try:
            result = run_suggest({**opts, "top": top})
        except UserError as err:  # nothing fits, or the pins exclude it all: say which pins were ours
            if not added or not (isinstance(err, NoPlanFits) or any(a.split()[0] in cli_text(err) for a in added)):
                raise
            raise UserError(f"{marked(err)} (--entry builtin searches only what the reference trainer runs, "
                            f"as if given {' '.join(added)}; {_OTHER_ENTRY})") from None
        kept = restrict(result, runs)
        if len(kept.plans) >= need or len(result.plans) < top or top >= MAX_TOP:
            break
        top = min(top * GROWTH, MAX_TOP)
    if not kept.plans:
        first = result.plans[0].plan.cfg
        refusal = trainer_refusal(first.framework, first.tp, first.pp, first.virtual_stages, is_moe, first.cp,
                                  first.dp_replicate, first.activation_offload)
        raise UserError(f"--entry builtin: the reference trainer runs none of the {len(result.plans)} best plans "
                        f"that fit (the best: {cli_text(refusal or '')}); pin --tp 1, or --framework "
                        f"{TRAINER_TP_FRAMEWORK} --pp 1, {_OTHER_ENTRY}")
    return kept
