"""Routed experts' FP4 weights -> float, one table lookup per stored byte.

Decoding the experts is most of a short prompt's time on a CPU: every prompt decodes every expert it reads, while a
resident model decoded its weights once. Both FP4 layouts the container holds for experts decode the same way
here: the release's FP4_E2M1 (two codes per byte, an E8M0 scale per 32 inputs in a separate tensor) and ggml's MXFP4
(17-byte blocks: the E8M0 byte, then 16 bytes of codes). For every byte, `scale byte << 8 | data byte` indexes a
65,536-entry table whose entry is that byte's two values, already scaled (256 KiB in bf16, 512 KiB in f32: it stays
in cache). That is one integer pass and one gather into reused buffers, against a gather, a broadcast multiply and a
fresh allocation per weight on the generic path (about 3x faster). The tables are built by running the format's own
decoders over all 65,536 (scale, byte) pairs, so the values are the generic path's, bit for bit.

Where a C compiler is found, the lookup runs as a small compiled loop (format_spec.quant_common.native_library:
built once per process, checked against the torch path, skipped with MOEPACK_NATIVE=0): it reads each group's 16
bytes and its scale directly, so no index is materialised, and it runs on the decode threads without the GIL.

MXFP4 keeps elements j and j+16 of a block in byte j, so its weights come out with each 32-column block in "pair
order" (0, 16, 1, 17, ...). Rather than shuffling the weight, the expert permutes its activations to match
(tokens x hidden, far smaller than the weight).
"""

from __future__ import annotations

import ctypes
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moepack.format_spec import quant_common, quants, source_formats
from moepack.format_spec.reader import Region

from . import model

# out[g * 16 + j] = table[scale[g * scale_stride] << 8 | data[g * data_stride + j]]: the lookup of every byte of
# `groups` 16-byte groups, for 4-byte (two bf16) and 8-byte (two f32) table entries
_NATIVE_SOURCE = r"""
#include <stdint.h>
#define DECODE(NAME, T) \
void NAME(const uint8_t *data, int64_t data_stride, const uint8_t *scale, int64_t scale_stride, \
          const T *table, T *out, int64_t groups) { \
    for (int64_t g = 0; g < groups; g++) { \
        const T *row = table + ((int64_t)scale[g * scale_stride] << 8); \
        const uint8_t *d = data + g * data_stride; \
        T *o = out + g * 16; \
        for (int j = 0; j < 16; j++) o[j] = row[d[j]]; \
    } \
}
DECODE(fp4_decode_pairs32, uint32_t)
DECODE(fp4_decode_pairs64, uint64_t)
"""

GROUP = 32  # inputs per scale, both layouts
GROUP_BYTES = GROUP // 2
MXFP4_BLOCK_BYTES = 1 + GROUP_BYTES
EXPERT_MATRICES = ("w1", "w3", "w2")


def _pair_order(columns: int) -> torch.Tensor:
    """Column j of an MXFP4 weight decoded in byte order holds logical column pair_order[j]."""
    within = torch.stack([torch.arange(GROUP_BYTES), torch.arange(GROUP_BYTES) + GROUP_BYTES], 1).reshape(-1)
    return (torch.arange(0, columns, GROUP)[:, None] + within[None, :]).reshape(-1)


