"""The largest inputs dsplan plans for: one table, each bound with the reason for its size.

Every count and size a user gives, as a flag, a Python argument, a config.json key or a
hardware YAML field, is checked against this table where it enters: the CLI's parse
functions, planner/api.py, the hardware profile's fields (planner/hardware/profile.py) and
the config importer (planner/model/hf_keys.py). Past a bound an input is a typo or a fuzzer,
never a cluster or a model: the largest clusters built hold about 10^5 GPUs and the largest
published models about 2 x 10^12 parameters, and every bound here leaves at least ten times
that room. Within the bounds the arithmetic stays exact (int64 and float64 never overflow)
and the search stays quick (its divisor loops are O(sqrt n) in the global batch and the GPU
count); without them a mistyped ``--global-batch $((2**62))`` searched for hours and
``nics: count: 2**64`` built a graph that never finished.

Checks are O(1) per input (``nesting`` is one pass over a parsed file) and import nothing
beyond planner.errors, so every entry point can afford them. Messages name the input with
``arg`` (the CLI spells its flag) and state the bound and its reason.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import UserError, arg


@dataclass(frozen=True)
class Bound:
    """The largest value an input may take, its unit as a message says it, and why."""

    most: int
    unit: str
    why: str


# -- the cluster -----------------------------------------------------------------------------
# The most GPUs in one cluster: ten times the largest built (xAI Colossus, ~2 x 10^5 GPUs in 2025).
MAX_GPUS = 2**20
# The most GPUs one node (one NVLink or xGMI domain) may hold: NVIDIA's largest announced NVLink
# domain, Rubin Ultra NVL576. The intra-node router prices every pair of a node's GPUs.
MAX_GPUS_PER_NODE = 576
# Compute NICs per node: two per GPU (a dual-rail design) of the largest node.
MAX_NICS_PER_NODE = 2 * MAX_GPUS_PER_NODE
# Ports of one network switch: NVIDIA Quantum-X800 has 144, Broadcom Tomahawk 5 at 100G 512.
MAX_SWITCH_RADIX = 4096

# A hardware profile's rates, latencies and memories (hardware_profiles/README.md): a thousand
# times the fastest parts (B200: 2,250 dense bf16 TFLOP/s, 8 TB/s of HBM; 800 Gb/s NICs), a
# second per hop, a PiB of memory, 2**16 CPU cores a node; leaves per uplink at most 64.
MAX_RATE = 1e6
MAX_LATENCY_US = 1e6
MAX_MEMORY_GIB = float(2**20)
MAX_CPU_CORES = 2**16
MAX_OVERSUBSCRIPTION = 64.0
# A calibration factor (dsplan calibrate) scales an achieved rate: a hundredfold either way is
# far past any measured miss (the published ones stay within 2x) and keeps the rates positive.
MAX_CALIBRATION_FACTOR = 100.0
MIN_CALIBRATION_FACTOR = 1.0 / MAX_CALIBRATION_FACTOR

# -- the workload ----------------------------------------------------------------------------
# Samples per optimizer step: published runs use at most ~16K samples (DeepSeek-V3: 15,360 of
# 4K tokens; Llama 3 405B: 16M tokens in 2K-sample steps); 2**24 is a thousand times that.
MAX_GLOBAL_BATCH = 2**24
# Tokens per sample: four times the longest published training sequences (~256K tokens).
MAX_SEQ_LEN = 2**20
# Tokens per optimizer step: ~60 times the largest published (DeepSeek-V3's ~63M).
MAX_TOKENS_PER_STEP = 2**32

# -- the model -------------------------------------------------------------------------------
MAX_LAYERS = 4096  # the deepest published models have ~200 layers; each becomes a block the planner walks
MAX_HIDDEN = 2**17  # six times MT-NLG's 20,480, the widest published
MAX_FFN = 2**20  # the MLP's width: ten times PaLM's 73,728
MAX_HEADS = 2**14  # attention heads: a hundred times the most published (128)
MAX_VOCAB = 2**24  # sixty times the largest published vocabularies (Gemma's 256K)
MAX_EXPERTS = 2**16  # routed experts: a hundred times DeepSeek-V3's 256 and Kimi K2's 384
MAX_POSITIONS = 2**30  # a config's context window: a hundred times the longest published (10M)
MAX_PARAMS = 2**50  # about 10^15 parameters: five hundred times the largest published models
MAX_CONFIG_INT = 2**20  # any other integer of a config.json (image sizes, patches, ratios, ...)
MAX_NESTING = 64  # levels of a JSON or YAML file: a config.json needs 3, a profile 3

# The largest value of a config.json integer, by what it counts (planner/model/hf_keys.py
# maps each key to one); any other integer (image sizes, patches, ratios) is at most MAX_CONFIG_INT.
MODEL_BOUNDS: dict[str, Bound] = {
    "layers": Bound(MAX_LAYERS, "layers", "the deepest published models have ~200"),
    "width": Bound(MAX_HIDDEN, "", "six times the widest published model, MT-NLG's 20,480"),
    "ffn": Bound(MAX_FFN, "", "ten times the widest published MLP, PaLM's 73,728"),
    "heads": Bound(MAX_HEADS, "heads", "a hundred times the most published, 128"),
    "vocab": Bound(MAX_VOCAB, "tokens", "sixty times the largest published vocabulary, 256K"),
    "experts": Bound(MAX_EXPERTS, "experts", "a hundred times the most published, 384"),
    "positions": Bound(MAX_POSITIONS, "tokens", "a hundred times the longest published context, 10M"),
    "other": Bound(MAX_CONFIG_INT, "", "far above any published model's"),
}

# -- the run ---------------------------------------------------------------------------------
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week without a step or a log line is not a slow job
MAX_GRACE_S = 3600.0  # an hour between SIGTERM and SIGKILL


_GPUS = Bound(MAX_GPUS, "GPUs", "ten times the largest cluster built, ~2 x 10^5 GPUs")
_SAMPLES = Bound(MAX_GLOBAL_BATCH, "samples", "a thousand times the largest published batches")

# Inputs by their API keyword (``planner.errors.arg``): the largest value each may take.
BOUNDS: dict[str, Bound] = {
    "nodes": Bound(MAX_GPUS, "nodes", "ten times the largest cluster built, ~2 x 10^5 GPUs"),
    "gpus": _GPUS,
    "gpus_per_node": Bound(MAX_GPUS_PER_NODE, "GPUs per node", "the largest NVLink domain, NVIDIA's NVL576"),
    "dp": _GPUS,
    "tp": _GPUS,
    "pp": _GPUS,
    "ep": _GPUS,
    "cp": _GPUS,
    "dp_replicate": _GPUS,
    "group_size": _GPUS,
    "global_batch": _SAMPLES,
    "micro_batch": _SAMPLES,
    "seq_len": Bound(MAX_SEQ_LEN, "tokens", "four times the longest published training contexts"),
    "tokens_per_step": Bound(MAX_TOKENS_PER_STEP, "tokens per step",
                             "sixty times the largest published, DeepSeek-V3's ~63M"),
    "images_per_sample": Bound(MAX_SEQ_LEN, "images", "each takes tokens of a sample of at most 2**20"),
    "tiles_per_image": Bound(MAX_SEQ_LEN, "tiles", "each takes tokens of a sample of at most 2**20"),
    "virtual_stages": Bound(MAX_LAYERS, "chunks per rank", "each holds a layer of at most 4,096"),
    "top": Bound(10_000, "plans", "more than a table can show; planner.explore lists every candidate"),
    "rank": Bound(10_000, "plans", "the search ranks at most that many"),
    "bytes": Bound(2**40, "bytes", "1 TiB, more than any GPU's memory"),
}


# Why a hardware profile's field has its bound (planner/hardware/load.py adds it to pydantic's
# "Input should be less than or equal to ..."): by field name, then by the unit its name ends in.
_PROFILE_WHY = {
    "gpus": "the largest NVLink domain, NVIDIA's NVL576",
    "count": "two NICs per GPU of the largest node",
    "gpus_per_nic": "the GPUs of the largest node",
    "links_per_gpu": "the GPUs of the largest node",
    "gpus_per_pcie_switch": "the GPUs of the largest node",
    "switch_radix": "ports of a switch: the largest have 144 to 512",
    "cpu_cores": "cores of a node",
    "oversubscription": "leaf downlinks per uplink",
    "peak_TFLOPs": "a thousand times the fastest GPU's",
}
_UNIT_WHY = {"_GBps": "a thousand times the fastest link or memory", "_gbit": "a thousand times the fastest NIC",
             "_us": "a second", "_GiB": "a PiB", "_W": "a megawatt"}


def profile_why(field: str) -> str | None:
    """Why a hardware profile's ``field`` is bounded where it is (None: not a bounded field)."""
    if field in _PROFILE_WHY:
        return _PROFILE_WHY[field]
    return next((why for unit, why in _UNIT_WHY.items() if field.endswith(unit)), None)


