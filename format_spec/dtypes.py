"""Storage types of the container: every tensor's bytes are a whole number of blocks along its last dimension.

A type is (block_elems, block_bytes): a tensor of logical shape S stores prod(S) / block_elems blocks of
block_bytes each, row-major, and S[-1] must be a multiple of block_elems. Plain element types are blocks of one.
Each type is a class in codecs.py, registered when defined; this module is the lookup the validator uses to prove
that a tensor's recorded length is exactly what its type and shape need, so an undersized tensor can never read
its neighbour's bytes.
"""

from __future__ import annotations

from .codecs import FROM_SAFETENSORS, REGISTRY, Codec, codec

# A storage type is its codec class (format_spec/codecs.py): name, block_elems, block_bytes, safetensors_dtype,
# description, and its decoding.
StorageType = Codec

# name -> codec class: the registry itself, so a codec defined later is here too.
STORAGE_TYPES: dict[str, type[Codec]] = REGISTRY

__all__ = ["FROM_SAFETENSORS", "STORAGE_TYPES", "StorageType", "storage_type", "tensor_nbytes"]


def storage_type(name: str) -> type[Codec]:
    """The codec class of a storage type name; FormatError for an unknown one."""
    return codec(name)


def tensor_nbytes(type_name: str, shape: list[int] | tuple[int, ...]) -> int:
    """Exact byte length of a tensor of this type and logical shape; FormatError if the shape can't be stored."""
    return storage_type(type_name).nbytes(shape)
