"""Routed experts' FP4 weights -> float, one table lookup per stored byte.

Decoding the experts is most of a short prompt's time on a CPU: every prompt decodes every expert it reads, while a
resident model decoded its weights once. Both FP4 layouts the container holds for experts decode the same way
here: the release's FP4_E2M1 (two codes per byte, an E8M0 scale per 32 inputs in a separate tensor) and ggml's MXFP4
(17-byte blocks: the E8M0 byte, then 16 bytes of codes). A group of 32 inputs shares one scale byte, so its 16 bytes
decode by looking their 32 codes up in one row of 16 values: the values of codes 0..15 under that scale, already
scaled. The rows (256 of them, 8 KiB in bf16) are built by running the format's own decoders, so the values are the
generic path's, bit for bit.

Where a C compiler is found, the lookup is compiled (native/fp4_decode.c: built once per machine into a cache,
checked against the torch path when it loads, skipped with MOEPACK_NATIVE=0). With AVX-512 a whole group is one vpermw
(bf16) or two vpermd (f32): 4 G weights decode in about 0.15 s on one core. SSSE3 (pshufb) and plain C kernels do
the same where AVX-512 is missing; the CPU picks at run time. The kernels read data and scales where they lie (any
row stride), write into buffers reused from expert to expert, and run on the decode threads without the GIL.
Without a compiler, torch does it: `scale byte << 8 | data byte` indexes a 65,536-entry table of byte pairs
(index_select), about 5x slower than the SSSE3 kernel.

On a CPU with AVX512-BF16, an expert on few tokens (this CPU's crossover as `moepack bench compute --expert-dtype
bfloat16` measured it, else default_fused_tokens) skips the decoded matrix altogether: the
fused kernel decodes 4 rows at a time into a scratch that stays in L1 and multiplies them by the tokens at once
(vdpbf16ps, float32 sums). `decode(..., tokens=n)` then returns the matrices still packed (PackedMatrix) with that
kernel as their matmul.

MXFP4 keeps elements j and j+16 of a block in byte j, so its weights come out with each 32-column block in "pair
order" (0, 16, 1, 17, ...). Rather than shuffling the weight, the expert permutes its activations to match
(tokens x hidden, far smaller than the weight).
"""

from __future__ import annotations

import ctypes
import math
import os
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moepack.format_spec import quants, source_formats
from moepack.format_spec.decode import scale_name
from moepack.format_spec.reader import Region
from moepack.native import LazyKernel, c_function, native_library, read_source

# The compiled lookups (native/fp4_decode.c): plain C, SSSE3 and AVX-512 kernels of the same table lookup, each
# compiled for its own target; the CPU picks at run time, so every level can be checked on a machine that runs the
# highest. NATIVE_LEVELS names them in the library's order.
_NATIVE_SOURCE = read_source("fp4_decode.c")
NATIVE_LEVELS = ("scalar", "ssse3", "avx512")

# The fused FP4 matmul (native/fp4_linear.c), for an expert's few tokens on a CPU with AVX512-BF16: out = x @ w.T with
# w decoded 4 rows at a time into an L1-sized scratch and multiplied straight away, so the decoded matrix never goes to
# memory. Its own library: a compiler without AVX512-BF16 intrinsics loses this kernel only.
_FUSED_SOURCE = read_source("fp4_linear.c")
FUSED_ROWS = 4  # the kernel's rows per tile: its scratch holds this many decoded rows
# Up to this many tokens an expert runs the fused kernel; beyond, decoding the matrices and torch's GEMM are as fast
# (AMD Zen 5, one thread, 1024 x 1024 experts, per expert: fused 0.41 / 0.81 / 1.26 / 1.8 / 2.2 / 2.7 / 3.2 / 3.6 ms
# at 16 / 48 / 80 / 128 / 160 / 192 / 224 / 256 tokens against 0.53 / 0.92 / 1.43 / 2.0 / 2.5 / 2.9 / 3.4 / 3.7 ms
# decoded; prefill of the medium model, medians alternating in one process: N = 1,024 2.31 -> 2.27 s and
# N = 2,048 5.06 -> 4.73 s with 256 here instead of 128). Another CPU has another crossover (an AMX core's GEMM
# is far ahead of vdpbf16ps): `moepack bench compute --expert-dtype bfloat16` measures it, and prefill takes that.
FUSED_MAX_TOKENS = 256

