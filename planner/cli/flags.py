"""How the command line spells the inputs the planner's messages name.

Below the CLI a message marks an input by its API keyword (``planner.errors.arg``); this is
the one table that turns each keyword into the flag that sets it, for every error, note and
piece of advice the CLI prints (``spell(text, FLAGS)``). Keywords missing here read as the
keyword (tests/test_error_names.py checks that every marked name has its flag).
"""

from __future__ import annotations

from typing import Any

from planner.errors import spell, spell_all

FLAGS: dict[str, str] = {
    "model": "--model",
    "hardware": "--hardware",
    "layer_profile": "--profile",
    "calibration": "--calibration",
    "nodes": "--nodes",
    "gpus_per_node": "--gpus-per-node",
    "dp": "--dp",
    "tp": "--tp",
    "pp": "--pp",
    "ep": "--ep",
    "etp": "--etp",
    "mtp_layers": "--mtp-layers",
    "cp": "--cp",
    "cp_comm": "--cp-comm",
    "flash_attention": "--flash-attention",
    "flash_version": "--flash-version",
    "zero": "--zero",
    "offload": "--offload",
    "micro_batch": "--micro-batch",
    "global_batch": "--global-batch",
    "seq_len": "--seq-len",
    "images_per_sample": "--images-per-sample",
    "tiles_per_image": "--tiles-per-image",
    "precision": "--precision",
    "optimizer": "--optimizer",
    "recompute": "--recompute",
    "sequence_parallel": "--sequence-parallel",
    "no_sequence_parallel": "--no-sequence-parallel",
    "virtual_stages": "--virtual-stages",
    "framework": "--framework",
    "allow_tp_across_nodes": "--allow-tp-across-nodes",
    "group_size": "--group-size",
    "draw": "--draw",
    "dot": "--dot",
    "top": "--top",
    "balancer": "--balancer",
    "objective": "--objective",
    "bytes": "--bytes",
    "rank": "--rank",
    "dp_replicate": "--dp-replicate",
    "moe_imbalance": "--moe-imbalance",
    "mtbf_hours": "--mtbf-hours",
    "precision_aware_optimizer": "--precision-aware-optimizer",
    "zero_pp": "--zeropp",
    "activation_offload": "--activation-offload",
    "no_ep_comm_overlap": "--no-ep-comm-overlap",
    "moe_dispatcher": "--moe-dispatcher",
    "moe_capacity_factor": "--moe-capacity-factor",
    "recompute_modules": "--recompute-modules",
    "pp_schedule": "--pp-schedule",
    "compile": "--compile",
    "rms_norm_kernel": "--rms-norm-kernel",
}


def cli_text(text: Any) -> str:
    """A message (str, Message or UserError) as the CLI prints it: inputs named by their flags."""
    return spell(text, FLAGS)


def cli_data(data: Any) -> Any:
    """JSON data with every Message in it (notes, advice, why) spelled with the flags."""
    return spell_all(data, FLAGS)