def shown(value: Any) -> str:
    """``value`` as a message shows it: 12,345; a power of two as 2**62; a huge number by its
    size (Python refuses to print an int of over 4,300 digits)."""
    if isinstance(value, str) and value.isdigit() and len(value) > 15:  # an int too long to convert
        return f"a {len(value):,}-digit number"
    if isinstance(value, bool) or not isinstance(value, int):
        text = repr(value)
        return text if len(text) <= 40 else f"{text[:30]}... ({len(text):,} characters)"
    if abs(value) < 10**15:
        return f"{value:,}"
    if value > 0 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    if abs(value) < 10**300:
        return f"{value:.3g}"
    digits = int(abs(value).bit_length() * math.log10(2)) + 1
    return f"a {'negative ' if value < 0 else ''}{digits:,}-digit number"


def shown_text(text: str, most: int = 60) -> str:
    """A user's name or path, quoted, cut to ``most`` characters so the message stays one line."""
    if len(text) <= most:
        return repr(text)
    return f"{text[:most]!r}... ({len(text):,} characters)"


def shown_path(path: Any) -> str:
    """A path as a message names it: as it is, unless too long for one line."""
    text = str(path)
    return text if len(text) <= 200 else shown_text(text)


def path_kind(path: Path) -> str | None:
    """"file", "dir" or None for what ``path`` names; None too where the name cannot be a path
    at all (too long for the file system, a NUL byte): such a ``--model`` or ``--hardware`` is
    an unknown name, not an OSError."""
    try:
        return "file" if path.is_file() else "dir" if path.is_dir() else None
    except (OSError, ValueError):
        return None


