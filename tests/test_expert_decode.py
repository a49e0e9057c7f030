"""The runtime's table decoder for FP4 experts gives the generic decode's values, bit for bit, for any bytes."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from moepack import native
from moepack.families.deepseek_v4 import model
from moepack.families.deepseek_v4.config import ModelConfig
from moepack.format_spec.decode import decode_group
from moepack.format_spec.reader import Container
from moepack.runtime import expert_decode
from moepack.runtime import expert_runner
from moepack.runtime.engine import PrefillOptions, prefill
from moepack.runtime.expert_decode import (FUSED_MAX_TOKENS, GROUP, NATIVE_LEVELS, ExpertDecoder, PackedMatrix,
                                           _nibble_table, _pair_order, _pair_table, default_fused_tokens,
                                           fused_available, native_levels)

from containers import tiny_policy_containers


@pytest.fixture(scope="module")
def fp4_containers(tmp_path_factory):
    """policy -> container: the release's FP4_E2M1 experts kept as they are, and repacked as MXFP4."""
    return tiny_policy_containers(tmp_path_factory.mktemp("expert_decode"), ("keep", "fp4"), seed=3)


def _compiler_usable() -> bool:
    return bool(native.c_compiler()) and os.environ.get(native.NATIVE_ENV, "1") != "0"


def test_the_best_kernel_this_cpu_runs_is_used():
    levels = native_levels()
    if not _compiler_usable():
        assert levels == []
        return
    assert levels and levels[0] == "scalar", native.native_builds()
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    if "avx512bw" in flags:  # x86 with AVX-512: every level was built and passed its self-check
        assert levels == list(NATIVE_LEVELS)
    assert ExpertDecoder(torch.bfloat16, torch.device("cpu")).native.name == levels[-1]
    with pytest.raises(ValueError, match="unknown FP4 lookup level"):
        ExpertDecoder(torch.bfloat16, torch.device("cpu"), native="avx9")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.dtype.itemsize == 2 else torch.int32)


