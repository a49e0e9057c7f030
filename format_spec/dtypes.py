"""Storage types of the container: every tensor's bytes are a whole number of blocks along its last dimension.

A type is (block_elems, block_bytes): a tensor of logical shape S stores prod(S) / block_elems blocks of
block_bytes each, row-major, and S[-1] must be a multiple of block_elems. Plain element types are blocks of one.
The validator uses this table to prove that a tensor's recorded length is exactly what its type and shape need,
so an undersized tensor can never read its neighbour's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import FormatError


@dataclass(frozen=True)
class StorageType:
    name: str
    block_elems: int
    block_bytes: int
    # The safetensors dtype that holds the same bytes (None: the type has no safetensors counterpart).
    safetensors_dtype: str | None
    description: str


_TYPES = [
    StorageType("F32", 1, 4, "F32", "IEEE float32"),
    StorageType("F16", 1, 2, "F16", "IEEE float16"),
    StorageType("BF16", 1, 2, "BF16", "bfloat16"),
    StorageType("F64", 1, 8, "F64", "IEEE float64"),
    StorageType("I64", 1, 8, "I64", "int64"),
    StorageType("I32", 1, 4, "I32", "int32"),
    StorageType("I16", 1, 2, "I16", "int16"),
    StorageType("I8", 1, 1, "I8", "int8"),
    StorageType("U8", 1, 1, "U8", "uint8"),
    StorageType("BOOL", 1, 1, "BOOL", "bool, one byte"),
    StorageType("F8_E4M3", 1, 1, "F8_E4M3", "float8 e4m3fn (OCP), as the release's non-expert linears"),
    StorageType("F8_E5M2", 1, 1, "F8_E5M2", "float8 e5m2"),
    StorageType("F8_E8M0", 1, 1, "F8_E8M0", "power-of-two scale 2^(e-127), as the release's block scales"),
    # The release's routed experts: two e2m1 codes per byte, element 2i in the low nibble, 2i+1 in the high one.
    # safetensors holds them as I8 with the last dimension halved.
    StorageType("FP4_E2M1", 2, 1, "I8", "packed FP4 e2m1, two per byte, low nibble first"),
    # ggml block types (ggml-common.h), byte-compatible with ggml/gguf-py.
    StorageType("Q8_0", 32, 34, None, "ggml Q8_0: f16 scale + 32 int8"),
    StorageType("MXFP4", 32, 17, None, "ggml MXFP4: E8M0 exponent + 16 bytes of e2m1 (j low, j+16 high)"),
    StorageType("NVFP4", 64, 36, None, "ggml NVFP4: 4 UE4M3 scales (one per 16) + 32 bytes of e2m1"),
    StorageType("Q2_K", 256, 84, None, "ggml Q2_K super-block"),
    StorageType("IQ2_XXS", 256, 66, None, "ggml IQ2_XXS super-block (E8 lattice grid + signs)"),
]

STORAGE_TYPES: dict[str, StorageType] = {t.name: t for t in _TYPES}

# safetensors dtype name -> storage type name for tensors kept as they are in the source.
FROM_SAFETENSORS = {t.safetensors_dtype: t.name for t in _TYPES if t.safetensors_dtype and t.block_elems == 1}


def storage_type(name: str) -> StorageType:
    try:
        return STORAGE_TYPES[name]
    except KeyError:
        raise FormatError(f"unknown storage type {name!r}") from None


def tensor_nbytes(type_name: str, shape: list[int] | tuple[int, ...]) -> int:
    """Exact byte length of a tensor of this type and logical shape; FormatError if the shape can't be stored."""
    t = storage_type(type_name)
    if any((not isinstance(d, int)) or isinstance(d, bool) or d < 0 for d in shape):
        raise FormatError(f"bad shape {list(shape)} (dimensions must be non-negative integers)")
    count = 1
    for d in shape:
        count *= d
    if t.block_elems > 1:
        last = shape[-1] if shape else 1
        if last % t.block_elems:
            raise FormatError(
                f"shape {list(shape)} can't be stored as {type_name}: last dimension {last} "
                f"is not a multiple of its block of {t.block_elems}"
            )
    return count // t.block_elems * t.block_bytes
