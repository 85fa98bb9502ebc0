"""A mixture-of-experts router from a Hugging Face config: scoring, renormalisation, group-limited
routing, the routed scaling factor and the load-balancing loss, each read from the config's key
or, where the config leaves it out, the model class's default (transformers' configuration_*.py).
"""

from __future__ import annotations

from planner.model.hf_keys import ConfigReader
from planner.model.parts import Router

# Families whose softmax router keeps the full softmax over every expert unless told otherwise
# (Qwen2MoeConfig.norm_topk_prob defaults to False); Mixtral, Qwen3-MoE and gpt-oss renormalise
# over the top k (their model classes' routing).
_NOT_RENORMALISED = {"Qwen2-MoE"}
# router_aux_loss_coef when the config omits it: the config classes' defaults.
_AUX_DEFAULT = {"gpt-oss": 0.9}
# DeepSeek-V3 (aux-loss-free balancing, noaux_tc): a complementary sequence-wise loss of weight
# 0.0001 (DeepSeek-V3 report, sec. 2.1.2 and 4.2); DeepSeek-V2's expert-level loss 0.001
# (DeepseekV2Config.aux_loss_alpha default, seq_aux true).
_NOAUX_SEQ_ALPHA = 1e-4


def _given(lm: ConfigReader, read, key: str, default):
    """``read(key)`` where the config has the key, else the model class's ``default`` (a family
    fact like Family's, not listed in ModelSpec.defaulted: it changes the loss, not the cost)."""
    return read(key) if key in lm.config else default


def router_from_config(lm: ConfigReader, family: str) -> Router:
    """The router of an MoE language-model config (``family``: the Family name, for defaults).
    DeepSeek's keys (scoring_func, topk_method, n_group, ...) are read only for its families."""
    deepseek = family.startswith("DeepSeek")
    score = _given(lm, lm.get_str, "scoring_func", "softmax") if deepseek else "softmax"
    if score not in ("softmax", "sigmoid"):
        lm.fail("scoring_func", f"must be softmax or sigmoid, got {score!r}")
    method = _given(lm, lm.get_str, "topk_method", "greedy") if deepseek else "greedy"
    groups, group_topk = 1, 1
    if method in ("group_limited_greedy", "noaux_tc"):  # greedy: the group keys are inert
        groups, group_topk = _given(lm, lm.get_int, "n_group", 1), _given(lm, lm.get_int, "topk_group", 1)
    if group_topk > groups:
        lm.fail("topk_group", f"({group_topk}) exceeds n_group ({groups})")
    # DeepseekV2Config defaults norm_topk_prob to false, DeepseekV3Config (sigmoid) to true
    renormalise = _given(lm, lm.get_bool, "norm_topk_prob",
                         score == "sigmoid" if deepseek else family not in _NOT_RENORMALISED)
    if score == "sigmoid" and not renormalise:
        lm.fail("norm_topk_prob", "false with sigmoid scores has no Megatron-Core router to match; set it true")
    if deepseek:
        balance = "seq_aux_loss" if _given(lm, lm.get_bool, "seq_aux", True) else "aux_loss"
        coeff = _given(lm, lm.get_float, "aux_loss_alpha", _NOAUX_SEQ_ALPHA if method == "noaux_tc" else 1e-3)
    else:
        balance, coeff = "aux_loss", _given(lm, lm.get_float, "router_aux_loss_coef", _AUX_DEFAULT.get(family, 1e-3))
    return Router(score=score, renormalise=renormalise, groups=groups, group_topk=group_topk,
                  scaling=_given(lm, lm.get_float, "routed_scaling_factor", 1.0), balance=balance, aux_coeff=coeff)
