"""`moepack prefill`: the streaming engine against transformers, bytes read, chunking, damaged input."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

pytest.importorskip("transformers")
from v4_models import (CONFIGS, build, indexer_boundary_ties, random_case, run_random_case,  # noqa: E402
                       saved_model, wide_indexer_models)

from moepack.cli.main import cli  # noqa: E402
from moepack.families.deepseek_v4 import model as v4_model  # noqa: E402
from moepack.format_spec.errors import FormatError, MoepackError  # noqa: E402
from moepack.format_spec.reader import Container  # noqa: E402
from moepack.packer.convert import convert_checkpoint  # noqa: E402
from moepack.runtime import engine, expert_runner, memory as memory_module, read_scheduler  # noqa: E402
from moepack.runtime.read_scheduler import bundle_runs  # noqa: E402
from moepack.runtime.engine import PrefillOptions, prefill  # noqa: E402
from moepack.runtime.io import HUGE_PAGE, HostBuffer  # noqa: E402

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


def test_lm_head_in_slices_and_only_the_prompts_embedding_rows(models, monkeypatch):
    """The LM head decoded and applied a few rows at a time gives the whole head's logits, and the embedding
    decodes the prompt's rows, never the vocabulary-sized table."""
    from moepack.format_spec import codecs

    hf_model, container = models["A"]
    vocab, hidden, n = hf_model.config.vocab_size, hf_model.config.hidden_size, 40
    ids = _prompt(n, vocab, seed=11)
    whole = prefill(container, ids).logits
    shapes = []
    real = codecs.Codec.decode_float.__func__  # every plain type's decode (this model's weights are F32)
    monkeypatch.setattr(codecs.Codec, "decode_float", classmethod(
        lambda cls, raw, shape, *a: shapes.append(tuple(shape)) or real(cls, raw, shape, *a)))
    monkeypatch.setattr(engine, "HEAD_CHUNK_BYTES", 4 * hidden * 10)  # 10 rows a slice
    sliced = prefill(container, ids).logits
    assert (n, hidden) in shapes and (vocab, hidden) not in shapes
    assert shapes.count((10, hidden)) == vocab // 10 and (vocab % 10, hidden) in shapes
    assert torch.allclose(sliced, whole, atol=1e-6 * whole.abs().max().item(), rtol=0)
    ref = _reference(hf_model, ids)
    assert (sliced - ref).abs().max() <= REL_TOL * ref.abs().max()


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


def test_an_expert_read_but_chosen_by_no_token_is_still_checked(models, monkeypatch, tmp_path):
    _, container = models["B"]
    computed = set()
    real = expert_runner.ExpertRunner._expert

    def record(self, block, region, *args):
        computed.add(region.name)
        return real(self, block, region, *args)
    monkeypatch.setattr(expert_runner.ExpertRunner, "_expert", record)
    prompt = _prompt(2, 61, 3)
    prefill(container, prompt, PrefillOptions(expert_selection="all"))  # every expert read, a few computed
    with Container(container) as c:
        idle = next(r for b in c.layers for r in b.experts if r.name not in computed)
    data = bytearray(open(container, "rb").read())
    data[idle.offset + 100] ^= 0x08
    bad = tmp_path / "bad.moepack"
    bad.write_bytes(data)
    with pytest.raises(FormatError, match=re.escape(idle.name) + ".*checksum mismatch while streaming"):
        prefill(str(bad), prompt, PrefillOptions(expert_selection="all"))


def test_o_direct_refused_falls_back_with_a_warning(models, monkeypatch):
    _, container = models["C"]
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(read_scheduler.RegionReader.__init__.__globals__["os"], "open", no_direct)
    with pytest.warns(RuntimeWarning, match="O_DIRECT"):
        result = prefill(container, _prompt(9, 50, 4), PrefillOptions(io_mode="direct"))
    assert result.stats["io_mode"] == "buffered" and "O_DIRECT" in result.stats["io_warning"]


# token ids no model takes, and the one line each is refused with (test_batching: by generate and submit too)
BAD_PROMPTS = [([1, 2, 10 ** 6], "out of range"), ([], "empty prompt"),
               ([1.5, 2], "must be integers, not torch.float32"), ([True], "not torch.bool"),
               (torch.tensor([1.7]), "not torch.float32"), ([1, 2 ** 70], "within 64 bits"),
               ([[1, 2], [3]], "within 64 bits"), ("hello", "not text"), (None, "within 64 bits"),
               (torch.tensor([[1, 2], [3, 4]]), "one prompt at a time")]


@pytest.mark.parametrize("ids,message", BAD_PROMPTS, ids=[m for _, m in BAD_PROMPTS])
def test_bad_prompts(models, ids, message):
    """None is rounded (a float), run as one prompt (a batch of several rows) or a Python traceback (text)."""
    with pytest.raises(MoepackError, match=re.escape(message)):
        prefill(models["C"][1], ids, PrefillOptions())


def test_a_prompt_as_one_row_a_range_a_generator_or_an_array_is_that_prompt():
    """[1, N] is what a tokenizer's return_tensors="pt" gives."""
    for ids in (torch.tensor([[3, 4, 5]]), range(3, 6), (i for i in (3, 4, 5)), np.array([3, 4, 5], np.int8)):
        assert engine.prompt_ids(ids).tolist() == [3, 4, 5]


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
                "peak_rss_bytes", "peak_device_bytes", "layers"):
        assert key in out, key
    assert out["peak_device_bytes"] is None and out["peak_rss_bytes"] > 0  # a CPU prefill: the host is the device
    assert out["peak_device_reserved_bytes"] is None
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("The quick brown fox")
    r = CliRunner().invoke(cli, ["prefill", container, "--prompt-file", str(prompt_file), "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    from_file = json.loads(r.output)
    assert (from_file["tokens"], from_file["next_token"]) == (out["tokens"], out["next_token"])
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("0 75 104 111 111 114")
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids_file)])
    assert r.exit_code == 0 and "next token:" in r.output
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids_file), "--compute-dtype", "bfloat16",
                                 "--json"])
    assert r.exit_code == 0, r.output
    low = json.loads(r.output)
    assert (low["compute_dtype"], low["expert_dtype"]) == ("bfloat16", "bfloat16")
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids_file), "--compute-dtype", "bfloat16",
                                 "--expert-dtype", "float32", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["expert_dtype"] == "float32", r.output
    r = CliRunner().invoke(cli, ["prefill", container])
    assert r.exit_code != 0


def test_token_id_files_in_every_accepted_form_and_bad_ones_named(tmp_path):
    from moepack.serve.tokenizer import read_token_ids

    path = tmp_path / "ids.txt"
    for text, ids in (("[3, 1, 4]", [3, 1, 4]), ("3 1\n4", [3, 1, 4]), ("3,1, 4", [3, 1, 4]), ("7", [7])):
        path.write_text(text)
        assert read_token_ids(str(path)) == ids, text
    for text in ("", "[]", "1 2.5", "abc", "true", '"7"', "[1, [2]]", "{}"):
        path.write_text(text)
        with pytest.raises(MoepackError, match="expected a non-empty list of integer token ids"):
            read_token_ids(str(path))
    with pytest.raises(MoepackError, match="cannot read"):
        read_token_ids(str(tmp_path / "missing.txt"))


