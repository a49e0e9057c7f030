"""Storage types as classes: one Codec subclass per type, registered when its class is defined (as gguf-py's
quants.py registers its quant classes).

A subclass declares its layout (name, elements and bytes per block), how its bytes decode, and for the ggml block
types its chunk kernels. Everything that lists or dispatches on storage types reads the registry: dtypes
(STORAGE_TYPES, tensor_nbytes, FROM_SAFETENSORS, so the reader's validation), quants (quantize, dequantize,
QTYPES), decode (decode_tensor, decode_float, decode_rows), the converter (encode) and the fidelity check. Adding
a type is defining its class, here or anywhere else.

Importing this module imports no torch (the reader and `moepack inspect` stay light): the methods that compute
import torch and their kernel modules when called.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from .errors import FormatError, MoepackError
from .source_blocks import FP4_GROUP, FP8_BLOCK, fp8_block_scale_shape

# name -> codec class, in definition order (the order listings and the fuzzer's choices follow)
REGISTRY: dict[str, type[Codec]] = {}
# safetensors dtype name -> storage type name, for tensors kept as they are in the source
FROM_SAFETENSORS: dict[str, str] = {}


class _TorchDtype:
    """A class attribute that is torch's dtype `name`, looked up on access (defining a codec imports no torch)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, owner=None):
        return getattr(importlib.import_module("torch"), self.name)

    def __repr__(self):
        return f"torch.{self.name}"


