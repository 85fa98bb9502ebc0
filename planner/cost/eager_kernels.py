"""What torchtitan's uncompiled blocks and loss move through HBM beyond the fused kernels.

transformer_layers prices a block's elementwise work as fused kernels, each reading its inputs
and writing its output once (Transformer Engine's in Megatron-LM, inductor's under
torch.compile). Eager PyTorch runs every aten op of torchtitan's llama3 block as a kernel of its
own, with fp32 upcasts in between: torchtitan without ``compile.enable``, and the stages of a
DualPipeV pipeline, which PyTorch cannot run compiled (torchtitan then compiles the loss only).

Bytes read plus written per element, forward and by autograd's kernels backward, of the ops in
torchtitan 0.2.2's models/llama3/model/model.py (the same ops at 9dec370, December 2024), bf16
activations. tests/test_eager_kernels.py counts them by running those functions under a
TorchDispatchMode:

- SwiGLU ``silu(w1(x)) * w3(x)`` per FFN element: silu (read 2, write 2), mul (4, 2); backward
  two muls (4, 2 each) and silu_backward (4, 2). Fused: read gate and up, write the product.
- RoPE ``apply_rotary_emb`` per query / key element: upcast to fp32 (2, 4), complex multiply
  (4, 4), downcast (4, 2); backward the same three kernels. Fused: read and write once.
- RMSNorm: PyTorch 2.8 and later run ``aten::_fused_rms_norm`` (pytorch/pytorch#153666), which
  costs what the fused price says; before it ``aten::rms_norm`` was a composite: upcast, pow,
  mean, rsqrt, mul, downcast, weight mul, and some 16 kernels backward.
- Cross-entropy ``F.cross_entropy(logits.float(), labels)`` per logit: upcast (2, 4),
  log_softmax (4, 4), nll (reads one logit a row); backward nll_loss_backward (writes 4),
  log_softmax backward (8, 4), downcast (4, 2). Fused: layers._lm_head's 30 bytes.

Each extra is the eager bytes less the fused price, forward and backward apart (the fused
backward is twice the forward: block_times).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from planner.errors import name_list

# torchtitan's compile.components: what inductor compiles (Workload.compile).
CompileComponent = Literal["model", "loss"]
COMPILE_COMPONENTS: tuple[CompileComponent, ...] = ("model", "loss")


class Bytes(NamedTuple):
    """Bytes read plus written per element, forward and backward."""

    fwd: float
    bwd: float

    def __sub__(self, other: "Bytes") -> "Bytes":  # type: ignore[override]
        return Bytes(self.fwd - other.fwd, self.bwd - other.bwd)


def _fused(fwd: float) -> Bytes:
    """A fused kernel as transformer_layers prices it: backward twice the forward."""
    return Bytes(fwd, 2.0 * fwd)


SWIGLU = Bytes(10.0, 18.0)
ROPE = Bytes(20.0, 20.0)
RMS_NORM_COMPOSITE = Bytes(36.0, 96.0)  # aten::rms_norm before PyTorch 2.8
CROSS_ENTROPY = Bytes(2.0 + 18.0, 26.0)  # the head GEMM's 16-bit logits written, then the fp32 loss
# What transformer_layers / layers price for the same work, forward (ACT-byte reads and writes).
FUSED = {"swiglu": _fused(6.0), "rope": _fused(4.0), "rms_norm": _fused(4.0), "cross_entropy": _fused(30.0 / 3.0)}


class Eager(NamedTuple):
    """What runs uncompiled (Workload.compile, Workload.pp_schedule) and on which PyTorch."""

    blocks: bool  # the transformer blocks' elementwise ops
    loss: bool  # the fp32 cross-entropy
    composite_norm: bool = False  # RMSNorm as aten's composite (PyTorch before 2.8)

    def block_extra(self, swiglu: float, rope: float, rms_norm: float) -> Bytes:
        """Extra bytes of a block's eager kernels over ``swiglu`` FFN, ``rope`` query / key and
        ``rms_norm`` normalized elements (per sample on one GPU)."""
        if not self.blocks:
            return Bytes(0.0, 0.0)
        norm = RMS_NORM_COMPOSITE - FUSED["rms_norm"] if self.composite_norm else Bytes(0.0, 0.0)
        parts = ((SWIGLU - FUSED["swiglu"], swiglu), (ROPE - FUSED["rope"], rope), (norm, rms_norm))
        return Bytes(sum(b.fwd * n for b, n in parts), sum(b.bwd * n for b, n in parts))

    def loss_extra(self, logits: float) -> Bytes:
        """Extra bytes of the eager cross-entropy over ``logits`` (per sample on one GPU)."""
        if not self.loss:
            return Bytes(0.0, 0.0)
        d = CROSS_ENTROPY - FUSED["cross_entropy"]
        return Bytes(d.fwd * logits, d.bwd * logits)


def compiled_components(compiled: "Sequence[str]", dualpipev: bool) -> tuple[str, ...]:
    """What torch.compile covers in the run: the components asked for (Workload.compile) but the
    blocks of DualPipeV's stages, which ScheduleDualPipeV refuses compiled
    (_check_torch_compile_compatibility): torchtitan's compile.components as emitted."""
    return tuple(c for c in compiled if not (c == "model" and dualpipev))


def eager_of(compiled: tuple[str, ...], composite_norm: bool, dualpipev: bool) -> Eager | None:
    """What runs eager: what ``compiled_components`` leaves out. None: all compiled."""
    covered = compiled_components(compiled, dualpipev)
    blocks, loss = "model" not in covered, "loss" not in covered
    return Eager(blocks, loss, composite_norm) if blocks or loss else None


def parse_compile(value: "str | Sequence[str] | None") -> tuple[CompileComponent, ...]:
    """Workload.compile from a comma list of torchtitan's compile components ("model,loss"),
    or "none"; None: both, as dsplan's torchtitan configs compile them."""
    if value is None:
        return COMPILE_COMPONENTS
    if isinstance(value, str) and value.strip().lower() == "none":
        return ()
    return name_list("compile", value, COMPILE_COMPONENTS, "component",  # type: ignore[return-value]
                     "what torchtitan's torch.compile covers; or none")


def eager_words(compiled: "Sequence[str]", rms_norm_kernel: str, dualpipev: bool) -> str:
    """What runs eager, for a plan's header line ("" when everything is compiled)."""
    eager = eager_of(tuple(compiled), rms_norm_kernel == "composite", dualpipev)
    if eager is None:
        return ""
    parts = [p for p, on in (("blocks", eager.blocks), ("loss", eager.loss)) if on]
    norm = " (composite RMSNorm)" if eager.blocks and eager.composite_norm else ""
    return f"eager {' and '.join(parts)}{norm}"