def test_logits_out_that_cannot_be_written_is_refused_before_the_prefill(models, tmp_path, monkeypatch):
    from moepack.runtime import outputs

    _, container = models["A"]
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3")
    ran = []
    monkeypatch.setattr(engine.StreamingPrefill, "run", lambda *a, **k: ran.append(1))
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids), "--logits-out",
                                 str(tmp_path / "missing" / "l.safetensors")])
    assert r.exit_code == 1 and "does not exist" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not ran
    # a failure while writing (safetensors raises its own error type) is one line too, and leaves no partial file
    monkeypatch.setattr(outputs, "save_file", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("I/O error")))
    with pytest.raises(MoepackError, match="cannot write .*I/O error"):
        outputs.write_logits(str(tmp_path / "l.safetensors"), torch.zeros(3))
    assert os.listdir(tmp_path) == ["ids.txt"]


CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the "
            "allocated memory 76.50 GiB is allocated by PyTorch, and 1.10 GiB is reserved by PyTorch but unallocated.")


@pytest.mark.parametrize("failure,reason", [
    (torch.OutOfMemoryError(CUDA_OOM), "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                       "of 79.19 GiB of which 1.06 GiB is free."),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
     "CUDA error: out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to "
                  "allocate 8589934592 bytes. can't allocate memory"), None),
    (MemoryError(), "MemoryError")])
def test_running_out_of_memory_in_the_middle_is_one_line(models, tmp_path, monkeypatch, failure, reason):
    """An allocation the check before the prefill did not foresee fails in the middle of it: one line naming it
    (a long CUDA message cut after a sentence), exit status 1, the JSON error object, what to do about it; in
    another command the same without the prefill's advice; other errors still surface as the bugs they are."""
    from moepack.cli import main as cli_main

    _, container = models["A"]
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3")

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(engine.StreamingPrefill, "run", fail)
    for extra in ([], ["--json"]):
        r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids), *extra])
        line = r.stderr.strip()
        assert r.exit_code == 1 and len(line.splitlines()) == 1, r.stderr
        assert line.startswith("moepack: error: out of memory (") and line.endswith(cli_main.PREFILL_MEMORY_HINT)
        assert reason is None or f"({reason}): " in line
        assert len(line) < 300
        if extra:
            assert json.loads(r.stdout) == {"ok": False, "error": line[len("moepack: error: "):]}
    monkeypatch.setattr("moepack.format_spec.verify.verify_container", fail)
    r = CliRunner().invoke(cli, ["verify", container, "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["error"].startswith("out of memory (")
    assert cli_main.PREFILL_MEMORY_HINT not in r.stdout
    monkeypatch.setattr(engine.StreamingPrefill, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bug")))
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids)])
    assert isinstance(r.exception, RuntimeError) and str(r.exception) == "bug"


def test_prompt_too_long_for_memory_is_refused_before_any_read(models, monkeypatch):
    from moepack.runtime import memory as memory_module

    _, container = models["A"]
    monkeypatch.setattr(memory_module, "available_memory_bytes", lambda: 64 << 20)  # a 64 MiB machine
    before = _proc_read_bytes()
    with pytest.raises(MoepackError, match=r"needs about .* GiB .* available host memory"):
        prefill(container, _prompt(200_000, 97, 0), PrefillOptions())
    assert _proc_read_bytes() - before < (1 << 20)
    prefill(container, _prompt(50, 97, 0), PrefillOptions())  # a short one still fits


def test_time_the_hypervisor_took_is_counted_per_prefill(models, monkeypatch, tmp_path):
    from moepack.runtime import engine as eng
    from moepack.runtime import io as io_module

    stat = tmp_path / "stat"  # /proc/stat's first line: user nice system idle iowait irq softirq steal ...
    stat.write_text(f"cpu  100 0 50 900 3 0 1 {3 * os.sysconf('SC_CLK_TCK')} 0 0\ncpu0 1 2 3\n")
    real_open = open
    monkeypatch.setattr(io_module, "open", lambda path, *a, **k: real_open(stat if path == "/proc/stat" else path,
                                                                           *a, **k), raising=False)
    assert io_module.cpu_steal_seconds() == 3.0
    stat.write_text("cpu  100 0 50\n")  # a kernel that does not count steal
    assert io_module.cpu_steal_seconds() is None
    monkeypatch.undo()

    _, container = models["A"]
    counter = iter([10.0, 10.25])
    monkeypatch.setattr(eng, "cpu_steal_seconds", lambda: next(counter))
    assert prefill(container, _prompt(20, 97, 0), PrefillOptions()).stats["steal_s"] == 0.25
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3")
    counter = iter([10.0, 10.25])
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids)])
    assert r.exit_code == 0 and "the hypervisor took 0.25 s of CPU" in r.output, r.output
    monkeypatch.setattr(eng, "cpu_steal_seconds", lambda: None)
    assert prefill(container, _prompt(20, 97, 0), PrefillOptions()).stats["steal_s"] is None
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids)])
    assert r.exit_code == 0 and "hypervisor" not in r.output, r.output


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


def test_read_pool_holds_a_layer_within_its_memory_share(models):
    assert read_scheduler.read_pool_buffers(10, 10, 4, 0) == 10  # a buffer for each read of a whole section
    assert read_scheduler.read_pool_buffers(1, 10, 4, 0) == 2 * 4  # at least 2 buffers per read in flight
    assert read_scheduler.read_pool_buffers(10, 10, 4, 400) == 5  # 1/8 of 400 bytes of memory
    assert read_scheduler.read_pool_buffers(10, 10, 4, 40) == 4  # never fewer than the reads in flight
    assert read_scheduler.read_pool_buffers(10, 10, 4, 0, pinned=True) == 2 * 4  # page-locked: 2 per read in flight,
    assert read_scheduler.read_pool_buffers(10, 10, 4, 400, pinned=True) == 5  # within the memory share too
    assert read_scheduler.read_pool_buffers(20, 10, 4, 0, sharers=2) == 10  # each rank reads half a section...
    assert read_scheduler.read_pool_buffers(20, 10, 4, 1600, sharers=2) == 10
    assert read_scheduler.read_pool_buffers(20, 10, 4, 800, sharers=2) == 5  # ... within half the memory share
    _, container = models["B"]
    with Container(container) as c:
        section = max(sum(r.length for r in b.experts) for b in c.layers)
        buffer = 2 * max(r.length for b in c.layers for r in b.experts)  # a bundle of 2
    stats = prefill(container, _prompt(20, 61, 3), PrefillOptions(bundle_experts=2, queue_depth=2)).stats
    assert section <= stats["read_pool_bytes"] < section + buffer


def test_host_buffers_start_on_a_huge_page(tmp_path):
    buffer = HostBuffer(5_000_000, pinned=False)
    assert buffer.tensor.data_ptr() % HUGE_PAGE == 0 and buffer.tensor.numel() == 5_000_000
    buffer.tensor.fill_(7)  # the whole requested length is there and writable past the alignment slack
    assert int(buffer.tensor[-1]) == 7 and int(buffer.tensor.sum()) == 7 * 5_000_000


