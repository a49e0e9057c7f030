"""Turn a tensor's stored bytes into a torch tensor (no copy for plain types when the buffer is writable)."""

from __future__ import annotations

import math

import numpy as np
import torch

from .dtypes import STORAGE_TYPES, storage_type, tensor_nbytes
from .errors import FormatError
from .layout import TENSOR_SCALE_SUFFIX

# What each type does is its codec's (codecs.py); these name the built-in plain types: storage type -> the torch
# dtype its bytes are a view of.
TORCH_DTYPES = {n: c.torch_dtype for n, c in STORAGE_TYPES.items() if c.torch_dtype is not None}


def as_uint8(buffer) -> torch.Tensor:
    """A uint8 torch view of any buffer (bytes are copied once into a writable array if needed)."""
    if isinstance(buffer, torch.Tensor):
        return buffer.view(torch.uint8).reshape(-1)
    mv = memoryview(buffer).cast("B")
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    return torch.frombuffer(mv, dtype=torch.uint8) if mv.nbytes else torch.empty(0, dtype=torch.uint8)


def decode_tensor(dtype: str, shape, buffer) -> torch.Tensor:
    """Stored bytes -> tensor. Plain types keep their dtype; FP4_E2M1 gives the unscaled e2m1 values (its scales
    are a separate tensor); ggml block types are dequantized to float32 on the buffer's device."""
    raw = as_uint8(buffer)
    return storage_type(dtype).decode(raw, tuple(shape))


def scale_name(weight_name: str) -> str | None:
    """The release's scale companion of a weight: `P.weight` -> `P.scale`."""
    return weight_name[: -len(".weight")] + ".scale" if weight_name.endswith(".weight") else None


def tensor_scale_name(weight_name: str) -> str | None:
    """The tensor-scale companion of a weight (SPEC.md section 6.1): `P.weight` -> `P.tensor_scale`."""
    return weight_name[: -len(".weight")] + TENSOR_SCALE_SUFFIX if weight_name.endswith(".weight") else None


def companion_names(weight_name: str) -> list[str]:
    """The names a weight's companions would have (`P.scale`, `P.tensor_scale`), present or not."""
    return [n for n in (scale_name(weight_name), tensor_scale_name(weight_name)) if n]


def is_companion(name: str, names) -> bool:
    """A `P.scale` or `P.tensor_scale` whose `P.weight` is among `names`: decoded as part of that weight."""
    for suffix in (".scale", TENSOR_SCALE_SUFFIX):
        if name.endswith(suffix) and name[: -len(suffix)] + ".weight" in names:
            return True
    return False


def tensor_scale_value(buffer, name: str = "tensor scale") -> float | torch.Tensor:
    """The stored bytes of a `P.tensor_scale` -> its value, checked to be a power of two 2^e with
    -126 <= e <= 127. Bytes already on a GPU give a 0-dim tensor there, unchecked: reading it back would stall
    the device once per weight (the reader has checked its type and shape, a CPU decode checks the value)."""
    stored = decode_tensor("F32", (), buffer)
    if stored.device.type != "cpu":
        return stored
    value = float(stored)
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2^exponent, mantissa in [0.5, 1)
    if mantissa != 0.5 or not -125 <= exponent <= 128:
        raise FormatError(f"{name}: a tensor scale must be a power of two from 2^-126 to 2^127, got {value!r}")
    return value


