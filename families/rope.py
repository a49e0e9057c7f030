"""RoPE frequencies as transformers' modeling_rope_utils computes them, for the families whose configs ask for YaRN
or linear scaling: the same float32 arithmetic, so that a scaled rope's logits are transformers'."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def default_inv_freq(dim: int, theta: float, device=None) -> Tensor:
    """[dim/2] float32 frequencies of the unscaled RoPE: theta^(-2i/dim) for each channel pair i."""
    import torch  # here: reading a config (moepack plan) needs no torch

    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_position_embeddings: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True) -> Tensor:
    """[dim/2] float32 YaRN frequencies: extrapolate the fast (high-frequency) pairs, interpolate the slow ones by
    `factor`, and blend linearly between the pair indices where a pair turns `beta_fast` resp. `beta_slow` times over
    the original context (those indices rounded outwards unless `truncate` is off)."""
    import torch  # here: reading a config (moepack plan) needs no torch

    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = theta ** exponents
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def pair_index(rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated_share = 1 - ramp
    return interpolated * (1 - extrapolated_share) + extrapolated * extrapolated_share


def whole_float_as_int(value):
    """`value`, an int where it is a float with an integer value (4096.0: transformers' arithmetic takes it as the
    int it equals); anything else unchanged, for the caller's own check."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's default scale of cos and sin (where a config gives no attention_factor), as transformers derives it."""
    def scale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return scale(mscale) / scale(mscale_all_dim) if mscale and mscale_all_dim else scale()


@dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE of transformers' rope_parameters: "linear" (every frequency divided by `factor`) or "yarn"
    (yarn_inv_freq, cos and sin multiplied by `attention_factor`)."""

    kind: str
    factor: float
    original_max_position_embeddings: int = 0  # yarn only
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def inv_freq(self, dim: int, theta: float) -> Tensor:
        """[dim/2] float32 frequencies of a head of `dim` channels rotated from base `theta`."""
        if self.kind == "linear":
            return default_inv_freq(dim, theta) / self.factor
        return yarn_inv_freq(dim, theta, self.factor, self.original_max_position_embeddings, self.beta_fast,
                             self.beta_slow, self.truncate)
