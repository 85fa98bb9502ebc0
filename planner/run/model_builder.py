"""Build the reference model from a (scaled) ModelSpec: one torch layer per block.

Two shapes of the same layer list:
- ``ReferenceForCausalLM`` for data / tensor / expert parallel runs (one module, the loss in
  ``forward``); it looks enough like a Hugging Face causal LM (``model.layers`` ModuleList,
  a ``config`` with head counts) for DeepSpeed AutoTP to shard it;
- ``PlannedPipelineModule`` for pipeline runs: DeepSpeed's ``PipelineModule`` whose stage
  boundaries are the planner's partition instead of one of DeepSpeed's own methods.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import (
    DecoderBlock,
    EmbeddingBlock,
    LMHeadBlock,
    ModelSpec,
    NormBlock,
    ProjectorBlock,
    VisionBlock,
    VisionEmbedBlock,
)
from planner.run.model_layers import (
    DecoderLayer,
    EmbeddingLayer,
    LMHeadLayer,
    NormLayer,
    ProjectorLayer,
    VisionEmbedLayer,
    VisionLayer,
)

AUX_LOSS_COEF = 0.01  # weight of the MoE load-balancing loss (Switch Transformer, section 2.2)
IGNORE_INDEX = -100


def tiles_per_sample(spec: ModelSpec, images_per_sample: int, tiles_per_image: int) -> int:
    """Vision tiles per sample: local tiles per image plus the global view when the model has one."""
    if spec.vision is None:
        return 0
    images = images_per_sample or spec.vision.default_images_per_sample
    tiles = tiles_per_image or spec.vision.default_tiles_per_image
    return images * (tiles + (1 if spec.vision.global_view else 0))


def layer_specs(spec: ModelSpec, *, ep_size: int, tiles: int, recompute: str,
                capacity: float = 1.0) -> list[tuple[type, tuple]]:
    """(class, args) per block, in forward order; built lazily so a pipeline stage builds only its own.
    ``capacity``: DeepSpeed MoE's capacity factor (model_layers.MoEFeedForward)."""
    out: list[tuple[type, tuple]] = []
    for block in spec.blocks:
        if isinstance(block, VisionEmbedBlock):
            out.append((VisionEmbedLayer, (block,)))
        elif isinstance(block, VisionBlock):
            out.append((_configured(VisionLayer, recompute), (block,)))
        elif isinstance(block, ProjectorBlock):
            out.append((ProjectorLayer, (block, tiles)))
        elif isinstance(block, EmbeddingBlock):
            out.append((EmbeddingLayer, (block,)))
        elif isinstance(block, DecoderBlock):
            out.append((_configured(DecoderLayer, recompute), (block, ep_size, capacity)))
        elif isinstance(block, NormBlock):
            out.append((NormLayer, (block,)))
        elif isinstance(block, LMHeadBlock):
            out.append((LMHeadLayer, (block,)))
        else:
            raise TypeError(f"no layer for block kind {block.kind}")
    return out


def _configured(cls: type, recompute: str) -> type:
    """A subclass of ``cls`` with the recompute mode baked in (LayerSpec needs a class)."""
    if recompute == "none":
        return cls

    def __init__(self, *args):
        cls.__init__(self, *args)
        self.recompute_full = recompute == "full"
        if recompute == "selective":
            self.self_attn.selective = True

    return type(f"{cls.__name__}{recompute.capitalize()}", (cls,), {"__init__": __init__})


def _tuple_input(cls: type) -> type:
    """The pipeline calls ``layer(x)`` with the whole tuple; our layers take the tensors as arguments."""

    def forward(self, x):
        return cls.forward(self, *x) if isinstance(x, (tuple, list)) else cls.forward(self, x)

    return type(cls.__name__, (cls,), {"forward": forward})


def causal_lm_loss(outputs: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (labels already shifted; image positions ignored) plus the MoE aux loss."""
    logits, aux = outputs
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    return ce + AUX_LOSS_COEF * aux


def hf_like_config(spec: ModelSpec) -> SimpleNamespace:
    """The config attributes AutoTP reads (head counts and width) to split attention by heads."""
    return SimpleNamespace(hidden_size=spec.hidden, num_attention_heads=spec.attention_heads,
                           num_key_value_heads=spec.kv_heads, vocab_size=spec.vocab)


class ReferenceModel(nn.Module):
    """The layer stack (named ``...Model`` with a ``layers`` list, which AutoTP's parser expects)."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *state: torch.Tensor):
        for layer in self.layers:
            state = layer(*state)
        return state


class ReferenceForCausalLM(nn.Module):
    """Whole model in one module: ``forward(tokens, [tiles,] labels) -> loss``."""

    # Hugging Face-style tensor-parallel plan, which DeepSpeed AutoTP applies by name:
    # Megatron's pairing (Shoeybi et al. 2019, section 3) of column-parallel input
    # projections with a row-parallel output projection in attention and in the MLP.
    _tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        # the vocabulary projection split by vocabulary, its logits gathered whole for the loss
        # (transformers' LlamaForCausalLM._tp_plan: "lm_head": "colwise_rep"); without it the head
        # runs unsharded on every TP rank, which DeepSpeed does not do to a Hugging Face model
        "layers.*.lm_head": "colwise_gather_output",
    }

    def __init__(self, spec: ModelSpec, *, ep_size: int = 1, tiles: int = 0, recompute: str = "none",
                 capacity: float = 1.0):
        super().__init__()
        self.config = hf_like_config(spec)
        self.model = ReferenceModel([cls(*args) for cls, args in layer_specs(
            spec, ep_size=ep_size, tiles=tiles, recompute=recompute, capacity=capacity)])

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        *data, labels = inputs
        return causal_lm_loss(self.model(*data), labels)


def build_pipeline(spec: ModelSpec, parts: list[int], *, ep_size: int, tiles: int, recompute: str,
                   seed: int = 1234, capacity: float = 1.0):
    """A DeepSpeed PipelineModule split exactly at ``parts`` (the planner's stage boundaries)."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    class PlannedPipelineModule(PipelineModule):
        """PipelineModule with explicit boundaries: DeepSpeed's methods would re-balance the plan away."""

        def __init__(self, layers, boundaries: list[int], **kwargs):
            object.__setattr__(self, "_planned_parts", list(boundaries))
            super().__init__(layers, partition_method="planner", **kwargs)

        def _partition_layers(self, method: str = "planner") -> None:
            parts = self._planned_parts
            if len(parts) != self.num_stages + 1 or parts[0] != 0 or parts[-1] != len(self._layer_specs):
                raise ValueError(f"stage boundaries {parts} do not cover {len(self._layer_specs)} layers "
                                 f"in {self.num_stages} stages")
            self.parts = list(parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=parts[stage], stop=parts[stage + 1])

    specs = [LayerSpec(_tuple_input(cls), *args) for cls, args in layer_specs(spec, ep_size=ep_size, tiles=tiles,
                                                                                recompute=recompute, capacity=capacity)]
    return PlannedPipelineModule(specs, parts, num_stages=len(parts) - 1, loss_fn=causal_lm_loss,
                                 base_seed=seed)
