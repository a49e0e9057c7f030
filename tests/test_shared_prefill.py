"""BatchScheduler's shared prefills: sequences of one prompt admitted while it prefills (n choices, identical
requests at once) follow its prefill and continue copies of its states, each giving what it gives alone."""

from __future__ import annotations

import sys
import threading

import httpx
import pytest
import torch

from moepack.format_spec.errors import MoepackError
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime.batching import BatchScheduler
from moepack.runtime.generate import GenerateOptions, Generator
from moepack.runtime.engine import StreamingPrefill
from containers import tiny_keep_container
from test_batching import TIMEOUT, Batch, _prompt, _solo

SAMPLED = dict(max_new_tokens=12, temperature=0.9, top_k=20)


@pytest.fixture(scope="module", params=["deepseek-v4", "qwen3-moe"])
def generator(request, tmp_path_factory):
    """Both families: Qwen3-MoE's decode continues a prefill's states in place on the CPU, DeepSeek-V4's copies."""
    if request.param == "deepseek-v4":
        path = tiny_keep_container(tmp_path_factory)
    else:
        base = tmp_path_factory.mktemp("shared-prefill-qwen3")
        synth_checkpoint(str(base / "src"), preset="tiny", layout="f32", seed=6, progress=False, family="qwen3-moe")
        path = str(base / "q.moepack")
        convert_checkpoint(str(base / "src"), path, policy="keep", progress=False)
    with Generator(path, cache_gib=0.5) as g:
        yield g


@pytest.fixture()
def passes(monkeypatch):
    """The prompts of every grouped prefill pass run (their token counts), as they are run."""
    seen: list[list[int]] = []
    run_many = StreamingPrefill.run_many

    def counted(self, chunks, *args, **kw):
        seen.append([len(c) for c in chunks])
        return run_many(self, chunks, *args, **kw)
    monkeypatch.setattr(StreamingPrefill, "run_many", counted)
    return seen


def test_choices_of_one_prompt_share_one_prefill_and_each_equals_its_solo_run(generator, passes):
    vocab = generator.cfg.vocab_size
    ids, other = _prompt(19, 301, vocab), _prompt(7, 302, vocab)
    alone = [_solo(generator, ids, **SAMPLED, seed=s).generated_ids for s in (5, 6, 7)]
    greedy = _solo(generator, ids, max_new_tokens=9).generated_ids
    passes.clear()
    with Batch(generator, max_batch=6) as batch:
        with batch.scheduler._cv:
            futures = [batch.submit(ids, **SAMPLED, seed=s) for s in (5, 6, 7)]
            futures += [batch.submit(other, max_new_tokens=4), batch.submit(ids, max_new_tokens=9)]
        results = [f.result(TIMEOUT) for f in futures]
    assert [r.generated_ids for r in results[:3]] == alone
    assert results[4].generated_ids == greedy
    assert results[3].generated_ids == _solo(generator, other, max_new_tokens=4).generated_ids
    assert passes == [[19, 7]]  # the prompt once, beside the other prompt: not 4 x 19 + 7 tokens
    stats = [r.stats["prefill"] for r in results]
    assert "shared_tokens" not in stats[0] and [stats[i]["shared_tokens"] for i in (1, 2, 4)] == [19, 19, 19]
    assert all(p["cached_tokens"] == 0 for p in stats)  # (no prompt cache here: usage counts no cached tokens)


def test_a_leader_stopped_hands_its_prefill_to_a_follower(generator, passes):
    vocab = generator.cfg.vocab_size
    ids = _prompt(30, 311, vocab)
    alone = _solo(generator, ids, max_new_tokens=6).generated_ids
    asked = {"n": 0}

    def leader_gone() -> bool:  # false before its first pass, true from that pass's first layer on
        asked["n"] += 1
        return asked["n"] > 1
    with Batch(generator, max_batch=4, prefill_chunk=8) as batch:
        on_token, decoding = _first_token()
        head = batch.submit(_prompt(3, 312, vocab), max_new_tokens=40, on_token=on_token)
        assert decoding.wait(TIMEOUT)  # something decodes: the prompts go in chunks of 8
        with batch.scheduler._cv:
            passes.clear()
            leader = batch.submit(ids, max_new_tokens=6, cancelled=leader_gone)
            followers = [batch.submit(ids, max_new_tokens=6) for _ in range(2)]
        results = [f.result(TIMEOUT) for f in (leader, *followers)]
        head.result(TIMEOUT)
    assert results[0].finish_reason == "cancelled" and results[0].generated_ids == []
    assert [r.generated_ids for r in results[1:]] == [alone, alone]
    # the heir went on from where the leader stopped: 30 tokens in all, in chunks, each once
    assert sum(p[0] for p in passes) == 30 and all(len(p) == 1 for p in passes)
    assert results[1].stats["prefill"]["tokens"] == 30 and results[2].stats["prefill"]["shared_tokens"] == 30
    assert results[0].stats["prefill"]["cancelled_after_layers"] == generator.cfg.num_layers  # its pass went on