def test_host_memory_the_driver_will_not_page_lock_is_one_line(monkeypatch):
    """A GPU's read buffers are page-locked host memory; where the driver refuses it, the error says so in one
    line instead of torch's traceback."""
    from moepack.runtime import io as io_module

    def refuse(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")

    monkeypatch.setattr(io_module.torch, "empty", refuse)
    with pytest.raises(MoepackError, match=r"^cannot page-lock 95 MiB of host memory for the GPU's reads \(CUDA "
                                           r"error: out of memory\)$"):
        HostBuffer(100_000_000, pinned=True)


def test_read_pipeline_with_spare_buffers_keeps_order(tmp_path):
    """More buffers than reads in flight (the prefill's read-ahead): still every read intact, in order."""
    from moepack.runtime.io import ReadPipeline, RegionReader

    path = tmp_path / "data.bin"
    data = os.urandom(4096 * 40)
    path.write_bytes(data)
    reader = RegionReader(str(path), "buffered")
    pipe = ReadPipeline(reader, 4096, depth=2, buffers=5)
    assert pipe.buffers == 5
    futures = [pipe.submit(4096 * i, 4096) for i in range(40)]
    held = []
    for i, f in enumerate(futures):
        buf, view = f.result(timeout=10)
        assert bytes(view) == data[4096 * i:4096 * (i + 1)]
        held.append(buf)
        if len(held) == 4:  # the consumer holds several buffers at once, as the expert threads do
            for b in held:
                pipe.release(b)
            held = []
    for b in held:
        pipe.release(b)
    pipe.close()
    reader.close()


def test_page_cache_reads_are_zero_copy_on_a_cpu(models):
    """mmap mode on a CPU: reads are views of the mapped file (nothing copied into the pool), read-only, with the
    same logits as O_DIRECT reads into the buffers; the reader closes even while such a view is still alive."""
    from moepack.runtime.io import RegionReader

    _, container = models["A"]
    with Container(container) as c:
        region = c.layer(1).experts[3]
    reader = RegionReader(container, "mmap", zero_copy=True)
    buf = HostBuffer(region.length, pinned=False)
    view = reader.read_into(buf, region.offset, region.length)
    with open(container, "rb") as f:
        f.seek(region.offset)
        assert bytes(view) == f.read(region.length)
    assert view.readonly and not any(bytes(buf.view[:64]))  # the buffer was not written
    reader.close()  # `view` is still alive: the mapping goes when it does
    assert bytes(view[:8]) == bytes(view[:8])
    del view
    ids = _prompt(90, 97, seed=11)
    direct = prefill(container, ids, PrefillOptions(io_mode="direct", expert_selection="all"))
    mapped = prefill(container, ids, PrefillOptions(io_mode="mmap", expert_selection="all"))
    assert mapped.stats["io_mode"] == "mmap" and torch.equal(mapped.logits, direct.logits)


@pytest.mark.parametrize("threads", [1, 2])
def test_expert_threads_give_the_reference_logits(models, threads):
    """With several CPU threads the experts of a layer run side by side, one core each; with one, in sequence.
    Both match transformers, and each other."""
    hf_model, container = models["B"]
    ids = _prompt(150, hf_model.config.vocab_size, seed=12)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = prefill(container, ids, PrefillOptions(expert_selection="all"))
        assert torch.get_num_threads() == threads  # the expert threads' one-thread setting did not leak
    finally:
        torch.set_num_threads(before)
    assert result.stats["expert_threads"] == threads
    ref = _reference(hf_model, ids)
    assert (result.logits - ref).abs().max() <= REL_TOL * ref.abs().max()
    assert result.stats["compute_busy_s"] <= result.stats["seconds"]  # overlapping threads are counted once


def test_an_expert_thread_error_is_raised_and_the_engine_closes(models, monkeypatch):
    """An expert thread's exception reaches the caller once the other expert tasks are done; then the read
    pipeline shuts down (no reader left waiting on a buffer), and torch's thread count is restored."""
    _, container = models["B"]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    calls = []

    def failing(self, block, region, raw, base, inputs, groups, view, prompt_ends=None):
        calls.append(region.expert)
        if len(calls) == 7:
            raise RuntimeError("expert blew up")
        a, b = groups.spans[region.expert]
        return torch.zeros(b - a, inputs.shape[1])
    monkeypatch.setattr(expert_runner.ExpertRunner, "_expert", failing)
    try:
        with Container(container) as c:
            e = engine.StreamingPrefill(c, PrefillOptions(expert_selection="all", queue_depth=2))
            try:
                with pytest.raises(RuntimeError, match="expert blew up"):
                    e.run(_prompt(120, 61, seed=3))
                assert torch.get_num_threads() == 2
            finally:
                e.close()
            assert not any(t.is_alive() for t in e.reads.experts_pipe._threads + e.reads.dense_pipe._threads)
    finally:
        torch.set_num_threads(before)


def test_bf16_compute_path(models):
    """--compute-dtype bfloat16: the attention's and shared expert's matrices in bf16, everything else float32;
    the logits stay within bf16 rounding of the float32 path, which is unchanged by the option's existence."""
    hf_model, container = models["C"]
    ids = _prompt(257, hf_model.config.vocab_size, seed=13)
    exact = prefill(container, ids, PrefillOptions(expert_selection="all"))
    low = prefill(container, ids, PrefillOptions(expert_selection="all", compute_dtype="bfloat16"))
    assert exact.stats["compute_dtype"] == "float32" and exact.stats["expert_dtype"] == "float32"
    assert low.stats["compute_dtype"] == "bfloat16" and low.stats["expert_dtype"] == "bfloat16"
    ref = _reference(hf_model, ids)
    scale = ref.abs().max()
    assert (exact.logits - ref).abs().max() <= REL_TOL * scale
    err = (low.logits - ref).abs().max()
    print(f"bf16 compute: max abs error {err:.3g} of logit scale {scale:.3g} ({err / scale:.1e})")
    assert 0 < err <= 3e-2 * scale, (err, scale)  # bf16 rounding: real, and small
    mixed = prefill(container, ids, PrefillOptions(expert_selection="all", compute_dtype="bfloat16",
                                                   expert_dtype="float32"))
    assert mixed.stats["expert_dtype"] == "float32" and not torch.equal(mixed.logits, low.logits)
    with Container(container) as c:  # which tensors the low-precision path keeps in bf16
        e = engine.StreamingPrefill(c, PrefillOptions(compute_dtype="bfloat16"))
        try:
            block = c.layer(1)
            w = e._dense_weights(block, e.reads.submit_dense(block))
        finally:
            e.close()
    low_names = {n for n, t in w.items() if t.dtype == torch.bfloat16}
    assert {"attn.wq_a.weight", "attn.wkv.weight", "attn.wo_b.weight", "ffn.shared_experts.w2.weight"} <= low_names
    assert all(n.startswith(("attn.", "ffn.shared_experts.")) and w[n].dim() == 2 for n in low_names)
    for name in ("ffn.gate.weight", "hc_attn_fn", "attn_norm.weight", "attn.attn_sink"):
        assert w[name].dtype == torch.float32, name
    with pytest.raises(MoepackError, match="unknown compute dtype"):
        prefill(container, ids, PrefillOptions(compute_dtype="float16"))


def test_busy_timer_counts_overlapping_threads_once():
    """Three threads inside the timer at once (a barrier inside proves it, whatever the machine's speed): the timer
    counts the span they cover together, not the sum of their spans."""
    import threading
    import time as _time

    timer = expert_runner.BusyTimer()
    inside = threading.Barrier(3)
    spans = []

    def busy():
        start = _time.perf_counter()
        with timer:
            inside.wait()  # all three are inside here
            _time.sleep(0.1)
        spans.append((start, _time.perf_counter()))
    threads = [threading.Thread(target=busy) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    covered = max(end for _, end in spans) - min(start for start, _ in spans)
    summed = sum(end - start for start, end in spans)
    assert 0.1 <= timer.seconds <= covered
    assert timer.seconds < summed - 0.1  # not the sum: the three 0.1 s after the barrier overlap (sum - union >= 0.2)
    before = timer.seconds
    with timer:
        _time.sleep(0.05)
    assert timer.seconds >= before + 0.05


@pytest.mark.parametrize("selection", ["all", "auto"])
def test_expert_reads_are_queued_layers_ahead_in_layer_order(models, monkeypatch, selection):
    """Reads known before their layer's router runs are queued READ_AHEAD_LAYERS layers ahead, each layer's once,
    in layer order (the order they are consumed in); hash and routed layers are queued when they are known."""
    _, container = models["A"]
    attentions_started = []
    submitted = []  # (layer, attention sublayers started so far)
    real_attention = v4_model.attention_sublayer
    real_submit = read_scheduler.ReadScheduler._submit_experts

    def attention(cfg, layer, *args, **kwargs):
        attentions_started.append(layer)
        return real_attention(cfg, layer, *args, **kwargs)

    def submit(self, block, layer, expert_ids):
        submitted.append((layer, len(attentions_started)))
        return real_submit(self, block, layer, expert_ids)
    monkeypatch.setattr(v4_model, "attention_sublayer", attention)
    monkeypatch.setattr(read_scheduler.ReadScheduler, "_submit_experts", submit)
    n = 300  # long enough for "auto" to read whole sections of the learned layers
    result = prefill(container, _prompt(n, 97, seed=21), PrefillOptions(expert_selection=selection))
    layers = [layer for layer, _ in submitted]
    assert layers == list(range(len(result.layers)))  # each layer once, in order
    known_from = 0  # the last layer whose reads wait for its own token ids or router: none later is queued before
    for (layer, started), stats in zip(submitted, result.layers):
        if stats.selection == "all":  # queued before the attention of layer - READ_AHEAD_LAYERS began
            assert started <= max(known_from, layer - read_scheduler.READ_AHEAD_LAYERS), (layer, started)
        else:  # hash: at its own layer's start, before its attention
            assert stats.selection == "hash" and started == layer
            known_from = layer
    assert {s.selection for s in result.layers} == ({"all"} if selection == "all" else {"hash", "all"})


def test_expert_threads_leave_torch_thread_count_as_it_was(models, monkeypatch):
    """The expert threads set one intra-op thread each; afterwards the count a new thread starts with is the
    caller's again, even in a layer with nothing to read on this process (only the shared expert ran there)."""
    import threading

    _, container = models["B"]
    real = expert_runner.ExpertRunner._run_experts
    calls = []
    with Container(container) as c:
        last_layer = len(c.layers) - 1

    def run_experts(self, block, reads, *args):
        calls.append(block.number)
        if block.number == last_layer:  # as a rank that owns none of the last layer's experts
            for _, _, future in reads:
                self.release(future.result()[0])
            return None
        return real(self, block, reads, *args)
    monkeypatch.setattr(expert_runner.ExpertRunner, "_run_experts", run_experts)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    try:
        prefill(container, _prompt(80, 61, seed=4), PrefillOptions(expert_selection="all"))
        probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        probe.start()
        probe.join()
    finally:
        torch.set_num_threads(before)
    assert calls and seen == [2]


def test_zero_copy_populate_falls_back_only_where_the_kernel_lacks_it(tmp_path, monkeypatch):
    """Zero-copy reads fault their pages in with libc's madvise (called through ctypes, so the GIL is released while
    a cold read waits for the disk). EINVAL (a kernel before 5.14) turns MADV_POPULATE_READ off for good, in favour
    of the page-cache hint; any other failure (a transient EAGAIN) keeps it; a zero-length read asks nothing."""
    import ctypes
    import errno as errno_codes
    import mmap as mmap_module

    from moepack.runtime import io as io_module

    path = tmp_path / "data.bin"
    data = os.urandom(1 << 20)
    path.write_bytes(data)
    reader = io_module.RegionReader(str(path), "mmap", zero_copy=True)
    buf = HostBuffer(1 << 20, pinned=False)
    assert bytes(reader.read_into(buf, 5000, 70000)) == data[5000:75000]
    if not reader._populate_works:
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14)")

    calls = []

    class FakeLibc:
        fail_with = errno_codes.EAGAIN

        def madvise(self, address, length, advice):
            calls.append((address, length, advice))
            if advice == io_module.MADV_POPULATE_READ:
                ctypes.set_errno(self.fail_with)
                return -1
            return 0

    fake = FakeLibc()
    monkeypatch.setattr(io_module, "_libc", fake)
    reader._populate(0, 5000, 70000)
    page = mmap_module.PAGESIZE
    start = 5000 - 5000 % page
    want = (reader._map_addresses[0] + start, 75000 - start)
    assert calls == [(*want, io_module.MADV_POPULATE_READ), (*want, mmap_module.MADV_WILLNEED)]
    assert reader._populate_works
    fake.fail_with = errno_codes.EINVAL
    calls.clear()
    reader._populate(0, 2 * page, page)
    assert [c[2] for c in calls] == [io_module.MADV_POPULATE_READ, mmap_module.MADV_WILLNEED]
    assert not reader._populate_works
    calls.clear()
    reader._populate(0, 2 * page, page)
    reader._populate(0, 2 * page + 5, 0)
    assert [c[2] for c in calls] == [mmap_module.MADV_WILLNEED]
    reader.close()


def test_keep_freed_memory_tunes_glibc_once_unless_the_allocator_is_the_users(models, monkeypatch):
    """keep_freed_memory (a CPU prefill calls it) asks glibc once to keep freed blocks for reuse (mmap threshold
    32 MiB, trim threshold 1 GiB, top pad 64 MiB) and release_freed_memory trims when a prefill closes; a user's
    own malloc settings, a preloaded allocator, MOEPACK_KEEP_FREED_MEMORY=0 or less than 4 GiB of memory the
    process may use leave malloc alone."""
    from moepack.runtime import io as io_module

    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad.value))
            return 1

    monkeypatch.setattr(io_module, "_libc", FakeLibc())
    for k in [k for k in os.environ if k.startswith("MALLOC_")] + ["GLIBC_TUNABLES", "LD_PRELOAD"]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(io_module, "_malloc_tuned", None)
    monkeypatch.setattr(io_module, "available_memory_bytes", lambda: 16 << 30)
    assert io_module.keep_freed_memory() and io_module.keep_freed_memory()
    assert calls == [(-3, 32 << 20), (-1, 1 << 30), (-2, 64 << 20)]  # once
    io_module.release_freed_memory()
    assert calls[-1] == ("trim", 0)
    for name, value in (("MOEPACK_KEEP_FREED_MEMORY", "0"), ("MALLOC_ARENA_MAX", "2"),
                        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"), ("LD_PRELOAD", "/usr/lib/libjemalloc.so")):
        calls.clear()
        monkeypatch.setattr(io_module, "_malloc_tuned", None)
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert not io_module.keep_freed_memory(), name
            io_module.release_freed_memory()
        assert calls == [], name
    # a process that may use little memory (a cgroup's limit, say) keeps none: the kept memory would run it out
    monkeypatch.setattr(io_module, "_malloc_tuned", None)
    monkeypatch.setattr(io_module, "available_memory_bytes", lambda: (3 << 30) + (1 << 29))
    assert not io_module.keep_freed_memory() and calls == []
    monkeypatch.undo()
    _, container = models["B"]
    assert prefill(container, _prompt(20, 61, 3), PrefillOptions()).stats["malloc_keeps_freed"] == \
        io_module.keep_freed_memory()


def test_a_damaged_dense_region_decoded_beside_the_experts_is_reported(models, tmp_path, monkeypatch):
    """With expert threads, layer L+1's dense weights decode on one of them during layer L's experts: damage there
    is still named, and the thread count of the caller is left as it was."""
    _, container = models["B"]
    with Container(container) as c:
        target = c.layer(2).dense
    data = bytearray(open(container, "rb").read())
    data[target.offset + 200] ^= 0x10
    bad = tmp_path / "bad.moepack"
    bad.write_bytes(data)
    decoded_on = {}
    real = engine.StreamingPrefill._dense_weights

    def record(self, block, future):
        decoded_on[block.name] = threading.current_thread().name
        return real(self, block, future)
    monkeypatch.setattr(engine.StreamingPrefill, "_dense_weights", record)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(FormatError, match=r"layers\.2\..*checksum mismatch while streaming"):
            prefill(str(bad), _prompt(100, 61, 3), PrefillOptions(expert_selection="all"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert decoded_on["layers.0"] == threading.main_thread().name
    assert decoded_on["layers.2"].startswith("moepack-expert")


def _within(seconds: float, fn):
    """fn() on another thread; fails the test (rather than hanging the suite) if it does not end in time."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: a deadlock"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("check_on_read", [False, True])
def test_every_read_buffer_comes_back_whether_or_not_its_experts_were_chosen(models, check_on_read, monkeypatch):
    """The expert threads take the layer's work in read order; a read none of whose experts a token chose has no
    work (where its bytes were checked on arrival, as on a GPU) and still gives its buffer back, or the next read
    would wait forever for a one-buffer pool. Both ways the logits are those of the run on one thread."""
    _, container = models["B"]
    prompt = _prompt(1, 61, 3)  # one token, one expert per read: most reads have no chosen expert
    monkeypatch.setattr(read_scheduler, "read_pool_buffers", lambda *args, **kw: 1)
    before = torch.get_num_threads()
    results = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            with Container(container) as c:
                e = engine.StreamingPrefill(c, PrefillOptions(expert_selection="all", queue_depth=1,
                                                              bundle_experts=1))
                try:
                    assert e.reads.experts_pipe.buffers == 1
                    e.reads.checker.on_read = check_on_read
                    results[threads] = _within(60, lambda: e.run(prompt))
                finally:
                    e.close()
        finally:
            torch.set_num_threads(before)
    assert all(layer.unused_experts > 0 for layer in results[1].layers)
    assert results[2].stats["expert_threads"] == 2 and results[1].stats["expert_threads"] == 1
    # the same work; only the attention's reductions differ (1 or 2 OpenMP threads)
    scale = results[1].logits.abs().max()
    assert (results[1].logits - results[2].logits).abs().max() <= 1e-5 * scale


def test_an_expert_failing_while_another_thread_waits_for_the_next_read_is_raised(models, monkeypatch):
    """One buffer: while one expert thread computes read 0's last expert, the other waits for read 1, whose
    buffer read 0 holds. That expert fails: its buffer must still go back, the waiting thread go on, and the
    failure come out of the prefill instead of a hang."""
    _, container = models["B"]
    monkeypatch.setattr(read_scheduler, "read_pool_buffers", lambda *args, **kw: 1)
    real = expert_runner.ExpertRunner._expert

    def failing(self, block, region, *args):
        if block.name == "layers.1" and region.expert == 3:
            time.sleep(0.5)  # the other thread has taken read 1's first expert and waits for the read by now
            raise RuntimeError("expert 3 blew up")
        return real(self, block, region, *args)
    monkeypatch.setattr(expert_runner.ExpertRunner, "_expert", failing)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="expert 3 blew up"):
            _within(60, lambda: prefill(container, _prompt(64, 61, 3),
                                        PrefillOptions(expert_selection="all", queue_depth=1, bundle_experts=4)))
    finally:
        torch.set_num_threads(before)


def test_openmp_spinning_is_limited_before_torch_loads_unless_the_user_chose(tmp_path):
    """Importing moepack sets GOMP_SPINCOUNT (libgomp reads it once, when torch loads it) unless the user set it or
    OMP_WAIT_POLICY."""
    import subprocess
    import sys

    probe = ("import os, sys, moepack; loaded = 'torch' in sys.modules; {}"
             "print(os.environ.get('GOMP_SPINCOUNT'), moepack.OMP_SPINCOUNT_SET_HERE, loaded)")
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    # (torch loaded once, where moepack sets the count: the user's choices are read at moepack's import alone)
    for extra, then, want in (({}, "import torch; ", "10000 True False"),
                              ({"GOMP_SPINCOUNT": "7"}, "", "7 False False"),
                              ({"OMP_WAIT_POLICY": "PASSIVE"}, "", "None False False")):
        out = subprocess.run([sys.executable, "-c", probe.format(then)], env={**base, **extra}, capture_output=True,
                             text=True, check=True).stdout.split()
        assert " ".join(out) == want, extra


def test_per_layer_expert_counts_are_the_routing(models):
    """Tokens per expert (min / median / max / unused) of a hash layer are tid2eid[token ids] counted; every
    layer's experts used and unused add up to its experts."""
    import statistics

    from moepack.format_spec.decode import decode_tensor

    hf_model, container = models["A"]
    ids = _prompt(41, hf_model.config.vocab_size, seed=4)
    result = prefill(container, ids, PrefillOptions())
    n_experts, top_k = hf_model.config.n_routed_experts, hf_model.config.num_experts_per_tok
    hash_layers = [s for s in result.layers if s.selection == "hash"]
    assert hash_layers
    with Container(container) as c:
        for stats in hash_layers:
            t = c.tensors[f"layers.{stats.layer}.ffn.gate.tid2eid"]
            chosen = decode_tensor(t.dtype, t.shape, c.tensor_bytes(t.name))[ids].reshape(-1)
            counts = torch.bincount(chosen, minlength=n_experts).tolist()
            assert (stats.tokens_per_expert_min, stats.tokens_per_expert_median, stats.tokens_per_expert_max,
                    stats.unused_experts) == (min(counts), statistics.median(counts), max(counts), counts.count(0))
    for stats in result.layers:
        assert stats.experts_used + stats.unused_experts == n_experts
        assert stats.tokens_computed == len(ids) * top_k


def _slow_reads(monkeypatch, seconds: float, events: list | None = None) -> None:
    """Every read of the runtime's reader takes `seconds` longer; ("read done", time) goes to `events` after each."""
    from moepack.runtime import io as io_module

    real_preadv = io_module.os.preadv

    def slow_preadv(*args):
        time.sleep(seconds)
        try:
            return real_preadv(*args)
        finally:
            if events is not None:
                events.append(("read done", time.perf_counter()))
    monkeypatch.setattr(io_module.os, "preadv", slow_preadv)


def test_stats_are_measured_not_only_present(models, monkeypatch):
    """io busy time covers reads that each take 5 ms; tokens/s and overlap are what the other stats make."""
    _, container = models["A"]
    _slow_reads(monkeypatch, 0.005)
    s = prefill(container, _prompt(40, 97, seed=9), PrefillOptions(io_mode="direct", queue_depth=1)).stats
    # at most four reads are in flight at once (an expert bundle, two dense regions, the embedding or the LM head)
    assert s["io_busy_s"] >= s["read_requests"] * 0.005 / 4 and s["io_busy_s"] <= s["seconds"] * 1.01
    assert s["compute_busy_s"] <= s["seconds"] * 1.01
    assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["seconds"], rel=0.01)
    assert s["overlap"] == pytest.approx(s["seconds"] / max(s["io_busy_s"], s["compute_busy_s"]), rel=0.01)


def test_io_auto_chooses_page_cache_only_where_the_container_fits(models, monkeypatch):
    from moepack.runtime import io as io_module

    _, container = models["A"]
    size = os.path.getsize(container)
    for free, want in ((size * 10, "mmap"), (size, "direct")):
        monkeypatch.setattr(io_module, "available_memory_bytes", lambda free=free: free)
        assert io_module.choose_io_mode("auto", size) == want
        stats = prefill(container, [5, 6, 7], PrefillOptions(io_mode="auto")).stats
        # a filesystem without O_DIRECT (tmpfs) turns direct into buffered reads, with a warning
        assert stats["io_mode"] == want or (want, stats["io_mode"]) == ("direct", "buffered") and "io_warning" in stats


def test_reads_run_ahead_of_the_compute(models, monkeypatch):
    """The dense region of layer L+1 is asked for before layer L's attention, and a layer's first expert computes
    while its later reads are still on their way (slowed to 20 ms each, one in flight)."""
    _, container = models["A"]
    events = []
    real_attention = v4_model.attention_sublayer
    real_dense, real_task = read_scheduler.ReadScheduler.submit_dense, expert_runner.ExpertRunner._expert

    def attention(cfg, layer, *args, **kwargs):
        events.append(("attention", layer))
        return real_attention(cfg, layer, *args, **kwargs)

    def submit_dense(self, block):
        events.append(("dense", int(block.name.split(".")[1])))
        return real_dense(self, block)

    def task(self, block, *args):
        events.append(("expert", time.perf_counter()))
        return real_task(self, block, *args)
    _slow_reads(monkeypatch, 0.02, events)
    monkeypatch.setattr(v4_model, "attention_sublayer", attention)
    monkeypatch.setattr(read_scheduler.ReadScheduler, "submit_dense", submit_dense)
    monkeypatch.setattr(expert_runner.ExpertRunner, "_expert", task)
    prefill(container, _prompt(200, 97, seed=2), PrefillOptions(io_mode="direct", queue_depth=1, bundle_experts=1,
                                                                  expert_selection="all"))
    order = [e for e in events if e[0] in ("attention", "dense")]
    for layer in range(4):
        assert order.index(("dense", layer + 1)) < order.index(("attention", layer)), order
    first_expert = next(t for kind, t in events if kind == "expert")
    last_read = max(t for kind, t in events if kind == "read done")
    assert first_expert < last_read


def test_each_layers_kv_leaves_the_engine_when_the_layer_ends(models):
    """The KV of layer L is handed over before layer L+1's attention starts, and the engine keeps no reference to
    it afterwards (on a GPU: it leaves device memory)."""
    import weakref

    _, container = models["A"]
    events, refs = [], []
    real_attention = v4_model.attention_sublayer

    def attention(cfg, layer, *args, **kwargs):
        events.append(("attention", layer, sum(r() is not None for r in refs)))
        return real_attention(cfg, layer, *args, **kwargs)

    def on_kv(layer, state):
        events.append(("kv", layer))
        refs.append(weakref.ref(state.window_kv))
    v4_model.attention_sublayer = attention
    try:
        prefill(container, _prompt(60, 97, seed=3), PrefillOptions(), on_layer_kv=on_kv)
    finally:
        v4_model.attention_sublayer = real_attention
    for layer in range(1, 5):
        assert events.index(("kv", layer - 1)) < [e[:2] for e in events].index(("attention", layer))
    assert all(alive == 0 for kind, *rest in events if kind == "attention" for _, alive in [rest])


def test_query_chunks_read_the_same_bytes(models):
    _, container = models["A"]
    ids = _prompt(150, 97, seed=5)
    stats = [prefill(container, ids, PrefillOptions(query_chunk=q)).stats for q in (None, 7, 64)]
    assert len({(s["bytes_read"], s["read_requests"]) for s in stats}) == 1


def _variant(tmp_path, **changes):
    """Configuration A with `changes`, re-drawn and saved by transformers: (its model, checkpoint directory)."""
    src = str(tmp_path / "src")
    return saved_model({**CONFIGS["A"], **changes}, 7, src), src


@pytest.mark.parametrize("seed", range(8))
def test_random_configurations_match_transformers(tmp_path, seed):
    """Configurations, prompt lengths, container policies, streaming options and KV continuations drawn at random
    (tests/v4_models.py `random_case`): shapes no hand-written case names. benchmarks/reference_error.py runs more
    seeds and prints each error."""
    row = run_random_case(random_case(seed), str(tmp_path))
    assert row["relative"] <= REL_TOL and row["same_token"], row  # these seeds are all comparable ("none": never)


@pytest.fixture(scope="module")
def release_storage(tmp_path_factory):
    """The release's own storage (FP8 e4m3 dense weights with 128x128 E8M0 block scales, FP4 e2m1 experts with one
    scale per 32 inputs), with widths that end in partial 128-blocks (160, 96), kept as it is or converted as
    `--fp4` does: policy -> (container, transformers on `moepack export` of it, float32)."""
    from transformers import DeepseekV4ForCausalLM

    from moepack.packer.export import export_container
    from moepack.packer.synth import synth_checkpoint

    base = tmp_path_factory.mktemp("release-storage")
    src = str(base / "src")
    synth_checkpoint(src, preset="tiny", layout="release", seed=1, progress=False,
                     config_overrides={"hidden_size": 160, "moe_intermediate_size": 96, "q_lora_rank": 96})
    out = {}
    for policy in ("keep", "fp4"):
        container = str(base / f"{policy}.moepack")
        convert_checkpoint(src, container, policy=policy, progress=False)
        export_container(container, str(base / f"{policy}-export"), dtype="f32", progress=False)
        exported = DeepseekV4ForCausalLM.from_pretrained(str(base / f"{policy}-export"), dtype=torch.float32).eval()
        out[policy] = container, exported
    return out


@pytest.mark.parametrize("policy,dense_type,expert_type", [("keep", "F8_E4M3", "FP4_E2M1"), ("fp4", "Q8_0", "MXFP4")])
def test_a_release_layout_container_matches_transformers_on_its_export(release_storage, policy, dense_type,
                                                                       expert_type, tmp_path):
    """Prefilled straight from the stored bytes, the logits are transformers' on `moepack export` of the same
    container; so are those of the prompt's last 100 tokens continued from the KV of its first 200."""
    container, exported = release_storage[policy]
    with Container(container) as c:
        stored = {t.name: t.dtype for t in c.tensors.values()}
    assert (stored["layers.0.attn.wq_a.weight"], stored["layers.0.ffn.experts.0.w2.weight"]) == (dense_type, expert_type)
    ids = _prompt(300, exported.config.vocab_size, seed=11)
    ref = _reference(exported, ids)
    result = prefill(container, ids, PrefillOptions(expert_selection="all"))
    assert (result.logits - ref).abs().max() <= REL_TOL * ref.abs().max()
    assert result.next_token == int(ref.argmax())
    prefill(container, ids[:200], PrefillOptions(), kv_out=str(tmp_path / "kv"))
    continued = prefill(container, ids[200:], PrefillOptions(), continue_from=str(tmp_path / "kv"))
    assert (continued.logits - ref).abs().max() <= REL_TOL * ref.abs().max()


@pytest.mark.parametrize("compiled", [True, False])
def test_the_memory_check_counts_the_fp8_decoders_scratch(release_storage, monkeypatch, compiled):
    """Decoding an FP8 matrix with torch's ops (on a GPU, or a CPU without the compiled decoder) holds an int32
    index per weight beside the bytes and the output: the check before the prefill counts it for the largest,
    and only where those ops decode."""
    container, _ = release_storage["keep"]
    seen = []
    real = memory_module.estimate_working_set
    monkeypatch.setattr(memory_module, "estimate_working_set", lambda *a, **k: seen.append(k) or real(*a, **k))
    monkeypatch.setattr(memory_module, "fp8_decoder_compiled", lambda: compiled)
    with Container(container) as c:
        largest = max(t.numel for t in c.tensors.values() if t.dtype == "F8_E4M3" and t.name.startswith("layers."))
    prefill(container, _prompt(5, 97, 1), PrefillOptions())
    assert seen[0]["decode_scratch_bytes"] == (0 if compiled else 4 * largest) and largest > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("policy", ["keep", "fp4"])
def test_cuda_prefill_of_release_storage_in_both_dtypes_and_continued(release_storage, policy, tmp_path):
    """On the GPU: FP8 / FP4 (or Q8_0 / MXFP4) bytes decoded on the device, in float32 (transformers' logits on
    the export), in bfloat16 (no further from them than the CPU's bfloat16 run, give or take the GPU's own sums)
    and continued from a KV written by a GPU prefill."""
    container, exported = release_storage[policy]
    ids = _prompt(300, exported.config.vocab_size, seed=11)
    ref = _reference(exported, ids)
    scale = ref.abs().max().item()
    f32 = prefill(container, ids, PrefillOptions(device="cuda", expert_selection="all"))
    assert (f32.logits - ref).abs().max() <= REL_TOL * scale and f32.next_token == int(ref.argmax())
    bf16_gpu = prefill(container, ids, PrefillOptions(device="cuda", compute_dtype="bfloat16")).logits
    bf16_cpu = prefill(container, ids, PrefillOptions(compute_dtype="bfloat16")).logits
    cpu_error = (bf16_cpu - ref).abs().max().item()
    assert (bf16_gpu - ref).abs().max().item() <= max(3 * cpu_error, 1e-2 * scale), cpu_error
    prefill(container, ids[:200], PrefillOptions(device="cuda"), kv_out=str(tmp_path / "kv"))
    continued = prefill(container, ids[200:], PrefillOptions(device="cuda"), continue_from=str(tmp_path / "kv"))
    assert (continued.logits - ref).abs().max() <= REL_TOL * scale


def test_a_head_tied_to_the_embedding_is_the_embedding_read_once(tmp_path):
    """tie_word_embeddings: the checkpoint stores no LM head; prefill applies the embedding table as the head,
    from the bytes it read for the prompt's rows (each region is still read once), and export round-trips it."""
    from transformers import DeepseekV4ForCausalLM

    from moepack.packer.export import export_container

    hf_model, src = _variant(tmp_path, tie_word_embeddings=True)
    container = str(tmp_path / "tied.moepack")
    convert_checkpoint(src, container, progress=False)
    with Container(container) as c:
        assert "head.weight" not in c.tensors and "embed.weight" in c.tensors
        used = sum(r.length for r in c.global_regions) + sum(b.dense.length + b.experts_span[1] for b in c.layers)
    ids = _prompt(45, 97, seed=8)
    ref = _reference(hf_model, ids)
    for io_mode in ("direct", "mmap"):
        result = prefill(container, ids, PrefillOptions(expert_selection="all", io_mode=io_mode))
        assert (result.logits - ref).abs().max() <= REL_TOL * ref.abs().max()
        assert result.stats["bytes_read"] == used
    export_container(container, str(tmp_path / "export"), dtype="f32", progress=False)
    exported = DeepseekV4ForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).eval()
    assert torch.allclose(_reference(exported, ids), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


def test_a_tied_config_beside_a_stored_head_uses_the_stored_head_as_transformers_does(tmp_path):
    """tie_word_embeddings in config.json, yet the checkpoint stores a head of its own: transformers computes with
    the stored head, and so does the container (its config untied, a warning said so)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4ForCausalLM

    _, src = _variant(tmp_path, tie_word_embeddings=True)
    shard = next(os.path.join(src, n) for n in sorted(os.listdir(src)) if n.endswith(".safetensors"))
    weights = load_file(shard)
    embed = next(n for n in weights if n.endswith("embed.weight") or n.endswith("embed_tokens.weight"))
    head = "lm_head.weight" if embed.startswith("model.") else "head.weight"
    weights[head] = torch.randn(weights[embed].shape, generator=torch.Generator().manual_seed(5))
    save_file(weights, shard, metadata={"format": "pt"})
    hf_model = DeepseekV4ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    container = str(tmp_path / "untied.moepack")
    with pytest.warns(UserWarning, match="stores a head of its own: it is kept and used as the head"):
        convert_checkpoint(src, container, progress=False)
    with Container(container) as c:
        assert c.config["tie_word_embeddings"] is False and "head.weight" in c.tensors
    ids = _prompt(20, 97, seed=8)
    ref = _reference(hf_model, ids)
    result = prefill(container, ids, PrefillOptions(expert_selection="all"))
    assert (result.logits - ref).abs().max() <= REL_TOL * ref.abs().max()


@pytest.mark.parametrize("change,named", [({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                                          ({"mlp_bias": True}, "mlp_bias")])
def test_a_model_this_runtime_would_compute_differently_is_refused_in_one_line(tmp_path, change, named):
    """transformers would run these configurations; this runtime's experts are SiLU-gated without biases, so
    `moepack convert` refuses them by name, in one line, writing nothing (as Qwen3-MoE's); a container that says
    so all the same (converted by another version) is refused by prefill, reported by verify, and planned."""
    from containers import mutate_index

    _, src = _variant(tmp_path, **change)
    container = str(tmp_path / "other.moepack")
    r = CliRunner().invoke(cli, ["convert", src, "-o", container, "--keep"])
    assert r.exit_code == 1 and named in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not os.path.exists(container)
    _, clean = _variant(tmp_path / "clean")
    convert_checkpoint(clean, str(tmp_path / "clean.moepack"), progress=False)
    mutate_index(str(tmp_path / "clean.moepack"), container, lambda index: index["config"].update(change))
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3")
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids)])
    assert r.exit_code == 1 and named in r.output and len(r.output.strip().splitlines()) == 1, r.output
    r = CliRunner().invoke(cli, ["plan", container, "--json"])  # sizes and FLOPs do not depend on it
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["verify", container, "--json"])  # a sound container of a model prefill refuses
    assert r.exit_code == 0 and json.loads(r.stdout)["prefill"].startswith("refused: " + named), r.output


@pytest.mark.parametrize("damage,named", [
    ("drop:model.layers.1.attn.wq_b.weight", "tensor layers.1.attn.wq_b.weight is missing"),
    ("drop:model.layers.3.ffn.gate.bias", "tensor layers.3.ffn.gate.bias is missing"),  # optional in the math
    ("drop:model.layers.2.ffn.experts.5.w3.weight", "tensor layers.2.ffn.experts.5.w3.weight is missing"),
    ("config:q_lora_rank=25", "tensor layers.0.attn.wq_a.weight is [24, 64] but the config says [25, 64]"),
    ("config:index_topk=3", None),  # not a shape: a valid model
])
def test_a_container_whose_tensors_do_not_fit_its_config_is_refused_before_any_read(tmp_path, damage, named):
    """A checkpoint missing a tensor, or whose config gives it another shape, is refused by convert before it
    writes anything; a container holding such a model (its index edited) is refused by prefill, which names the
    first tensor that does not fit, in one line, before reading anything, and by verify."""
    from containers import mutate_index
    from safetensors.torch import save_file

    _, src = _variant(tmp_path)
    clean = str(tmp_path / "clean.moepack")
    convert_checkpoint(src, clean, progress=False)
    kind, _, what = damage.partition(":")
    if kind == "drop":
        weights = load_file(os.path.join(src, "model.safetensors"))
        del weights[what]
        save_file(weights, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
        stored = what.removeprefix("model.")

        def edit(index):
            index["tensors"] = [t for t in index["tensors"] if t["name"] != stored]
    else:
        key, value = what.split("=")
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
        config[key] = int(value)
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump(config, f)

        def edit(index):
            index["config"][key] = int(value)
    container = str(tmp_path / "damaged.moepack")
    if named is not None:
        with pytest.raises(MoepackError, match=re.escape(named)):
            convert_checkpoint(src, container, progress=False)
        assert not os.path.exists(container)
    mutate_index(clean, container, edit)
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3")
    before = _proc_read_bytes()
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids)])
    verified = CliRunner().invoke(cli, ["verify", container, "--json"])
    if named is None:
        assert r.exit_code == 0 and verified.exit_code == 0, (r.output, verified.output)
        return
    assert r.exit_code == 1 and named in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert _proc_read_bytes() - before < (1 << 20)
    assert verified.exit_code == 1 and named in verified.output, verified.output  # verify says it too


def test_swish_is_silu(tmp_path):
    """transformers' ACT2FN gives "swish" and "silu" the same function: both are computed, not refused."""
    hf_model, src = _variant(tmp_path, hidden_act="swish")
    container = str(tmp_path / "swish.moepack")
    convert_checkpoint(src, container, progress=False)
    ids = _prompt(20, 97, seed=9)
    ref = _reference(hf_model, ids)
    assert (prefill(container, ids).logits - ref).abs().max() <= REL_TOL * ref.abs().max()


def test_cli_without_a_cuda_device_says_so_in_one_line(models, tmp_path):
    _, container = models["A"]
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is there")
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3")
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids), "--device", "cuda"])
    assert r.exit_code != 0 and "CUDA" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    for device in ("tpu", "cpu:x", "mps"):
        r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids), "--device", device])
        assert r.exit_code == 1 and "unknown device" in r.output and len(r.output.strip().splitlines()) == 1, \
            r.output


