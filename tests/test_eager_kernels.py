"""torchtitan's eager kernels (planner/cost/eager_kernels.py): the bytes per element the cost model
prices are the bytes torchtitan's own functions move, counted kernel by kernel under a
TorchDispatchMode; a plan left uncompiled pays them in its step, a compiled one does not; what
torch.compile covers reaches torchtitan's config and is torchtitan's alone."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from planner import api
from planner.cli import main
from planner.cost import eager_kernels as ek
from planner.cost import efficiency as eff

# Ops that move no bytes (views, aliases) or that the cost model prices elsewhere (the GEMMs).
_NOT_COUNTED = {"view", "_unsafe_view", "reshape", "t", "transpose", "expand", "permute", "view_as_complex",
                "view_as_real", "detach", "alias", "slice", "select", "unsqueeze", "squeeze", "_conj", "clone",
                "mm", "addmm", "bmm"}


class _Bytes(TorchDispatchMode):
    """Bytes each aten kernel reads (its tensor inputs) and writes (its tensor outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in _NOT_COUNTED:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.total += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _per_element(fn, inputs: list[torch.Tensor], elements: int) -> ek.Bytes:
    """Bytes per element of ``fn`` forward and of autograd's backward."""
    inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    with _Bytes() as fwd:
        out = fn(*inputs)
    grad = torch.ones_like(out)
    with _Bytes() as bwd:
        out.backward(grad)
    return ek.Bytes(fwd.total / elements, bwd.total / elements)


def _composite_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """aten::rms_norm before PyTorch 2.8 (aten/src/ATen/native/layer_norm.cpp, CompositeImplicit):
    upcast, rsqrt of the mean square, multiply, downcast, times the weight."""
    up = x.to(torch.float32)
    return up.mul(torch.rsqrt(up.pow(2).mean(-1, keepdim=True).add_(eps))).type_as(x).mul(weight)


TOKENS, HIDDEN = 512, 2048


def test_swiglu_bytes_are_torchtitans_feed_forward():
    model = pytest.importorskip("torchtitan.models.llama3.model.model")
    ffn = model.FeedForward(HIDDEN, 4 * HIDDEN, 256, None).to(torch.bfloat16)
    width = ffn.w1.out_features
    got = _per_element(ffn, [torch.randn(1, TOKENS, HIDDEN, dtype=torch.bfloat16)], TOKENS * width)
    assert got.fwd == pytest.approx(ek.SWIGLU.fwd, rel=0.01)
    # Backward also adds w1's and w3's input gradients (read 4, write 2 per hidden element), as a
    # compiled block does too: not an eager cost, in neither price.
    assert got.bwd == pytest.approx(ek.SWIGLU.bwd + 6 * HIDDEN / width, rel=0.01)


def test_rope_bytes_are_torchtitans_apply_rotary_emb():
    model = pytest.importorskip("torchtitan.models.llama3.model.model")
    heads, head_dim = 16, 128
    freqs = model.precompute_freqs_cis(head_dim, TOKENS)
    q = torch.randn(1, TOKENS, heads, head_dim, dtype=torch.bfloat16)
    got = _per_element(lambda x: model.apply_rotary_emb(x, x.detach(), freqs)[0], [q], q.numel())
    # the key's copy of the same kernels runs beside it (x.detach()): counted once per element each
    assert got.fwd / 2 == pytest.approx(ek.ROPE.fwd, rel=0.02)
    assert got.bwd == pytest.approx(ek.ROPE.bwd, rel=0.02)


def test_composite_rms_norm_bytes():
    x, w = torch.randn(1, TOKENS, HIDDEN, dtype=torch.bfloat16), torch.ones(HIDDEN, dtype=torch.bfloat16)
    got = _per_element(_composite_rms_norm, [x, w], x.numel())
    assert got.fwd == pytest.approx(ek.RMS_NORM_COMPOSITE.fwd, rel=0.01)
    assert got.bwd == pytest.approx(ek.RMS_NORM_COMPOSITE.bwd, rel=0.01)


def test_cross_entropy_bytes_are_torchtitans_loss():
    loss = pytest.importorskip("torchtitan.components.loss")
    vocab = 8192
    logits = torch.randn(1, TOKENS, vocab, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (1, TOKENS))
    got = _per_element(lambda x: loss.cross_entropy_loss(x, labels), [logits], logits.numel())
    written = 2.0  # the head GEMM's 16-bit logits, which the priced loss includes
    assert got.fwd + written == pytest.approx(ek.CROSS_ENTROPY.fwd, rel=0.01)
    assert got.bwd == pytest.approx(ek.CROSS_ENTROPY.bwd, rel=0.01)


def _plan(**kw):
    cluster = api.load_cluster("dgx-h100", nodes=1)
    return api.estimate("llama-3.1-8b", cluster, framework="torchtitan", zero=3, dp=8, micro_batch=1,
                        recompute="none", global_batch=8, seq_len=4096, **kw)


def test_an_uncompiled_step_pays_the_eager_bytes_over_hbm():
    """Per layer and token: SwiGLU over the FFN width, RoPE over the query and key heads, each
    RMSNorm over the hidden width (composite only); per logit the loss; at HBM speed."""
    base, eager, old = _plan(), _plan(compile="none"), _plan(compile="none", rms_norm_kernel="composite")
    model = api.load_model("llama-3.1-8b")
    layer = model.decoder_blocks[0]
    h, ffn = layer.hidden, layer.mlp.ffn
    rope = (layer.attention.heads + layer.attention.kv_heads) * layer.attention.head_dim
    per_token = sum(ek.SWIGLU - ek.FUSED["swiglu"]) * ffn + sum(ek.ROPE - ek.FUSED["rope"]) * rope
    vocab = next(b for b in model.blocks if b.kind == "lm_head").vocab
    loss = sum(ek.CROSS_ENTROPY - ek.FUSED["cross_entropy"]) * vocab
    tokens = 4096  # one sample of 4,096 tokens per GPU
    dev = eff.device(api.load_cluster("dgx-h100", nodes=1).profile)
    expected = float(eff.hbm_time((model.num_layers * per_token + loss) * tokens, dev))
    assert eager.step_time_s - base.step_time_s == pytest.approx(expected, rel=1e-6)
    norms = sum(ek.RMS_NORM_COMPOSITE - ek.FUSED["rms_norm"]) * h * (2 * model.num_layers + 1)
    assert old.step_time_s - eager.step_time_s == pytest.approx(float(eff.hbm_time(norms * tokens, dev)), rel=1e-6)
    assert _plan(compile="model,loss").step_time_s == base.step_time_s


def test_dualpipev_stages_run_eager_and_its_loss_compiled():
    assert ek.eager_of(("model", "loss"), False, dualpipev=True) == ek.Eager(blocks=True, loss=False)
    assert ek.eager_of(("model", "loss"), False, dualpipev=False) is None
    assert ek.eager_of((), True, dualpipev=False) == ek.Eager(True, True, True)


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def test_compile_is_torchtitans_and_bad_lists_exit_2():
    megatron = _cli("estimate", "--model", "llama-3.1-8b", "--framework", "megatron", "--compile", "none")
    assert megatron.exit_code == 2 and "--framework torchtitan" in megatron.output
    assert "Traceback" not in megatron.output
    bad = _cli("estimate", "--model", "llama-3.1-8b", "--framework", "torchtitan", "--zero", "3", "--compile", "graph")
    assert bad.exit_code == 2 and "--compile: unknown component 'graph'" in bad.output


def test_suggest_without_compile_searches_torchtitan_and_says_eager():
    result = _cli("suggest", "--model", "llama-3.1-8b", "--hardware", "dgx-h100", "--nodes", "1", "--compile", "none",
                  "--top", "3", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {p["framework"] for p in data["plans"]} == {"torchtitan"}
    assert all(p["compile"] == [] for p in data["plans"]) and data["inputs"]["compile"] == "none"
    text = _cli("suggest", "--model", "llama-3.1-8b", "--hardware", "dgx-h100", "--nodes", "1", "--compile", "model",
                "--top", "1")
    assert "eager loss" in " ".join(text.output.split())


def test_torchao_casts_in_eager_blocks_are_refused_not_priced():
    """torchao's float8 casts run eager where the blocks are not compiled; dsplan does not count
    them, so it says so (exit 2) rather than pricing them as the compiled casts."""
    base = ("estimate", "--model", "llama-3.1-8b", "--hardware", "dgx-h100", "--framework", "torchtitan", "--zero", "3",
            "--precision", "fp8-tensorwise")
    assert _cli(*base).exit_code == 0
    eager = _cli(*base, "--compile", "loss")
    assert eager.exit_code == 2 and "--compile model,loss" in eager.output
    dual = _cli(*base, "--pp", "2", "--pp-schedule", "dualpipev", "--global-batch", "64")
    assert dual.exit_code == 2 and "DualPipeV's stages" in dual.output and "--precision bf16" in dual.output
