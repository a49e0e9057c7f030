"""The compiled token matmul (backends/token_kernels.py, native/token_matmul.c): decode's linears and a token's
routed experts, against torch and the container's own decoders, in every stored kind, both loops (AVX-512 and
plain), any thread count; and decode through it against decode without it."""

from __future__ import annotations

import multiprocessing
import os
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from moepack import native
from moepack.backends import token_kernels
from moepack.families.deepseek_v4 import model
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime.engine import PrefillOptions
from moepack.runtime.generate import Generator

KINDS = list(token_kernels.KINDS)
BLOCK_KINDS = ("FP4_E2M1", "MXFP4", "Q8_0")


def _kernels():
    kernels = token_kernels.token_kernels()
    if kernels is None:
        pytest.skip("no C compiler (or MOEPACK_NATIVE=0): decode keeps torch")
    return kernels


@pytest.fixture(params=["vector", "plain"])
def loop(request):
    """Each test once with the AVX-512 loop (where this CPU has it) and once with the plain one."""
    kernels = _kernels()
    if request.param == "vector" and not kernels.vector:
        pytest.skip("this build has no AVX-512 loop")
    kernels.set_vector(request.param == "vector")
    yield kernels
    kernels.set_vector(True)


def _weight(kind: str, rows: int, cols: int, seed: int):
    """(Matrix, its float64 values, the tensors it points into) of a random weight stored as `kind`."""
    gen = torch.Generator().manual_seed(seed)
    data, scale = token_kernels._random_stored(kind, rows, cols, gen)
    table = token_kernels.value_table(kind) if kind in ("FP4_E2M1", "MXFP4") else None
    values = token_kernels._reference_values(kind, data, rows, cols, scale).double()
    return token_kernels.stored_matrix(kind, data, rows, cols, scale, table), values, (data, scale, table)


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> bool:
    return torch.allclose(got.double(), want, rtol=rtol, atol=rtol * float(want.abs().max()))


def test_the_kernel_is_built_where_a_compiler_is():
    usable = bool(native.c_compiler()) and os.environ.get(native.NATIVE_ENV, "1") != "0"
    assert (token_kernels.token_kernels() is not None) == usable, native.native_builds().get(token_kernels.LIBRARY)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,cols,tokens,threads", [(1, 32, 1, 1), (37, 96, 1, 2), (300, 4096, 3, 3),
                                                      (65, 160, 4, 7)])
def test_rows_equal_the_decoded_weight_times_x(loop, kind, rows, cols, tokens, threads):
    """Every stored kind, odd row counts, inputs of a partial vector (float kinds: cols - 5), several tokens, more
    threads than cores, with and without rounding the input to bfloat16."""
    cols = cols if kind in BLOCK_KINDS else cols - 5 if cols > 32 else cols
    w, values, _keep = _weight(kind, rows, cols, seed=rows + cols)
    for round_bf16 in (False, True):
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
        xr = x.bfloat16().double() if round_bf16 else x.double()
        got = loop.linear(x, w, round_bf16, threads=threads)
        assert got.shape == (tokens, rows) and _close(got, xr @ values.T)


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_rows_take_their_own_input(loop, kind):
    groups, per_group, cols = 4, 24, 64
    w, values, _keep = _weight(kind, groups * per_group, cols, seed=3)
    x = torch.randn(groups, cols, generator=torch.Generator().manual_seed(1))
    want = torch.stack([values[g * per_group:(g + 1) * per_group] @ x[g].double() for g in range(groups)])
    assert _close(loop.grouped(x, w, False, threads=2), want)


