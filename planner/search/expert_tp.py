"""The expert-TP choices a search tries, each searched on its own and ranked with the rest
(suggest.py), as the context-parallel splits are: the routed experts on the attention's TP
ranks (Megatron-Core's default), or folded out of TP (expert TP 1, MoE parallel folding:
Liu et al. 2025, arXiv:2504.14960), where EP takes the TP ranks too."""

from __future__ import annotations

from planner.cost.framework_rules import EXPERT_TP_RUNTIMES
from planner.model.spec import ModelSpec
from planner.search.space import Constraints


def expert_tp_choices(cons: Constraints, model: ModelSpec) -> list[tuple[int | None, bool]]:
    """The expert-TP searches (``etp``, whether tp 1 is in it): the experts on the attention's
    TP (None) and, for a mixture-of-experts model where tp > 1 is allowed, folded out of it (1)
    without tp 1, which the first search has; ``constraints.etp`` pins either (None: "tp")."""
    folds = model.is_moe and (cons.tp is None or any(t > 1 for t in cons.tp))
    frameworks_fold = cons.framework is None or bool(set(EXPERT_TP_RUNTIMES) & set(cons.framework))
    if cons.etp is not None:
        return [(e, True) for e in dict.fromkeys(cons.etp)] if model.is_moe else [(None, True)]
    return [(None, True), (1, False)] if folds and frameworks_fold else [(None, True)]
