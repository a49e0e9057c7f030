"""The batch scheduler's prompt cache (runtime/prompt_cache.py, `moepack serve --prompt-cache-gib`): a prompt that
starts with a snapshot's ids prefills only the rest and gets the tokens and logprobs of the whole prompt prefilled
alone, on both families; the snapshot is the cache's own, the budget evicts, cache_prompt false keeps out, and a
chat's second turn through the server continues its first."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

from moepack.families import kv_directory as kvd
from moepack.families.qwen3_moe.synth import SPECIAL_TOKENS
from moepack.families.synthetic import byte_level_tokenizer
from moepack.format_spec.errors import MoepackError
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime import memory as memory_module
from moepack.runtime.batching import BatchScheduler
from moepack.runtime.generate import GenerateOptions, Generator
from moepack.runtime.limits import MIN_CACHED_TOKENS
from moepack.runtime.memory import memory_need
from moepack.runtime.prompt_cache import PromptCache
from moepack.serve.app import make_app
from containers import tiny_keep_container
from test_serve import Running
from test_template_tools import QWEN3_TEMPLATE, QWEN_MARKUP

TIMEOUT = 60
BUDGET = 1 << 28


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    """The synthetic tiny Qwen3-MoE with Qwen3's own chat template and a tokenizer with its thinking tags."""
    base = tmp_path_factory.mktemp("prompt-cache-qwen3")
    src = base / "src"
    synth_checkpoint(str(src), preset="tiny", layout="f32", seed=5, progress=False, family="qwen3-moe")
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer(SPECIAL_TOKENS, None, QWEN_MARKUP)))
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_TEMPLATE}))
    convert_checkpoint(str(src), str(base / "q.moepack"), policy="keep", progress=False)
    return str(base / "q.moepack")


@pytest.fixture(scope="module", params=["deepseek-v4", "qwen3-moe"])
def generator(request, tmp_path_factory):
    path = tiny_keep_container(tmp_path_factory) if request.param == "deepseek-v4" else request.getfixturevalue(
        "qwen3_path")
    with Generator(path, cache_gib=0.5) as g:
        yield g


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _options(**kw) -> GenerateOptions:
    return GenerateOptions(**{"max_new_tokens": 6, "stop_at_eos": False, "logprobs": 3, **kw})


