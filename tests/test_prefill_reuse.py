"""One prefill engine per Generator: its read pools, threads and buffers are opened by the first generation and serve
every later one (Generator.generate, and BatchScheduler's grouped passes over the same Generator), after a
generation cancelled mid-prefill or failed too: each pass gives back what it left of its reads."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from moepack.format_spec.errors import MoepackError
from moepack.runtime import io as io_module
from moepack.runtime.batching import BatchScheduler
from moepack.runtime.engine import PrefillOptions
from moepack.runtime.read_scheduler import ReadScheduler
from moepack.runtime.generate import GenerateOptions, Generator
from containers import tiny_keep_container

# every expert read, queued layers ahead: a pass stopped between layers leaves reads queued and in flight
PREFILL = PrefillOptions(expert_selection="all", queue_depth=2)
OPTIONS = GenerateOptions(max_new_tokens=5, stop_at_eos=False, logprobs=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_keep_container(tmp_path_factory)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fresh(path: str, ids: list[int]):
    """What a Generator opened for this generation alone gives."""
    with Generator(path, cache_gib=0.5, prefill=PREFILL) as g:
        return g.generate(ids, OPTIONS)


def _same(a, b) -> None:
    assert a.generated_ids == b.generated_ids and a.finish_reason == b.finish_reason
    assert [(p.logprob, p.top) for p in a.logprobs] == [(p.logprob, p.top) for p in b.logprobs]  # to the bit


def _moepack_threads() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate() if t.name.startswith("moepack")}


def test_generations_share_one_prefill_engine_across_a_cancel_and_a_failure(tiny, monkeypatch):
    opened = {"pipelines": 0, "readers": 0}
    for cls, key in ((io_module.ReadPipeline, "pipelines"), (io_module.RegionReader, "readers")):
        def counting(self, *a, _init=cls.__init__, _key=key, **kw):
            opened[_key] += 1
            _init(self, *a, **kw)
        monkeypatch.setattr(cls, "__init__", counting)
    left_queued = []  # per pass: the layers whose reads were still queued when it ended
    end_pass = ReadScheduler.end_pass
    monkeypatch.setattr(ReadScheduler, "end_pass",
                        lambda self, *a: (left_queued.append(len(self._queued)), end_pass(self, *a))[1])

    with Generator(tiny, cache_gib=0.5, prefill=PREFILL) as g:
        vocab = g.cfg.vocab_size
        a, b, c = _prompt(30, 1, vocab), _prompt(12, 2, vocab), _prompt(45, 3, vocab)
        first = g.generate(a, OPTIONS)
        engine = g.prefill_engine()
        pipe = engine.reads.experts_pipe
        assert engine.reads.dense_pipe is None  # the dense weights are the decoder's, held: no dense pool opened
        pool_buffers = pipe.buffers
        opened_once = dict(opened)
        threads_once = _moepack_threads()
        assert any(name.startswith("moepack-read") for name in threads_once.values())

        asked = []  # stopped before the prefill's third layer: the reads of the layers ahead are queued
        cancelled = g.generate(b, OPTIONS, cancelled=lambda: (asked.append(1), len(asked) > 2)[1])
        assert cancelled.finish_reason == "cancelled" and cancelled.stats["prefill"]["cancelled_after_layers"] == 2
        assert left_queued[-1] > 0  # the cancelled pass left reads queued ahead: end_pass gave them back
        assert pipe.buffers_lent == 0

        route = engine.family.route

        def failing_route(number, *args):
            if number == 1:
                raise RuntimeError("a compute error in layer 1")
            return route(number, *args)
        monkeypatch.setattr(engine.family, "route", failing_route)
        with pytest.raises(RuntimeError, match="layer 1"):
            g.generate(c, OPTIONS)
        monkeypatch.setattr(engine.family, "route", route)
        assert pipe.buffers_lent == 0

        after = [g.generate(c, OPTIONS), g.generate(b, OPTIONS), g.generate(a, OPTIONS)]
        with BatchScheduler(g, max_batch=2) as batch:
            batched = batch.generate(b, replace(OPTIONS, logprobs=None))
        assert g.prefill_engine() is engine and engine.reads.experts_pipe is pipe and pipe.buffers == pool_buffers
        assert opened == opened_once  # no pipeline, reader (nor their buffers) opened after the first generation
        batch_thread = {i: n for i, n in _moepack_threads().items() if n != "moepack-batch"}
        assert batch_thread == threads_once  # the same threads, not new ones of the same names

    for got, ids in zip([first, *after], [a, c, b, a]):
        _same(got, _fresh(tiny, ids))
    assert batched.generated_ids == after[1].generated_ids


def test_the_decodes_misses_and_the_prefill_read_through_one_reader(tiny, monkeypatch):
    """One read front end: the Generator opens the container's reader once (one io mode chosen, one set of
    descriptors) and the prefill's reads, the decoder's resident weights and its expert misses all go through it;
    a closed engine does not close it."""
    from moepack.format_spec.reader import Container

    opened = []
    init = io_module.RegionReader.__init__
    # the decoder's resident weights and its seed read through it too, not through the container's own descriptors
    monkeypatch.setattr(Container, "pread_into", lambda *a, **k: pytest.fail("a read past the shared reader"))
    monkeypatch.setattr(io_module.RegionReader, "__init__",
                        lambda self, *a, **k: (opened.append(1), init(self, *a, **k))[1])
    with Generator(tiny, cache_gib=0.0, prefill=PREFILL) as g:  # no cache: every step reads its experts
        ids = _prompt(10, 5, g.cfg.vocab_size)
        engine = g.prefill_engine()
        assert engine.reads.reader is g.reader and g.decoder.reader is g.reader
        before = g.reader.stats.bytes_read
        result = g.generate(ids, OPTIONS)
        decoded = result.stats["decode"]["bytes_read"]
        assert decoded > 0 and g.reader.stats.bytes_read - before >= decoded + result.stats["prefill"]["bytes_read"]
        engine.close()
        again = g.generate(ids, OPTIONS)  # a new engine, over the same open reader
    assert opened == [1]
    _same(again, result)


def test_a_closed_engine_is_opened_again(tiny):
    """A caller that closed the Generator's engine (as tests of run_many do) gets a fresh one next time."""
    with Generator(tiny, cache_gib=0.5, prefill=PREFILL) as g:
        engine = g.prefill_engine()
        engine.close()
        ids = _prompt(10, 4, g.cfg.vocab_size)
        result = g.generate(ids, OPTIONS)
        assert g.prefill_engine() is not engine and not g.prefill_engine().closed
    _same(result, _fresh(tiny, ids))