GROUP = 32  # inputs per scale, both layouts
GROUP_BYTES = GROUP // 2
MXFP4_BLOCK_BYTES = 1 + GROUP_BYTES
EXPERT_ROLES = ("gate", "up", "down")  # an expert's matrices, as a family's ExpertNaming.names gives their names
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # what experts' matmuls may run in


def expert_weight_count(region: Region) -> int:
    """The weights of an expert's region (its matrices' elements, their scales left out): decoded, it takes this
    times its dtype's size."""
    return sum(t.numel for t in region.tensors if t.name.endswith(".weight"))


def _pair_order(columns: int) -> torch.Tensor:
    """Column j of an MXFP4 weight decoded in byte order holds logical column pair_order[j]."""
    within = torch.stack([torch.arange(GROUP_BYTES), torch.arange(GROUP_BYTES) + GROUP_BYTES], 1).reshape(-1)
    return (torch.arange(0, columns, GROUP)[:, None] + within[None, :]).reshape(-1)


def _nibble_table(layout: str, dtype: torch.dtype) -> torch.Tensor:
    """[256, 16] `dtype`: row s holds the values of codes 0..15 under scale byte s, computed by the format's own
    decoder (bytes 0..15 put code n in the low nibble; the high nibble's code decodes the same way)."""
    scales = torch.arange(256, dtype=torch.uint8)
    codes = torch.arange(GROUP_BYTES, dtype=torch.uint8).repeat(256, 1)  # one group per scale byte
    if layout == "FP4_E2M1":
        values = source_formats.fp4_dequantize(codes, scales[:, None].view(torch.float8_e8m0fnu),
                                               dtype=torch.float32)
        low_nibbles = slice(0, None, 2)
    else:
        blocks = torch.cat([scales[:, None], codes], 1)  # [256, 17]
        values = quants.dequantize_torch(blocks.reshape(-1), "MXFP4", (256, GROUP))
        low_nibbles = slice(0, GROUP_BYTES)
    # converted whole, as the generic decode converts: torch's strided conversion writes another NaN (scale 0xFF)
    return values.to(dtype)[:, low_nibbles].contiguous()


def _pair_table(nibbles: torch.Tensor) -> torch.Tensor:
    """The torch path's table: [65536] integers, entry (scale << 8 | byte) holding that byte's two values (low
    nibble's first) as one integer, so that one index_select decodes a byte."""
    byte = torch.arange(256)
    pairs = torch.stack([nibbles[:, byte & 15], nibbles[:, byte >> 4]], -1).contiguous()  # [256, 256, 2]
    return pairs.view(torch.int64 if nibbles.element_size() == 4 else torch.int32).reshape(65536)


def _byte_planes(nibbles: torch.Tensor) -> torch.Tensor:
    """The SSSE3 kernel's table: per scale byte, byte b of its 16 values gathered into plane b."""
    width = nibbles.element_size()
    return nibbles.contiguous().view(torch.uint8).view(256, GROUP_BYTES, width).transpose(1, 2).contiguous()


class NativeLookup:
    """The compiled lookup at one level (index into NATIVE_LEVELS)."""

    def __init__(self, fn, level: int):
        self._fn, self.level = fn, level

    @property
    def name(self) -> str:
        return NATIVE_LEVELS[self.level]

    def table(self, nibbles: torch.Tensor) -> torch.Tensor:
        """What this level's kernel reads for a [256, 16] nibble table."""
        return _byte_planes(nibbles) if NATIVE_LEVELS[self.level] == "ssse3" else nibbles.contiguous()

    def __call__(self, itemsize: int, data: torch.Tensor, scale: torch.Tensor, table: torch.Tensor,
                 out: torch.Tensor, groups: int) -> None:
        """Decode `groups` groups: data [>= groups, 16] uint8 rows, scale [>= groups] uint8 (any row strides)."""
        if self._fn(self.level, itemsize, data.data_ptr(), data.stride(0), scale.data_ptr(), scale.stride(0),
                    table.data_ptr(), out.data_ptr(), groups):
            raise RuntimeError(f"the {self.name} FP4 kernel was not built for {itemsize}-byte values")


