"""Activation recomputation in the reference model the trainer builds, measured, on CPU.

tests/test_trainer.py can only read back ``run_info["recompute"]``, which the trainer copies from
the plan. Here the model is built as the trainer builds it (``scale_spec`` of the preset, then
``ReferenceForCausalLM(small, ep_size, tiles, recompute)``; batches from ``SyntheticData``) with
each recompute mode, and one forward pass is measured: every tensor autograd saves for backward
goes through ``torch.autograd.graph.saved_tensors_hooks``, and the inputs each
``torch.utils.checkpoint.checkpoint`` call holds on to (which are kept by the checkpoint, not
saved through the hooks) are recorded by a pass-through wrapper around the real function. Memory
is counted once per storage, parameters and scalars left out, and attributed to the layer whose
forward was running.

What the modes mean (Chen et al. 2016; Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 5; Megatron-LM ``--recompute-granularity``):
``full`` keeps only each transformer layer's input and recomputes the layer in backward;
``selective`` recomputes only the attention core (softmax(QK^T)V), whose own saved tensors
(attention output and softmax statistics, or the probabilities on the math path) are dropped;
``none`` keeps everything. Recomputation changes memory, never the numbers: the loss and every
gradient must be the same in all three modes.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from planner.model.load import load_model
from planner.model.spec import DecoderBlock, VisionBlock, VisionEmbedBlock
from planner.run import model_layers
from planner.run.data import SyntheticData
from planner.run.model_builder import ReferenceForCausalLM, tiles_per_sample
from planner.run.model_scale import TINY, scale_spec

MODES = ("none", "selective", "full")
SEED = 1234
MICRO_BATCH = 2
TEXT_TOKENS = 64  # sequence positions after any image tokens
FP32 = 4

# One preset per attention and layer kind the trainer builds: GQA + RMSNorm + SwiGLU (Llama),
# MHA + learned positions + LayerNorm + GELU (GPT-3), a ViT tower before a dense GQA decoder
# (Qwen2-VL), MLA with a dense first layer and DeepSpeed MoE layers (DeepSeek-V2-Lite).
MODELS = ("llama-3.1-8b", "gpt3-125m", "qwen2-vl-7b", "deepseek-v2-lite")


class Measured:
    """One forward + backward of one mode: saved bytes per layer, loss, gradients."""

    def __init__(self, per_layer: dict[int | None, int], loss: float, grads: dict[str, torch.Tensor]):
        self.per_layer, self.loss, self.grads = per_layer, loss, grads

    @property
    def total(self) -> int:
        return sum(self.per_layer.values())


def build(name: str):
    """The trainer's model inputs for ``name`` at the tiny scale (trainer.main, single process)."""
    small = scale_spec(load_model(name), TINY).spec
    tiles = tiles_per_sample(small, 0, 0)
    image_tokens = tiles * small.vision.tokens_per_tile if small.vision else 0
    embed = next((b for b in small.blocks if isinstance(b, VisionEmbedBlock)), None)
    data = SyntheticData(vocab=small.vocab, seq_len=image_tokens + TEXT_TOKENS, micro_batch=MICRO_BATCH,
                         image_tokens=image_tokens, tiles=tiles,
                         patches_per_tile=small.vision.patches_per_tile if small.vision else 0,
                         patch_pixels=embed.patch_pixels if embed else 0, seed=SEED)
    return small, tiles, data


def measure(name: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> Measured:
    small, tiles, data = build(name)
    torch.manual_seed(SEED)
    model = ReferenceForCausalLM(small, ep_size=1, tiles=tiles, recompute=mode)
    inputs, labels = data.batch(1, 0, 0)

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    per_layer: dict[int | None, int] = defaultdict(int)
    current: list[int | None] = [None]

    def account(t: torch.Tensor) -> None:
        if not t.is_floating_point() or t.dim() == 0:
            return  # token ids ride along, and 0-d losses are noise
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in params or ptr in seen:
            return
        seen.add(ptr)
        per_layer[current[0]] += storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        account(t)
        return t

    def recording_checkpoint(fn, *args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor):
                account(a)
        return torch_checkpoint(fn, *args, **kwargs)

    monkeypatch.setattr(model_layers, "checkpoint", recording_checkpoint)
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda _m, _a, _o: current.__setitem__(0, None))

    torch.manual_seed(SEED)  # the MoE gate draws noise: same draws in every mode
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs, labels)
    loss.backward()
    monkeypatch.undo()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Measured(dict(per_layer), float(loss.detach()), grads)


