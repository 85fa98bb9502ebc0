"""Synthetic training data, a pure function of (seed, step, micro-batch, data-parallel rank).

Determinism is the point: a run resumed at step N sees exactly the batches the crashed run
would have seen, and the ranks of one tensor-parallel group (same data-parallel rank) get
identical batches, which AutoTP requires. The token stream is learnable (a fixed random
successor table with a little noise), so a working trainer shows a falling loss within a
few steps; the image tiles are noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planner.run.model_builder import IGNORE_INDEX

NOISE = 0.1  # fraction of tokens replaced by random ones


@dataclass(frozen=True)
class SyntheticData:
    vocab: int
    seq_len: int
    micro_batch: int
    image_tokens: int = 0  # leading positions filled by projected image tokens
    tiles: int = 0  # tiles per sample
    patches_per_tile: int = 0
    patch_pixels: int = 0
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.image_tokens >= self.seq_len:
            raise ValueError(f"{self.image_tokens} image tokens do not fit a sequence of {self.seq_len}")

    def _successor(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.randperm(self.vocab, generator=g)

    def batch(self, step: int, micro: int, dp_rank: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """((tokens[, tiles]), labels) for one micro-batch; labels are the next tokens."""
        g = torch.Generator().manual_seed(hash((self.seed, step, micro, dp_rank)) & 0x7FFF_FFFF_FFFF)
        succ = self._successor()
        b, s = self.micro_batch, self.seq_len + 1
        seq = torch.empty(b, s, dtype=torch.long)
        seq[:, 0] = torch.randint(0, self.vocab, (b,), generator=g)
        noise = torch.rand(b, s, generator=g) < NOISE
        rand = torch.randint(0, self.vocab, (b, s), generator=g)
        for t in range(1, s):
            seq[:, t] = torch.where(noise[:, t], rand[:, t], succ[seq[:, t - 1]])
        tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].clone()
        labels[:, : self.image_tokens] = IGNORE_INDEX
        if not self.tiles:
            return (tokens,), labels
        tiles = torch.randn(b, self.tiles, self.patches_per_tile, self.patch_pixels, generator=g)
        return (tokens, tiles), labels

    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len