def _load_native() -> dict[int, NativeLookup] | None:
    """{level: NativeLookup} for every kernel level this CPU runs that decodes like torch (the highest is used),
    or None when nothing is compiled."""
    lib = native_library("moepack_fp4_decode", _NATIVE_SOURCE)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = c_function(lib, "fp4_decode_nibbles", (ctypes.c_int, ctypes.c_int, p, i64, p, i64, p, p, i64))
    best_level = c_function(lib, "fp4_best_level", ())
    # self-check: random values in the table, every scale byte and every data byte, in the MXFP4 (strided)
    # arrangement, against the torch path's index_select
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4096, MXFP4_BLOCK_BYTES), dtype=torch.uint8, generator=gen)
    blocks[:, 0] = torch.arange(4096) % 256
    index = (blocks[:, 1:].to(torch.int64) + blocks[:, :1].to(torch.int64) * 256).reshape(-1)
    levels = {}
    for level in range(best_level() + 1):
        lookup = NativeLookup(fn, level)
        for dtype in (torch.bfloat16, torch.float32):
            nibbles = torch.randint(-2**15, 2**15, (256, GROUP_BYTES), dtype=torch.int32, generator=gen)
            nibbles = nibbles.to(torch.int16 if dtype.itemsize == 2 else torch.int32).view(dtype)
            out = torch.empty(4096 * GROUP_BYTES, dtype=_pair_table(nibbles).dtype)
            lookup(dtype.itemsize, blocks[:, 1:], blocks[:, 0], lookup.table(nibbles), out, 4096)
            if not torch.equal(out, _pair_table(nibbles)[index]):
                warnings.warn(f"moepack: the {lookup.name} FP4 decoder disagrees with torch; not using it")
                break
        else:
            levels[level] = lookup
    return levels or None


_native_kernels = LazyKernel(_load_native)


def native_levels() -> list[str]:
    """The compiled FP4 lookup levels usable here (the last one is used), or [] where none is."""
    return [lookup.name for lookup in (_native_kernels() or {}).values()]


@dataclass
class PackedMatrix:
    """An FP4 matrix left as stored, for the fused kernel: data [rows * cols / 32, 16] and scale [rows * cols / 32]
    uint8 (any row strides), its scale rows' values in table ([256, 16] bf16)."""
    data: torch.Tensor
    scale: torch.Tensor
    table: torch.Tensor
    rows: int
    cols: int