def test_a_follower_stopped_while_it_waits_leaves_alone_and_at_once(generator):
    vocab = generator.cfg.vocab_size
    ids = _prompt(25, 321, vocab)
    alone = _solo(generator, ids, max_new_tokens=5).generated_ids
    stop = threading.Event()
    with Batch(generator, max_batch=4, prefill_chunk=4) as batch:
        on_token, decoding = _first_token()
        head = batch.submit(_prompt(3, 322, vocab), max_new_tokens=60, on_token=on_token)
        assert decoding.wait(TIMEOUT)
        with batch.scheduler._cv:
            leader = batch.submit(ids, max_new_tokens=5)
            follower = batch.submit(ids, max_new_tokens=5, cancelled=stop.is_set)
        stop.set()
        gone = follower.result(TIMEOUT)
        assert not leader.done()  # it left during the leader's prefill (chunks of 4 of 25 tokens), not after
        assert leader.result(TIMEOUT).generated_ids == alone
        head.result(TIMEOUT)
    assert gone.finish_reason == "cancelled" and gone.generated_ids == []


def test_every_sequence_of_a_shared_prefill_stopped_stops_the_pass(generator):
    vocab = generator.cfg.vocab_size
    stop = threading.Event()
    with Batch(generator, max_batch=4) as batch:
        with batch.scheduler._cv:
            futures = [batch.submit(_prompt(40, 331, vocab), max_new_tokens=5, cancelled=stop.is_set)
                       for _ in range(3)]
        stop.set()
        results = [f.result(TIMEOUT) for f in futures]
    assert all(r.finish_reason == "cancelled" and not r.generated_ids for r in results)


def test_a_follower_waits_while_a_leader_keeps_on(generator, passes):
    """A follower only waits on its leader's pass: one that does not stop cannot end a pass early."""
    vocab = generator.cfg.vocab_size
    ids = _prompt(14, 341, vocab)
    alone = _solo(generator, ids, max_new_tokens=4).generated_ids
    passes.clear()
    with Batch(generator, max_batch=4) as batch:
        with batch.scheduler._cv:
            leader = batch.submit(ids, max_new_tokens=4, cancelled=lambda: True)
            follower = batch.submit(ids, max_new_tokens=4)
        assert leader.result(TIMEOUT).finish_reason == "cancelled"
        assert follower.result(TIMEOUT).generated_ids == alone
    assert passes == [[14]]  # the leader stopped before its pass: the follower ran it in its place


def test_prompt_logprobs_and_cache_prompt_false_prefill_their_own(generator, passes):
    vocab = generator.cfg.vocab_size
    ids = _prompt(11, 351, vocab)
    passes.clear()
    with Batch(generator, max_batch=4) as batch:
        with batch.scheduler._cv:
            futures = [batch.submit(ids, max_new_tokens=3), batch.submit(ids, max_new_tokens=3, cache_prompt=False),
                       batch.submit(ids, max_new_tokens=3, prompt_logprobs=2)]
        results = [f.result(TIMEOUT) for f in futures]
    assert passes == [[11, 11, 11]]
    assert len({tuple(r.generated_ids) for r in results}) == 1
    assert results[2].prompt_logprobs is not None and len(results[2].prompt_logprobs) == 11