def _reference_moe(x, experts, weights, limit, round_bf16=False):
    x = x.bfloat16().double() if round_bf16 else x.double()
    out = torch.zeros_like(x)
    for (w1, w3, w2), weight in zip(experts, weights.double()):
        gate = (w1 @ x).clamp(max=limit)
        up = (w3 @ x).clamp(-limit, limit)
        hidden = F.silu(gate) * up
        if round_bf16:
            hidden = hidden.float().bfloat16().double()
        out += weight * (w2 @ hidden)
    return out


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_a_tokens_experts_in_one_call_equal_their_weighted_sum(loop, threads):
    """Six experts, each matrix of another kind (the kernel arranges each input for its matrix), with weights
    that are not normalised, clamping that bites (limit 0.5 on outputs of a few units)."""
    hidden, inter, limit = 96, 64, 0.5
    gen = torch.Generator().manual_seed(0)
    experts, values, keep = [], [], []
    for e in range(6):
        kinds = [KINDS[(e + j) % len(KINDS)] for j in range(3)]
        mats = [_weight(k, r, c, seed=10 * e + j) for j, (k, (r, c)) in
                enumerate(zip(kinds, ((inter, hidden), (inter, hidden), (hidden, inter))))]
        experts.append(tuple(m[0] for m in mats))
        values.append(tuple(m[1] for m in mats))
        keep.append(mats)
    x, weights = torch.randn(hidden, generator=gen), torch.rand(6, generator=gen) * 3
    for round_bf16 in (False, True):
        got = loop.moe(x, experts, weights, limit, round_bf16, threads=threads)
        want = _reference_moe(x, values, weights, limit, round_bf16)
        assert _close(got, want, rtol=1e-4 if not round_bf16 else 1e-2)


@pytest.mark.parametrize("scale", [0.0371, 1.0, 2.0 ** -140, 2.0 ** 125, 3e38])
def test_every_fp8_code_times_its_scale_is_exactly_torchs(loop, scale):
    """Each of the 256 e4m3fn codes (subnormals, both zeros, the NaNs) times a block scale, one rounding: exactly
    torch's float8_e4m3fn value times the scale in float32, whatever the scale (subnormal products; one where the
    AVX-512 loop's scale x 256 would overflow, and one where the product does)."""
    codes = torch.arange(256, dtype=torch.uint8)  # one code per row, one column: a row's dot is its value
    scales = torch.full(token_kernels.fp8_scale_blocks(256, 1), scale, dtype=torch.float32)
    w = token_kernels.stored_matrix("F8_E4M3", codes, 256, 1, scales)
    got = loop.linear(torch.ones(1, 1), w, False)[0]
    want = codes.view(torch.float8_e4m3fn).float() * torch.tensor(scale, dtype=torch.float32)
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


def test_no_experts_give_zeros_and_a_nan_input_stays_nan():
    kernels = _kernels()
    assert torch.equal(kernels.moe(torch.randn(64), [], torch.empty(0), 10.0, False), torch.zeros(64))
    w, _, _keep = _weight("BF16", 8, 64, seed=0)
    x = torch.randn(1, 64)
    x[0, 5] = float("nan")
    assert kernels.linear(x, w, False).isnan().all()


def test_shapes_that_do_not_fit_are_refused():
    kernels = _kernels()
    w, _, _keep = _weight("MXFP4", 8, 64, seed=0)
    with pytest.raises(ValueError):
        kernels.linear(torch.randn(1, 32), w, False)
    with pytest.raises(ValueError):
        token_kernels.stored_matrix("MXFP4", torch.zeros(10, dtype=torch.uint8), 8, 64,
                                    table=token_kernels.value_table("MXFP4"))
    with pytest.raises(ValueError):
        token_kernels.stored_matrix("Q8_0", torch.zeros(8 * 34, dtype=torch.uint8), 8, 40)  # not whole blocks
    w2, _, _keep2 = _weight("BF16", 64, 8, seed=1)
    with pytest.raises(RuntimeError):  # w1 [8, 64] with a w2 that does not map 8 back to 64... given as w3
        kernels.moe(torch.randn(64), [(w, w2, w2)], torch.ones(1), 10.0, False)