class FusedKernels:
    """The compiled fused FP4 kernels (native/fp4_linear.c): `matmul` (one packed matrix) and `expert` (a whole
    clamped SwiGLU expert, its three matrices packed)."""

    def __init__(self, lib):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._linear = c_function(lib, "fp4_linear_bf16", (p, i64, i64, p, i64, p, i64, p, i64, p, i64, p))
        self._expert = c_function(lib, "fp4_expert_bf16", (p, i64, i64, i64, *(p, i64, p, i64) * 3, p,
                                                            ctypes.c_float, p, p, p, p, p))

    def matmul(self, x: torch.Tensor, m: PackedMatrix, scratch: torch.Tensor) -> torch.Tensor:
        """x @ w.T (float32 [tokens, rows]) for bf16 x [tokens, cols] and the packed matrix w: bf16 products,
        float32 sums. scratch: FUSED_ROWS * cols bf16."""
        x = x.to(torch.bfloat16).contiguous()
        out = torch.empty(x.shape[0], m.rows, dtype=torch.float32)
        if self._linear(x.data_ptr(), x.shape[0], m.cols, m.data.data_ptr(), m.data.stride(0), m.scale.data_ptr(),
                        m.scale.stride(0), m.table.data_ptr(), m.rows, out.data_ptr(), out.stride(0),
                        scratch.data_ptr()):
            raise RuntimeError(f"the fused FP4 matmul refused a {m.rows} x {m.cols} matrix")
        return out

    def expert(self, x: torch.Tensor, w1: PackedMatrix, w3: PackedMatrix, w2: PackedMatrix, limit: float,
               hidden_order: torch.Tensor | None, buffer, out: torch.Tensor | None = None) -> torch.Tensor:
        """The clamped SwiGLU expert, down(silu(min(gate x, limit)) * clamp(up x, -limit, limit)), on bf16 x
        [tokens, hidden]: float32 [tokens, hidden], written into `out` where it is given (contiguous float32 of that
        shape). Products in bf16, sums in float32, the hidden activation rounded to bf16 once. `buffer(role, numel,
        dtype)` gives scratch memory."""
        x = x.to(torch.bfloat16).contiguous()
        tokens, (inter, hidden) = x.shape[0], (w1.rows, w1.cols)
        if w3.rows != inter or w3.cols != hidden or w2.rows != hidden or w2.cols != inter or x.shape[1] != hidden:
            raise RuntimeError(f"expert matrices {w1.rows}x{w1.cols}, {w3.rows}x{w3.cols}, {w2.rows}x{w2.cols} "
                               f"do not make an expert on {x.shape[1]} inputs")
        order = hidden_order.contiguous() if hidden_order is not None else None
        if out is None:
            out = torch.empty(tokens, hidden, dtype=torch.float32)
        elif out.shape != (tokens, hidden) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"the fused expert writes float32 [{tokens}, {hidden}], contiguous; got "
                             f"{out.dtype} {list(out.shape)}")
        work = buffer("fused.work", 2 * tokens * inter + inter, torch.float32)
        act = buffer("fused.hidden", tokens * inter, torch.bfloat16)
        scratch = buffer("fused.rows", FUSED_ROWS * max(hidden, inter), torch.bfloat16)
        packed = [v for m in (w1, w3, w2) for v in (m.data.data_ptr(), m.data.stride(0), m.scale.data_ptr(),
                                                     m.scale.stride(0))]
        if self._expert(x.data_ptr(), tokens, hidden, inter, *packed, w1.table.data_ptr(), limit,
                        order.data_ptr() if order is not None else None, work.data_ptr(), act.data_ptr(),
                        scratch.data_ptr(), out.data_ptr()):
            raise RuntimeError(f"the fused FP4 expert refused {inter} x {hidden} matrices")
        return out


