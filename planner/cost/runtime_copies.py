"""The memory copies a runtime makes around its data-parallel collectives.

DeepSpeed flattens before it communicates: each gradient reduction copies the bucket's
gradients into a newly allocated flat tensor and, after the collective, back into the
gradients (ZeRO-0: engine.py ``buffered_allreduce_fallback``; ZeRO-1/2: stage_1_and_2.py
``allreduce_bucket``, which copies back only the slices the rank owns), and ZeRO-2 first copies
each gradient into its contiguous reduction bucket during the backward. ZeRO-3 gathers every
fetched module's weights into freshly allocated storage (partition_parameters.py) and flattens
the gradients it reduce-scatters (coalesced_collectives.py ``reduce_scatter_coalesced``).

On a GPU this is a few milliseconds of HBM traffic beside the collectives. On CPU ranks it is
not: a large allocation there is fresh pages, faulted in on first touch at a fraction of the
copy rate (efficiency.Device.first_touch_s_per_byte, measured by ``dsplan profile``).
Megatron-Core and torchtitan communicate from persistent buffers and are not charged here.
"""

from __future__ import annotations

import numpy as np

from planner.cost.efficiency import Device, hbm_time


def grad_reduction_copies(dev: Device, grad_bytes: np.ndarray, dp: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """Seconds of DeepSpeed's copies per gradient reduction of ``grad_bytes`` on a rank (ZeRO 0-2).
    ZeRO-0/1: the flat copy into new memory and the copy back (all of it under ZeRO-0, the slices
    the rank owns under ZeRO-1). ZeRO-2 also copies every gradient into its contiguous bucket and
    the rank's share into its partition buffer, both allocated anew each step (stage_1_and_2.py
    ``_release_ipg_buffers`` frees them at the step)."""
    g = np.asarray(grad_bytes, dtype=float)
    share = 1.0 / np.maximum(dp, 1)
    copied = np.where(zero == 0, 2.0, np.where(zero == 2, 2.0 + 2.0 * share, 1.0 + share)) * g
    fresh = np.where(zero == 2, 2.0 + share, 1.0) * g
    return hbm_time(2.0 * copied, dev) + fresh * dev.first_touch_s_per_byte


def fresh_buffer_seconds(dev: Device, nbytes: np.ndarray) -> np.ndarray:
    """Seconds of first touch of ``nbytes`` allocated anew (ZeRO-3's gathered weights)."""
    return np.asarray(nbytes, dtype=float) * dev.first_touch_s_per_byte


def flat_copy_seconds(dev: Device, nbytes: np.ndarray) -> np.ndarray:
    """Seconds to copy ``nbytes`` into a new flat buffer (ZeRO-3's reduce-scatter input)."""
    return hbm_time(2.0 * np.asarray(nbytes, dtype=float), dev) + fresh_buffer_seconds(dev, nbytes)
