"""The grouped expert backend (backends/grouped_experts.py) equals the per-expert path, for every storage type the
container holds experts in: decode_stacked against decode_group bit for bit, a layer's grouped GEMMs against each
expert's own matmuls, and whole prefills against the per-expert runner. torch's grouped GEMM runs on the CPU too."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from moepack.backends import grouped_experts
from moepack.backends.grouped_experts import GroupedExperts, grouped_matmul, resolve_expert_backend
from moepack.families.deepseek_v4 import model
from moepack.format_spec import source_formats
from moepack.format_spec.decode import decode_group, decode_stacked
from moepack.format_spec.dtypes import storage_type
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container
from moepack.runtime.engine import PrefillOptions, model_config, prefill

from containers import tiny_policy_containers

# policy -> what its experts are stored as: the release's FP4_E2M1 kept, MXFP4, NVFP4 with tensor scales, Q8_0,
# IQ2_XXS gate / up with a Q2_K down, BF16
POLICIES = ("keep", "fp4", "nvfp4", "q8", "q2", "bf16")


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    return tiny_policy_containers(tmp_path_factory.mktemp("grouped"), POLICIES, seed=5)


# --- decode_stacked: G experts' bytes side by side, decoded as one tensor ------------------------------------------

def _entries(dtype: str, groups: int, rows: int, cols: int, seed: int):
    """(groups as (prefix, entries), read, expected per group): `groups` tensors `g{i}.w` stored as `dtype` with
    the companions that type takes, at arbitrary offsets in one byte buffer."""
    gen = torch.Generator().manual_seed(seed)
    blobs, entries, offset = [], [], 0

    def put(name, type_, shape, data: torch.Tensor):
        nonlocal offset
        data = data.contiguous().reshape(-1).view(torch.uint8)
        entries.append(SimpleNamespace(name=name, dtype=type_, shape=tuple(shape), offset=offset, length=data.numel()))
        blobs.append(data)
        gap = 16 + (-data.numel()) % 16  # a gap between entries: the stacking must not rely on their being adjacent
        offset += data.numel() + gap
        blobs.append(torch.zeros(gap, dtype=torch.uint8))

    groups_out = []
    for g in range(groups):
        values = torch.randn(rows, cols, generator=gen) * (g + 1)
        name = f"g{g}.w.weight"
        first = len(entries)
        if dtype == "F8_E4M3":
            weight, scale = source_formats.fp8_block_quantize(values)
            put(name, dtype, (rows, cols), weight)
            put(f"g{g}.w.scale", "F8_E8M0", scale.shape, scale)
        elif dtype == "FP4_E2M1":
            packed, scale = source_formats.fp4_quantize(values)
            put(name, dtype, (rows, cols), packed)
            put(f"g{g}.w.scale", "F8_E8M0", scale.shape, scale)
        else:
            stored, exponent = storage_type(dtype).encode(values)
            put(name, dtype, (rows, cols), stored)
            if exponent is not None:
                put(f"g{g}.w.tensor_scale", "F32", (), torch.tensor(2.0 ** exponent))
        groups_out.append((f"g{g}.", entries[first:]))
    raw = torch.cat(blobs)

    def read(t):
        return raw[t.offset:t.offset + t.length]
    return groups_out, read


@pytest.mark.parametrize("dtype,rows", [("F32", 16), ("F16", 16), ("BF16", 16), ("F8_E4M3", 256), ("F8_E4M3", 200),
                                        ("FP4_E2M1", 16), ("Q8_0", 16), ("MXFP4", 16), ("NVFP4", 16), ("Q2_K", 8),
                                        ("IQ2_XXS", 8)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_stacked_decode_equals_each_tensor_decoded_alone(dtype, rows, out_dtype):
    cols = 256
    groups, read = _entries(dtype, 3, rows, cols, seed=rows)
    stacked = decode_stacked(groups, read, ["w.weight"], out_dtype)["w.weight"]
    assert stacked.shape == (3, rows, cols) and stacked.dtype == out_dtype
    for g, (prefix, entries) in enumerate(groups):
        alone = decode_group(entries, read, out_dtype)[prefix + "w.weight"]
        assert torch.equal(stacked[g].view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                           alone.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)), g


def test_stacked_decode_names_a_missing_tensor():
    groups, read = _entries("F32", 2, 4, 32, seed=0)
    with pytest.raises(MoepackError, match="g0.w.bias is missing"):
        decode_stacked(groups, read, ["w.bias"])


# --- the grouped GEMM -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_equals_a_matmul_per_group_with_empty_groups(dtype, monkeypatch):
    a = torch.randn(40, 64).to(dtype)
    b = torch.randn(4, 48, 64).to(dtype)  # [G, N, K] as stored; the GEMM takes it transposed
    counts = [10, 0, 25, 5]
    got = grouped_matmul(a, b.transpose(1, 2), counts)
    first = 0
    for g, n in enumerate(counts):
        want = a[first:first + n] @ b[g].T
        torch.testing.assert_close(got[first:first + n], want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
        first += n
    # the fallback (one matmul per group) gives the same
    monkeypatch.setattr(grouped_experts, "grouped_mm_refusal", lambda *args, **kw: "off")
    torch.testing.assert_close(grouped_matmul(a, b.transpose(1, 2), counts), got, rtol=1e-2, atol=1e-2)


def test_cudas_grouped_gemm_checks_refuse_what_its_kernel_refuses():
    """grouped_mm_refusal(as_cuda=True) on CPU tensors: the checks of torch's CUDA grouped GEMM (GroupedBlas.cpp,
    GroupedMMUtils.h, GroupMM.cu), each refused operand named; the operands as the backends lay them taken."""
    refusal = grouped_experts.grouped_mm_refusal
    a = torch.randn(40, 64).to(torch.bfloat16)
    b = torch.randn(4, 48, 64).to(torch.bfloat16).transpose(1, 2)  # [G, K, N], column-major as stored
    offs = torch.tensor([10, 10, 35, 40], dtype=torch.int32)
    assert refusal(a, b, offs, as_cuda=True) is None
    assert refusal(a, b.contiguous(), offs, as_cuda=True) is None  # row-major b: another kernel, also taken
    assert "dtypes" in refusal(a.float(), b.float(), offs, as_cuda=True)  # CUDA's kernel: bf16 only
    assert refusal(a.float(), b.float(), offs, as_cuda=False) is None  # torch's CPU loop takes float32
    assert "aligned" in refusal(a.view(-1)[4:4 + 39 * 64].view(39, 64), b, offs, as_cuda=True)
    assert "K = 60" in refusal(a[:, :60], b[:, :60], offs, as_cuda=True)  # K of 120 bytes
    assert "a's strides" in refusal(torch.randn(40, 68).to(torch.bfloat16)[:, :64], b, offs, as_cuda=True)
    sparse = torch.randn(4, 64, 96).to(torch.bfloat16)[:, :, ::2]  # neither of its last dimensions dense
    assert "b's strides" in refusal(a, sparse, offs, as_cuda=True)
    many = torch.zeros(1024, 64, 48, dtype=torch.bfloat16)
    assert "groups" in refusal(a, many, torch.zeros(1024, dtype=torch.int32), as_cuda=True)
    assert refusal(a, many[:1023], torch.zeros(1023, dtype=torch.int32), as_cuda=True) is None
    assert "offsets" in refusal(a, b, offs.long(), as_cuda=True)
    assert "offsets" in refusal(a, b, offs[:3], as_cuda=True)
    assert "no rows" in refusal(a[:0], b, offs, as_cuda=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_grouped_gemm_refuses_what_grouped_mm_refusal_names_and_computes_what_it_takes():
    """On the device: torch's own grouped GEMM raises for the operands grouped_mm_refusal names for their layout
    (alignment, strides, group count), and for those it takes gives each group's matmul, empty groups (most of
    the pool's) included."""
    if grouped_experts.grouped_mm_refusal(torch.empty(1, 16, dtype=torch.bfloat16, device="cuda"),
                                          torch.empty(1, 16, 16, dtype=torch.bfloat16, device="cuda")):
        pytest.skip("this GPU has no grouped GEMM kernel torch runs without the host (sm_90 / sm_100)")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def bf16(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    def offsets(counts):
        return torch.tensor(counts, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    a, b = bf16(40, 64), bf16(4, 48, 64).transpose(1, 2)
    counts = [10, 0, 25, 5]
    pool = bf16(768, 32, 64).transpose(1, 2)  # the pool's shape of call: a few rows, most groups empty
    pool_counts = [0] * 768
    pool_counts[3], pool_counts[500], pool_counts[767] = 2, 3, 1
    taken = [(a, b, counts), (a, b.contiguous(), counts), (a[:6], pool, pool_counts)]
    for x, w, n in taken:
        assert grouped_experts.grouped_mm_refusal(x, w, offsets(n)) is None
        got = grouped_experts._GROUPED_MM(x, w, offs=offsets(n))
        first = 0
        for g, rows in enumerate(n):
            torch.testing.assert_close(got[first:first + rows].float(), (x[first:first + rows] @ w[g]).float(),
                                       rtol=2e-2, atol=2e-2)
            first += rows
    # (not a misaligned data pointer: a torch without that host check would run the kernel into a device fault
    # that ends every test after it)
    refused = [(bf16(40, 68)[:, :64], b, counts),  # a row stride of 136 bytes
               (a[:, :60].contiguous(), b[:, :60], counts),  # K of 120 bytes
               (a, bf16(1024, 48, 64).transpose(1, 2), [40] + [0] * 1023)]  # 1024 groups
    for x, w, n in refused:
        assert grouped_experts.grouped_mm_refusal(x, w, offsets(n)) is not None
        with pytest.raises(RuntimeError):
            grouped_experts._GROUPED_MM(x, w, offs=offsets(n))
            torch.cuda.synchronize()


def test_every_grouped_gemm_of_a_bf16_grouped_prefill_meets_cudas_checks(containers, monkeypatch):
    """The grouped backend's calls, as a GPU would make them (bf16 experts): each satisfies CUDA's grouped GEMM
    (grouped_mm_refusal(as_cuda=True) finds nothing), one call per GEMM and read, none through the loop."""
    real, calls = grouped_experts._GROUPED_MM, []

    def checked(a, b, offs):
        calls.append(grouped_experts.grouped_mm_refusal(a, b, offs, as_cuda=True))
        return real(a, b, offs=offs)
    monkeypatch.setattr(grouped_experts, "_GROUPED_MM", checked)
    prefill(containers["keep"], list(range(3, 60)), PrefillOptions(expert_dtype="bfloat16", expert_backend="grouped",
                                                                  bundle_experts=3))
    assert calls and calls == [None] * len(calls)


def test_backend_choice():
    assert resolve_expert_backend("auto", torch.device("cpu")) == "per-expert"
    assert resolve_expert_backend("auto", torch.device("cuda", 0)) == "grouped"
    assert resolve_expert_backend("grouped", torch.device("cpu")) == "grouped"
    with pytest.raises(MoepackError, match="unknown expert backend 'fast'"):
        resolve_expert_backend("fast", torch.device("cpu"))


# --- a layer: the grouped GEMMs against each expert's own matmuls ------------------------------------------------

def _reference_layer(path: str, block_number: int, routing, dtype: torch.dtype) -> torch.Tensor:
    """The routed experts of `routing`, each decoded alone (decode_group) and run alone (model.expert_forward),
    summed per token with the routing weights: the per-expert path."""
    with Container(path) as c:
        cfg = model_config(c)
        block = c.layers[block_number]
        out = torch.zeros(routing.x.shape, dtype=torch.float64)
        x = routing.x.to(dtype)
        for e, batch in routing.tokens_by_expert().items():
            region = block.experts[e]
            w = decode_group(region.tensors, lambda t: c.tensor_bytes(t.name), dtype)
            prefix = model.EXPERT_NAMING.prefix(block.number, e)
            y = model.expert_forward(cfg, x[batch.token_index], w[prefix + "w1.weight"], w[prefix + "w3.weight"],
                                     w[prefix + "w2.weight"])
            out.index_add_(0, batch.token_index, y.double() * batch.weight[:, None].double())
    return out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("expert_dtype", ["float32", "bfloat16"])
def test_each_layer_of_the_grouped_backend_equals_the_per_expert_path(containers, monkeypatch, policy, expert_dtype):
    seen = []
    real = GroupedExperts.run_layer

    def recording(self, block, reads, routing, beside=()):
        combined, results = real(self, block, reads, routing, beside)
        seen.append((int(block.name.split(".")[1]), routing, combined.clone()))
        return combined, results
    monkeypatch.setattr(GroupedExperts, "run_layer", recording)
    # bundles of 3 experts: reads that are not the whole layer, and experts no token chose among them
    prefill(containers[policy], list(range(3, 60)), PrefillOptions(expert_dtype=expert_dtype, expert_backend="grouped",
                                                                  bundle_experts=3))
    assert seen and len(seen) == len(Container(containers[policy]).layers)
    dtype = getattr(torch, expert_dtype)
    for number, routing, got in seen:
        want = _reference_layer(containers[policy], number, routing, dtype)
        scale = want.abs().max().item()
        tolerance = 1e-5 if expert_dtype == "float32" else 2e-2  # bf16: another order of float32 sums, rounded
        assert (got.double() - want).abs().max().item() <= tolerance * scale, (policy, number)


# --- whole prefills -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["keep", "q2"])
def test_prefill_with_the_grouped_backend_equals_the_per_expert_runner(containers, policy):
    ids = list(range(7, 71))
    per_expert = prefill(containers[policy], ids, PrefillOptions(expert_backend="per-expert"))
    grouped = prefill(containers[policy], ids, PrefillOptions(expert_backend="grouped", bundle_experts=5))
    assert grouped.stats["expert_backend"] == "grouped" and per_expert.stats["expert_backend"] == "per-expert"
    torch.testing.assert_close(grouped.logits, per_expert.logits, rtol=1e-4, atol=1e-4)
    assert grouped.next_token == per_expert.next_token
    assert grouped.stats["bytes_read"] == per_expert.stats["bytes_read"]  # each region read once either way


def test_grouped_backend_refuses_a_damaged_expert(containers, tmp_path):
    damaged = tmp_path / "damaged.moepack"
    data = bytearray(open(containers["q8"], "rb").read())
    with Container(containers["q8"]) as c:
        region = c.layers[1].experts[2]
        data[region.offset + 5] ^= 0xFF
    damaged.write_bytes(data)
    with pytest.raises(MoepackError, match="checksum mismatch"):
        prefill(str(damaged), list(range(3, 40)), PrefillOptions(expert_backend="grouped", expert_selection="all"))


def test_cli_prefill_takes_the_expert_backend(containers, tmp_path):
    from click.testing import CliRunner

    from moepack.cli.main import cli

    ids = tmp_path / "ids.txt"
    ids.write_text("5 6 7 8 9 10 11 12")
    for backend in ("grouped", "per-expert"):
        result = CliRunner().invoke(cli, ["prefill", containers["fp4"], "--token-ids", str(ids), "--expert-backend",
                                          backend, "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["expert_backend"] == backend


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_grouped_prefill_matches_the_cpu(containers, policy):
    """On the device: every storage type decoded there, torch's CUDA grouped GEMM (bf16), against the CPU's
    float32 per-expert path, within bf16's tolerance."""
    ids = list(range(7, 71))
    cpu = prefill(containers[policy], ids, PrefillOptions(expert_backend="per-expert"))
    cuda = prefill(containers[policy], ids, PrefillOptions(device="cuda", compute_dtype="bfloat16",
                                                          expert_backend="grouped", bundle_experts=4))
    assert cuda.stats["expert_backend"] == "grouped"
    scale = cpu.logits.abs().max().item()
    assert (cuda.logits - cpu.logits).abs().max().item() <= 0.05 * scale


@pytest.mark.parametrize("storage", ["FP4_E2M1", "NVFP4", "Q8_0"])
def test_bench_compute_measures_the_grouped_backend(storage):
    from moepack.tools.bench import bench_compute

    r = bench_compute("cpu", [4, 16], storage=storage, hidden=256, intermediate=256, expert_dtype="bfloat16",
                      experts=3, repeat=1, save=False, expert_backend="grouped")
    assert r["expert_backend"] == "grouped" and r["experts"] == 3
    assert [p["tokens_per_expert"] for p in r["points"]] == [4, 16]
    # both rates measured (finite, positive); how they compare is a timing, one repeat on a shared machine: not
    # asserted here (a matmul-alone pass descheduled once read under half the whole pass's rate)
    assert all(0 < p["gflops"] < float("inf") and 0 < p["matmul_gflops"] < float("inf") for p in r["points"])
    assert bench_compute("cpu", [4], storage=storage, hidden=256, intermediate=256, repeat=1,
                         save=False)["expert_backend"] == "per-expert"  # auto on a CPU


def test_the_gpu_query_chunk_gives_the_cpu_chunk_logits(containers, monkeypatch):
    """A GPU runs its attention in larger query chunks (model.preferred_query_chunk): the same arithmetic per
    query, so the same logits within float32 rounding."""
    ids = [3 + i % 500 for i in range(700)]  # chunks of 256 against one of 1024
    options = PrefillOptions(expert_selection="all", query_chunk=None)
    small = prefill(containers["bf16"], ids, options)
    monkeypatch.setattr(model, "preferred_query_chunk", lambda cfg, device: model.GPU_QUERY_CHUNK)
    large = prefill(containers["bf16"], ids, options)
    torch.testing.assert_close(large.logits, small.logits, rtol=1e-4, atol=1e-4)
    assert model.preferred_query_chunk(model_config(Container(containers["bf16"])), torch.device("cuda")) == 1024


def test_float32_matmuls_use_tf32_only_on_a_gpu_with_bf16_compute():
    from moepack.runtime.engine import float32_matmuls_on_tensor_cores

    before = torch.backends.cuda.matmul.allow_tf32
    for device, dtype, inside in ((torch.device("cpu"), torch.bfloat16, before),
                                  (torch.device("cuda", 0), torch.float32, before),
                                  (torch.device("cuda", 0), torch.bfloat16, True)):
        with float32_matmuls_on_tensor_cores(device, dtype):
            assert torch.backends.cuda.matmul.allow_tf32 == inside
        assert torch.backends.cuda.matmul.allow_tf32 == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_decode_in_index_chunks_equals_one_lookup(monkeypatch, dtype):
    packed, scale = source_formats.fp4_quantize(torch.randn(48, 256))
    whole = source_formats.fp4_dequantize(packed, scale, dtype=dtype)
    monkeypatch.setattr(source_formats, "FP4_INDEX_CHUNK", 1000)  # 6144 bytes: seven lookups, the last partial
    assert torch.equal(source_formats.fp4_dequantize(packed, scale, dtype=dtype), whole)