def decode_float(dtype: str, shape, buffer, scale: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32, tensor_scale: float | torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Stored bytes -> float values (`out_dtype`: float32, or bfloat16 for a faster compute path), applying the
    release's block scales where the type needs them: F8_E4M3 with 128x128 block scales (E8M0 or F32),
    FP4_E2M1 with one E8M0 scale per 32 inputs. ggml block types are dequantized. `tensor_scale` (the weight's
    `P.tensor_scale` from tensor_scale_value, a power of two) multiplies the result, exactly. `out`: a buffer the
    values may be decoded into (Codec.decode_float)."""
    codec = storage_type(dtype)
    values = codec.decode_float(as_uint8(buffer), tuple(shape), scale, out_dtype, out)
    return _apply_tensor_scale(values, tensor_scale, fresh=values is out or codec.decodes_fresh(scale))


def _apply_tensor_scale(values: torch.Tensor, tensor_scale: float | torch.Tensor | None,
                        fresh: bool) -> torch.Tensor:
    """values * tensor_scale; in place when `values` is a fresh tensor, not a view of the stored bytes."""
    if tensor_scale is None or (isinstance(tensor_scale, float) and tensor_scale == 1.0):
        return values
    return values.mul_(tensor_scale) if fresh else values * tensor_scale


INTEGER_TYPES = tuple(n for n, t in TORCH_DTYPES.items() if not t.is_floating_point)


def row_decodable(dtype: str, scale: torch.Tensor | None) -> bool:
    """Whether decode_rows decodes the chosen rows of such a tensor alone, not the whole tensor: plain and ggml
    block types (a row is whole blocks), FP4_E2M1 with its per-row scales, F8_E4M3 with E8M0 128x128 block scales."""
    return storage_type(dtype).row_decodable(scale)


def decode_rows(dtype: str, shape, buffer, rows: slice | torch.Tensor, scale: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32, tensor_scale: float | torch.Tensor | None = None
                ) -> torch.Tensor:
    """decode_float(...)[rows] of a 2-D tensor, decoding only the bytes of those rows where the type allows it
    (row_decodable): an embedding lookup needs N rows of a vocabulary-sized table, an LM head can be applied a
    slice at a time. `rows` is a slice (step 1) or an index tensor. Other types decode the whole tensor first."""
    shape = tuple(shape)
    if len(shape) != 2:
        raise FormatError(f"row decoding needs a 2-D tensor, got shape {list(shape)}")
    n_rows, cols = shape
    raw = as_uint8(buffer)
    if isinstance(rows, slice):
        span = range(n_rows)[rows]
        if span.step != 1:
            raise ValueError("decode_rows takes slices of step 1")
        numbers = torch.arange(span.start, span.stop, device=raw.device)
    else:
        rows = numbers = rows.to(raw.device)
    codec = storage_type(dtype)
    if not codec.row_decodable(scale) or (scale is not None and tuple(scale.shape) != codec.scale_shape(n_rows, cols)):
        return decode_float(dtype, shape, buffer, scale, out_dtype, tensor_scale)[rows]  # (it names a bad scale)
    row_bytes = tensor_nbytes(dtype, (cols,))
    if raw.numel() != n_rows * row_bytes:
        raise FormatError(f"{dtype}{list(shape)} needs {n_rows * row_bytes} bytes, got {raw.numel()}")
    picked = raw.view(n_rows, row_bytes)[rows]
    values = codec.decode_rows(picked, numbers, cols, scale, out_dtype)
    return _apply_tensor_scale(values, tensor_scale, fresh=codec.decodes_fresh(scale))


def _companions(t, by_name: dict, read) -> tuple[torch.Tensor | None, float | torch.Tensor | None]:
    """The decoded `P.scale` and `P.tensor_scale` that go with weight entry `t` (None where absent)."""
    s, ts = by_name.get(scale_name(t.name)), by_name.get(tensor_scale_name(t.name))
    return (decode_tensor(s.dtype, s.shape, read(s)) if s is not None else None,
            tensor_scale_value(read(ts), ts.name) if ts is not None else None)


def decode_group(tensors, read, out_dtype: torch.dtype = torch.float32, keep=INTEGER_TYPES, dtype_of=None,
                 out_for=None) -> dict:
    """Decode tensors stored together (a region): each `P.weight` takes its `P.scale` and `P.tensor_scale`
    along and they are not returned; types in `keep` come back as stored (times a tensor scale, if one goes with
    them); everything else as `out_dtype` values, or `dtype_of(entry)` where that is given. `read(t)` gives the
    stored bytes of entry `t` (anything with .name, .dtype, .shape). `out_for(t, dtype)`: a buffer (contiguous,
    CPU, t's shape) entry t's values may be decoded into (decode_float's `out`)."""
    by_name = {t.name: t for t in tensors}
    out = {}
    for t in tensors:
        if is_companion(t.name, by_name):
            continue  # folded into its weight
        scale, tensor_scale = _companions(t, by_name, read)
        if t.dtype in keep:
            out[t.name] = _apply_tensor_scale(decode_tensor(t.dtype, t.shape, read(t)), tensor_scale, fresh=False)
            continue
        dtype = dtype_of(t) if dtype_of else out_dtype
        out[t.name] = decode_float(t.dtype, t.shape, read(t), scale, dtype, tensor_scale,
                                   out_for(t, dtype) if out_for else None)
    return out


def entry_bytes(raw: torch.Tensor, base: int):
    """read(entry) for decode_group: the entry's stored bytes within `raw`, the bytes from file offset `base`."""
    return lambda t: raw[t.file_offset - base: t.file_offset - base + t.length]


def decode_stacked(groups, read, suffixes, out_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Same-layout tensors of several groups (a layer's experts), each as decode_group decodes it, stacked:
    {suffix: [G, *shape]} for the entries `prefix + suffix` of each (prefix, tensors) in `groups`. Where the type
    allows (Codec.stacks_by_rows) the G tensors' bytes and block scales are put one after another and decoded as
    one tensor of G x rows rows: a few launches for many experts on a GPU, not a chain of small ones per expert.
    `read(t)` gives the stored bytes of entry `t`."""
    by_name = [({t.name: t for t in tensors}, prefix) for prefix, tensors in groups]
    out = {}
    for suffix in suffixes:
        picked = []
        for names, prefix in by_name:
            t = names.get(prefix + suffix)
            if t is None:
                raise FormatError(f"{prefix + suffix} is missing")
            picked.append((t, names.get(scale_name(t.name)), names.get(tensor_scale_name(t.name))))
        out[suffix] = _decode_same_layout(picked, read, out_dtype)
    return out


def _decode_same_layout(picked: list, read, out_dtype: torch.dtype) -> torch.Tensor:
    """[G, *shape]: the (weight, scale entry or None, tensor-scale entry or None) of `picked`, decoded."""
    first, first_scale, _ = picked[0]
    shape = tuple(first.shape)

    def layout(t, s, ts):
        return t.dtype, tuple(t.shape), s and (s.dtype, tuple(s.shape)), ts is not None
    scales = [decode_tensor(s.dtype, s.shape, read(s)) for _, s, _ in picked] if first_scale is not None else None
    if len(shape) != 2 or not all(layout(*p) == layout(*picked[0]) for p in picked):
        return torch.stack([decode_float(t.dtype, t.shape, read(t), None if scales is None else scales[i], out_dtype,
                                         tensor_scale_value(read(ts), ts.name) if ts is not None else None)
                            for i, (t, _, ts) in enumerate(picked)])
    raw = torch.stack([as_uint8(read(t)) for t, _, _ in picked])
    factors = None
    if picked[0][2] is not None:
        factors = [tensor_scale_value(read(ts), ts.name) for _, _, ts in picked]
        factors = torch.stack(factors) if isinstance(factors[0], torch.Tensor) else torch.tensor(factors)
    return decode_side_by_side(first.dtype, shape, raw, torch.stack(scales) if scales is not None else None, factors,
                               out_dtype)


def decode_side_by_side(dtype: str, shape, raw: torch.Tensor, scale: torch.Tensor | None = None,
                        tensor_scale: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32
                        ) -> torch.Tensor:
    """G 2-D tensors of one storage type and `shape`, their stored bytes the rows of `raw` (uint8 [G, nbytes]),
    their decoded block scales `scale` [G, *scale shape] (or None) and tensor scales `tensor_scale` [G] (powers of
    two, or None) -> [G, *shape] `out_dtype` values. Where the type allows (Codec.stacks_by_rows) one decode of
    G x rows rows: a few launches for many experts on a GPU, whatever G; else one per tensor. Nothing in it waits
    for the host."""
    codec, shape, groups = storage_type(dtype), tuple(shape), raw.shape[0]
    if codec.stacks_by_rows(shape[0], scale[0] if scale is not None else None):
        flat_scale = scale.reshape(-1, *scale.shape[2:]) if scale is not None else None
        values = codec.decode_float(raw.reshape(-1), (groups * shape[0], shape[1]), flat_scale, out_dtype)
        values = values.view(groups, *shape)
    else:
        values = torch.stack([codec.decode_float(raw[g], shape, None if scale is None else scale[g], out_dtype)
                              for g in range(groups)])
    if tensor_scale is None:
        return values
    factors = tensor_scale.to(device=values.device, dtype=values.dtype).view(-1, 1, 1)  # powers of two: exact
    return values.mul_(factors) if codec.decodes_fresh(scale) else values * factors


def _named_with_companions(tensors, read, name: str):
    """Entry `name` among `tensors`, with its decoded scale and tensor scale (None where absent)."""
    by_name = {t.name: t for t in tensors}
    t = by_name[name]
    return (t, *_companions(t, by_name, read))


def decode_group_rows(tensors, read, name: str, rows: slice | torch.Tensor,
                      out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of the 2-D float tensor `name` among `tensors` (with its scales, as decode_group decodes it), decoding
    only those rows where the type allows (decode_rows)."""
    t, scale, tensor_scale = _named_with_companions(tensors, read, name)
    return decode_rows(t.dtype, t.shape, read(t), rows, scale, out_dtype, tensor_scale)


def decode_group_row_slices(tensors, read, name: str, rows_per_slice: int, out_dtype: torch.dtype = torch.float32):
    """The 2-D float tensor `name` among `tensors` (as decode_group decodes it), `rows_per_slice` rows at a time,
    each slice decoded alone where the type allows (row_decodable), else the whole tensor as one slice."""
    t, scale, tensor_scale = _named_with_companions(tensors, read, name)
    if not row_decodable(t.dtype, scale):
        yield decode_float(t.dtype, t.shape, read(t), scale, out_dtype, tensor_scale)
        return
    for first in range(0, t.shape[0], max(1, rows_per_slice)):
        yield decode_rows(t.dtype, t.shape, read(t), slice(first, first + rows_per_slice), scale, out_dtype,
                          tensor_scale)


# NaN and infinity by their bits: plain type -> (itemsize, exponent mask); a value is not finite where its exponent
# bits are all ones (F8_E4M3 has no infinity: S.1111.111 is its NaN; F8_E8M0 is all exponent, 0xFF its NaN)
_NON_FINITE_BITS = {"F64": (8, 0x7FF0000000000000), "F32": (4, 0x7F800000), "F16": (2, 0x7C00),
                    "BF16": (2, 0x7F80), "F8_E5M2": (1, 0x7C), "F8_E4M3": (1, 0x7F), "F8_E8M0": (1, 0xFF)}
_NUMPY_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# ggml blocks whose values are all finite exactly when their f16 scales are (65504 times the largest code stays within
# float32): type -> (block bytes, values per block, ((byte of the block, exponent mask), ...)). A block is not finite
# where any of its tested bytes has all its mask bits set. An f16 scale is tested by its high byte (stored
# little-endian): its exponent bits 0x7C00 all lie there, so a piece of the tensor that cuts through the field holds
# all of the exponent or none of it, and pieces may start anywhere.
_BLOCK_SCALE_BITS = {"Q8_0": (34, 32, ((1, 0x7C),)),  # f16 d
                     "Q2_K": (84, 256, ((81, 0x7C), (83, 0x7C))),  # f16 d, f16 dmin (after scales[16], qs[64])
                     "IQ2_XXS": (66, 256, ((1, 0x7C),))}  # f16 d (before qs)
_MXFP4_BYTES = 17
# Types none of whose bit patterns is a NaN or an infinity: integers, FP4 codes, and NVFP4, whose UE4M3 scales ggml
# decodes with no NaN (0x7F is 0, the top bit is ignored: 0xFF is 240; its tensor scale is an F32 of its own).
_ALWAYS_FINITE = frozenset(INTEGER_TYPES) | {"FP4_E2M1", "NVFP4"}


def checks_finiteness(dtype: str) -> bool:
    """Whether first_non_finite answers for this storage type from its bits (None for a type whose every bit
    pattern is finite); for other types (a codec defined elsewhere) it answers None unchecked."""
    return dtype in _NON_FINITE_BITS or dtype in _BLOCK_SCALE_BITS or dtype in _ALWAYS_FINITE or dtype == "MXFP4"


def first_non_finite(dtype: str, buffer, start: int = 0) -> int | None:
    """The index (in the whole tensor) of the first NaN or infinite value among a piece of a tensor's stored
    bytes that begins `start` bytes into the tensor (a multiple of the type's item size for plain types; any for
    the block types), or None. For a block type, the first value of the first block holding such a value: a block
    with a non-finite f16 scale (all its values are NaN or infinite), found by position whatever the cut; an MXFP4
    block whose exponent overflows a code (judged on the blocks the piece holds whole: verify passes whole blocks).
    From the bits alone: no decode."""
    data = np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)
    if dtype in _NON_FINITE_BITS:
        size, mask = _NON_FINITE_BITS[dtype]
        if start % size:
            raise ValueError(f"a piece of a {dtype} tensor must start on a whole value, not at byte {start}")
        values = data[:len(data) - len(data) % size].view(_NUMPY_UINTS[size])
        bad = np.flatnonzero((values & values.dtype.type(mask)) == mask)
        return int(bad[0]) + start // size if len(bad) else None
    if dtype in _BLOCK_SCALE_BITS:
        block, per_block, tested = _BLOCK_SCALE_BITS[dtype]
        first_bad = None  # block number in the whole tensor
        for at, mask in tested:
            first = (at - start) % block  # this tested byte's first occurrence in the piece
            bad = np.flatnonzero((data[first::block] & mask) == mask)
            if len(bad):
                number = (start + first) // block + int(bad[0])
                first_bad = number if first_bad is None else min(first_bad, number)
        return None if first_bad is None else first_bad * per_block
    if dtype == "MXFP4":
        number = _mxfp4_overflow(data, start)
        return None if number is None else number * 32
    return None


def _mxfp4_overflow(data: np.ndarray, start: int) -> int | None:
    """The number of the first whole MXFP4 block in `data` (a piece `start` bytes into the tensor) holding a value
    past float32. ggml decodes code c of a block with exponent byte e as e2m1(c) * 2^(e-127) (e = 255 too, OCP's
    NaN): 2^128 or more for none up to e = 252, then for a code of magnitude 2^(255-e) or more, a nibble's low three
    bits >= 2 * (256 - e) (e2m1 4 and 6 at e = 253, 2 and up at 254, 1 and up at 255: 0 and +-0.5 stay finite)."""
    skip = -start % _MXFP4_BYTES
    whole = max(0, (len(data) - skip) // _MXFP4_BYTES)
    blocks = data[skip:skip + whole * _MXFP4_BYTES].reshape(whole, _MXFP4_BYTES)
    exponents = blocks[:, 0]
    high = np.flatnonzero(exponents >= 253)  # rare: only these blocks' codes are read
    if not len(high):
        return None
    codes = blocks[high, 1:]
    largest = np.maximum(codes & 7, (codes >> 4) & 7).max(1)
    bad = high[largest >= 2 * (256 - exponents[high].astype(np.int64))]
    return (start + skip) // _MXFP4_BYTES + int(bad[0]) if len(bad) else None
