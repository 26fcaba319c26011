"""The sampler's per-row keys for the fused CUDA kernel (the kernel itself: test_sampler_gpu.py)."""

from __future__ import annotations

import numpy as np

from refractor.inference.engine.sampler import step_seeds


def test_step_seeds_are_deterministic_distinct_and_non_negative():
    seeds = np.array([0, 1, 2**62, 2**63 - 1] * 3, dtype=np.int64)
    positions = np.repeat(np.arange(3), 4)
    keys = step_seeds(seeds, positions)
    assert keys.dtype == np.int64 and (keys >= 0).all()
    assert len(set(keys.tolist())) == 12
    assert (step_seeds(seeds, positions) == keys).all()
