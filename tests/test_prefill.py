"""`moepack prefill`: the streaming engine against transformers, bytes read, chunking, damaged input."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

pytest.importorskip("transformers")
from v4_models import build  # noqa: E402

from moepack.cli.main import cli  # noqa: E402
from moepack.format_spec.errors import FormatError, MoepackError  # noqa: E402
from moepack.format_spec.reader import Container  # noqa: E402
from moepack.packer.convert import convert_checkpoint  # noqa: E402
from moepack.runtime import engine  # noqa: E402
from moepack.runtime.engine import PrefillOptions, bundle_runs, prefill  # noqa: E402

REL_TOL = 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (transformers model, container path) for the reference configurations, in float32 (keep policy)."""
    base = str(tmp_path_factory.mktemp("prefill"))
    out = {}
    for name in ("A", "B", "C", "long"):
        hf_model, _, _ = build(name, base)
        container = os.path.join(base, f"{name}.moepack")
        convert_checkpoint(os.path.join(base, name), container, progress=False)
        out[name] = hf_model, container
    return out


def _prompt(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _reference(hf_model, ids):
    with torch.no_grad():
        return hf_model(ids[None]).logits[0, -1].float()


CASES = [("A", 1, {}), ("A", 37, {"bundle_experts": 3, "queue_depth": 1}), ("A", 301, {"query_chunk": 64}),
         ("B", 5, {"expert_selection": "all"}), ("B", 130, {"bundle_experts": 16, "expert_selection": "routed"}),
         ("C", 20, {}), ("C", 257, {"bundle_experts": 1, "queue_depth": 8, "io_mode": "direct"}),
         # several thousand tokens: many windows of every kind, index_topk far below the compressed entries
         ("long", 2500, {"query_chunk": 256})]


@pytest.mark.parametrize("name,n,options", CASES, ids=[f"{c[0]}-N{c[1]}-{'-'.join(c[2]) or 'default'}" for c in CASES])
def test_streamed_prefill_matches_transformers(models, name, n, options):
    hf_model, container = models[name]
    ids = _prompt(n, hf_model.config.vocab_size, seed=n)
    ref = _reference(hf_model, ids)
    result = prefill(container, ids, PrefillOptions(**options))
    err = (result.logits - ref).abs().max().item()
    assert err <= REL_TOL * ref.abs().max().item(), (err, ref.abs().max().item())
    assert result.next_token == int(ref.argmax())
    assert result.stats["tokens"] == n and result.stats["overlap"] >= 0.99


def test_query_chunking_and_bundling_do_not_change_logits(models):
    _, container = models["A"]
    ids = _prompt(150, 97, seed=5)
    base = prefill(container, ids, PrefillOptions(query_chunk=None, bundle_experts=1)).logits
    for opts in ({"query_chunk": 7, "bundle_experts": 8}, {"query_chunk": 149, "bundle_experts": 3, "queue_depth": 2}):
        assert torch.allclose(prefill(container, ids, PrefillOptions(**opts)).logits, base, atol=1e-5, rtol=0)


def test_every_weight_read_exactly_once(models):
    """All-experts mode reads each region the model uses exactly once: bytes read == the container's bytes minus
    the regions prefill never touches (the MTP block), cross-checked with the kernel's own count on a cold cache."""
    _, container = models["A"]
    with Container(container) as c:
        used = sum(r.length for r in c.global_regions) + sum(
            b.dense.length + b.experts_span[1] for b in c.layers)
        requests = len(c.global_regions) + sum(1 + -(-len(b.experts) // 2) for b in c.layers)
    fd = os.open(container, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold cache for this file
    os.close(fd)
    before = _proc_read_bytes()
    result = prefill(container, _prompt(64, 97, 1), PrefillOptions(expert_selection="all", bundle_experts=2,
                                                                     io_mode="direct"))
    kernel = _proc_read_bytes() - before
    assert result.stats["bytes_read"] == used
    assert result.stats["read_requests"] == requests
    assert used <= kernel <= used + (4 << 20), (used, kernel)


def _proc_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def test_short_prompts_read_only_routed_experts(models):
    _, container = models["B"]
    ids = _prompt(3, 61, seed=2)
    result = prefill(container, ids, PrefillOptions(expert_selection="auto"))
    selections = [s.selection for s in result.layers]
    assert selections[0] == "hash" and all(s == "routed" for s in selections[1:])
    for s in result.layers:
        assert s.experts_read == s.experts_used <= 3 * 4  # at most N x top_k experts
        assert s.bytes_skipped > 0
    full = prefill(container, ids, PrefillOptions(expert_selection="all"))
    assert torch.equal(full.logits, result.logits)
    assert full.stats["bytes_read"] == result.stats["bytes_read"] + result.stats["bytes_skipped"]


def test_bundle_runs():
    assert bundle_runs([0, 1, 2, 3, 4], 2) == [(0, 2), (2, 2), (4, 1)]
    assert bundle_runs([1, 2, 5, 6, 7, 9], 8) == [(1, 2), (5, 3), (9, 1)]
    assert bundle_runs([], 4) == []


def test_damaged_region_is_refused_while_streaming(models, tmp_path):
    _, container = models["B"]
    with Container(container) as c:
        target = c.layer(2).experts[5]
    data = bytearray(open(container, "rb").read())
    data[target.offset + 100] ^= 0x08
    bad = tmp_path / "bad.moepack"
    bad.write_bytes(data)
    with pytest.raises(FormatError, match=r"layers\.2\.experts\.5"):
        prefill(str(bad), _prompt(200, 61, 3), PrefillOptions(expert_selection="all"))
    # with checks off the damage goes unnoticed: the option really switches them off
    prefill(str(bad), _prompt(200, 61, 3), PrefillOptions(expert_selection="all", verify_reads=False))


def test_o_direct_refused_falls_back_with_a_warning(models, monkeypatch):
    _, container = models["C"]
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(engine.RegionReader.__init__.__globals__["os"], "open", no_direct)
    with pytest.warns(RuntimeWarning, match="O_DIRECT"):
        result = prefill(container, _prompt(9, 50, 4), PrefillOptions(io_mode="direct"))
    assert result.stats["io_mode"] == "buffered" and "O_DIRECT" in result.stats["io_warning"]


def test_bad_prompts(models):
    _, container = models["C"]
    with pytest.raises(MoepackError, match="out of range"):
        prefill(container, [1, 2, 50], PrefillOptions())
    with pytest.raises(MoepackError, match="empty prompt"):
        prefill(container, [], PrefillOptions())


def test_cli_prefill_on_a_release_layout_container(tmp_path):
    from moepack.packer.synth import synth_checkpoint

    src = str(tmp_path / "src")
    synth_checkpoint(src, preset="tiny", layout="release", seed=0, progress=False)
    container = str(tmp_path / "tiny.moepack")
    convert_checkpoint(src, container, progress=False)
    logits_path = str(tmp_path / "logits.safetensors")
    threads = torch.get_num_threads()
    try:
        r = CliRunner().invoke(cli, ["prefill", container, "--prompt", "The quick brown fox", "--logits-out",
                                     logits_path, "--threads", "1", "--json"])
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["threads"] == 1
    logits = load_file(logits_path)["logits"]
    with Container(container) as c:
        vocab = c.config["vocab_size"]
    assert logits.dtype == torch.float32 and logits.shape == (vocab,)
    assert out["next_token"] == int(logits.argmax()) and isinstance(out["next_token_text"], str)
    for key in ("tokens", "seconds", "tokens_per_s", "bytes_read", "io_busy_s", "compute_busy_s", "overlap",
                "peak_rss_bytes", "layers"):
        assert key in out, key
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("0 75 104 111 111 114")
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids_file)])
    assert r.exit_code == 0 and "next token:" in r.output
    r = CliRunner().invoke(cli, ["prefill", container])
    assert r.exit_code != 0


def test_prompt_too_long_for_memory_is_refused_before_any_read(models, monkeypatch):
    from moepack.runtime import engine as eng

    _, container = models["A"]
    monkeypatch.setattr(eng, "available_memory_bytes", lambda: 64 << 20)  # a 64 MiB machine
    before = _proc_read_bytes()
    with pytest.raises(MoepackError, match=r"needs about .* GiB .* available host memory"):
        prefill(container, _prompt(200_000, 97, 0), PrefillOptions())
    assert _proc_read_bytes() - before < (1 << 20)
    prefill(container, _prompt(50, 97, 0), PrefillOptions())  # a short one still fits


def test_chunk_major_order_same_logits_more_bytes(models):
    """The usual chunked prefill reads the whole model once per chunk; layer-major reads it once."""
    _, container = models["A"]
    ids = _prompt(100, 97, seed=8)
    layer = prefill(container, ids, PrefillOptions(expert_selection="all"))
    # (transformers itself gives its full forward and its cached, chunked forward slightly different logits at
    # some split points, e.g. after 60 or 90 tokens of config A; chunks of 32 are not among them)
    chunked = prefill(container, ids, PrefillOptions(expert_selection="all"), chunk_tokens=32)
    assert torch.allclose(chunked.logits, layer.logits, atol=1e-5 * layer.logits.abs().max().item())
    assert chunked.stats["passes_over_model"] == 4 and layer.stats["passes_over_model"] == 1
    assert chunked.stats["bytes_read"] == 4 * layer.stats["bytes_read"]


def test_read_pipeline_hands_buffers_out_in_submission_order(tmp_path):
    """Many more reads than buffers, consumed slowly in order: never a deadlock, every read lands intact."""
    import time as _time

    from moepack.runtime.io import ReadPipeline, RegionReader

    path = tmp_path / "data.bin"
    data = os.urandom(4096 * 64)
    path.write_bytes(data)
    reader = RegionReader(str(path), "buffered")
    pipe = ReadPipeline(reader, 4096 * 2, depth=3)
    futures = [(i, pipe.submit(4096 * i, 4096 * 2)) for i in range(0, 60, 2)]
    for i, f in futures:
        buf, view = f.result(timeout=10)
        assert bytes(view) == data[4096 * i:4096 * (i + 2)]
        _time.sleep(0.001)
        pipe.release(buf)
    pipe.close()
    reader.close()