def _random_packed(rows: int, cols: int, table: torch.Tensor, gen: torch.Generator) -> tuple[PackedMatrix,
                                                                                               torch.Tensor]:
    """A random FP4 matrix in the MXFP4 arrangement (strided groups), normal magnitudes, and its decoded values."""
    blocks = torch.randint(0, 256, (rows * cols // GROUP, MXFP4_BLOCK_BYTES), dtype=torch.uint8, generator=gen)
    blocks[:, 0] = torch.randint(118, 136, (len(blocks),), dtype=torch.uint8, generator=gen)
    index = (blocks[:, 1:].to(torch.int64) + blocks[:, :1].to(torch.int64) * 256).reshape(-1)
    decoded = _pair_table(table)[index].view(torch.bfloat16).reshape(rows, cols)
    return PackedMatrix(blocks[:, 1:], blocks[:, 0], table, rows, cols), decoded


def _load_fused() -> FusedKernels | None:
    """The compiled fused FP4 kernels where this CPU has AVX512-BF16 and both agree with float64 on the decoded
    matrices (strided groups, rows and tokens that are not whole tiles, a permuted hidden activation), else None."""
    lib = native_library("moepack_fp4_linear", _FUSED_SOURCE)
    if lib is None or not lib.fp4_linear_supported():
        return None
    kernels = FusedKernels(lib)
    gen = torch.Generator().manual_seed(0)
    table = _nibble_table("FP4_E2M1", torch.bfloat16).contiguous()
    buffers = {}

    def buffer(role, numel, dtype):
        return buffers.setdefault(role, torch.empty(numel, dtype=dtype))
    hidden, inter, tokens, limit = 2 * GROUP, 3 * GROUP, 13, 7.0
    w1, w1d = _random_packed(inter, hidden, table, gen)
    w3, w3d = _random_packed(inter, hidden, table, gen)
    w2, w2d = _random_packed(hidden, inter, table, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    odd, odd_d = _random_packed(2 * FUSED_ROWS + 3, hidden, table, gen)  # a last tile of 3 rows
    got = kernels.matmul(x, odd, buffer("rows", FUSED_ROWS * hidden, torch.bfloat16)).double()
    want = x.double() @ odd_d.double().T
    exact = torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    order = torch.randperm(inter, generator=gen)
    got = kernels.expert(x, w1, w3, w2, limit, order, buffer).double()
    # the kernel's own contract in float64: down(silu(min(gate x, limit)) * clamp(up x, -limit, limit))
    gate, up = F.linear(x.double(), w1d.double()), F.linear(x.double(), w3d.double())
    want = F.linear((F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit))[:, order], w2d.double())
    close = bool((got - want).abs().max() <= 2e-2 * want.abs().max())  # the hidden activation is rounded to bf16
    if not (exact and close):
        warnings.warn("moepack: the fused FP4 kernels disagree with torch; not using them")
        return None
    return kernels


_fused_kernel = LazyKernel(_load_fused)


def fused_available() -> bool:
    """Whether the fused FP4 matmul runs here (a CPU with AVX512-BF16, a C compiler)."""
    return _fused_kernel() is not None


def fused_max_tokens(dtype: torch.dtype, device: torch.device, limit: int | None = None) -> int:
    """Up to how many tokens an expert's matmuls run fused with its decode, for experts computed in `dtype` on
    `device` (0: never): `limit` where given (this CPU's measured crossover, default_fused_tokens), else
    FUSED_MAX_TOKENS."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not fused_available():
        return 0
    return FUSED_MAX_TOKENS if limit is None else max(int(limit), 0)


def l2_cache_bytes(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """This CPU's per-core L2 size (1 MiB where sysfs does not say)."""
    try:
        for index in sorted(os.listdir(sysfs)):
            with open(os.path.join(sysfs, index, "level")) as f:
                if f.read().strip() != "2":
                    continue
            with open(os.path.join(sysfs, index, "size")) as f:
                size = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            return int(size.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return 1 << 20


def default_fused_tokens(hidden: int) -> int:
    """The fused kernel's token limit where `moepack bench compute` never measured this CPU's crossover. The kernel
    runs every token through each 4-row tile, so its input rows (bf16, `hidden` wide) are read again per tile and
    want to stay in L2; past that, decode + GEMM wins (Zen 5, 1 MiB L2: 256+ tokens for 1024-wide experts, ~128 for
    V4-Flash's 4096: a prefill with 256 there ran 12 % slower than with 128). At most FUSED_MAX_TOKENS."""
    return max(FUSED_ROWS, min(FUSED_MAX_TOKENS, l2_cache_bytes() // (2 * max(hidden, 1))))


@dataclass
class ExpertWeights:
    w1: torch.Tensor | PackedMatrix
    w3: torch.Tensor | PackedMatrix
    w2: torch.Tensor | PackedMatrix
    input_order: torch.Tensor | None = None  # permute x's columns by this before w1/w3 (MXFP4 pair order)
    hidden_order: torch.Tensor | None = None  # permute the hidden activation's columns by this before w2
    # (limit, x, weights, out) -> the expert on x, for PackedMatrix weights: the fused kernel does the whole expert
    kernel: Callable | None = None

    def apply(self, x: torch.Tensor, out: torch.Tensor | None = None, *, forward: Callable,
              limit: float) -> torch.Tensor:
        """The expert on its tokens x [n, hidden], in x's dtype; or written into `out` (float32 [n, hidden],
        contiguous: the fused kernel writes it directly), which is returned. The family's arithmetic: `forward(x,
        gate, up, down, hidden_order)` for decoded matrices, `limit` the clamp the fused kernel's SwiGLU takes."""
        if self.input_order is not None:
            x = x[:, self.input_order]
        if self.kernel is not None:
            y = self.kernel(limit, x, self, out)
            return y if out is not None else y.to(x.dtype)
        y = forward(x, self.w1, self.w3, self.w2, self.hidden_order)
        return y if out is None else out.copy_(y)


class ExpertDecoder:
    """Decodes experts whose three matrices are FP4_E2M1 (+ E8M0 `.scale`) or MXFP4, into buffers reused from one
    expert to the next: an expert's weights are valid until the next `decode`."""

    def __init__(self, dtype: torch.dtype, device: torch.device, threads: int | None = None,
                 native: bool | str = True, fused: bool = True, fused_tokens: int | None = None):
        """`native`: True uses the best compiled lookup this CPU runs, a NATIVE_LEVELS name that one (tests), False
        the torch path (also where nothing is compiled, and on GPUs). `fused`: bf16 experts on up to `fused_tokens`
        tokens (default FUSED_MAX_TOKENS) use the fused FP4 matmul where this CPU has it (`decode(tokens=)`)."""
        self.dtype = dtype
        self.device = device
        self._tables: dict[str, torch.Tensor] = {}
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._orders: dict[int, torch.Tensor] = {}
        # torch runs index_select on one core; on a CPU the lookups are split over this many threads instead
        self.threads = max(1, threads or torch.get_num_threads()) if device.type == "cpu" else 1
        self._pool = ThreadPoolExecutor(self.threads, "moepack-decode") if self.threads > 1 else None
        levels = (_native_kernels() if device.type == "cpu" and native else None) or {}
        if isinstance(native, str) and not isinstance(native, bool):
            if native not in NATIVE_LEVELS:
                raise ValueError(f"unknown FP4 lookup level {native!r} (one of {', '.join(NATIVE_LEVELS)})")
            levels = {k: v for k, v in levels.items() if v.name == native}
        self.native: NativeLookup | None = levels[max(levels)] if levels else None
        self.fused_tokens = fused_max_tokens(dtype, device, fused_tokens) if fused and native is not False else 0
        self.fused = _fused_kernel() if self.fused_tokens else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    @staticmethod
    def layout(region: Region, names: Mapping[str, str]) -> str | None:
        """"FP4_E2M1" or "MXFP4" when all three matrices of the expert (`names`: its gate / up / down weights'
        names, a family's ExpertNaming.names) are in that layout (and nothing else in the region needs decoding),
        else None: the caller takes the generic path."""
        by_name = {t.name: t for t in region.tensors}
        layouts = set()
        for role in EXPERT_ROLES:
            w = by_name.get(names[role])
            if w is None or len(w.shape) != 2 or w.shape[1] % GROUP:
                return None
            if w.dtype == "FP4_E2M1":
                s = by_name.get(scale_name(w.name))
                if s is None or s.dtype != "F8_E8M0" or tuple(s.shape) != (w.shape[0], w.shape[1] // GROUP):
                    return None
            elif w.dtype != "MXFP4":
                return None
            layouts.add(w.dtype)
        expected = {names[role] for role in EXPERT_ROLES}
        if layouts == {"FP4_E2M1"}:
            expected |= {scale_name(names[role]) for role in EXPERT_ROLES}
        return layouts.pop() if len(layouts) == 1 and set(by_name) == expected else None

    def _buffer(self, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (role, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel]

    def buffer_for(self, prefix: str) -> Callable[[Any, torch.dtype], torch.Tensor]:
        """out_for(entry, dtype) for format_spec.decode.decode_group: the buffer of the expert's matrix `entry`
        (named `prefix` + its role), reused from one expert to the next as this decoder's own are."""
        def out_for(entry, dtype: torch.dtype) -> torch.Tensor:
            shape = tuple(entry.shape)
            return self._buffer(entry.name[len(prefix):], math.prod(shape), dtype).view(shape)
        return out_for

    def _table(self, layout: str) -> torch.Tensor:
        if layout not in self._tables:
            nibbles = _nibble_table(layout, self.dtype)
            table = self.native.table(nibbles) if self.native else _pair_table(nibbles)
            self._tables[layout] = table.to(self.device)
        return self._tables[layout]

    def _order(self, columns: int) -> torch.Tensor:
        if columns not in self._orders:
            self._orders[columns] = _pair_order(columns).to(self.device)
        return self._orders[columns]

    def _index(self, role: str, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """data: uint8 [groups, 16] (any strides); scale: uint8 [groups] -> the table index of every byte."""
        index = self._buffer(f"{role}.index", data.numel(), torch.int32).view(-1, GROUP_BYTES)
        index.copy_(data)
        index.add_(scale.to(torch.int32).mul_(256)[:, None])
        return index.view(-1)

    def _pieces(self, n: int) -> list[tuple[int, int]]:
        bounds = [n * k // self.threads for k in range(self.threads + 1)]
        return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]

    def _run(self, work, pieces: list) -> None:
        if self._pool is None:
            for piece in pieces:
                work(piece)
        else:
            list(self._pool.map(work, pieces))  # list(): re-raises a piece's exception here

    def _lookup(self, table: torch.Tensor, jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """For every (data [groups, 16] uint8, scale [groups] uint8, out [groups * 32] values) job: every byte's
        two values, in equal pieces over the threads."""
        if self.native is not None:  # data and scale are read where they lie (any row stride)
            itemsize = self.dtype.itemsize

            def native(piece):
                data, scale, out, a, b = piece
                self.native(itemsize, data[a:], scale[a:], table, out[a * GROUP:], b - a)
            self._run(native, [(d, s, o, a, b) for d, s, o in jobs for a, b in self._pieces(len(d))])
            return
        pieces = []
        for m, (data, scale, out) in enumerate(jobs):
            index = self._index(str(m), data, scale)
            pairs = out.view(table.dtype)  # one integer per byte: its two values
            pieces += [(index[a:b], pairs[a:b]) for a, b in self._pieces(len(index))]
        self._run(lambda piece: torch.index_select(table, 0, piece[0], out=piece[1]), pieces)

    def decode(self, region: Region, layout: str, raw: torch.Tensor, base: int, names: Mapping[str, str],
               tokens: int | None = None) -> ExpertWeights:
        """The expert of `region` (bytes in `raw`, which starts at file offset `base`; `names` as for layout, the
        gate / up / down weights becoming ExpertWeights' w1 / w3 / w2). `tokens`: how many tokens it
        is about to run on; up to `fused_tokens`, where the fused kernel runs, the weights stay packed and each
        matmul decodes as it goes."""
        by_name = {t.name: t for t in region.tensors}

        def stored(name: str) -> torch.Tensor:
            t = by_name[name]
            return raw[t.file_offset - base: t.file_offset - base + t.length]

        fused = self.fused is not None and tokens is not None and tokens <= self.fused_tokens
        table = self._fused_table(layout) if fused else self._table(layout)
        jobs, weights = [], {}
        for m in EXPERT_ROLES:
            w = by_name[names[m]]
            rows, cols = w.shape
            if layout == "FP4_E2M1":
                data, scale = stored(w.name).view(-1, GROUP_BYTES), stored(scale_name(w.name))
            else:
                blocks = stored(w.name).view(-1, MXFP4_BLOCK_BYTES)
                data, scale = blocks[:, 1:], blocks[:, 0]
            if fused:
                weights[m] = PackedMatrix(data, scale, table, rows, cols)
                continue
            out = self._buffer(m, rows * cols, self.dtype)
            jobs.append((data, scale, out))
            weights[m] = out.view(rows, cols)
        self._lookup(table, jobs)
        columns = {m: by_name[names[m]].shape[1] for m in ("gate", "down")}
        orders = (self._order(columns["gate"]), self._order(columns["down"])) if layout == "MXFP4" else (None, None)
        return ExpertWeights(weights["gate"], weights["up"], weights["down"], *orders,
                             kernel=self._fused_expert if fused else None)

    def _fused_table(self, layout: str) -> torch.Tensor:
        key = f"fused {layout}"
        if key not in self._tables:
            self._tables[key] = _nibble_table(layout, torch.bfloat16).contiguous()
        return self._tables[key]

    def _fused_expert(self, limit: float, x: torch.Tensor, w: ExpertWeights,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        return self.fused.expert(x, w.w1, w.w3, w.w2, limit, w.hidden_order, self._buffer, out)