def test_followers_count_against_max_batch_and_the_memory_check(generator, monkeypatch):
    vocab = generator.cfg.vocab_size
    ids = _prompt(9, 361, vocab)
    seen: list[list[int]] = []
    check = Generator._check_memory

    def recorded(self, n_tokens, others=(), *args, **kw):
        seen.append(list(others))
        return check(self, n_tokens, others, *args, **kw)
    monkeypatch.setattr(Generator, "_check_memory", recorded)
    with Batch(generator, max_batch=3) as batch:
        with batch.scheduler._cv:
            futures = [batch.submit(ids, max_new_tokens=6) for _ in range(3)]
        results = [f.result(TIMEOUT) for f in futures]
    assert seen[:3] == [[], [15], [15, 15]]  # each check counted the KV of those before it (9 + 6 tokens each)
    assert [r.stats["prefill"].get("shared_tokens") for r in results] == [None, 9, 9]
    # a slot is a slot: with a prefill under way in chunks (something decoding), a newcomer of the same prompt
    # waits while its leader and followers fill the batch
    with Batch(generator, max_batch=3, prefill_chunk=2) as batch:
        on_token, decoding = _first_token()
        head = batch.submit(_prompt(3, 362, vocab), max_new_tokens=30, on_token=on_token)
        assert decoding.wait(TIMEOUT)
        with batch.scheduler._cv:
            futures = [batch.submit(ids, max_new_tokens=6) for _ in range(2)]
        late = batch.submit(ids, max_new_tokens=6)
        results = [f.result(TIMEOUT) for f in (*futures, late)]
        head.result(TIMEOUT)
    assert max(batch.sizes) == 3
    assert len({tuple(r.generated_ids) for r in results}) == 1

    def refused(self, n_tokens, others=(), *args, **kw):
        if others:
            raise MoepackError("no memory for a second sequence")
        return check(self, n_tokens, others, *args, **kw)
    monkeypatch.setattr(Generator, "_check_memory", refused)
    with Batch(generator, max_batch=4) as batch:
        with batch.scheduler._cv:
            futures = [batch.submit(ids, max_new_tokens=6) for _ in range(2)]
        assert futures[0].result(TIMEOUT).generated_ids == _solo(generator, ids, max_new_tokens=6).generated_ids
        with pytest.raises(MoepackError, match="no memory for a second"):
            futures[1].result(TIMEOUT)


def _first_token():
    event = threading.Event()
    return (lambda token, logprob: event.set()), event


def test_a_failed_shared_prefill_fails_its_followers_too_never_leaving_them_waiting(generator, monkeypatch):
    """A shared pass that fails (a read error), and a prompt whose working set does not fit even alone: the leader
    and every follower fail with its error (none waits for a prefill that will not come)."""
    ids = _prompt(12, 371, generator.cfg.vocab_size)

    def broken(self, *args, **kw):
        raise MoepackError("the disk went away")

    def too_big(engine, n_tokens, scored_tokens=0, freeable_bytes=0):
        raise MoepackError(f"a prompt of {n_tokens} tokens needs more than there is")
    for name, fake, says in (("run_many", broken, "the disk went away"),
                             ("check_memory", too_big, "a prompt of 12 tokens")):
        with monkeypatch.context() as m:
            m.setattr(StreamingPrefill, name, fake)
            with Batch(generator, max_batch=4) as batch:
                with batch.scheduler._cv:
                    futures = [batch.submit(ids, max_new_tokens=4) for _ in range(3)]
                for f in futures:
                    with pytest.raises(MoepackError, match=says):
                        f.result(TIMEOUT)


def test_a_follower_whose_copy_fails_fails_alone_and_the_worker_goes_on(generator, monkeypatch):
    """Either copy a follower takes (its states, the logits after the prompt) may fail for memory: that follower
    fails, its leader and the others are answered (an escaping one had ended the worker, leaving them waiting)."""
    vocab = generator.cfg.vocab_size
    ids = _prompt(13, 391, vocab)
    alone = _solo(generator, ids, max_new_tokens=4).generated_ids
    clone = torch.Tensor.clone
    copies = {"n": 0}

    def clone_failing_once(tensor, *args, **kw):  # the second follower's copy of the logits
        if sys._getframe(1).f_code.co_name == "_followers_start":
            copies["n"] += 1
            if copies["n"] == 2:
                raise RuntimeError("CUDA out of memory")
        return clone(tensor, *args, **kw)
    monkeypatch.setattr(torch.Tensor, "clone", clone_failing_once)
    with Batch(generator, max_batch=4) as batch:
        with batch.scheduler._cv:
            futures = [batch.submit(ids, max_new_tokens=4) for _ in range(4)]
        with pytest.raises(RuntimeError, match="out of memory"):
            futures[2].result(TIMEOUT)
        results = [futures[i].result(TIMEOUT) for i in (0, 1, 3)]
        monkeypatch.undo()
        assert batch.submit(ids, max_new_tokens=4).result(TIMEOUT).generated_ids == alone  # the worker goes on
    assert [r.generated_ids for r in results] == [alone] * 3