def above(name: str, value: Any, bound: Bound | None = None) -> str:
    """The message for ``value`` of input ``name`` over its bound."""
    b = bound or BOUNDS[name]
    return (f"{arg(name)}: {shown(value)} is above the largest supported {b.most:,} {b.unit} ({b.why}); "
            f"give at most {b.most:,}")


def count(name: str, value: Any, low: int = 1) -> int:
    """``value`` as an int from ``low`` to the bound of input ``name`` (BOUNDS), else a
    UserError naming the input (below ``low`` in planner.errors.whole_number's words; above
    the bound with the bound and why)."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < low:
        raise UserError(f"{arg(name)}: need a whole number >= {low}, got {shown(value)}")
    if number > BOUNDS[name].most:
        raise UserError(above(name, number))
    return number


def tokens_per_step(global_batch: int, seq_len: int) -> None:
    """global_batch x seq_len within MAX_TOKENS_PER_STEP, else a UserError naming both."""
    tokens = global_batch * seq_len
    b = BOUNDS["tokens_per_step"]
    if tokens > b.most:
        raise UserError(f"{arg('global_batch')} {global_batch:,} x {arg('seq_len')} {seq_len:,} = {tokens:,} tokens "
                        f"per step is above the largest supported {b.most:,} ({b.why}); use a smaller batch "
                        "or sequence")


def nesting(data: Any, source: str, most: int = MAX_NESTING) -> None:
    """Refuse ``data`` (parsed JSON or YAML) nested more than ``most`` containers deep, level
    by level without recursing: a deep file fails here, in one message naming ``source``, not
    in a RecursionError later. Containers shared through YAML aliases (or cycles) are walked once."""
    level: list = [data] if isinstance(data, (dict, list)) else []
    seen: set[int] = set()
    for _ in range(most):
        deeper: list = []
        for item in level:
            if id(item) not in seen:
                seen.add(id(item))
                deeper.extend(v for v in (item.values() if isinstance(item, dict) else item)
                              if isinstance(v, (dict, list)))
        if not deeper:
            return
        level = deeper
    raise UserError(f"{source}: nested more than {most} levels deep; dsplan reads files nested at most {most} "
                    "levels (a Hugging Face config.json or a hardware profile needs 3 or 4): fix the file")