def _same(result, alone) -> None:
    """The greedy tokens of `alone` exactly, and their logprobs to float32 rounding."""
    assert result.generated_ids == alone.generated_ids
    for a, b in zip(result.logprobs, alone.logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4 and [i for i, _ in a.top] == [i for i, _ in b.top]


def _cached(result) -> int:
    return result.stats["prefill"]["cached_tokens"]


def test_a_continued_prompt_gets_what_the_whole_prompt_gets_prefilled_alone(generator):
    """After a first prompt: a longer one continues its prompt's snapshot, the same prompt again its logits (no
    prefill at all, twice: the entry is the cache's own, untouched by the decodes that continued copies of it), and
    a prompt going on after the answer continues the snapshot taken where the first sequence ended."""
    g, vocab = generator, generator.cfg.vocab_size
    first = _ids(40, 1, vocab)
    longer = first + _ids(9, 2, vocab)
    first_alone, longer_alone = g.generate(first, _options()), g.generate(longer, _options())
    after_answer = first + first_alone.generated_ids[:-1] + _ids(5, 3, vocab)
    after_alone = g.generate(after_answer, _options())
    with BatchScheduler(g, max_batch=2, prompt_cache_bytes=BUDGET) as batch:
        ran = batch.generate(first, _options())
        assert _cached(ran) == 0
        _same(ran, first_alone)
        continued = batch.generate(longer, _options())
        assert _cached(continued) == 40 and continued.stats["prefill"]["tokens"] == 9
        _same(continued, longer_alone)
        for _ in range(2):
            again = batch.generate(first, _options())
            assert _cached(again) == 40 and again.stats["prefill"]["tokens"] == 0
            _same(again, first_alone)
        after = batch.generate(after_answer, _options())
        assert _cached(after) == 40 + 5 and after.stats["prefill"]["tokens"] == 5
        _same(after, after_alone)
        cache = batch.prompt_cache
        assert cache.hits == 4 and cache.tokens_reused == 40 * 3 + 45 and 0 < cache.nbytes <= BUDGET


def test_a_snapshot_inside_the_prompt_is_kept_on_the_way(generator):
    """options.snapshot_at k (a chat's part its next turn renders again): the prefill stops at k for the cache to
    copy the state there, then goes on; the answer is the whole prompt's alone, and a prompt going on from k
    differently continues it."""
    g, vocab = generator, generator.cfg.vocab_size
    head = _ids(40, 61, vocab)
    first, second = head + _ids(6, 62, vocab), head + _ids(9, 63, vocab)
    first_alone, second_alone = g.generate(first, _options()), g.generate(second, _options())
    with BatchScheduler(g, max_batch=2, prompt_cache_bytes=BUDGET) as batch:
        ran = batch.generate(first, _options(snapshot_at=40))
        assert ran.stats["prefill"]["chunks"] == 2 and ran.stats["prefill"]["tokens"] == 46
        _same(ran, first_alone)
        continued = batch.generate(second, _options())
        assert _cached(continued) == 40
        _same(continued, second_alone)
        # (not kept: past the prompt, or shorter than an entry's least)
        for at in (46, 60, MIN_CACHED_TOKENS - 1):
            other = _ids(46, 70 + at, vocab)
            assert batch.generate(other, _options(snapshot_at=at, max_new_tokens=1)).stats["prefill"]["chunks"] == 1


def test_only_an_exact_prefix_of_enough_tokens_is_continued(generator):
    g, vocab = generator, generator.cfg.vocab_size
    first = _ids(40, 11, vocab)
    changed = list(first)
    changed[20] = (changed[20] + 1) % vocab
    short = _ids(MIN_CACHED_TOKENS - 1, 12, vocab)
    with BatchScheduler(g, max_batch=2, prompt_cache_bytes=BUDGET) as batch:
        batch.generate(first, _options())
        # a token changed inside it, or a prompt the entry does not fit into whole (a state is never cut back)
        for other in (changed + _ids(4, 13, vocab), first[:-1], first[:30] + _ids(20, 14, vocab)):
            assert _cached(batch.generate(other, _options())) == 0
        batch.generate(short, _options(max_new_tokens=1))  # (too short to keep: the answer's one token is not fed)
        assert _cached(batch.generate(short + [5, 6], _options())) == 0
        alone = g.generate(first + [7], _options())
        _same(batch.generate(first + [7], _options()), alone)


def test_cache_prompt_false_neither_continues_nor_leaves_an_entry(generator):
    g, vocab = generator, generator.cfg.vocab_size
    first = _ids(40, 21, vocab)
    with BatchScheduler(g, max_batch=2, prompt_cache_bytes=BUDGET) as batch:
        batch.generate(first, _options(cache_prompt=False))
        assert len(batch.prompt_cache) == 0
        batch.generate(first, _options())
        assert len(batch.prompt_cache) == 2
        assert _cached(batch.generate(first + [5], _options(cache_prompt=False))) == 0
        assert batch.prompt_cache.hits == 0
        # prompt_logprobs score every prompt position: never continued, and the same as alone
        scored = batch.generate(first + [5], _options(prompt_logprobs=2))
        alone = g.generate(first + [5], _options(prompt_logprobs=2))
        assert _cached(scored) == 0 and len(scored.prompt_logprobs) == 41
        assert [e and e.token for e in scored.prompt_logprobs] == [e and e.token for e in alone.prompt_logprobs]


def test_the_budget_evicts_the_least_recently_used(generator):
    g, vocab = generator, generator.cfg.vocab_size
    prompts = [_ids(40, 30 + i, vocab) for i in range(3)]
    with BatchScheduler(g, max_batch=2, prompt_cache_bytes=BUDGET) as batch:
        batch.generate(prompts[0], _options(max_new_tokens=1))  # (one entry: its answer's token is never fed)
        one = batch.prompt_cache.nbytes
    with BatchScheduler(g, max_batch=2, prompt_cache_bytes=2 * one + one // 2) as batch:
        cache = batch.prompt_cache
        for ids in prompts[:2]:
            batch.generate(ids, _options(max_new_tokens=1))
        batch.generate(prompts[0] + [5], _options(max_new_tokens=1))  # prompts[0]'s entry used: prompts[1]'s is older
        batch.generate(prompts[2], _options(max_new_tokens=1))
        assert cache.evicted >= 1 and cache.nbytes <= 2 * one + one // 2
        assert _cached(batch.generate(prompts[1] + [5], _options(max_new_tokens=1))) == 0
        assert _cached(batch.generate(prompts[2] + [5], _options(max_new_tokens=1))) == 40
    with BatchScheduler(g, max_batch=2, prompt_cache_bytes=one // 2) as batch:  # an entry larger than the budget
        batch.generate(prompts[0], _options(max_new_tokens=1))
        assert len(batch.prompt_cache) == 0 and batch.prompt_cache.nbytes == 0
    with pytest.raises(MoepackError, match="--prompt-cache-gib must be >= 0"):
        PromptCache(g.kv_format(), g.c.config, -1)


def test_a_continued_prompt_cancelled_during_its_prefill_leaves_the_entry_whole(generator):
    g, vocab = generator, generator.cfg.vocab_size
    first = _ids(40, 41, vocab)
    longer = first + _ids(12, 42, vocab)
    alone = g.generate(longer, _options())
    asked = []

    def cancelled() -> bool:  # asked before the pass and between its layers: stops it after its first layer
        asked.append(1)
        return len(asked) > 2

    with BatchScheduler(g, max_batch=2, prompt_cache_bytes=BUDGET) as batch:
        batch.generate(first, _options())
        stopped = batch.generate(longer, _options(), cancelled=cancelled)
        assert stopped.finish_reason == "cancelled" and not stopped.generated_ids
        assert 0 < stopped.stats["prefill"]["cancelled_after_layers"] < len(g.c.layers)
        continued = batch.generate(longer, _options())
        assert _cached(continued) == 40
        _same(continued, alone)


def test_a_generation_that_fits_only_without_the_cache_empties_it(generator, monkeypatch):
    """The memory checks count what the cache holds; a generation refused for it empties the cache and runs."""
    g, vocab = generator, generator.cfg.vocab_size
    first, other = _ids(40, 51, vocab), _ids(40, 52, vocab)
    alone = g.generate(other, _options())
    with BatchScheduler(g, max_batch=2, prompt_cache_bytes=BUDGET) as batch:
        batch.generate(first, _options())
        held = batch.prompt_cache.nbytes
        assert held and g._held() >= held
        free = memory_need(g.c, 40 + 6, g.host_cache_bytes) + held // 2  # room for it, not for it and the cache
        monkeypatch.setattr(memory_module, "memory_for_generation", lambda held=0: free)
        _same(batch.generate(other, _options()), alone)
        assert batch.prompt_cache.evicted >= 2
        monkeypatch.undo()
    assert g.prompt_cache is None and g._prompt_cache_bytes() == 0  # (closed: the generator counts none)


def test_a_refusal_evicts_only_what_it_needs_and_nothing_when_refused_anyway(generator, monkeypatch):
    """Entries are evicted least recently used first only until the check passes; a generation refused even without
    the cache (a request past the memory) evicts nothing: one client's absurd request cannot empty the others'."""
    g, vocab = generator, generator.cfg.vocab_size
    prompts = [_ids(40, 55 + i, vocab) for i in range(2)]
    other = _ids(40, 57, vocab)
    alone = g.generate(other, _options())
    with BatchScheduler(g, max_batch=2, prompt_cache_bytes=BUDGET) as batch:
        for ids in prompts:
            batch.generate(ids, _options())
        cache = batch.prompt_cache
        entries, held = list(cache._entries.values()), cache.nbytes
        assert len(entries) == 4  # each prompt's end and each sequence's end
        need = memory_need(g.c, 40 + 6, g.host_cache_bytes)
        monkeypatch.setattr(memory_module, "memory_for_generation", lambda held=0: need - 1)
        with pytest.raises(MoepackError, match="needs about"):
            batch.generate(other, _options())
        assert len(cache) == 4 and cache.nbytes == held and cache.evicted == 0
        # room for the generation beside all but the oldest entry: that one goes, the rest stay
        room = need + held - entries[0].nbytes
        monkeypatch.setattr(memory_module, "memory_for_generation", lambda held=0: room)
        _same(batch.generate(other, _options()), alone)
        assert cache.evicted == 1 and entries[0].ids not in cache._entries
        assert all(e.ids in cache._entries for e in entries[1:])
        monkeypatch.undo()


def test_a_refusal_evicts_the_entry_the_prompt_continues_last(generator, monkeypatch):
    """The entry a newcomer's prompt continues is in use: its memory check evicts the others first (it had evicted
    that one, the least recently used, and prefilled the whole prompt again)."""
    g, vocab = generator, generator.cfg.vocab_size
    first, second = _ids(40, 58, vocab), _ids(40, 59, vocab)
    turn = first + _ids(10, 60, vocab)  # a next turn: it continues first's entry, the oldest
    alone = g.generate(turn, _options())
    with BatchScheduler(g, max_batch=2, prompt_cache_bytes=BUDGET) as batch:
        for ids in (first, second):
            batch.generate(ids, _options())
        cache = batch.prompt_cache
        entries = list(cache._entries.values())
        assert [len(e.ids) for e in entries] == [40, 45, 40, 45] and entries[0].ids == tuple(first)
        # room for the turn beside all but first's sequence end (the larger entry after first's prompt end)
        room = memory_need(g.c, 50 + 6, g.host_cache_bytes) + cache.nbytes - entries[1].nbytes
        monkeypatch.setattr(memory_module, "memory_for_generation", lambda held=0: room)
        result = batch.generate(turn, _options())
        monkeypatch.undo()
        assert result.stats["prefill"]["cached_tokens"] == 40 and cache.evicted == 1
    _same(result, alone)


def test_the_prefills_working_set_check_counts_what_the_cache_would_give_back(generator, monkeypatch):
    engine = generator.prefill_engine()
    try:
        monkeypatch.setattr(memory_module, "available_memory_bytes", lambda: 1 << 20)
        with pytest.raises(MoepackError, match="available host memory"):
            engine.check_memory(64)
        engine.check_memory(64, freeable_bytes=1 << 36)  # (the prompt cache's bytes, given back first)
    finally:
        engine.after_prompt()


def test_a_copy_that_fails_fails_no_other_request(generator, monkeypatch):
    """A snapshot whose copy fails (memory) is not kept and its sequence is answered; a hit whose copy fails fails
    that request alone: the scheduler's worker goes on."""
    g, vocab = generator, generator.cfg.vocab_size
    first = _ids(40, 81, vocab)
    alone = g.generate(first, _options())

    def out_of_memory(*args, **kw):
        raise RuntimeError("out of memory (simulated)")

    with BatchScheduler(g, max_batch=2, prompt_cache_bytes=BUDGET) as batch:
        def run(ids):  # (a worker that died would leave the future unanswered: waited for a bounded time)
            return batch.submit(ids, _options()).result(TIMEOUT)
        monkeypatch.setattr(kvd, "host_copy", out_of_memory)
        _same(run(first), alone)
        assert len(batch.prompt_cache) == 0
        monkeypatch.undo()
        run(first)
        monkeypatch.setattr(kvd, "copied_states", out_of_memory)
        with pytest.raises(RuntimeError, match="simulated"):
            run(first + [5])
        monkeypatch.undo()
        _same(run(first), alone)


# ---- through the server -----------------------------------------------------------------------------------------

def _chat_twice(running, topic: str, **body) -> tuple[dict, dict]:
    """A two-turn chat: the first question (on `topic`: another chat's entries cannot serve it), then the
    conversation with its answer and a second question."""
    question = {"role": "user", "content": f"Tell me about {topic}, briefly, in one line."}
    with httpx.Client(base_url=running.url, timeout=TIMEOUT) as http:
        def ask(messages):
            r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0,
                                                         **body})
            assert r.status_code == 200, r.text
            return r.json()
        one = ask([question])
        answer = one["choices"][0]["message"]
        two = ask([question, {"role": "assistant", "content": answer["content"] or ""},
                   {"role": "user", "content": "And why is that faster?"}])
    return one, two


@pytest.fixture(scope="module", params=["deepseek-v4", "qwen3-moe"])
def chat_server(request, tmp_path_factory):
    path = tiny_keep_container(tmp_path_factory) if request.param == "deepseek-v4" else request.getfixturevalue(
        "qwen3_path")
    logs: list[str] = []
    with Generator(path, cache_gib=0.5) as g:
        running = Running(make_app(g, "m", log=logs.append, max_batch=4, prompt_cache_gib=0.25))
        running.logs, running.family = logs, request.param
        try:
            yield running
        finally:
            running.stop()


def _metric(running, name: str) -> float:
    text = httpx.get(f"{running.url}/metrics", timeout=TIMEOUT).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


# the thinking switch as each family takes it, and whether the generation prompt then opens a thought that the next
# turn, which drops an earlier turn's thought, does not render: DeepSeek-V4's thinking `<think>` (its chat mode's
# `</think>` is rendered again), Qwen3's closed empty thought with thinking off (`<think>\n\n</think>\n\n`; on, the
# answer opens its own)
THINKING = {"deepseek-v4": {None: ({}, False), True: ({"thinking": True}, True), False: ({"thinking": False}, False)},
            "qwen3-moe": {None: ({}, False), True: ({"chat_template_kwargs": {"enable_thinking": True}}, False),
                          False: ({"chat_template_kwargs": {"enable_thinking": False}}, True)}}


@pytest.mark.parametrize("thinking", [None, True, False])
def test_a_chats_second_turn_continues_the_first(chat_server, thinking):
    """The second turn continues the first turn's prompt (all of it, or the answer's end too where the answer's ids
    come back), or where the generation prompt opens a thought the next turn drops, the state kept before it:
    its usage says how many tokens, and so do the log and /metrics."""
    body, opens_thought = THINKING[chat_server.family][thinking]
    hits, reused = (_metric(chat_server, f"moepack_prompt_cache_{name}_total") for name in ("hits", "tokens"))
    one, two = _chat_twice(chat_server, f"streaming experts from disk ({thinking})", **body)
    assert one["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached, prompt = two["usage"]["prompt_tokens_details"]["cached_tokens"], one["usage"]["prompt_tokens"]
    if opens_thought:  # (DeepSeek-V4's one `<think>`; Qwen3's `<think>`, `</think>` and two "\n\n", 6 here)
        assert prompt - 6 <= cached < prompt
    else:
        assert prompt <= cached < two["usage"]["prompt_tokens"]
    assert f"cached_tokens={cached} " in chat_server.logs[-1]
    assert _metric(chat_server, "moepack_prompt_cache_hits_total") == hits + 1
    assert _metric(chat_server, "moepack_prompt_cache_tokens_total") == reused + cached
    assert 0 < _metric(chat_server, "moepack_prompt_cache_bytes") <= 0.25 * 2**30


def test_a_responses_second_turn_says_what_it_took_from_the_cache(chat_server):
    """/v1/responses goes through the chat's path: its second turn continues the first, and its usage's
    input_tokens_details.cached_tokens says how many tokens (0 on the first)."""
    question = {"role": "user", "content": "Tell me about the Responses API, briefly."}
    with httpx.Client(base_url=chat_server.url, timeout=TIMEOUT) as http:
        def ask(items):
            r = http.post("/v1/responses", json={"input": items, "max_output_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()
        one = ask([question])
        two = ask([question, *[item for item in one["output"] if item["type"] == "message"],
                   {"role": "user", "content": "And then?"}])
    assert one["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert 0 < two["usage"]["input_tokens_details"]["cached_tokens"] < two["usage"]["input_tokens"]


def test_cache_prompt_false_is_taken_by_the_server(chat_server):
    """llama-server's cache_prompt: false (a boolean, else a 400 naming it): the second turn prefills it all."""
    _, off = _chat_twice(chat_server, "reading weights once per pass", cache_prompt=False)
    assert off["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    r = httpx.post(f"{chat_server.url}/v1/chat/completions", timeout=TIMEOUT,
                   json={"messages": [{"role": "user", "content": "x"}], "cache_prompt": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_prompt"


def test_the_prompt_cache_needs_the_batch_scheduler(tmp_path_factory):
    with Generator(tiny_keep_container(tmp_path_factory), cache_gib=0.1) as g:
        with pytest.raises(MoepackError, match="--prompt-cache-gib needs --max-batch above 1"):
            make_app(g, "m", log=lambda line: None, prompt_cache_gib=1)
        with pytest.raises(MoepackError, match="--prompt-cache-gib must be >= 0"):
            make_app(g, "m", log=lambda line: None, max_batch=2, prompt_cache_gib=-1)