@pytest.fixture(scope="module", params=MODELS)
def measured(request) -> tuple[str, dict[str, Measured]]:
    with pytest.MonkeyPatch.context() as mp:
        runs = {mode: measure(request.param, mode, mp) for mode in MODES}
    return request.param, runs


def recomputed_layers(name: str) -> list[tuple[int, object]]:
    small, _, _ = build(name)
    return [(i, b) for i, b in enumerate(small.blocks) if isinstance(b, (DecoderBlock, VisionBlock))]


def input_bytes(name: str, block) -> int:
    """The one activation a transformer layer takes in: micro x tokens x width, fp32."""
    small, tiles, data = build(name)
    if isinstance(block, VisionBlock):
        return MICRO_BATCH * tiles * small.vision.patches_per_tile * block.hidden * FP32
    return MICRO_BATCH * data.seq_len * block.hidden * FP32


def test_saved_activations_fall_from_none_to_selective_to_full(measured):
    name, runs = measured
    none, selective, full = (runs[m].total for m in MODES)
    assert full < selective < none, f"{name}: saved bytes none {none}, selective {selective}, full {full}"


def test_full_recompute_keeps_only_each_layers_input(measured):
    name, runs = measured
    layers = recomputed_layers(name)
    assert layers
    for i, block in layers:
        assert runs["full"].per_layer.get(i, 0) == input_bytes(name, block), f"{name} layer {i} ({block.kind})"
        # none keeps the input too, and everything after it
        assert runs["none"].per_layer[i] > input_bytes(name, block)


def test_selective_recompute_drops_the_attention_core_of_every_layer(measured):
    """The core's backward needs at least its softmax statistics: one float per head and query
    (the log-sum-exp a fused kernel keeps; the math path keeps whole probability rows). Selective
    recompute drops at least that much per layer, and keeps the rest of the layer's saves."""
    name, runs = measured
    small, tiles, data = build(name)
    for i, block in recomputed_layers(name):
        full, selective, none = (runs[m].per_layer.get(i, 0) for m in ("full", "selective", "none"))
        assert full < selective < none, \
            f"{name} layer {i} ({block.kind}): none {none}, selective {selective}, full {full}"
        if isinstance(block, VisionBlock):
            heads, rows = block.heads, MICRO_BATCH * tiles * small.vision.patches_per_tile
        else:
            heads, rows = block.attention.heads, MICRO_BATCH * data.seq_len
        assert none - selective >= heads * rows * FP32, f"{name} layer {i}: the core's statistics are still saved"


def test_layers_without_recompute_save_the_same_in_every_mode(measured):
    name, runs = measured
    recomputed = {i for i, _ in recomputed_layers(name)}
    others = {m: {i: b for i, b in runs[m].per_layer.items() if i not in recomputed} for m in MODES}
    assert others["none"], name
    assert others["none"] == others["selective"] == others["full"], name


def test_recompute_changes_neither_the_loss_nor_any_gradient(measured):
    name, runs = measured
    reference = runs["none"]
    nonzero = sum(1 for g in reference.grads.values() if g.abs().sum() > 0)
    assert nonzero >= len(reference.grads) // 2, f"{name}: most gradients are zero, the check would be empty"
    for mode in ("selective", "full"):
        run = runs[mode]
        assert run.loss == pytest.approx(reference.loss, rel=1e-6), f"{name} {mode}"
        assert run.grads.keys() == reference.grads.keys()
        for key, grad in reference.grads.items():
            torch.testing.assert_close(run.grads[key], grad, rtol=1e-5, atol=1e-7, msg=f"{name} {mode} {key}")