def test_replaced_prefill_options_take_effect_at_the_next_generation(tiny):
    """prefill_options replaced between generations (a caller's on_layer): the engine opened with the old ones is
    closed and the next generation runs with the new ones; unchanged options keep the engine."""
    with Generator(tiny, cache_gib=0.5, prefill=PREFILL) as g:
        ids = _prompt(10, 5, g.cfg.vocab_size)
        first = g.generate(ids, OPTIONS)
        engine = g.prefill_engine()
        assert g.prefill_engine() is engine
        layers = []
        g.prefill_options = replace(g.prefill_options, on_layer=lambda layer, n, nbytes: layers.append(layer))
        again = g.generate(ids, OPTIONS)
        assert engine.closed and g.prefill_engine() is not engine
        assert layers and layers == list(range(len(layers)))  # each layer once, in order
    _same(again, first)


def test_the_scheduler_lets_go_of_the_engine_after_a_lone_prompts_memory_refusal(tiny, prefill_room):
    """A prompt refused alone for memory: the batch scheduler lets go of the engine as after any pass (the next
    group asks the Generator again, so replaced prefill_options take effect)."""
    prefill_room(50)
    options = replace(OPTIONS, logprobs=0)
    with Generator(tiny, cache_gib=0.5, prefill=PREFILL) as g, BatchScheduler(g, max_batch=2) as batch:
        first = batch.generate([5, 6, 7, 8], options)
        with pytest.raises(MoepackError, match="a prompt of 80 tokens needs more"):
            batch.generate(list(range(3, 83)), options)
        layers = []
        g.prefill_options = replace(g.prefill_options, on_layer=lambda layer, n, nbytes: layers.append(layer))
        again = batch.generate([5, 6, 7, 8], options)
    assert layers and layers == list(range(len(layers)))
    assert again.generated_ids == first.generated_ids


def test_a_pass_gives_back_its_reads_however_it_ended(tiny):
    """ReadPipeline.end_pass: reads not started are cancelled, those done but never consumed are given back once,
    and a late release of a reclaimed buffer does not put it in the pool twice."""
    with Generator(tiny, cache_gib=0.5, prefill=PREFILL) as g:
        pipe = g.prefill_engine().reads.experts_pipe
        region = g.c.layers[0].experts[0]
        futures = [pipe.submit(region.offset, region.length, part=region.part) for _ in range(pipe.buffers + 3)]
        buffer, _ = futures[0].result()
        assert pipe.buffers_lent >= 1
        pipe.end_pass()
        assert pipe.buffers_lent == 0 and any(f.cancelled() for f in futures)
        pipe.release(buffer)  # its consumer, late: already back in the pool
        again = [pipe.submit(region.offset, region.length, part=region.part) for _ in range(pipe.buffers)]
        held = [f.result(timeout=30)[0] for f in again]
        assert len({id(b) for b in held}) == pipe.buffers  # every buffer lent once: none twice in the pool
        for b in held:
            pipe.release(b)
        with pytest.raises(MoepackError, match="empty prompt"):
            g.generate([], OPTIONS)