def test_calls_from_several_threads_at_once_are_each_right():
    """The pool serves one caller at a time; another runs its rows on its own thread meanwhile."""
    kernels = _kernels()
    w, values, _keep = _weight("BF16", 512, 256, seed=5)
    xs = [torch.randn(1, 256, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    wrong = []

    def run(x):
        for _ in range(50):
            if not _close(kernels.linear(x, w, False, threads=2), x.double() @ values.T):
                wrong.append(x)
    threads = [threading.Thread(target=run, args=(x,)) for x in xs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def _in_child(queue, x, w):
    """The kernel alone (torch's own parallel ops may hang in a forked child: its OpenMP pool is the parent's)."""
    queue.put(token_kernels.token_kernels().linear(x, w, False, threads=2).tolist())


def test_a_forked_child_starts_its_own_workers():
    """The parent's pool threads do not exist in a child: the child's first call starts its own (no hang). The
    weight is large enough for two parts (a call under 64K multiply-adds runs on the caller alone)."""
    kernels = _kernels()
    w, values, _keep = _weight("F32", 512, 256, seed=2)
    x = torch.randn(1, 256)
    kernels.linear(x, w, False, threads=2)  # the parent's workers are running
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(queue, x, w))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and _close(torch.tensor(queue.get(timeout=5)), x.double() @ values.T)


def _kernel_threads() -> int:
    """The pool's workers in this process (by the name the kernel gives them)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return names.count("moepack-kernel")


def test_the_pool_never_runs_more_threads_than_the_usable_cpus():
    """More threads asked for than CPUs the process may use run as one part a CPU (the same rows each way): a
    pool grown past them made every later call wait for workers taking turns on the CPUs, several times slower."""
    kernels = _kernels()
    if not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads through Linux's /proc")
    cpus = len(os.sched_getaffinity(0))
    w, values, _keep = _weight("F32", 256 * (cpus + 9), 256, seed=3)  # work enough for cpus + 10 parts
    x = torch.randn(1, 256)
    assert _close(kernels.linear(x, w, False, threads=cpus + 8), x.double() @ values.T)
    assert 0 < _kernel_threads() <= cpus - 1 or cpus == 1


def test_a_float32_input_to_a_bfloat16_weight_rounds_inside_the_kernel_as_outside(loop):
    """model.linear(float32 x, bfloat16 w) for a decoded token rounds x and the result to bfloat16 inside the kernel
    (ROUND_OUTPUT): bit for bit what rounding around it gives (x.to(bf16), the kernel, .to(bf16).to(float32)),
    NaN, infinities and ties included."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(257, 1024, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, 1024, generator=gen) * 3
    x[0, :5] = torch.tensor([float("nan"), float("inf"), 1 + 2 ** -8, 1 + 3 * 2 ** -8, -1 - 2 ** -8])
    got = model.linear(x, w)
    want = model.matmul(x.to(torch.bfloat16), w).to(torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got[1], want[1])
    assert torch.equal(got[0].isnan(), want[0].isnan())  # the NaN input: every result NaN, either way
    for seed in range(20):  # results near a rounding tie: the same rounding as torch's .to(bfloat16)
        y = torch.randn(1, 1024, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(model.linear(y, w), model.matmul(y.to(torch.bfloat16), w).float())


def test_model_matmul_is_f_linear_for_a_decoded_token():
    """model.matmul on a few rows goes through the kernel: F.linear's values (bf16: the result rounded the same
    way, up to one bf16 step where the float32 sums differ in their last bit)."""
    _kernels()
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(300, 1024, generator=gen).to(dtype)
        x = torch.randn(1, 3, 1024, generator=gen).to(dtype)  # 3 rows under leading dimensions
        got, want = model.matmul(x, w), F.linear(x, w)
        assert got.dtype == want.dtype and got.shape == want.shape
        step = 2e-6 if dtype == torch.float32 else 8e-3
        assert torch.allclose(got.float(), want.float(), rtol=step, atol=step * float(want.abs().max()))
        q, k = torch.randn(1, 8, 64, generator=gen), torch.randn(40, 64, generator=gen)
        low = model.low_matmul(q, k.T, dtype)
        assert low.dtype == dtype and torch.allclose(low.float(), torch.matmul(q.to(dtype), k.T.to(dtype)).float(),
                                                     rtol=step, atol=step * float(low.abs().max()))


def test_several_matrices_on_one_token_equal_one_call_each(loop):
    """linear_many: float and stored kinds mixed, each matrix's own roundings, rows split over the threads across
    matrix boundaries."""
    weights = [_weight(kind, rows, 96, seed) for seed, (kind, rows) in
               enumerate((("BF16", 37), ("F32", 5), ("Q8_0", 70), ("FP4_E2M1", 3), ("MXFP4", 64)))]
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(1))
    flags = [token_kernels.ROUND_INPUT | token_kernels.ROUND_OUTPUT, 0, token_kernels.ROUND_INPUT, 0, 0]
    outs = loop.linear_many(x, token_kernels.LinearPlan([w[0] for w in weights], flags), threads=3)
    for out, (matrix, values, _), flag in zip(outs, weights, flags):
        want = loop.linear(x, matrix, bool(flag & token_kernels.ROUND_INPUT), threads=1,
                           round_output=bool(flag & token_kernels.ROUND_OUTPUT))
        assert out.shape == (1, matrix.rows) and torch.allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("low", [torch.float32, torch.bfloat16])
def test_one_tokens_attention_and_norms_equal_the_torch_path(loop, low):
    """attend and norm_rope against model's torch path for one query: per-head norm and RoPE, softmax over a window
    and compressed entries plus the sink, RoPE undone (the indexer's scores: tests/test_indexer_native.py)."""
    gen = torch.Generator().manual_seed(0)
    heads, dim, rope = 6, 72, 16
    q, sink = torch.randn(heads, dim, generator=gen) * 2, torch.randn(heads, generator=gen)
    angles = torch.rand(1, rope // 2, generator=gen) * 6
    rotation = torch.polar(torch.full_like(angles, 1.3), angles)
    keys = [torch.randn(n, dim, generator=gen).to(low).float() for n in (17, 0, 9)]
    want = model.attend_key_sets(model.apply_rope(model.rms_norm(q[None], None, 1e-6), rotation),
                         [(k, torch.zeros(1, k.shape[0])) for k in keys], sink, 0.1, low)
    want = model.apply_rope(want, rotation.conj())[0]
    got = loop.attend(q, keys, sink, 0.1, rotation, 1e-6, low == torch.bfloat16, threads=2)
    step = 1e-5 if low == torch.float32 else 2e-2
    assert torch.allclose(got, want, rtol=step, atol=step * float(want.abs().max())), (got - want).abs().max()
    rows, weight = torch.randn(3, dim, generator=gen), torch.rand(dim, generator=gen) + 0.5
    assert torch.allclose(loop.norm_rope(rows, weight, 1e-6, rotation),
                          model.apply_rope(model.rms_norm(rows, weight, 1e-6), rotation), rtol=1e-5, atol=1e-6)
    assert torch.allclose(loop.norm_rope(rows, None, 1e-6), model.rms_norm(rows, None, 1e-6), rtol=1e-5, atol=1e-6)


def test_the_shared_expert_of_one_token_is_its_three_linears(loop):
    """model.expert_forward of one float32 token through one compiled call equals the three linears (bf16 weights:
    the same roundings; float32: the same sums up to their order)."""
    cfg = SimpleNamespace(swiglu_limit=2.0)  # what expert_forward reads
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w1, w3, w2 = (torch.randn(*shape, generator=gen).to(dtype) * 0.1 for shape in ((48, 64), (48, 64), (64, 48)))
        x = torch.randn(1, 64, generator=gen) * 3
        got = model.expert_forward(cfg, x, w1, w3, w2)
        gate = model.linear(x, w1).clamp(max=2.0)
        up = model.linear(x, w3).clamp(-2.0, 2.0)
        want = model.linear(F.silu(gate) * up, w2)
        step = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got, want, rtol=step, atol=step * float(want.abs().max())), (got - want).abs().max()


def test_routed_experts_with_the_shared_one_appended_equal_routed_plus_shared(loop):
    """decode's FFN call: routed experts of stored kinds (intermediate size 64) and the shared expert (bf16, 48
    wide) appended with weight 1 and its own roundings: the routed sum plus model.expert_forward of the shared."""
    hidden, inter, limit = 96, 64, 3.0
    gen = torch.Generator().manual_seed(1)
    experts, values, keep = [], [], []
    for e, kinds in enumerate((("FP4_E2M1",) * 3, ("MXFP4", "Q8_0", "BF16"))):
        mats = [_weight(k, r, c, seed=20 + 3 * e + j) for j, (k, (r, c)) in
                enumerate(zip(kinds, ((inter, hidden), (inter, hidden), (hidden, inter))))]
        experts.append(tuple(m[0] for m in mats))
        values.append(tuple(m[1] for m in mats))
        keep.append(mats)
    shapes = ((48, hidden), (48, hidden), (hidden, 48))
    shared = [(torch.randn(*shape, generator=gen) * 0.1).bfloat16() for shape in shapes]
    x, weights = torch.randn(hidden, generator=gen), torch.rand(2, generator=gen) * 2
    for routed_flag in (0, token_kernels.ROUND_INPUT):
        got = loop.moe(x, experts + [tuple(token_kernels.float_matrix(w) for w in shared)],
                       torch.cat([weights, torch.ones(1)]), limit, False, threads=2,
                       flags=[routed_flag] * 2 + [token_kernels.ROUND_INPUT | token_kernels.ROUND_OUTPUT])
        want = _reference_moe(x, values, weights, limit, bool(routed_flag)) \
            + model.expert_forward(SimpleNamespace(swiglu_limit=limit), x[None], *shared)[0].double()
        assert _close(got, want, rtol=1e-2)
    with pytest.raises(ValueError):  # a flag for each expert
        loop.moe(x, experts, weights, limit, False, flags=[0])


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("hashed", [False, True], ids=["learned", "hash"])
def test_the_compiled_router_chooses_as_moe_route_and_token_choice(loop, scoring, hashed):
    """TokenKernels.route against moe_route's arithmetic (then decode's token_choice) on random tokens: the same experts
    in ascending id, a hash layer's repeated expert once with its weights added, the same weights."""
    from moepack.runtime.decode import token_choice

    gen = torch.Generator().manual_seed(2)
    experts, hidden, top_k = 37, 80, 5
    gate = torch.randn(experts, hidden, generator=gen) * 0.2
    w = {"ffn.gate.weight": gate}
    if hashed:
        w["ffn.gate.tid2eid"] = torch.randint(0, experts, (50, top_k), generator=gen)
        w["ffn.gate.tid2eid"][7, 1] = w["ffn.gate.tid2eid"][7, 3]  # a repeated expert
    else:
        w["ffn.gate.bias"] = torch.randn(experts, generator=gen) * 0.1
    for token in range(10) if not hashed else (7, 3, 9):
        x = torch.randn(1, hidden, generator=gen)
        scores = model._router_scores(scoring, x @ gate.T)
        experts_ = w["ffn.gate.tid2eid"][[token]] if hashed else (scores + w["ffn.gate.bias"]).topk(top_k).indices
        weights = scores.gather(1, experts_)
        routing = SimpleNamespace(experts=experts_, weights=weights / weights.sum() * 2.5)
        want = token_choice(routing)
        ids, got = loop.route(x, token_kernels.float_matrix(gate), w.get("ffn.gate.bias"), scoring, top_k,
                              w["ffn.gate.tid2eid"][token].tolist() if hashed else None, 2.5, threads=2)
        assert ids == list(want)
        assert torch.allclose(torch.tensor(got), torch.tensor(list(want.values())), rtol=1e-5, atol=1e-7)
    with pytest.raises(RuntimeError):  # a hash id out of range
        loop.route(torch.randn(hidden), token_kernels.float_matrix(gate), None, scoring, 2, [0, experts], 1.0)
    with pytest.raises(ValueError):  # fewer hash ids than top_k
        loop.route(torch.randn(hidden), token_kernels.float_matrix(gate), None, scoring, 2, [0], 1.0)
    with pytest.raises(ValueError):  # a bias of another size
        loop.route(torch.randn(hidden), token_kernels.float_matrix(gate), torch.zeros(experts - 1), scoring, 2, None,
                   1.0)


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    """The tiny preset in the release layout (FP8 dense, FP4 E2M1 experts) kept, and converted bf16 / fp4 (MXFP4)
    / q8 (Q8_0 dense and experts)."""
    base = tmp_path_factory.mktemp("token_kernels")
    src = str(base / "src")
    synth_checkpoint(src, preset="tiny", layout="release", progress=False)
    out = {}
    for policy in ("keep", "bf16", "fp4", "q8"):
        out[policy] = str(base / f"{policy}.moepack")
        convert_checkpoint(src, out[policy], policy=policy, progress=False)
    return out


def _decode_logits(path: str, compute_dtype: str, steps: list[int]) -> tuple[list[torch.Tensor], dict, int]:
    """The prefill of a fixed prompt, then `steps` fed one by one: each step's logits, the decode stats and the
    number of layers."""
    with Generator(path, cache_gib=1.0, prefill=PrefillOptions(compute_dtype=compute_dtype)) as g:
        states = g._prefill(torch.arange(3, 40), None, len(steps))[1]
        g.decoder.begin(states)
        return [g.decoder.step(t) for t in steps], g.decoder.stats_dict(), g.cfg.num_layers


def test_a_bf16_head_is_kept_as_stored_and_widened_exactly(containers):
    """Decode keeps a BF16-stored LM head as stored; model.head widens it in the kernel's loop: the float32
    products and sums of a float32 copy (up to their order), from half the bytes."""
    _kernels()
    with Generator(containers["bf16"], cache_gib=0.1) as g:
        head = g.decoder.head_weights[g.cfg.head_weight]
    assert head.dtype == torch.bfloat16
    x = torch.randn(1, head.shape[1], generator=torch.Generator().manual_seed(0)) * 3
    want = F.linear(x.double(), head.double())
    got = model.widened_matmul(x, head)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("policy", ["keep", "bf16", "fp4", "q8"])
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_decode_through_the_kernel_equals_decode_without_it(containers, monkeypatch, policy, compute_dtype):
    """float32: the same logits up to the sums' order. bfloat16: the kernel rounds less (never the weights, the
    hidden activation once), so the steps' logits are checked against float32 decode: typically no farther than
    torch's bf16 path is, and a routing choice flipped by rounding (a step that strays ~23 % on this model) not more
    often."""
    _kernels()
    steps = [5, 17, 2, 40, 9, 33]
    with_kernel, stats, layers = _decode_logits(containers[policy], compute_dtype, steps)
    assert stats["kernel_layers"] == len(steps) * layers  # every layer's experts in one call
    reference = _decode_logits(containers[policy], "float32", steps)[0] if compute_dtype == "bfloat16" else None
    monkeypatch.setattr(token_kernels, "token_kernels", lambda: None)
    without, stats, _ = _decode_logits(containers[policy], compute_dtype, steps)
    assert stats["kernel_layers"] == 0
    errors = []  # (kernel path's, torch path's) relative to float32 decode
    for step, (a, b) in enumerate(zip(with_kernel, without)):
        if reference is None:
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max())), (a - b).abs().max()
            assert int(a.argmax()) == int(b.argmax())
        else:
            scale = float(reference[step].abs().max())
            errors.append((float((a - reference[step]).abs().max()) / scale,
                           float((b - reference[step]).abs().max()) / scale))
    if errors:
        kernel_errors, torch_errors = (sorted(e) for e in zip(*errors))
        middle = len(errors) // 2
        assert kernel_errors[middle] <= max(1.5 * torch_errors[middle], 1.5e-2), errors
        # a routing choice near a tie flips under either path's roundings (a step strays ~23 %): not much more
        # often. Which steps flip depends on the machine's summation order, torch's own included: on one machine
        # each path flipped one of these 6 steps; on an AVX-512 one (2026-12-05) torch's none and the kernel's two
        assert sum(e > 0.05 for e in kernel_errors) <= sum(e > 0.05 for e in torch_errors) + 2, errors
