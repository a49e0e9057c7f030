"""The release formats' block geometry: FP8 weights scaled per 128 x 128 block, FP4 values per group of 32.
Torch-free, so that the tensor schemas `moepack plan` sizes a config by load no torch (source_formats.py, which
quantizes and dequantizes by it, does)."""

from __future__ import annotations

FP8_BLOCK = 128
FP4_GROUP = 32


def fp8_block_scale_shape(out_features: int, in_features: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    """Shape of the `.scale` tensor that goes with an [out, in] FP8 weight (edge blocks count as whole)."""
    return (-(-out_features // block), -(-in_features // block))