@pytest.mark.parametrize("policy,layout", [("keep", "FP4_E2M1"), ("fp4", "MXFP4")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [*NATIVE_LEVELS, False], ids=[*NATIVE_LEVELS, "torch"])
def test_table_decode_equals_generic_decode_for_arbitrary_bytes(fp4_containers, policy, layout, dtype, native):
    with Container(fp4_containers[policy]) as c:
        block = c.layers[1]
        region = block.experts[2]
        names = model.EXPERT_NAMING.names(block.number, region.expert)
        assert ExpertDecoder.layout(region, names) == layout
        with open(c.path, "rb") as f:
            f.seek(region.offset)
            raw = torch.frombuffer(bytearray(f.read(region.length)), dtype=torch.uint8)
    decoder = ExpertDecoder(dtype, torch.device("cpu"), threads=3, native=native)  # uneven pieces: every split
    if native and native not in native_levels():
        # a level this CPU can't run; where a compiler is, plain C at least must be there
        assert native != "scalar" or not _compiler_usable(), native.native_builds()
        pytest.skip(f"this CPU does not run the {native} kernel")
    assert (decoder.native.name if decoder.native else False) == native
    for seed in range(3):  # the stored bytes, then random bytes everywhere: every scale byte 0..255 occurs
        if seed:
            raw = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        generic = decode_group(region.tensors, lambda t: raw[t.file_offset - region.offset:
                                                              t.file_offset - region.offset + t.length], dtype)
        fast = decoder.decode(region, layout, raw, region.offset, names)
        for role, m in (("gate", "w1"), ("up", "w3"), ("down", "w2")):  # ExpertWeights' own field names
            want = generic[names[role]]
            got = getattr(fast, m)
            if layout == "MXFP4":  # stored in pair order: column j is logical column order[j]
                want = want[:, _pair_order(want.shape[1])]
            assert got.dtype == dtype and torch.equal(_bits(got), _bits(want)), (m, seed)


def test_pair_order_is_a_permutation_within_each_block():
    order = _pair_order(96)
    assert sorted(order.tolist()) == list(range(96))
    assert order[:4].tolist() == [0, 16, 1, 17] and order[32:34].tolist() == [32, 48]
    assert all(o // 32 == j // 32 for j, o in enumerate(order.tolist()))


def test_layout_refuses_what_the_table_cannot_decode(fp4_containers):
    with Container(fp4_containers["keep"]) as c:
        block = c.layers[0]
        wrong = model.EXPERT_NAMING.names(block.number, 1)  # another expert's names
        assert ExpertDecoder.layout(block.experts[0], wrong) is None
        assert ExpertDecoder.layout(block.dense, model.EXPERT_NAMING.names(block.number, 0)) is None


@pytest.mark.parametrize("policy", ["keep", "fp4"])
@pytest.mark.parametrize("expert_dtype", ["float32", "bfloat16"])
def test_prefill_with_the_table_decoder_equals_the_generic_path(fp4_containers, monkeypatch, policy, expert_dtype):
    monkeypatch.setattr(expert_decode, "_fused_kernel", lambda: None)  # the lookup alone (the fused path: below)
    ids = torch.randint(0, 500, (70,), generator=torch.Generator().manual_seed(1))
    options = PrefillOptions(expert_dtype=expert_dtype)
    fast = prefill(fp4_containers[policy], ids, options).logits
    monkeypatch.setattr(expert_runner.ExpertDecoder, "layout", staticmethod(lambda region, names: None))
    generic = prefill(fp4_containers[policy], ids, options).logits
    if policy == "keep":  # same values in the same order: the same bits
        assert torch.equal(fast, generic)
    else:  # the same products summed in another order: in bfloat16, each sum rounded to its 8 bits (about 4e-3
        # apart where the two orders round apart: seen on an AMD EPYC without AVX512-BF16's kernels)
        tolerance = 1e-3 if expert_dtype == "float32" else 1e-2
        assert (fast - generic).abs().max() <= tolerance * generic.abs().max()


def _compiler_targets_avx512_bf16(tmp_path_factory) -> bool:
    """Whether the C compiler builds a function for AVX512-BF16 (an old one does not know the target)."""
    if not _compiler_usable():
        return False
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "probe_avx512_bf16.c")
    obj = tmp_path_factory.mktemp("probe") / "probe.o"
    cc = native.c_compiler()
    return subprocess.run([cc, "-c", "-O1", src, "-o", str(obj)], capture_output=True).returncode == 0


def _needs_fused(tmp_path_factory):
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    if not fused_available():
        # where the CPU has AVX512-BF16 and the compiler can target it, the kernel must have built and passed its
        # check: a broken kernel fails here rather than skipping every fused test
        cpu = "avx512_bf16" in flags and "avx512bw" in flags
        assert not (cpu and _compiler_targets_avx512_bf16(tmp_path_factory)), \
            native.native_builds().get("moepack_fp4_linear")
        pytest.skip("no fused FP4 matmul here (needs AVX512-BF16 and a C compiler)")


@pytest.mark.parametrize("rows,cols,tokens", [(4, 32, 1), (7, 96, 13), (9, 64, 6), (16, 256, FUSED_MAX_TOKENS)])
def test_fused_matmul_equals_a_float64_matmul_on_the_decoded_matrix(rows, cols, tokens, tmp_path_factory):
    _needs_fused(tmp_path_factory)
    gen = torch.Generator().manual_seed(rows * cols + tokens)
    blocks = torch.randint(0, 256, (rows * cols // GROUP, 17), dtype=torch.uint8, generator=gen)  # strided groups
    blocks[:, 0] = torch.randint(112, 140, (len(blocks),), dtype=torch.uint8, generator=gen)
    table = _nibble_table("FP4_E2M1", torch.bfloat16).contiguous()
    matrix = PackedMatrix(blocks[:, 1:], blocks[:, 0], table, rows, cols)
    x = torch.randn(tokens, cols, generator=gen).to(torch.bfloat16).float()  # bf16 values, float32 result
    got = expert_decode._fused_kernel().matmul(x, matrix, torch.empty(4 * cols, dtype=torch.bfloat16))
    index = (blocks[:, 1:].to(torch.int64) + blocks[:, :1].to(torch.int64) * 256).reshape(-1)
    w = _pair_table(table)[index].view(torch.bfloat16).reshape(rows, cols)
    want = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (tokens, rows)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("policy,layout", [("keep", "FP4_E2M1"), ("fp4", "MXFP4")])
def test_fused_expert_matches_the_decoded_expert(fp4_containers, policy, layout, tmp_path_factory):
    _needs_fused(tmp_path_factory)
    with Container(fp4_containers[policy]) as c:
        cfg = ModelConfig.from_hf(c.config)
        block = c.layers[1]
        region = block.experts[2]
        names = model.EXPERT_NAMING.names(block.number, region.expert)
        with open(c.path, "rb") as f:
            f.seek(region.offset)
            raw = torch.frombuffer(bytearray(f.read(region.length)), dtype=torch.uint8)
    decoder = ExpertDecoder(torch.bfloat16, torch.device("cpu"))
    for tokens in (1, 7, FUSED_MAX_TOKENS, FUSED_MAX_TOKENS + 1):
        x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
        packed = decoder.decode(region, layout, raw, region.offset, names, tokens=tokens)
        assert isinstance(packed.w1, PackedMatrix) == (tokens <= FUSED_MAX_TOKENS)
        got = packed.apply(x, **model.expert_arithmetic(cfg))
        full = decoder.decode(region, layout, raw, region.offset, names)  # decoded: the exact weights
        order = full.input_order if full.input_order is not None else slice(None)
        want = model.expert_forward(cfg, x[:, order].double(), full.w1.double(), full.w3.double(), full.w2.double(),
                                    full.hidden_order)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        # bf16 rounding of the inputs to each matmul and of its result, as the decoded bf16 path has
        assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max(), tokens
        # into the engine's float32 rows: the fused kernel writes them itself, the same sums before rounding
        rows = torch.full((tokens + 2, cfg.hidden_size), 7.0)
        into = packed.apply(x, rows[1:-1], **model.expert_arithmetic(cfg))
        assert into.data_ptr() == rows[1].data_ptr() and torch.equal(into.to(torch.bfloat16), got)
        assert torch.equal(rows[0], rows[-1]) and rows[0].eq(7.0).all()  # nothing written around them
    with pytest.raises(ValueError, match="float32"):
        packed = decoder.decode(region, layout, raw, region.offset, names, tokens=3)
        packed.apply(torch.zeros(3, cfg.hidden_size, dtype=torch.bfloat16), torch.empty(3, 5),
                     **model.expert_arithmetic(cfg))


def test_default_fused_tokens_keep_the_inputs_in_l2(tmp_path, monkeypatch):
    """Without a measured crossover the fused kernel runs while a token tile's input rows (bf16) fit in L2."""
    for index, (level, size) in enumerate([("1", "48K"), ("2", "2048K"), ("3", "32M")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(level + "\n")
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert expert_decode.l2_cache_bytes(str(tmp_path)) == 2 << 20
    assert expert_decode.l2_cache_bytes(str(tmp_path / "missing")) == 1 << 20
    monkeypatch.setattr(expert_decode, "l2_cache_bytes", lambda: 1 << 20)
    assert [default_fused_tokens(h) for h in (64, 1024, 2048, 4096, 7168, 1 << 20)] == \
        [FUSED_MAX_TOKENS, 256, 256, 128, 73, expert_decode.FUSED_ROWS]


def test_prefill_with_the_fused_experts_stays_close_to_the_decoded_path(fp4_containers, monkeypatch,
                                                                        tmp_path_factory):
    _needs_fused(tmp_path_factory)
    ids = torch.randint(0, 500, (70,), generator=torch.Generator().manual_seed(1))
    options = PrefillOptions(compute_dtype="bfloat16", expert_selection="all")
    calls = []
    real_expert = expert_decode.FusedKernels.expert
    monkeypatch.setattr(expert_decode.FusedKernels, "expert",
                        lambda self, *args, **kw: calls.append(len(args[0])) or real_expert(self, *args, **kw))
    fused = prefill(fp4_containers["keep"], ids, options)
    with Container(fp4_containers["keep"]) as c:
        limit = default_fused_tokens(c.config["hidden_size"])
    assert (fused.stats["fused_expert_max_tokens"], fused.stats["fused_expert_max_tokens_source"]) == (limit, "default")
    assert calls and max(calls) <= limit  # the experts did run through the fused kernel
    monkeypatch.undo()
    monkeypatch.setattr(expert_decode, "_fused_kernel", lambda: None)
    decoded = prefill(fp4_containers["keep"], ids, options)
    assert decoded.stats["fused_expert_max_tokens"] == 0
    exact = prefill(fp4_containers["keep"], ids, PrefillOptions(expert_selection="all")).logits
    scale = exact.abs().max()
    # the fused path is as close to the float32 path as the decoded bf16 path is (bf16 products either way)
    assert (fused.logits - exact).abs().max() <= max(3e-2 * scale, 2 * (decoded.logits - exact).abs().max())