class _Kernel:
    """A class attribute that is function `name` of the kernel module `module` (format_spec/quant_*.py), imported
    on first access (defining a codec imports no torch)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __get__(self, obj, owner=None):
        return getattr(importlib.import_module(f"{__package__}.{self.module}"), self.name)


class Codec:
    """One storage type. Subclasses are used as they are (never instantiated); defining one with a `name`
    registers it (a subclass without its own `name` is a shared base and registers nothing)."""

    name: str
    block_elems: int = 1  # a tensor's last dimension is a multiple of this
    block_bytes: int
    safetensors_dtype: str | None = None  # the safetensors dtype holding the same bytes (None: none does)
    description: str = ""
    torch_dtype = None  # plain element types: the torch dtype the stored bytes are a view of

    # ggml block codecs: chunk kernels on 2-D views, quantize_chunk(x float32 (nb, block_elems), out uint8
    # (nb, block_bytes)[, weights]) and dequantize_chunk(blocks, out float32), each with the CPU elements per
    # chunk it runs best at (sizes measured on the 2-core dev machine: big enough that the ~10-40 torch ops per
    # chunk amortise their per-op overhead, small enough that the temporaries stay within a few MiB of cache).
    quantize_chunk = None
    quantize_elems: int = 1 << 17
    weighted: bool = False  # quantize_chunk takes per-element importance weights
    # native_quantizer() gives the compiled CPU quantizer (a kernel like quantize_chunk) or None when there is
    # none. It makes one pass per block, so its chunks need not fit in L2: they are sized for load balance.
    native_quantizer = None
    native_elems: int = 1 << 20
    dequantize_chunk = None
    dequantize_elems: int = 1 << 17

    takes_scale: bool = False  # a weight may keep a `P.scale` companion (block scales) that decoding applies
    needs_tensor_scale: bool = False  # encode gives a power-of-two tensor scale (SPEC.md section 6.1)
    exact_from: tuple[str, ...] = ()  # source types whose (decoded) values this type holds exactly
    max_rel_rmse: float | None = None  # largest relative RMSE `verify --source` accepts for a conversion to it

    def __init__(self):
        raise TypeError("codecs are used as classes, not instances")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            register(cls)

    @classmethod
    def can_quantize(cls) -> bool:
        return cls.quantize_chunk is not None

    @classmethod
    def nbytes(cls, shape) -> int:
        """Exact byte length of a tensor of this type and logical shape; FormatError if it can't be stored."""
        if any((not isinstance(d, int)) or isinstance(d, bool) or d < 0 for d in shape):
            raise FormatError(f"bad shape {list(shape)} (dimensions must be non-negative integers)")
        count = 1
        for d in shape:
            count *= d
        if cls.block_elems > 1:
            last = shape[-1] if shape else 1
            if last % cls.block_elems:
                raise FormatError(
                    f"shape {list(shape)} can't be stored as {cls.name}: last dimension {last} "
                    f"is not a multiple of its block of {cls.block_elems}"
                )
        return count // cls.block_elems * cls.block_bytes

    # --- ggml blocks (quants.quantize / dequantize; MoepackError, the codec API's error, for bad arguments)

    @classmethod
    def check_shape(cls, shape) -> tuple[int, ...]:
        try:
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise MoepackError(f"bad shape {shape!r} (expected a sequence of integers)") from None
        if not shape or any(d < 0 for d in shape):
            raise MoepackError(f"bad shape {list(shape)} for {cls.name} (need at least one non-negative dimension)")
        if shape[-1] % cls.block_elems:
            raise MoepackError(
                f"can't store shape {list(shape)} as {cls.name}: last dimension {shape[-1]} is not a multiple of "
                f"its block of {cls.block_elems}")
        return shape

    @classmethod
    def quantized_nbytes(cls, shape) -> int:
        shape = cls.check_shape(shape)
        n = 1
        for d in shape:
            n *= d
        return n // cls.block_elems * cls.block_bytes

    @classmethod
    def quantize(cls, x, *, importance=None, out=None):
        """A float array/tensor -> its blocks, uint8 torch [..., n/block_elems*block_bytes] on x's device."""
        if cls.quantize_chunk is None:
            raise MoepackError(f"{cls.name} has no block quantizer")
        from .quant_common import quantize_blocks

        return quantize_blocks(cls, x, importance, out)

    @classmethod
    def dequantize(cls, blocks, shape, *, dtype=None, out=None):
        """Blocks -> float32 values of logical `shape` (`dtype`: converted) on the bytes' device."""
        if cls.dequantize_chunk is None:
            raise MoepackError(f"{cls.name} has no block dequantizer")
        import torch

        from .quant_common import dequantize_blocks

        return dequantize_blocks(cls, blocks, shape, torch.float32 if dtype is None else dtype, out)

    # --- decoding (format_spec/decode.py dispatches here); `raw` is a flat uint8 torch tensor

    @classmethod
    def decode(cls, raw, shape: tuple):
        """raw -> a tensor of `shape`: a view in the plain type's dtype, or dequantized float32 on raw's device.
        FormatError unless raw holds exactly nbytes(shape)."""
        need = cls.nbytes(shape)
        if raw.numel() != need:
            raise FormatError(f"{cls.name}{list(shape)} needs {need} bytes, got {raw.numel()}")
        return cls.decode_checked(raw, shape)

    @classmethod
    def decode_checked(cls, raw, shape: tuple):
        """decode, raw's length checked."""
        if cls.torch_dtype is not None:
            return raw.view(cls.torch_dtype).reshape(shape)
        return cls.dequantize(raw, shape)

    @classmethod
    def decode_float(cls, raw, shape: tuple, scale, out_dtype, out=None):
        """raw -> `out_dtype` values, applying `scale` where the type takes block scales (others have none).
        `out`: a contiguous CPU tensor of `shape` and `out_dtype` the values may be decoded into (a buffer reused
        from one call to the next: no fresh pages to fault in); the result is then `out`, a view of raw where the
        stored type is `out_dtype`, or (a type that cannot decode into it) a tensor of its own."""
        import torch

        if out is not None and cls.torch_dtype is None and out_dtype == torch.float32:
            return cls.dequantize(raw, shape, out=out)
        values = cls.decode(raw, shape)
        if out is not None and values.dtype != out_dtype:
            return out.copy_(values)
        return values.to(out_dtype)

    @classmethod
    def decodes_fresh(cls, scale) -> bool:
        """Whether decode_float gives a new tensor, not a view of the stored bytes (a tensor scale may then
        multiply it in place)."""
        return cls.torch_dtype is None

    @classmethod
    def scale_shape(cls, rows: int, cols: int) -> tuple[int, int] | None:
        """The shape of the block scale a [rows, cols] weight takes (None: it takes none)."""
        return None

    @classmethod
    def row_decodable(cls, scale) -> bool:
        """Whether decode_rows can decode a few rows alone (with this scale, or None)."""
        return scale is None

    @classmethod
    def stacks_by_rows(cls, rows: int, scale) -> bool:
        """Whether E tensors of `rows` rows (with block scales like `scale`, or None) decode as one tensor of
        E x rows rows whose bytes (and scales) are theirs one after another: true wherever a row's values depend
        on that row's bytes and scales alone (format_spec.decode.decode_stacked)."""
        return True

    @classmethod
    def decode_rows(cls, picked, numbers, cols: int, scale, out_dtype):
        """The bytes of some whole rows (uint8 [n, row bytes]; `numbers` their row indices) -> float values."""
        return cls.decode_float(picked.reshape(-1), (picked.shape[0], cols),
                                scale[numbers] if scale is not None else None, out_dtype)

    # --- encoding (the converter)

    @classmethod
    def encode(cls, values):
        """float32 values -> (the stored bytes as a uint8 torch tensor, the exponent e of the tensor scale 2^e to
        store beside them, or None)."""
        if cls.torch_dtype is not None:
            import torch

            return values.to(cls.torch_dtype).view(torch.uint8), None
        return cls.quantize(values), None