def _pair_table(layout: str, dtype: torch.dtype) -> torch.Tensor:
    """[65536] integers, each holding the two `dtype` values that byte (index & 255) decodes to under scale byte
    (index >> 8), in byte order (low nibble's value first)."""
    scales = torch.arange(256, dtype=torch.uint8)
    data = torch.arange(256, dtype=torch.uint8)
    if layout == "FP4_E2M1":
        # one row per scale byte: all 256 data bytes, i.e. 16 groups, each under that scale
        packed = data.repeat(256, 1)
        scale = scales[:, None].expand(256, 256 // GROUP_BYTES).contiguous().view(torch.float8_e8m0fnu)
        values = source_formats.fp4_dequantize(packed, scale, dtype=torch.float32)  # [256, 512], pairs adjacent
    else:
        blocks = torch.cat([scales.repeat_interleave(256 // GROUP_BYTES)[:, None],
                            data.view(-1, GROUP_BYTES).repeat(256, 1)], 1)  # [4096, 17]
        decoded = quants.dequantize_torch(blocks.reshape(-1), "MXFP4", (256 * 256 // GROUP_BYTES, GROUP))
        # byte j of a block holds elements j (low nibble) and j + 16 (high nibble)
        values = torch.stack([decoded[:, :GROUP_BYTES], decoded[:, GROUP_BYTES:]], -1)
    pairs = values.reshape(65536, 2).to(dtype).contiguous()
    return pairs.view(torch.int64 if dtype.itemsize == 4 else torch.int32).reshape(65536)


def _load_native():
    """{table itemsize: C function} when the compiled lookup is available and agrees with torch, else None."""
    lib = quant_common.native_library("moepack_fp4_decode", _NATIVE_SOURCE)
    if lib is None:
        return None
    kernels = {}
    for itemsize, symbol in ((4, "fp4_decode_pairs32"), (8, "fp4_decode_pairs64")):
        fn = getattr(lib, symbol)
        fn.restype = None
        fn.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int64)
        kernels[itemsize] = fn
    # self-check: every scale byte and data byte, in the MXFP4 (strided) arrangement, against index_select
    table = torch.randint(-2**31, 2**31 - 1, (65536,), dtype=torch.int64)
    blocks = torch.randint(0, 256, (4096, MXFP4_BLOCK_BYTES), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    blocks[:, 0] = torch.arange(4096) % 256
    index = blocks[:, 1:].to(torch.int64) + blocks[:, :1].to(torch.int64) * 256
    for itemsize, dtype in ((4, torch.int32), (8, torch.int64)):
        t = table.to(dtype)
        out = torch.empty(4096 * GROUP_BYTES, dtype=dtype)
        kernels[itemsize](blocks[:, 1:].data_ptr(), MXFP4_BLOCK_BYTES, blocks.data_ptr(), MXFP4_BLOCK_BYTES,
                          t.data_ptr(), out.data_ptr(), 4096)
        if not torch.equal(out, t[index.reshape(-1)]):
            warnings.warn("moepack: the compiled FP4 decoder disagrees with torch; using torch")
            return None
    return kernels


_native_kernels = quant_common.LazyKernel(_load_native)


@dataclass
class ExpertWeights:
    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    input_order: torch.Tensor | None = None  # permute x's columns by this before w1/w3 (MXFP4 pair order)
    hidden_order: torch.Tensor | None = None  # permute the hidden activation's columns by this before w2

    def apply(self, cfg: "model.ModelConfig", x: torch.Tensor) -> torch.Tensor:
        """The expert on its tokens x [n, hidden]."""
        if self.input_order is not None:
            x = x[:, self.input_order]
        return model.expert_forward(cfg, x, self.w1, self.w3, self.w2, self.hidden_order)


class ExpertDecoder:
    """Decodes experts whose three matrices are FP4_E2M1 (+ E8M0 `.scale`) or MXFP4, into buffers reused from one
    expert to the next: an expert's weights are valid until the next `decode`."""

    def __init__(self, dtype: torch.dtype, device: torch.device, threads: int | None = None, native: bool = True):
        self.dtype = dtype
        self.device = device
        self._tables: dict[str, torch.Tensor] = {}
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._orders: dict[int, torch.Tensor] = {}
        # torch runs index_select on one core; on a CPU the lookups are split over this many threads instead
        self.threads = max(1, threads or torch.get_num_threads()) if device.type == "cpu" else 1
        self._pool = ThreadPoolExecutor(self.threads, "moepack-decode") if self.threads > 1 else None
        self._native = (_native_kernels() if device.type == "cpu" and native else None) or {}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    @staticmethod
    def layout(region: Region, prefix: str) -> str | None:
        """"FP4_E2M1" or "MXFP4" when all three matrices of the expert are in that layout (and nothing else in the
        region needs decoding), else None: the caller takes the generic path."""
        by_name = {t.name: t for t in region.tensors}
        layouts = set()
        for m in EXPERT_MATRICES:
            w = by_name.get(f"{prefix}{m}.weight")
            if w is None or len(w.shape) != 2 or w.shape[1] % GROUP:
                return None
            if w.dtype == "FP4_E2M1":
                s = by_name.get(f"{prefix}{m}.scale")
                if s is None or s.dtype != "F8_E8M0" or tuple(s.shape) != (w.shape[0], w.shape[1] // GROUP):
                    return None
            elif w.dtype != "MXFP4":
                return None
            layouts.add(w.dtype)
        expected = {f"{prefix}{m}.{kind}" for m in EXPERT_MATRICES
                    for kind in (("weight", "scale") if layouts == {"FP4_E2M1"} else ("weight",))}
        return layouts.pop() if len(layouts) == 1 and set(by_name) == expected else None

    def _buffer(self, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (role, dtype.itemsize)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel]

    def _table(self, layout: str) -> torch.Tensor:
        if layout not in self._tables:
            self._tables[layout] = _pair_table(layout, self.dtype).to(self.device)
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
        """For every (data [groups, 16] uint8, scale [groups] uint8, out) job: out = the table entries of
        (scale << 8 | byte), in equal pieces over the threads."""
        kernel = self._native.get(table.element_size())
        if kernel is not None:  # data and scale are read where they lie (any row stride)
            def native(piece):
                data, scale, out, a, b = piece
                kernel(data[a].data_ptr(), data.stride(0), scale[a:].data_ptr(), scale.stride(0), table.data_ptr(),
                       out[a * GROUP_BYTES:].data_ptr(), b - a)
            self._run(native, [(d, s, o, a, b) for d, s, o in jobs for a, b in self._pieces(len(d))])
            return
        pieces = []
        for m, (data, scale, out) in enumerate(jobs):
            index = self._index(str(m), data, scale)
            pieces += [(index[a:b], out[a:b]) for a, b in self._pieces(len(index))]
        self._run(lambda piece: torch.index_select(table, 0, piece[0], out=piece[1]), pieces)

    def decode(self, region: Region, layout: str, raw: torch.Tensor, base: int, prefix: str) -> ExpertWeights:
        """The expert of `region` (bytes in `raw`, which starts at file offset `base`)."""
        by_name = {t.name: t for t in region.tensors}

        def stored(name: str) -> torch.Tensor:
            t = by_name[name]
            return raw[t.file_offset - base: t.file_offset - base + t.length]

        table = self._table(layout)
        jobs, weights = [], {}
        for m in EXPERT_MATRICES:
            w = by_name[f"{prefix}{m}.weight"]
            rows, cols = w.shape
            if layout == "FP4_E2M1":
                data, scale = stored(w.name).view(-1, GROUP_BYTES), stored(f"{prefix}{m}.scale")
            else:
                blocks = stored(w.name).view(-1, MXFP4_BLOCK_BYTES)
                data, scale = blocks[:, 1:], blocks[:, 0]
            out = self._buffer(m, rows * cols // 2, table.dtype)
            jobs.append((data, scale, out))
            weights[m] = out.view(self.dtype).view(rows, cols)
        self._lookup(table, jobs)
        if layout == "FP4_E2M1":
            return ExpertWeights(weights["w1"], weights["w3"], weights["w2"])
        return ExpertWeights(weights["w1"], weights["w3"], weights["w2"],
                             self._order(weights["w1"].shape[1]), self._order(weights["w2"].shape[1]))
