"""Time each distinct block of a model as the reference trainer builds it: ``dsplan profile``.

Every distinct block (by planner.cost.measured_blocks.block_signature: Llama's 32 decoder
layers are one, DeepSeek's dense first layer and its MoE layers two) is run alone on the
device with the input it sees in the whole model (the model's earlier layers make it, so a
projector gets real vision activations and an LM head real hidden states):

- forward: the layer with autograd recording, as training runs it;
- backward: from a unit gradient on each floating output, the forward run (untimed) before;
- recompute: the backward of the same layer under full recomputation (torch checkpoint, as
  the trainer's ``--recompute full``) less the plain backward: the forward it re-runs;
- activations: bytes of the tensors autograd saves for backward (not the weights), by storage;
  on CUDA the allocator's growth over the forward as well, which the profile keeps.

Each time is the median of ``repetitions`` runs after ``warmup`` (the first runs pay for
allocation and kernel selection); CUDA is synchronised around every timed region.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from planner.cost.measured_blocks import BlockMeasurement, block_signature
from planner.model.spec import ModelSpec, VisionEmbedBlock
from planner.run.data import SyntheticData
from planner.run.model_builder import layer_specs, tiles_per_sample
from planner.run.model_layers import _Recomputable
from planner.run.model_scale import ScaledModel


@dataclass(frozen=True)
class Settings:
    device: torch.device
    dtype: torch.dtype
    micro_batch: int
    seq_len: int
    warmup: int
    repetitions: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, repetitions: int,
                   setup: Callable[[], object] | None = None) -> float:
    """Median wall seconds of ``fn()`` (``setup()`` runs untimed before each call and its
    result is passed to ``fn``)."""
    times = []
    for i in range(warmup + repetitions):
        state = setup() if setup is not None else None
        _sync(device)
        t0 = time.perf_counter()
        fn(state) if setup is not None else fn()  # type: ignore[call-arg]
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _data(small: ModelSpec, micro_batch: int, seq_len: int) -> tuple[tuple[torch.Tensor, ...], int]:
    """One micro-batch of the trainer's synthetic data for ``small``, and its tiles per sample."""
    tiles = tiles_per_sample(small, 0, 0)
    embed = next((b for b in small.blocks if isinstance(b, VisionEmbedBlock)), None)
    image_tokens = tiles * small.vision.tokens_per_tile if small.vision else 0
    data = SyntheticData(vocab=small.vocab, seq_len=seq_len, micro_batch=micro_batch, image_tokens=image_tokens,
                         tiles=tiles, patches_per_tile=small.vision.patches_per_tile if small.vision else 0,
                         patch_pixels=embed.patch_pixels if embed else 0)
    inputs, _ = data.batch(0, 0, 0)
    return inputs, tiles


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """A detached copy that gets a gradient (floats), as a layer's input inside a model does."""
    x = x.detach().clone()
    return x.requires_grad_(True) if x.is_floating_point() else x


def _outputs_with_grad(out: object) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


def _backward(out: object) -> None:
    outs = _outputs_with_grad(out)
    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def saved_bytes(layer: nn.Module, inputs: tuple[torch.Tensor, ...]) -> float:
    """Bytes of the tensors autograd keeps for the backward of ``layer(*inputs)``, weights
    excluded, each storage once."""
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(*[_leaf(x) for x in inputs])
    del out
    return float(sum(seen.values()))


def _measure(layer: nn.Module, inputs: tuple[torch.Tensor, ...],
             s: Settings) -> tuple[float, float, float | None, float]:
    """Forward, backward, recompute seconds and activation bytes of one layer."""
    def fresh() -> tuple[torch.Tensor, ...]:
        return tuple(_leaf(x) for x in inputs)

    fwd = median_seconds(lambda xs: layer(*xs), s.device, s.warmup, s.repetitions, setup=fresh)
    bwd = median_seconds(_backward, s.device, s.warmup, s.repetitions, setup=lambda: layer(*fresh()))
    rc = None
    if isinstance(layer, _Recomputable):
        layer.recompute_full = True
        full = median_seconds(_backward, s.device, s.warmup, s.repetitions, setup=lambda: layer(*fresh()))
        layer.recompute_full = False
        rc = max(0.0, full - bwd)
    act = saved_bytes(layer, inputs)
    if s.device.type == "cuda":
        torch.cuda.synchronize(s.device)
        before = torch.cuda.memory_allocated(s.device)
        out = layer(*fresh())
        act = max(act, float(torch.cuda.memory_allocated(s.device) - before))
        del out
    return fwd, bwd, rc, act


def profile_blocks(spec: ModelSpec, scaled: ScaledModel, s: Settings,
                   progress: Callable[[str], None] = lambda _: None) -> list[BlockMeasurement]:
    """One measurement per distinct block of ``spec`` (``scaled``: the layers that run, with the
    original block each came from). Long: builds the layers in model order, walking the
    model's forward once to hand each distinct block the input it sees there."""
    small = scaled.spec
    inputs, tiles = _data(small, s.micro_batch, s.seq_len)
    state: tuple[torch.Tensor, ...] = tuple(x.to(s.device) for x in inputs)
    specs = layer_specs(small, ep_size=1, tiles=tiles, recompute="none")
    out: list[BlockMeasurement] = []
    seen: set[str] = set()
    for i, (cls, args) in enumerate(specs):
        torch.manual_seed(1234 + i)
        layer = cls(*args).to(device=s.device, dtype=s.dtype)
        state = tuple(x.to(s.dtype) if x.is_floating_point() else x for x in state)
        origin = scaled.origin[i]
        sig = block_signature(spec.blocks[origin])
        if sig not in seen:
            seen.add(sig)
            progress(f"block {origin} ({spec.blocks[origin].kind})")
            fwd, bwd, rc, act = _measure(layer, state, s)
            out.append(BlockMeasurement(signature=sig, kind=spec.blocks[origin].kind, block_index=origin,
                                        profiled_index=i, forward_s=fwd, backward_s=bwd, recompute_s=rc,
                                        activation_bytes=act))
        with torch.no_grad():
            state = tuple(layer(*state))
        del layer
    return out
