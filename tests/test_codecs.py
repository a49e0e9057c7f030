"""The codec registry (format_spec/codecs.py): one class per storage type, and a type defined anywhere (here, a toy
one) is known to everything that lists or dispatches on types without touching another file."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from moepack import MoepackError
from moepack.format_spec import codecs, decode, dtypes, quants
from moepack.format_spec.codecs import Codec
from moepack.format_spec.errors import FormatError
from moepack.format_spec.reader import Container
from moepack.format_spec.writer import ContainerWriter

EXPECTED = {  # name: (block_elems, block_bytes, can quantize)
    "F32": (1, 4, False), "F16": (1, 2, False), "BF16": (1, 2, False), "F64": (1, 8, False),
    "I64": (1, 8, False), "I32": (1, 4, False), "I16": (1, 2, False), "I8": (1, 1, False), "U8": (1, 1, False),
    "BOOL": (1, 1, False), "F8_E4M3": (1, 1, False), "F8_E5M2": (1, 1, False), "F8_E8M0": (1, 1, False),
    "FP4_E2M1": (2, 1, False), "Q8_0": (32, 34, True), "MXFP4": (32, 17, True), "NVFP4": (64, 36, True),
    "Q2_K": (256, 84, True), "IQ2_XXS": (256, 66, True),
}


def test_the_registry_lists_exactly_the_storage_types():
    assert list(codecs.REGISTRY) == list(EXPECTED)  # in definition order (listings, the fuzzer's choices)
    for name, (be, bb, quantizes) in EXPECTED.items():
        c = codecs.REGISTRY[name]
        assert issubclass(c, Codec) and c.name == name
        assert (c.block_elems, c.block_bytes, c.can_quantize()) == (be, bb, quantizes)
    assert dtypes.STORAGE_TYPES is codecs.REGISTRY
    assert tuple(quants.QTYPES) == ("Q8_0", "MXFP4", "NVFP4", "Q2_K", "IQ2_XXS")
    assert set(dtypes.FROM_SAFETENSORS) == {n for n, (be, _, q) in EXPECTED.items() if be == 1}
    assert set(decode.TORCH_DTYPES) == set(dtypes.FROM_SAFETENSORS)


def test_every_codec_decodes_and_every_quantizer_runs():
    # the kernels and torch dtypes are imported when first used (codecs.py imports no torch): use each once
    for name, c in codecs.REGISTRY.items():
        shape = (2, 2 * c.block_elems)
        raw = torch.zeros(c.nbytes(shape), dtype=torch.uint8)
        assert decode.decode_tensor(name, shape, raw).shape == shape, name
        if c.block_elems == 1:
            assert isinstance(c.torch_dtype, torch.dtype) and c.torch_dtype.itemsize == c.block_bytes, name
        if c.can_quantize():
            x = torch.linspace(-1, 1, 2 * shape[1]).reshape(shape)
            y = quants.dequantize_torch(quants.quantize_torch(x, name), name, shape)
            assert float((y - x).abs().max()) < 0.5, name
        if c.native_quantizer is not None:
            c.native_quantizer()  # the kernel, or None without a C compiler


def test_reading_a_container_needs_no_torch():
    code = "import sys, moepack.format_spec.reader, moepack.format_spec.dtypes; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="already defined"):
        class Again(Codec):  # noqa: F811
            name = "Q8_0"
            block_bytes = 34
    with pytest.raises(ValueError, match="block_bytes"):
        class NoBytes(Codec):
            name = "TOY_NO_BYTES"
    assert "TOY_NO_BYTES" not in codecs.REGISTRY and codecs.REGISTRY["Q8_0"].block_bytes == 34
    with pytest.raises(TypeError):
        codecs.REGISTRY["F32"]()


# ------------------------------------------------------------------------------------------- a toy type

def _toy_quantize(x: torch.Tensor, out: torch.Tensor) -> None:
    """(nb, 4) float32 -> (nb, 6): f16 scale max|x|/127, then 4 int8 codes."""
    d = (x.abs().amax(1) / 127).to(torch.float16)
    inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    out.view(torch.float16)[:, 0] = d
    out[:, 2:].view(torch.int8).copy_(torch.round(x * inv[:, None]))


def _toy_dequantize(blocks: torch.Tensor, out: torch.Tensor) -> None:
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    out.copy_(blocks[:, 2:].view(torch.int8).float() * d)


@pytest.fixture
def toy():
    class TOY8(Codec):  # defining the class is all it takes
        name = "TOY8"
        block_elems = 4
        block_bytes = 6
        description = "toy: f16 scale + 4 int8"
        quantize_chunk = staticmethod(_toy_quantize)
        dequantize_chunk = staticmethod(_toy_dequantize)
        quantize_elems = dequantize_elems = 64  # several chunks
        max_rel_rmse = 0.02

    try:
        yield TOY8
    finally:
        codecs.unregister("TOY8")
    assert "TOY8" not in dtypes.STORAGE_TYPES and "TOY8" not in quants.QTYPES


def test_a_new_codec_class_is_known_everywhere(toy, tmp_path):
    assert dtypes.storage_type("TOY8") is toy and dtypes.STORAGE_TYPES["TOY8"] is toy
    assert list(codecs.REGISTRY)[-1] == "TOY8" and "TOY8" in quants.QTYPES
    assert dtypes.tensor_nbytes("TOY8", [3, 8]) == 3 * 2 * 6
    with pytest.raises(FormatError, match="block of 4"):
        dtypes.tensor_nbytes("TOY8", [3, 6])
    assert quants.block_layout("TOY8") == (4, 6) and quants.quantized_nbytes("TOY8", (5, 16)) == 120

    x = np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)
    q = quants.quantize(x, "TOY8")
    assert q.shape == (40, 24) and q.dtype == np.uint8
    ref = torch.empty(160, 6, dtype=torch.uint8)
    _toy_quantize(torch.from_numpy(x).reshape(-1, 4), ref)
    assert np.array_equal(q.reshape(-1, 6), ref.numpy())
    y = quants.dequantize(q, "TOY8", x.shape)
    assert np.abs(y - x).max() <= np.abs(x).max() / 127
    with pytest.raises(MoepackError, match="not a multiple of its block of 4"):
        quants.quantize(x[:, :6], "TOY8")

    # the converter's encode, the decoder, and a container written and validated by the reader
    blocks, exponent = toy.encode(torch.from_numpy(x))
    assert exponent is None and np.array_equal(blocks.numpy(), q)
    assert np.array_equal(decode.decode_tensor("TOY8", x.shape, q.tobytes()).numpy(), y)
    assert np.array_equal(decode.decode_rows("TOY8", x.shape, q.tobytes(), slice(3, 7)).numpy(), y[3:7])
    path = str(tmp_path / "toy.moepack")
    w = ContainerWriter(path)
    w.begin_region("global", tensor="toy.weight")
    w.add_tensor("toy.weight", "TOY8", list(x.shape), q.tobytes())
    w.end_region()
    w.finish(config={"model_type": "toy"}, architecture="toy", policy={"name": "keep"}, provenance={"source": "test"})
    with Container(path) as c:
        assert c.tensors["toy.weight"].dtype == "TOY8"
        t = c.tensors["toy.weight"]
        assert np.array_equal(decode.decode_tensor(t.dtype, t.shape, c.tensor_bytes(t.name)).numpy(), y)

    codecs.unregister("TOY8")
    try:  # without its class, the same file names an unknown type
        with pytest.raises(FormatError, match="TOY8"):
            Container(path)
    finally:
        codecs.register(toy)


def test_fp4_values_without_a_scale_copy_their_table_to_the_device_once():
    """FP4_E2M1's unscaled decode on a GPU (the meta device stands in): the e2m1 table goes there on the first
    call only, not on every call."""
    from host_copies import HostToDevice

    raw = torch.zeros(2, 8, dtype=torch.uint8, device="meta")
    dtypes.storage_type("FP4_E2M1").decode_checked(raw, (2, 16))
    with HostToDevice() as later:
        values = dtypes.storage_type("FP4_E2M1").decode_checked(raw, (2, 16))
    assert values.shape == (2, 16) and values.device.type == "meta" and values.dtype == torch.float32
    assert later.copies == []


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_decode_float_into_a_buffer_gives_the_values_it_gives_alone(out_dtype):
    """decode_float's `out` (a buffer a CPU prefill reuses from one expert to the next: no fresh pages each time):
    every float type decodes to the same bits with it as without; FP8 under either kind of block scale, the ggml
    block types and a plain type of another dtype end in the buffer itself; a plain type of the same dtype stays a
    view of its bytes."""
    gen = torch.Generator().manual_seed(4)
    into = set()
    for name, c in codecs.REGISTRY.items():
        if name in decode.INTEGER_TYPES:
            continue
        shape = (256, max(8 * c.block_elems, 64)) if c.block_elems > 1 else (256, 260)
        raw = torch.randint(0, 256, (c.nbytes(shape),), dtype=torch.uint8, generator=gen)
        if name in ("F32", "F16", "BF16", "F64"):  # finite values (random bytes of these are NaN often)
            raw = torch.randn(shape, generator=gen).to(c.torch_dtype).view(torch.uint8).reshape(-1)
        if name == "F8_E8M0":
            continue  # (a scale type: no weight decodes through it)
        scales = [None]
        if name == "F8_E4M3":
            e8m0 = torch.randint(100, 140, (2, 3), dtype=torch.uint8, generator=gen).view(torch.float8_e8m0fnu)
            scales = [None, e8m0, torch.rand(2, 3, generator=gen).to(torch.bfloat16)]
        if name == "FP4_E2M1":
            scales = [torch.randint(110, 130, (256, shape[1] // 32), dtype=torch.uint8,
                                    generator=gen).view(torch.float8_e8m0fnu)]
        for scale in scales:
            alone = decode.decode_float(name, shape, raw, scale, out_dtype)
            buffer = torch.full(shape, float("nan"), dtype=out_dtype)
            got = decode.decode_float(name, shape, raw, scale, out_dtype, out=buffer)
            bits = torch.int16 if out_dtype.itemsize == 2 else torch.int32
            assert got.dtype == out_dtype and torch.equal(got.view(bits), alone.view(bits)), name
            if got.data_ptr() == buffer.data_ptr():
                into.add(name if scale is None else f"{name} {scale.dtype}")
            elif got.data_ptr() == raw.data_ptr():
                assert c.torch_dtype == out_dtype, name
    fp8 = {"F8_E4M3 torch.float8_e8m0fnu", "F8_E4M3 torch.bfloat16"}
    ggml = {"Q8_0", "MXFP4", "NVFP4", "Q2_K", "IQ2_XXS"}  # (bfloat16: through a float32 tensor of their own)
    plain = {n for n in ("F32", "F16", "BF16", "F64", "F8_E4M3", "F8_E5M2")
             if codecs.REGISTRY[n].torch_dtype != out_dtype}
    assert into == fp8 | ggml | plain
