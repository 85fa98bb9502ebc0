"""Precision recipes: the working precision, and the low-precision format the linear layers'
GEMMs run in under Transformer Engine (TE), with what each recipe adds.

``--precision`` names one of ``PRECISIONS``. ``bf16``, ``fp16`` and ``fp32`` are plain mixed (or
full) precision. The others are TE recipes on top of bf16 training (Megatron-Core's
``--fp8-format/--fp8-recipe`` and ``--fp4-format/--fp4-recipe``; megatron/core/enums.py
Fp8Recipe, Fp4Recipe):

- ``fp8-delayed``: per-tensor scales from an amax history, so the cast needs no pass of its
  own (the amax is taken in the same kernel) (TE DelayedScaling);
- ``fp8-tensorwise``: per-tensor *current* scaling, so each tensor is read once for its amax
  before the cast (TE Float8CurrentScaling);
- ``fp8-blockwise``: DeepSeek-V3's 1x128 activation and 128x128 weight blocks, one fp32 scale
  per block, amax and cast in one pass (TE Float8BlockScaling; DeepSeek-V3 report sec. 3.3.2);
- ``mxfp8``: OCP microscaling, 32-element blocks with an E8M0 scale each, in Blackwell's
  tensor cores (TE MXFP8BlockScaling; OCP MX spec v1.0);
- ``nvfp4``: E2M1 values in 16-element blocks with an E4M3 scale each plus a per-tensor
  fp32 scale, hence an amax pass; a random Hadamard transform before the wgrad GEMM's
  operands (NVIDIA, "Pretraining LLMs with NVFP4", arXiv:2509.25149, sec. 4).

What a recipe changes in the cost model, and nothing else:

- the linear layers' GEMMs of transformer layers (fprop, dgrad and wgrad: TE runs all three in
  the recipe) run at the GPU's peak for the format; attention's score and value products,
  the router and the LM head stay bf16 (Megatron keeps the output layer outside TE's autocast);
- quantizing each GEMM input is memory-bound work: read the bf16 tensor (twice when a
  per-tensor amax is needed first), write a row-wise and a column-wise quantized copy (the
  forward GEMM and the wgrad GEMM want the two layouts), plus the block scales;
- TE saves the quantized copy of each linear input for backward, not the bf16 tensor;
- the quantized weights (both layouts) are cached across the micro-batches of a step (Megatron
  passes ``is_first_microbatch``: megatron/core/extensions/transformer_engine.py), memory held
  for the whole step, and cast once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import UserError, arg

# The working precisions and the recipes, in the order --help lists them.
BASE_PRECISIONS: tuple[str, ...] = ("bf16", "fp16", "fp32")
RECIPE_NAMES: tuple[str, ...] = ("fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4")
PRECISIONS: tuple[str, ...] = BASE_PRECISIONS + RECIPE_NAMES


@dataclass(frozen=True, slots=True)
class Recipe:
    """One low-precision recipe: its GEMM format and the bytes its quantization moves and keeps."""

    name: str
    gemm_format: str  # the peak_TFLOPs key its GEMMs run at: "fp8" or "fp4"
    value_bytes: float  # bytes of one quantized element
    block: int  # elements per scale (0: one scale per tensor)
    scale_bytes: int  # bytes of one scale
    amax_pass: bool  # a read of the bf16 tensor for its amax before the cast
    needs_microscaling: bool  # MX / NVFP4 block scales live in Blackwell's tensor cores
    megatron_flags: tuple[tuple[str, str], ...]  # Megatron-LM's flags for it
    # The model's weights kept only in the recipe's format, all-gathered in it by the distributed
    # optimizer (Megatron-Core --fp8-param-gather): Megatron-Bridge's delayed, current-scaling
    # and MXFP8 recipes turn it on, its blockwise one off (megatron/bridge/training/mixed_precision.py).
    param_gather: bool = False

    @property
    def element_bytes(self) -> float:
        """Bytes per quantized element, scales included."""
        return self.value_bytes + (self.scale_bytes / self.block if self.block else 0.0)

    def quantize_bytes_per_element(self) -> float:
        """HBM bytes to quantize one bf16 element into both layouts (the roofline's memory side)."""
        reads = 2 * (2 if self.amax_pass else 1)
        return reads + 2 * self.element_bytes

    @property
    def weight_cache_bytes(self) -> float:
        """Bytes per linear weight of its cached quantized copies (row-wise and column-wise)."""
        return 2 * self.element_bytes


_FP8 = (("--fp8-format", "hybrid"),)  # e4m3 forward, e5m2 gradients (TE's Format.HYBRID)
RECIPES: dict[str, Recipe] = {
    "fp8-delayed": Recipe("fp8-delayed", "fp8", 1, 0, 4, False, False, _FP8 + (("--fp8-recipe", "delayed"),), True),
    "fp8-tensorwise": Recipe("fp8-tensorwise", "fp8", 1, 0, 4, True, False,
                             _FP8 + (("--fp8-recipe", "tensorwise"),), True),
    "fp8-blockwise": Recipe("fp8-blockwise", "fp8", 1, 128, 4, False, False,
                            (("--fp8-format", "e4m3"), ("--fp8-recipe", "blockwise"))),
    # MXFP8 keeps e4m3 everywhere: the 32-element E8M0 scales give gradients their range.
    "mxfp8": Recipe("mxfp8", "fp8", 1, 32, 1, False, True, (("--fp8-format", "e4m3"), ("--fp8-recipe", "mxfp8")),
                    True),
    "nvfp4": Recipe("nvfp4", "fp4", 0.5, 16, 1, True, True, (("--fp4-format", "e2m1"), ("--fp4-recipe", "nvfp4"))),
}


def gathers_fp8_params(recipe: str | None, wanted: bool, framework: str, zero: int, offload: str = "none") -> bool:
    """Whether the recipe's GEMM weights are all-gathered in FP8: Megatron-Core's
    ``--fp8-param-gather`` (kept only in FP8) with the distributed optimizer (``zero`` 1) or
    Megatron-FSDP (``zero`` 3; arguments.py allows both), under a recipe that allows it, with
    optimizer CPU offload only under delayed scaling (arguments.py asserts it); or torchtitan's
    FSDP2 under torchao's tensorwise float8 (``enable_fsdp_float8_all_gather``: the fp32 shard
    cast to float8 before the gather, torchao float8/fsdp_utils.py; rowwise and MX have none)."""
    if recipe is None or not wanted:
        return False
    if framework == "torchtitan":
        return recipe == "fp8-tensorwise" and zero == 3 and offload == "none"
    return (RECIPES[recipe].param_gather and framework == "megatron" and zero in (1, 3)
            and (offload == "none" or recipe == "fp8-delayed"))


def split_precision(name: str) -> tuple[str, str | None]:
    """``--precision`` as (working precision, recipe): every TE recipe trains in bf16."""
    if name in RECIPES:
        return "bf16", name
    if name in BASE_PRECISIONS:
        return name, None
    raise UserError(f"{arg('precision')}: unknown value {name!r}; choose from {', '.join(PRECISIONS)}")


def unsupported(recipe: Recipe, peaks: dict[str, float], gpu: str) -> str | None:
    """Why ``gpu`` (its dense peaks by format) cannot run ``recipe``, or None when it can.

    FP8 tensor cores came with Hopper and Ada (sm_89/90); the microscaled formats (MXFP8,
    NVFP4) with Blackwell's fifth-generation tensor cores, the only ones with an FP4 rate."""
    if recipe.needs_microscaling and "fp4" not in peaks:
        return (f"{recipe.name} needs Blackwell's block-scaled tensor cores, which {gpu} does not have; use "
                f"fp8-tensorwise or fp8-blockwise (Hopper, Ada) or bf16")
    if recipe.gemm_format not in peaks:
        return (f"{recipe.name} needs {recipe.gemm_format.upper()} tensor cores (Hopper, Ada or newer), which "
                f"{gpu} does not have; use bf16")
    return None


def check_recipe(name: str, peaks: dict[str, float], gpu: str) -> None:
    """One clear error when the GPU cannot run the recipe ``name``."""
    recipe = RECIPES.get(name)
    if recipe is None:
        return
    why = unsupported(recipe, peaks, gpu)
    if why:
        raise UserError(f"{arg('precision')} {name}: {why}")

PRECISION_HELP = ("bf16, fp16, fp32, or a Transformer Engine recipe on bf16 (framework megatron): fp8-delayed, "
                  "fp8-tensorwise, fp8-blockwise (Hopper, Ada, Blackwell), mxfp8, nvfp4 (Blackwell).")