def register(cls: type[Codec]) -> type[Codec]:
    """Add a codec class to the registry (Codec.__init_subclass__ calls it); ValueError for a bad declaration or
    a name already taken."""
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__qualname__}: a codec's name must be a non-empty string")
    if name in REGISTRY:
        raise ValueError(f"storage type {name!r} is already defined (by {REGISTRY[name].__qualname__})")
    for attr in ("block_elems", "block_bytes"):
        value = getattr(cls, attr, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{cls.__qualname__}: {attr} must be a positive integer, got {value!r}")
    REGISTRY[name] = cls
    if cls.safetensors_dtype and cls.block_elems == 1:
        FROM_SAFETENSORS[cls.safetensors_dtype] = name
    return cls


def unregister(name: str) -> None:
    """Remove a storage type (a test's toy codec) from the registry."""
    cls = REGISTRY.pop(name)
    if FROM_SAFETENSORS.get(cls.safetensors_dtype) == name:
        del FROM_SAFETENSORS[cls.safetensors_dtype]


def codec(name: str) -> type[Codec]:
    """The codec of a storage type name; FormatError for an unknown one."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise FormatError(f"unknown storage type {name!r}") from None


class _Names(Sequence):
    """The names of the registered codecs that pass `keep`, in definition order, read at each use (so a codec
    defined later is among them)."""

    def __init__(self, keep):
        self._keep = keep

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n, c in REGISTRY.items() if self._keep(c))

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self):
        return len(self._names())

    def __eq__(self, other):
        return tuple(self) == tuple(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self):
        return repr(self._names())


# The block codecs quants.quantize/dequantize take (the ggml types)
QTYPES: Sequence[str] = _Names(lambda c: c.can_quantize())


def block_codec(qtype: str) -> type[Codec]:
    """The codec of a quantization type; MoepackError for a name that isn't one."""
    if qtype not in QTYPES:
        raise MoepackError(f"unknown quantization type {qtype!r} (expected one of {', '.join(QTYPES)})")
    return REGISTRY[qtype]


def block_layout(qtype: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of a quantization type; MoepackError for an unknown name."""
    c = block_codec(qtype)
    return c.block_elems, c.block_bytes


def quantized_nbytes(qtype: str, shape) -> int:
    return block_codec(qtype).quantized_nbytes(shape)


# ------------------------------------------------------------------------------------------- plain types

class F32(Codec):
    name = "F32"
    block_bytes = 4
    safetensors_dtype = "F32"
    torch_dtype = _TorchDtype("float32")
    description = "IEEE float32"
    exact_from = ("BF16", "F16")


class F16(Codec):
    name = "F16"
    block_bytes = 2
    safetensors_dtype = "F16"
    torch_dtype = _TorchDtype("float16")
    description = "IEEE float16"
    max_rel_rmse = 0.002


class BF16(Codec):
    name = "BF16"
    block_bytes = 2
    safetensors_dtype = "BF16"
    torch_dtype = _TorchDtype("bfloat16")
    description = "bfloat16"
    # every FP8 e4m3 / FP4 e2m1 value times a power-of-two scale is a bfloat16 (the `bf16` policy converts only these)
    exact_from = ("F8_E4M3", "FP4_E2M1", "F8_E5M2")
    max_rel_rmse = 0.01


class F64(Codec):
    name = "F64"
    block_bytes = 8
    safetensors_dtype = "F64"
    torch_dtype = _TorchDtype("float64")
    description = "IEEE float64"


class I64(Codec):
    name = "I64"
    block_bytes = 8
    safetensors_dtype = "I64"
    torch_dtype = _TorchDtype("int64")
    description = "int64"


class I32(Codec):
    name = "I32"
    block_bytes = 4
    safetensors_dtype = "I32"
    torch_dtype = _TorchDtype("int32")
    description = "int32"


class I16(Codec):
    name = "I16"
    block_bytes = 2
    safetensors_dtype = "I16"
    torch_dtype = _TorchDtype("int16")
    description = "int16"


class I8(Codec):
    name = "I8"
    block_bytes = 1
    safetensors_dtype = "I8"
    torch_dtype = _TorchDtype("int8")
    description = "int8"


class U8(Codec):
    name = "U8"
    block_bytes = 1
    safetensors_dtype = "U8"
    torch_dtype = _TorchDtype("uint8")
    description = "uint8"


class BOOL(Codec):
    name = "BOOL"
    block_bytes = 1
    safetensors_dtype = "BOOL"
    torch_dtype = _TorchDtype("bool")
    description = "bool, one byte"


# ------------------------------------------------------------------------------------------- the release's types

class F8_E4M3(Codec):
    """The release's non-expert linears: float8 with one E8M0 (or F32) scale per 128x128 block in `P.scale`."""

    name = "F8_E4M3"
    block_bytes = 1
    safetensors_dtype = "F8_E4M3"
    torch_dtype = _TorchDtype("float8_e4m3fn")
    description = "float8 e4m3fn (OCP), as the release's non-expert linears"
    takes_scale = True

    @classmethod
    def decode_float(cls, raw, shape, scale, out_dtype, out=None):
        if scale is None:
            return super().decode_float(raw, shape, scale, out_dtype, out)
        import torch

        from .source_formats import FLOAT_SCALE_DTYPES, fp8_block_dequantize, fp8_float_block_dequantize

        weight = cls.decode(raw, shape)
        if scale.dtype in FLOAT_SCALE_DTYPES:  # other releases' float block scales (Qwen3's weight_scale_inv)
            return fp8_float_block_dequantize(weight, scale, dtype=out_dtype, out=out)
        if out_dtype in (torch.float32, torch.bfloat16):  # decoded straight into it
            return fp8_block_dequantize(weight, scale, dtype=out_dtype, out=out)
        return fp8_block_dequantize(weight, scale).to(out_dtype)

    @classmethod
    def decodes_fresh(cls, scale):
        return scale is not None

    @classmethod
    def scale_shape(cls, rows, cols):
        return fp8_block_scale_shape(rows, cols, FP8_BLOCK)

    @classmethod
    def row_decodable(cls, scale):
        import torch

        return scale is None or scale.dtype == torch.float8_e8m0fnu

    @classmethod
    def stacks_by_rows(cls, rows, scale):
        return scale is None or rows % FP8_BLOCK == 0  # a 128-row block of scales must not span two tensors

    @classmethod
    def decode_rows(cls, picked, numbers, cols, scale, out_dtype):
        if scale is None:
            return super().decode_rows(picked, numbers, cols, scale, out_dtype)
        import torch

        # each row times its block row's scales, one per 128 columns
        scales = scale[numbers // FP8_BLOCK].float().repeat_interleave(FP8_BLOCK, dim=1)[:, :cols]
        return (picked.view(torch.float8_e4m3fn).float() * scales).to(out_dtype)


class F8_E5M2(Codec):
    name = "F8_E5M2"
    block_bytes = 1
    safetensors_dtype = "F8_E5M2"
    torch_dtype = _TorchDtype("float8_e5m2")
    description = "float8 e5m2"


class F8_E8M0(Codec):
    name = "F8_E8M0"
    block_bytes = 1
    safetensors_dtype = "F8_E8M0"
    torch_dtype = _TorchDtype("float8_e8m0fnu")
    description = "power-of-two scale 2^(e-127), as the release's block scales"


class FP4_E2M1(Codec):
    """The release's routed experts: two e2m1 codes per byte, element 2i in the low nibble, 2i+1 in the high
    one, with one E8M0 scale per 32 inputs in `P.scale`. safetensors holds them as I8 with the last dimension
    halved (so FROM_SAFETENSORS doesn't map to it: the converter recognises them by name)."""

    name = "FP4_E2M1"
    block_elems = 2
    block_bytes = 1
    safetensors_dtype = "I8"
    description = "packed FP4 e2m1, two per byte, low nibble first"
    takes_scale = True

    @classmethod
    def decode_checked(cls, raw, shape):
        """The unscaled e2m1 values (the scales are a separate tensor)."""
        import torch

        from .quant_common import on_device
        from .source_formats import E2M1_VALUES

        codes = torch.stack([(raw & 0x0F).long(), (raw >> 4).long()], dim=-1).reshape(shape)
        return on_device(E2M1_VALUES, raw.device)[codes]  # the table copied to a GPU once, not per call

    @classmethod
    def decode_float(cls, raw, shape, scale, out_dtype, out=None):  # (a tensor of its own: expert_decode.py's
        # ExpertDecoder decodes FP4 experts into buffers it reuses)
        if scale is None:
            raise FormatError("an FP4_E2M1 tensor needs its scale tensor to be decoded")
        from .source_formats import fp4_dequantize

        return fp4_dequantize(raw.view(*shape[:-1], shape[-1] // 2), scale, dtype=out_dtype)

    @classmethod
    def scale_shape(cls, rows, cols):
        return (rows, cols // FP4_GROUP)

    @classmethod
    def row_decodable(cls, scale):
        return scale is not None


# ------------------------------------------------------------------------------------------- ggml block types
# Byte-compatible with ggml's ggml-common.h and gguf-py; kernels in format_spec/quant_*.py.

class Q8_0(Codec):
    name = "Q8_0"
    block_elems = 32
    block_bytes = 34
    description = "ggml Q8_0: f16 scale + 32 int8"
    quantize_elems = 1 << 18
    native_elems = 1 << 20
    dequantize_elems = 1 << 19
    max_rel_rmse = 0.02

    quantize_chunk = _Kernel("quant_q8_0", "quantize_chunk")
    native_quantizer = _Kernel("quant_q8_0", "native_quantize_chunk")
    dequantize_chunk = _Kernel("quant_q8_0", "dequantize_chunk")


class MXFP4(Codec):
    name = "MXFP4"
    block_elems = 32
    block_bytes = 17
    description = "ggml MXFP4: E8M0 exponent + 16 bytes of e2m1 (j low, j+16 high)"
    quantize_elems = 1 << 18
    native_elems = 1 << 20
    dequantize_elems = 1 << 18
    exact_from = ("FP4_E2M1",)  # the same codes and exponents (quants.fp4_to_mxfp4)
    max_rel_rmse = 0.2

    quantize_chunk = _Kernel("quant_fp4", "mxfp4_quantize_chunk")
    native_quantizer = _Kernel("quant_fp4", "native_mxfp4_quantize_chunk")
    dequantize_chunk = _Kernel("quant_fp4", "mxfp4_dequantize_chunk")


class NVFP4(Codec):
    name = "NVFP4"
    block_elems = 64
    block_bytes = 36
    description = "ggml NVFP4: 4 UE4M3 scales (one per 16) + 32 bytes of e2m1"
    quantize_elems = 1 << 18
    dequantize_elems = 1 << 18
    needs_tensor_scale = True
    max_rel_rmse = 0.15

    quantize_chunk = _Kernel("quant_fp4", "nvfp4_quantize_chunk")
    dequantize_chunk = _Kernel("quant_fp4", "nvfp4_dequantize_chunk")

    @classmethod
    def encode(cls, values):
        # ggml's NVFP4 block has no per-tensor scale: small weights would decode to zero
        from .quant_fp4 import nvfp4_prescale

        values, exponent = nvfp4_prescale(values)
        return cls.quantize(values), exponent


class Q2_K(Codec):
    name = "Q2_K"
    block_elems = 256
    block_bytes = 84
    description = "ggml Q2_K super-block"
    quantize_elems = 1 << 16
    weighted = True
    dequantize_elems = 1 << 16
    max_rel_rmse = 0.45

    quantize_chunk = _Kernel("quant_q2_k", "quantize_chunk")
    dequantize_chunk = _Kernel("quant_q2_k", "dequantize_chunk")


class IQ2_XXS(Codec):
    name = "IQ2_XXS"
    block_elems = 256
    block_bytes = 66
    description = "ggml IQ2_XXS super-block (E8 lattice grid + signs)"
    quantize_elems = 1 << 13
    weighted = True
    dequantize_elems = 1 << 16
    max_rel_rmse = 0.55

    quantize_chunk = _Kernel("quant_iq2_xxs", "quantize_chunk")
    dequantize_chunk = _Kernel("quant_iq2_xxs", "dequantize_chunk")