def test_serve_prefills_a_requests_n_choices_once(tmp_path_factory):
    from moepack.serve.app import make_app
    from test_serve import Running

    with Generator(tiny_keep_container(tmp_path_factory), cache_gib=0.5) as g:
        running = Running(make_app(g, "tiny", log=lambda line: None, max_queue=8, max_batch=4))
        try:
            with httpx.Client(base_url=running.url, timeout=TIMEOUT) as http:
                body = {"prompt": "Streaming experts from the disk", "max_tokens": 6, "temperature": 1.0,
                        "seed": 5}
                one = [http.post("/v1/completions", json={**body, "seed": 5 + i}).json() for i in range(3)]
                assert "moepack_shared_prefill_tokens_total 0.0" in http.get("/metrics").text
                three = http.post("/v1/completions", json={**body, "n": 3}).json()
                metrics = http.get("/metrics").text
        finally:
            running.stop()
    prompt_tokens = three["usage"]["prompt_tokens"]
    # choice i is seed 5 + i's generation alone; the prompt prefilled once for the three
    assert [c["text"] for c in three["choices"]] == [r["choices"][0]["text"] for r in one]
    assert f"moepack_shared_prefill_tokens_total {2.0 * prompt_tokens}" in metrics


def test_submit_together_queues_all_or_none_and_they_share_one_pass(generator, passes):
    vocab = generator.cfg.vocab_size
    ids = _prompt(10, 381, vocab)
    passes.clear()
    with Batch(generator, max_batch=4) as batch:
        with pytest.raises(MoepackError):
            batch.scheduler.submit_together([dict(token_ids=ids), dict(token_ids=[vocab + 5])])
        futures = batch.scheduler.submit_together(
            [dict(token_ids=ids, options=GenerateOptions(max_new_tokens=3, stop_at_eos=False)) for _ in range(3)])
        results = [f.result(TIMEOUT) for f in futures]
    assert passes == [[10]]  # the refused call queued nothing; the three were admitted in one turn
    assert [r.stats["prefill"].get("shared_tokens") for r in results] == [None, 10, 10]


def test_a_fault_of_the_schedulers_own_fails_the_admitted_and_the_worker_goes_on(generator, monkeypatch):
    """An exception no path of the worker's caught (here one raised while followers start): every admitted
    sequence fails with it, wherever it was (none is left without an answer), and the scheduler serves the next."""
    vocab = generator.cfg.vocab_size
    ids, other = _prompt(10, 391, vocab), _prompt(6, 392, vocab)
    alone = _solo(generator, other, max_new_tokens=3).generated_ids

    def broken(self, s, logits):
        raise TypeError("a bug")
    with Batch(generator, max_batch=4) as batch:
        with monkeypatch.context() as m:
            m.setattr(BatchScheduler, "_followers_start", broken)
            with batch.scheduler._cv:
                futures = [batch.submit(ids, max_new_tokens=3) for _ in range(2)]
                futures.append(batch.submit(other, max_new_tokens=3))
            for f in futures:
                with pytest.raises(TypeError, match="a bug"):
                    f.result(TIMEOUT)
        assert batch.submit(other, max_new_tokens=3).result(TIMEOUT).generated_ids == alone


def test_followers_of_a_prompt_cache_hit_count_only_the_tokens_prefilled_for_them(generator):
    vocab = generator.cfg.vocab_size
    first = _prompt(40, 401, vocab)
    longer = first + _prompt(10, 402, vocab)
    alone = _solo(generator, longer, max_new_tokens=4).generated_ids
    options = GenerateOptions(max_new_tokens=4, stop_at_eos=False)
    with BatchScheduler(generator, max_batch=4, prompt_cache_bytes=1 << 28) as batch:
        batch.generate(first, options)
        results = [f.result(TIMEOUT) for f in batch.submit_together([dict(token_ids=longer, options=options)] * 3)]
        assert batch.shared_tokens == 2 * 10
    assert [r.generated_ids for r in results] == [alone] * 3
    stats = [r.stats["prefill"] for r in results]
    assert [p["cached_tokens"] for p in stats] == [40] * 3  # (the leader's hit, which the followers continued)
    assert [p.get("shared_tokens") for p in stats] == [None, 10, 10]  # 40 + 10: the prompt, counted once