def _strict_index(device) -> int:
    """torch.cuda's own rule for calls without optional=True (get_per_process_memory_fraction in torch 2.13):
    a torch.device without an index is refused."""
    if isinstance(device, torch.device):
        if device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        return device.index
    return int(device)


def test_a_cuda_device_always_carries_its_index(monkeypatch):
    """`--device cuda` becomes the current CUDA device with its index before any torch.cuda call sees it: torch
    refuses an index-less device in some of them (it crashed every GPU prefill before any read)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert engine.compute_device("cuda") == torch.device("cuda", 1)
    assert engine.compute_device("cuda:0") == torch.device("cuda", 0)
    assert engine.compute_device("cpu") == torch.device("cpu")
    with pytest.raises(MoepackError, match="torch sees 2 CUDA device"):
        engine.compute_device("cuda:2")
    for bad in ("tpu", "cpu:x", "mps"):
        with pytest.raises(MoepackError, match="unknown device"):
            engine.compute_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MoepackError, match="no CUDA device"):
        engine.compute_device("cuda")
    # an expert-parallel rank names a bad device as such, before it tries to join its job
    with pytest.raises(MoepackError, match="unknown device 'tpu'"):
        prefill("unused.moepack", [1, 2], PrefillOptions(device="tpu"), expert_parallel=True)


@pytest.mark.parametrize("fraction", [None, 0.5])
def test_free_device_memory_is_the_devices_within_the_process_cap(monkeypatch, fraction):
    """Free device memory for the prompt-length check: the device's free bytes, capped by the process's memory
    fraction where torch has one (older torch: no cap), plus what torch holds cached but unused."""
    gib = 2**30
    calls = []

    def strict(value):
        def call(device):
            calls.append(_strict_index(device))
            return value
        return call

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", strict(10 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", strict(4 * gib))
    if fraction is None:
        monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    else:
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", strict(fraction))
    free = memory_module.cuda_free_bytes(torch.device("cuda", 0))
    # no cap: 60 free + 10 cached - 4 in use; a cap of 40 GiB: 40 - 10 reserved = 30 more, + 10 - 4
    assert free == (66 * gib if fraction is None else 36 * gib)
    assert calls and set(calls) == {0}


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    """A and C with 16 indexer heads (v4_models.wide_indexer): no exact ties for the device's top-k to break."""
    return wide_indexer_models(str(tmp_path_factory.mktemp("prefill-wide")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name,n", [("A", 300), ("C", 257), ("A", 1000)])
def test_cuda_prefill_matches_transformers_and_the_cpu(wide_models, name, n):
    """The CUDA path: pinned buffers, copies on a copy stream, decode and matmuls on the device. Same logits as
    the reference and as the CPU run; the device's peak memory is reported; each layer's KV reaches the hook."""
    hf_model, container = wide_models[name]
    ids = _prompt(n, hf_model.config.vocab_size, seed=n)
    ref = _reference(hf_model, ids)
    devices = []
    with indexer_boundary_ties() as ties:
        gpu = prefill(container, ids, PrefillOptions(device="cuda"),
                      on_layer_kv=lambda layer, state: devices.append(state.window_kv.device.type))
        cpu = prefill(container, ids, PrefillOptions())
    assert ties == [0]  # else the device's top-k may rightly choose other entries than the CPU's
    assert (gpu.logits - ref).abs().max() <= REL_TOL * ref.abs().max()
    assert torch.allclose(gpu.logits, cpu.logits, atol=REL_TOL * ref.abs().max().item(), rtol=0)
    assert gpu.next_token == cpu.next_token and gpu.stats["bytes_read"] == cpu.stats["bytes_read"]
    assert 0 < gpu.stats["peak_device_bytes"] <= gpu.stats["peak_device_reserved_bytes"]
    assert gpu.stats["device"].startswith("cuda:")
    assert len(devices) == hf_model.config.num_hidden_layers


def test_a_grouped_pass_makes_its_rows_prompts_once_not_per_layer():
    """The per-expert backend's rows -> prompt index of a pass of several prompts: right, and on a GPU (the meta
    device stands in) copied there once for the pass, not again for each layer."""
    from host_copies import HostToDevice

    assert expert_runner.rows_prompt((2, 5, 6), 6, torch.device("cpu")).tolist() == [0, 0, 1, 1, 1, 2]
    device = torch.device("meta")
    first = expert_runner.rows_prompt((3, 7), 7, device)
    with HostToDevice() as later:
        again = expert_runner.rows_prompt((3, 7), 7, device)
    assert again is first and later.copies == []
