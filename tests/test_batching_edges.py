"""BatchScheduler's edges under a hostile or careless caller: a future cancelled by its caller, a `cancelled`
callback that raises, a sequence over at its first token; each touches that sequence alone."""

from __future__ import annotations

import threading

import pytest

from moepack.format_spec.errors import MoepackError
from moepack.runtime.generate import Generator
from containers import tiny_keep_container
from test_batching import TIMEOUT, Batch, _prompt, _solo


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    with Generator(tiny_keep_container(tmp_path_factory), cache_gib=0.5) as g:
        yield g


def test_a_future_cancelled_by_its_caller_stops_its_sequence_alone(generator):
    vocab = generator.cfg.vocab_size
    long_ids, short_ids = _prompt(8, 61, vocab), _prompt(6, 62, vocab)
    alone = _solo(generator, long_ids, max_new_tokens=30)
    seen, first = [], threading.Event()

    def on_token(token, logprob):
        seen.append(token)
        first.set()
    with Batch(generator, max_batch=2) as batch:
        kept = batch.submit(long_ids, max_new_tokens=30)
        dropped = batch.submit(short_ids, max_new_tokens=6, on_token=on_token)
        assert first.wait(TIMEOUT)
        assert dropped.cancel()  # concurrent.futures: its caller no longer waits for it
        assert kept.result(TIMEOUT).generated_ids == alone.generated_ids
        assert len(seen) < 6  # it stopped at the next step, not at its max_new_tokens
        later = batch.submit(short_ids, max_new_tokens=4).result(TIMEOUT)  # the worker goes on
    assert later.generated_ids == _solo(generator, short_ids, max_new_tokens=4).generated_ids


@pytest.mark.parametrize("when", [0, 3])  # raising before its prefill, or once it decodes
def test_a_cancelled_callback_that_raises_fails_its_sequence_alone(generator, when):
    vocab = generator.cfg.vocab_size
    ids = _prompt(7, 63, vocab)
    alone = _solo(generator, ids, max_new_tokens=10)
    calls = []

    def cancelled():
        calls.append(1)
        if len(calls) > when:
            raise RuntimeError("the caller's cancelled() broke")
        return False
    with Batch(generator, max_batch=3) as batch:
        futures = [batch.submit(ids, max_new_tokens=10),
                   batch.submit(_prompt(5, 64, vocab), max_new_tokens=10, cancelled=cancelled),
                   batch.submit(_prompt(9, 65, vocab), max_new_tokens=3)]
        with pytest.raises(RuntimeError, match="cancelled\\(\\) broke"):
            futures[1].result(TIMEOUT)
        assert futures[0].result(TIMEOUT).generated_ids == alone.generated_ids
        assert futures[2].result(TIMEOUT).finish_reason == "length"


def test_a_sequence_over_at_its_first_token_counts_no_decode_reads(generator):
    vocab = generator.cfg.vocab_size
    ids = _prompt(6, 66, vocab)
    alone = _solo(generator, ids, max_new_tokens=1)
    with Batch(generator, max_batch=2) as batch:
        warm = batch.submit(_prompt(9, 67, vocab), max_new_tokens=5).result(TIMEOUT)  # the cache has counted reads
        result = batch.submit(ids, max_new_tokens=1).result(TIMEOUT)
    assert warm.stats["decode"]["expert_cache_hit_rate"] is not None
    assert result.generated_ids == alone.generated_ids and result.finish_reason == "length"
    decode = result.stats["decode"]
    assert decode["steps"] == 0 and decode["bytes_read"] == 0 and decode["expert_cache_hit_rate"] is None
    assert decode["expert_cache_hit_rate"] == alone.stats["decode"]["expert_cache_hit_rate"]


def test_a_read_that_fails_while_seeding_the_cache_fails_that_sequence_alone(generator, monkeypatch):
    vocab = generator.cfg.vocab_size
    ids = _prompt(6, 68, vocab)
    alone = _solo(generator, ids, max_new_tokens=4)

    def unreadable(counts):
        raise OSError("an expert's bytes could not be read")
    with Batch(generator, max_batch=2) as batch:
        with monkeypatch.context() as patch:
            patch.setattr(generator.decoder, "seed", unreadable)
            with pytest.raises(OSError, match="could not be read"):  # alone: its prompt's experts seed the cache
                batch.submit(ids, max_new_tokens=4).result(TIMEOUT)
        assert batch.submit(ids, max_new_tokens=4).result(TIMEOUT).generated_ids == alone.generated_ids


@pytest.mark.parametrize("bad", [[5, 10 ** 9, 6], [5, -1, 6], []])
def test_a_prompt_with_an_id_outside_the_vocabulary_is_refused_when_submitted(generator, bad):
    """Refused at submit, as Generator.generate refuses it: in a grouped prefill pass it failed every prompt."""
    vocab = generator.cfg.vocab_size
    ids = _prompt(6, 69, vocab)
    alone = _solo(generator, ids, max_new_tokens=3)
    with Batch(generator, max_batch=2) as batch:
        good = batch.submit(ids, max_new_tokens=3)
        with pytest.raises(MoepackError, match="token id out of range|empty prompt"):
            batch.submit(bad, max_new_tokens=3)
        assert good.result(TIMEOUT).generated_ids == alone.generated_ids


def test_a_future_cancelled_while_it_waits_for_a_slot_is_never_run(generator):
    vocab = generator.cfg.vocab_size
    ids = _prompt(6, 70, vocab)
    ran = []
    with Batch(generator, max_batch=1) as batch:
        first = batch.submit(_prompt(8, 71, vocab), max_new_tokens=8)
        waiting = batch.submit(ids, max_new_tokens=4, cancelled=lambda: ran.append(1) or False)
        assert waiting.cancel()
        assert first.result(TIMEOUT).finish_reason == "length"
        after = batch.submit(ids, max_new_tokens=4).result(TIMEOUT)
    assert not ran and after.generated_ids == _solo(generator, ids, max_new_tokens=4).generated_ids
