"""moepack serve for real clients (issue #38), through the official `openai` client: every request field acted on
or refused by name, logprobs (streamed too), penalties and logit_bias, n, echo, timings; the tokenize / metrics /
model endpoints; JSON output by constrained decoding; tool calls."""

from __future__ import annotations

import json
import math
import time

import httpx
import openai
import pytest
import torch

from moepack.runtime.generate import GenerateOptions, Generator
from moepack.serve.app import make_app
from moepack.serve.tokenizer import PromptTokenizer
from containers import tiny_keep_container
from test_serve import Running

TIMEOUT = 60
CHAT = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_keep_container(tmp_path_factory)


@pytest.fixture(scope="module")
def server(tiny_path):
    g = Generator(tiny_path, cache_gib=0.5)
    running = Running(make_app(g, "tiny", log=lambda line: None, max_queue=4))
    running.generator, running.state = g, running.app.state.server
    running.tok = PromptTokenizer(g.c)
    yield running
    running.stop()
    g.close()


def _client(server) -> openai.OpenAI:
    return server.client()


def _bad(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    error = e.value.body
    assert error["param"] == param, error
    assert "\n" not in error["message"]
    return error["message"]


# ---- 0. what an omitted sampling field is ------------------------------------------------------------------------

OPENAI_SAMPLING = (1.0, 1.0, 0, 0.0, 1.0)  # temperature, top_p, top_k, min_p, repetition_penalty

@pytest.mark.parametrize("generation, defaults, warnings", [
    ({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}, (0.6, 0.95, 20, 0.0, 1.0), []),
    ({"temperature": 0, "top_k": 0}, (0.0, 1.0, 0, 0.0, 1.0), []),  # (greedy, whatever do_sample says: vLLM's)
    ({"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.05}, (0.7, 1.0, 0, 0.05, 1.05), []),
    ({"temperature": -1, "top_p": 1.5, "top_k": 2.5, "min_p": 2, "repetition_penalty": 0}, OPENAI_SAMPLING,
     ["temperature", "top_p", "top_k", "min_p", "repetition_penalty"]),
    ({"temperature": "hot", "top_p": True, "top_k": [1]}, OPENAI_SAMPLING, ["temperature", "top_p", "top_k"]),
    (None, OPENAI_SAMPLING, []),  # none: OpenAI's
])
def test_an_omitted_sampling_field_is_the_models_recommendation(tiny_path, tmp_path, generation, defaults, warnings):
    """`serve` takes a request's omitted temperature / top_p / top_k / min_p / repetition_penalty from the model's
    generation_config.json where
    it recommends them (as vLLM does), saying so once at start; a value out of range or of another type is left out
    with a warning naming it; a request's own fields win; `--sampling-defaults openai` keeps OpenAI's."""
    from containers import mutate_index
    from moepack.families import container_family
    from moepack.format_spec.reader import Container
    from moepack.serve.app import Server
    from types import SimpleNamespace

    path = str(tmp_path / "m.moepack")
    mutate_index(tiny_path, path, lambda index: index["tokenizer"].__setitem__(
        "generation_config.json", {"encoding": "utf-8", "data": json.dumps(generation)}))

    def sampled(server, body) -> tuple:
        options = server.options(body, 5, 16, chat=True)
        return options.temperature, options.top_p, options.top_k, options.min_p, options.repetition_penalty
    with Container(path) as c:
        for choice in ("model", "openai"):
            logged = []
            server = Server(SimpleNamespace(c=c, family=container_family(c)), "m", None, 1, log=logged.append,
                            sampling_defaults=choice)
            try:
                assert sampled(server, {}) == (defaults if choice == "model" else OPENAI_SAMPLING)
                asked = {"temperature": 0.2, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2}
                assert sampled(server, asked) == tuple(asked.values())
            finally:
                server.executor.shutdown()
            said = [line for line in logged if "generation_config.json" in line]
            if choice == "openai":
                assert not said
                continue
            assert [line.split("'s ")[1].split()[0] for line in said if "warning" in line] == warnings, said
            announced = defaults != OPENAI_SAMPLING or generation == {"temperature": 0, "top_k": 0}
            assert sum("omitted" in line for line in said) == announced, said


# ---- 1. every field acted on or refused ------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True])
def test_an_unknown_field_is_a_400_naming_it(server, chat):
    c = _client(server)
    if chat:
        call = lambda: c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,  # noqa: E731
                                                 extra_body={"mirostat": 2})
    else:
        call = lambda: c.completions.create(model="tiny", prompt="Hi", max_tokens=2,  # noqa: E731
                                            extra_body={"mirostat": 2})
    assert "unknown field" in _bad(call, "mirostat")


@pytest.mark.parametrize("field,value,chat", [
    ("suffix", "tail", False), ("best_of", 3, False), ("service_tier", "flex", True), ("store", True, True),
    ("audio", {"voice": "alloy", "format": "wav"}, True), ("functions", [{"name": "f"}], True),
    ("modalities", ["text", "audio"], True), ("prediction", {"type": "content", "content": "x"}, True),
    ("messages", [], False), ("prompt", "x", True), ("top_logprobs", 2, True),
])
def test_an_openai_field_not_acted_on_is_refused_by_name(server, field, value, chat):
    c = _client(server)
    if chat:
        _bad(lambda: c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                               extra_body={field: value}), field)
    else:
        _bad(lambda: c.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={field: value}),
             field)


def test_stream_options_and_message_keys_are_checked(server):
    c = _client(server)
    _bad(lambda: c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                           stream_options={"include_usage": True}), "stream_options")
    _bad(lambda: c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, stream=True,
                                           stream_options={"include_obfuscation": True}), "stream_options")
    message = _bad(lambda: c.chat.completions.create(
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x", "cache_control": {}}]), "messages")
    assert message.startswith("messages[0].cache_control")
    for name in ("ann", None):  # (a null one is unset, as some clients send it)
        named = c.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x",
                                                                                   "name": name}])
        assert named.choices[0].message.role == "assistant"
    for key, value in (("name", 5), ("tool_call_id", {"id": "x"})):  # OpenAI's are strings: dropped, had been 200s
        message = _bad(lambda: c.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": "x"}, {"role": "tool", "content": "r", key: value}]), "messages")
        assert message.startswith(f"messages[1].{key}: expected a string")


def test_accepted_no_op_fields(server):
    c = _client(server)
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=3, user="someone",
                                  service_tier="auto", store=False, temperature=0, safety_identifier="hashed-user",
                                  prompt_cache_key="conversation-17")
    assert r.usage.completion_tokens <= 3
    r = c.completions.create(model="tiny", prompt="Hi", max_tokens=1,
                             extra_body={"safety_identifier": "u", "prompt_cache_key": "k"})
    assert r.usage.completion_tokens == 1
    _bad(lambda: c.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=3, max_tokens=4),
         "max_completion_tokens")
    for field in ("user", "safety_identifier", "prompt_cache_key"):
        for value in (5, {"id": "x"}):  # OpenAI's are strings: another value is no client's intent
            _bad(lambda: c.completions.create(model="tiny", prompt="Hi", max_tokens=1, extra_body={field: value}),
                 field)


def test_chat_logprobs_are_the_greedy_choice_and_stream_the_same(server):
    c = _client(server)
    whole = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                      top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the likeliest token
        assert entry.logprob <= 0 and sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-9
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    stream = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3, stream=True)
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None


def test_logprobs_of_tokens_inside_a_character_give_its_bytes_and_its_offset(server):
    """Byte-level tokens that hold part of a character: chat's `bytes` are the token's own (joined, the text's
    UTF-8), never U+FFFD's; completions' text_offset never points past the text, each token at the place its
    text (or its character's) begins."""
    from moepack.runtime.sampling import TokenLogprob
    from moepack.serve.app import TextOffsets, chat_logprobs, completion_logprobs

    text = "aɸ 你好, b ✓"
    tok = server.tok
    ids = tok.encode(text, special_tokens=False, add_bos=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the case: some token is part of a character
    entries = [TokenLogprob(i, -0.5, ()) for i in ids]
    chat = chat_logprobs(tok, entries)["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat) == text.encode()
    echo = "Say: "
    offsets = TextOffsets(tok, len(echo))
    got = [o for part in (entries[:3], entries[3:]) for o in completion_logprobs(tok, part, offsets)["text_offset"]]
    whole = echo + text
    assert got == sorted(got) and all(len(echo) <= o < len(whole) for o in got), got
    for token, at in zip(ids, got):
        piece = tok.decode([token])
        assert "\ufffd" in piece or whole[at:].startswith(piece), (piece, at)


def test_completion_top_logprobs_of_tokens_with_one_text_keep_the_likeliests(server):
    """Completions' top_logprobs is keyed by text (OpenAI's): tokens of one text (parts of characters, all U+FFFD)
    keep the likeliest one's logprob, the one the chosen token has when it is the likeliest, never a later one's."""
    from moepack.runtime.sampling import TokenLogprob
    from moepack.serve.app import TextOffsets, completion_logprobs

    tok = server.tok
    parts = [i for i in tok.encode("你好", special_tokens=False, add_bos=False) if tok.decode([i]) == "\ufffd"][:3]
    plain = tok.encode("a", special_tokens=False, add_bos=False)[0]
    assert len(parts) >= 2  # the case: several tokens of one text
    top = tuple((t, -0.5 - k) for k, t in enumerate([parts[0], plain, *parts[1:]]))
    got = completion_logprobs(tok, [TokenLogprob(parts[0], -0.5, top)], TextOffsets(tok))
    assert got["top_logprobs"] == [{"\ufffd": -0.5, "a": -1.5}]
    assert got["top_logprobs"][0][got["tokens"][0]] == got["token_logprobs"][0]


def test_completion_logprobs_match_the_generator(server):
    c = _client(server)
    r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    direct = server.generator.generate(server.tok.encode("Once upon a time", special_tokens=False),
                                       GenerateOptions(max_new_tokens=6, logprobs=2), detokenize=server.tok.decode)
    assert lp.token_logprobs == pytest.approx([e.logprob for e in direct.logprobs])
    assert lp.tokens == [server.tok.decode([e.token]) for e in direct.logprobs]
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    stream = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0,
                                  logprobs=2, stream=True)
    tokens = [t for chunk in stream if chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_logit_bias_forces_a_token(server):
    c = _client(server)
    forced = server.tok.encode("a", special_tokens=False)[-1]
    r = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=5, temperature=0,
                             logit_bias={str(forced): 100})
    assert r.choices[0].model_dump()["token_ids"] == [forced] * 5
    _bad(lambda: c.completions.create(model="tiny", prompt="Hi", max_tokens=2, logit_bias={"x": 1}), "logit_bias")
    _bad(lambda: c.completions.create(model="tiny", prompt="Hi", max_tokens=2, logit_bias={"5": 101}),
         "logit_bias")


def test_penalties_are_applied_as_the_generator_applies_them(server):
    c = _client(server)
    ids = [5, 6, 7, 8]
    free = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    got = {}
    for name in ("presence_penalty", "frequency_penalty"):
        r = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, **{name: 2.0})
        got[name] = r.choices[0].model_dump()["token_ids"]
        direct = server.generator.generate(ids, GenerateOptions(max_new_tokens=12, **{name: 2.0}))
        assert got[name] == direct.generated_ids
    # a strong penalty repeats no token as often as the free answer's most repeated one
    free_ids = free.choices[0].model_dump()["token_ids"]
    most = max(free_ids.count(t) for t in free_ids)
    if most > 2:
        assert max(got["frequency_penalty"].count(t) for t in got["frequency_penalty"]) < most
    _bad(lambda: c.completions.create(model="tiny", prompt="Hi", max_tokens=2, presence_penalty=2.5),
         "presence_penalty")


def test_n_choices_one_after_the_other_with_their_own_seeds(server):
    c = _client(server)
    r = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=6, temperature=1.0, seed=11, n=2)
    assert [ch.index for ch in r.choices] == [0, 1]
    for i, choice in enumerate(r.choices):
        direct = server.generator.generate([1, 2, 3], GenerateOptions(max_new_tokens=6, temperature=1.0,
                                                                      seed=11 + i))
        assert choice.model_dump()["token_ids"] == direct.generated_ids
    assert r.usage.completion_tokens == sum(len(ch.model_dump()["token_ids"]) for ch in r.choices)
    chat = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=1.0, n=3)
    assert len(chat.choices) == 3
    _bad(lambda: c.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=2, temperature=0), "n")
    assert c.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=2, best_of=2).choices[1].index == 1


@pytest.fixture(scope="module")
def batched(tiny_path):
    g = Generator(tiny_path, cache_gib=0.5)
    running = Running(make_app(g, "tiny", log=lambda line: None, max_queue=4, max_batch=4))
    running.generator, running.state = g, running.app.state.server
    running.tok = PromptTokenizer(g.c)
    yield running
    running.stop()
    g.close()


def _streamed_choices(stream, field: str) -> tuple[dict, dict, list]:
    """Each index's text and finish_reason reassembled from a stream, and its usage chunks."""
    texts, finishes, usage = {}, {}, []
    for chunk in stream:
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for ch in chunk.choices:
            part = getattr(ch.delta, field, None) if hasattr(ch, "delta") else ch.text
            texts[ch.index] = texts.get(ch.index, "") + (part or "")
            if ch.finish_reason is not None:
                assert ch.index not in finishes
                finishes[ch.index] = ch.finish_reason
    return texts, finishes, usage


@pytest.mark.parametrize("where", ["server", "batched"])
def test_n_choices_stream_interleaved_each_as_its_whole_answer(where, request):
    c = _client(request.getfixturevalue(where))
    kw = dict(model="tiny", max_tokens=8, temperature=1.0, seed=5, n=3)
    whole = c.completions.create(prompt="Once upon", echo=True, **kw)
    texts, finishes, usage = _streamed_choices(c.completions.create(
        prompt="Once upon", echo=True, stream=True, stream_options={"include_usage": True}, **kw), "text")
    assert texts == {ch.index: ch.text for ch in whole.choices} and len(texts) == 3
    assert all(t.startswith("Once upon") for t in texts.values())
    assert finishes == {ch.index: ch.finish_reason for ch in whole.choices}
    assert len(usage) == 1 and usage[0].completion_tokens == whole.usage.completion_tokens
    whole = c.chat.completions.create(messages=CHAT, logprobs=True, **kw)
    stream = list(c.chat.completions.create(messages=CHAT, logprobs=True, stream=True, **kw))
    texts, finishes, usage = _streamed_choices(stream, "content")
    assert texts == {ch.index: ch.message.content for ch in whole.choices} and not usage
    assert finishes == {ch.index: ch.finish_reason for ch in whole.choices} and set(finishes) == {0, 1, 2}
    for ch in whole.choices:  # each choice's logprobs streamed with its own chunks
        streamed = [e.token for chunk in stream for c2 in chunk.choices if c2.index == ch.index and c2.logprobs
                    for e in c2.logprobs.content]
        assert streamed == [e.token for e in ch.logprobs.content]
    _bad(lambda: c.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=2, stream=True, temperature=0),
         "n")


def test_a_failed_choice_fails_its_request_and_stops_the_others(batched, monkeypatch):
    """A memory bound that admits one choice only: the request gets the refusal, its first choice (which no end of
    sentence would end) is stopped with it."""
    from moepack.format_spec.errors import MoepackError

    g, scheduler = batched.generator, batched.state.scheduler
    real = g._check_memory

    def one_only(tokens, reserved=0, **kw):
        if reserved:
            raise MoepackError("not enough memory for this test's second choice")
        return real(tokens, reserved, **kw)

    monkeypatch.setattr(g, "_check_memory", one_only)
    c = _client(batched)
    room = batched.state.context - 3
    message = _bad(lambda: c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=room, n=2,
                                                temperature=1.0, logit_bias={str(e): -100 for e in g.eos_ids}),
                   None)
    assert "second choice" in message
    deadline = time.monotonic() + 5
    while scheduler._active or scheduler._prefilling or scheduler._waiting:
        assert time.monotonic() < deadline, "a choice of the failed request is still decoding"
        time.sleep(0.02)
    monkeypatch.undo()
    assert c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2).choices[0].finish_reason


def test_a_client_gone_while_its_choices_wait_for_a_batch_slot_frees_its_queue_place(tiny_path):
    """--max-batch 2 --max-queue 2: a request's two choices decode (held by no end of sentence); a second client
    gives up while its choices wait for a slot: its place is free at once (a third request is admitted, not 429)
    and its choices never run."""
    import concurrent.futures

    g, lines = Generator(tiny_path, cache_gib=0.5), []
    running = Running(make_app(g, "tiny", log=lines.append, max_queue=2, max_batch=2))
    state = running.app.state.server

    def wait_admitted(n):
        deadline = time.monotonic() + 10
        while state.admitted != n:
            assert time.monotonic() < deadline, state.admitted
            time.sleep(0.02)
    try:
        endless = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 100000, "n": 2, "stream": True,
                   "temperature": 1.0, "logit_bias": {str(e): -100 for e in g.eos_ids}}
        with httpx.stream("POST", f"{running.url}/v1/completions", json=endless, timeout=TIMEOUT) as first:
            assert first.status_code == 200
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{running.url}/v1/completions", timeout=httpx.Timeout(TIMEOUT, read=0.5),
                           json={"model": "tiny", "prompt": [4, 5, 6, 7, 8], "max_tokens": 2})
            wait_admitted(1)  # the vanished one's place, freed while the first still decodes
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                third = pool.submit(httpx.post, f"{running.url}/v1/completions", timeout=TIMEOUT,
                                    json={"model": "tiny", "prompt": [7, 8, 9, 10], "max_tokens": 2})
                wait_admitted(2)
                first.close()  # the first's client leaves: its choices stop, the third's get their slots
                assert third.result(TIMEOUT).status_code == 200
        # its place was given back when its client left; its choices, dropped while waiting or stopped before a
        # layer once a slot came (the first's client left at once here), ran nothing
        deadline = time.monotonic() + 10
        while not (second := [line for line in lines if "prompt_tokens=5 " in line]):
            assert time.monotonic() < deadline, lines
            time.sleep(0.02)
        assert "cancelled before it started" in second[0] or (
            "generated_tokens=0 " in second[0] and "prefill_stopped_after_layers=0" in second[0]), second
    finally:
        running.stop()
        g.close()


def test_echo_puts_the_prompt_first(server):
    c = _client(server)
    plain = c.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0)
    echoed = c.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon" + plain.choices[0].text
    stream = c.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0, echo=True,
                                  stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == echoed.choices[0].text


@pytest.mark.parametrize("which", ["server", "batched"])
def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(server, request, which):
    """lm-eval's loglikelihood request (local-completions: token-id prompts, echo, logprobs 1, max_tokens 1): each
    choice's logprobs cover its prompt's tokens (the first null, the others the model's log-probability of that
    token after those before it: the prefill's logits of each prefix) and then the generated token, text offsets
    from the echo's start; lm-eval's own reading (the continuation's sum, is_greedy) holds; streamed, the echo's
    chunk carries the prompt's and the chunks add up to the whole answer's."""
    from moepack.runtime.engine import PrefillOptions, prefill

    tok, server = server.tok, request.getfixturevalue(which)
    context = tok.encode("Once upon a time", special_tokens=False)
    greedy = httpx.post(f"{server.url}/v1/completions", json={"prompt": context, "max_tokens": 3, "temperature": 0},
                        timeout=TIMEOUT).json()["choices"][0]["token_ids"]
    other = [(t + 1) % 64 for t in greedy]  # (not the greedy continuation: within any test vocabulary)
    body = {"model": "tiny", "prompt": [context + greedy, context + other], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for choice, ids in zip(choices, body["prompt"]):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] >= len(tok.decode(ids))
        for j in range(1, len(ids)):
            logits = prefill(server.generator.path, ids[:j], PrefillOptions(compute_dtype="float32")).logits
            want = torch.log_softmax(logits.double(), dim=0)
            assert abs(lp["token_logprobs"][j] - float(want[ids[j]])) < 1e-4, j
            assert list(lp["top_logprobs"][j].values()) == pytest.approx([float(want.max())], abs=1e-4)
        assert lp["tokens"][:len(ids)] == [tok.decode([t]) for t in ids]
    is_greedy = []
    for choice in choices:  # lm-eval's parse_logprobs
        lp = choice["logprobs"]
        tokens, tops = lp["token_logprobs"][len(context):-1], lp["top_logprobs"][len(context):-1]
        assert math.isfinite(sum(tokens))
        is_greedy.append(all(t == max(top.values()) for t, top in zip(tokens, tops)))
    assert is_greedy == [True, False]
    alone = {**body, "prompt": body["prompt"][0]}  # (alone: a prompt beside another differs by float32 rounding)
    whole = httpx.post(f"{server.url}/v1/completions", json=alone, timeout=TIMEOUT).json()["choices"][0]
    assert whole["logprobs"]["tokens"] == choices[0]["logprobs"]["tokens"]
    streamed = _sse(server, "/v1/completions", {**alone, "stream": True})
    assert streamed[0]["choices"][0]["text"] == tok.decode(body["prompt"][0])
    joined = {key: [] for key in whole["logprobs"]}
    for chunk in streamed:
        for key, values in (chunk["choices"][0]["logprobs"] or {}).items():
            joined[key] += values
    assert joined == whole["logprobs"]
    plain = httpx.post(f"{server.url}/v1/completions", json={**alone, "echo": False}, timeout=TIMEOUT).json()
    assert plain["choices"][0]["logprobs"]["token_logprobs"] == whole["logprobs"]["token_logprobs"][-1:]


@pytest.mark.parametrize("which", ["server", "batched"])
def test_vllms_prompt_logprobs_give_each_prompt_tokens_logprob_rank_and_likeliest(server, request, which):
    """vLLM's prompt_logprobs k: per prompt token (the first null) {token id: {logprob, rank, decoded_token}}, the
    token's own first with its rank over the vocabulary (how many score at least as high), then its k likeliest
    ranked 1..k: on each completions choice, on a chat response; beside echo's logprobs (each its own k), which
    are what they are without it; -1, over 20 or with stream a 400 naming it."""
    from moepack.runtime.engine import PrefillOptions, prefill

    tok, server = server.tok, request.getfixturevalue(which)
    ids = tok.encode("Once upon a time", special_tokens=False)

    def post(path, **body):
        r = httpx.post(f"{server.url}{path}", json={"max_tokens": 1, "temperature": 0, **body}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()
    scored = post("/v1/completions", prompt=ids, prompt_logprobs=2, n=1)["choices"][0]
    entries = scored["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None and scored["logprobs"] is None
    for j in range(1, len(ids)):
        logits = prefill(server.generator.path, ids[:j], PrefillOptions(compute_dtype="float32")).logits.double()
        want = torch.log_softmax(logits, dim=0)
        entry = entries[j]
        first = next(iter(entry))
        assert first == str(ids[j]) and len(entry) in (2, 3)
        assert abs(entry[first]["logprob"] - float(want[ids[j]])) < 1e-4
        assert entry[first]["rank"] == int((want >= want[ids[j]] - 1e-6).sum()) or \
            entry[first]["rank"] == int((want > want[ids[j]] + 1e-6).sum()) + 1  # (ties within float rounding)
        assert entry[first]["decoded_token"] == tok.decode([ids[j]])
        top = want.topk(2)
        assert {t: v["rank"] for t, v in entry.items() if v["rank"] <= 2} == {
            str(int(t)): r for r, t in enumerate(top.indices, 1)}
    with_echo = post("/v1/completions", prompt=ids, prompt_logprobs=3, echo=True, logprobs=1)["choices"][0]
    alone = post("/v1/completions", prompt=ids, echo=True, logprobs=1)["choices"][0]
    assert with_echo["logprobs"] == alone["logprobs"] and "prompt_logprobs" not in alone
    assert all(len(e) >= 3 for e in with_echo["prompt_logprobs"][1:])
    no_echo = post("/v1/completions", prompt=ids, prompt_logprobs=1, logprobs=1)["choices"][0]
    assert len(no_echo["logprobs"]["tokens"]) == 1  # (the answer's: the prompt's are in their own field)
    chat = post("/v1/chat/completions", messages=CHAT, prompt_logprobs=1)
    prompt = server.state.chat_ids({"messages": CHAT})[0]
    assert len(chat["prompt_logprobs"]) == len(prompt) == chat["usage"]["prompt_tokens"]
    assert [next(iter(e)) for e in chat["prompt_logprobs"][1:]] == [str(t) for t in prompt[1:]]
    for bad in ({"prompt_logprobs": -1}, {"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids, "max_tokens": 1, **bad}, timeout=TIMEOUT)
        assert _error_of(r, 400)["param"] == "prompt_logprobs", bad


def test_echoed_logprobs_text_offsets_index_the_returned_text(server):
    """Each text_offset of an echo with logprobs is where its token's text stands in the choice's text: a string
    prompt's BOS (the tokenizer's, no part of the client's text) at 0 and its own tokens after it, characters split
    across tokens, and a whole token after bytes that never made a character (they come out with it, as U+FFFD)
    begins after them."""
    tok = server.tok
    lone = next(t for t in range(server.generator.cfg.vocab_size) if tok.token_bytes(t) == b"\x80")
    plus = tok.encode("+", special_tokens=False, add_bos=False)
    prompts = ["héllo wörld 日本 😀", tok.encode("ab", special_tokens=False) + [lone] + plus, "Once upon a time"]
    body = {"model": "tiny", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 6, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        text, lp = choice["text"], choice["logprobs"]
        offsets = lp["text_offset"]
        assert offsets == sorted(offsets) and offsets[-1] <= len(text), offsets
        added = [0] if isinstance(prompts[choice["index"]], str) and tok.add_special_tokens else []
        for i, (token, at) in enumerate(zip(lp["tokens"], offsets)):
            if i not in added and "\ufffd" not in token:
                assert text[at:].startswith(token), (i, token, at, text)
        assert offsets[added[0] + 1 if added else 0] == 0


def test_responses_carry_llama_server_timings(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0},
                   timeout=TIMEOUT).json()
    t = r["timings"]
    assert t["prompt_n"] == 3 and t["predicted_n"] == r["usage"]["completion_tokens"]
    assert t["prompt_ms"] > 0 and t["predicted_per_second"] > 0
    assert t["prompt_per_second"] == pytest.approx(3 / (t["prompt_ms"] / 1000), rel=1e-2)


# ---- 2. JSON output by constrained decoding --------------------------------------------------------------------

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                                "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}


def _needs_llguidance():
    pytest.importorskip("llguidance", reason="the json extra (pip install 'moepack[json]')")


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(server, stream):
    _needs_llguidance()
    import jsonschema

    c = _client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    if stream:
        chunks = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, temperature=0,
                                           response_format=fmt, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, temperature=0,
                                      response_format=fmt)
        assert r.choices[0].finish_reason == "stop"  # the grammar ended it: only the end of sentence was left
        text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    # sampled too (any seed): still valid
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, temperature=1.0, seed=3,
                                  response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_object_output_is_an_object(server):
    _needs_llguidance()
    c = _client(server)
    # (a random model may write a number's digits until max_tokens: several seeds, each ended answer an object)
    ended = 0
    for seed in range(4):
        r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30, temperature=1.0, seed=seed,
                                      response_format={"type": "json_object"})
        text = r.choices[0].message.content
        assert text.startswith("{"), text
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            ended += 1
    assert ended, "no seed's answer ended"


def test_json_output_with_top_logprobs_lists_only_tokens_it_allows(server):
    """The constraint leaves few tokens (-inf for the rest): top_logprobs holds only finite ones, never a 500."""
    _needs_llguidance()
    c = _client(server)
    for stream in (False, True):
        r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                      top_logprobs=20, response_format={"type": "json_object"}, stream=stream)
        content = ([e for chunk in r if chunk.choices and chunk.choices[0].logprobs
                    for e in chunk.choices[0].logprobs.content] if stream else r.choices[0].logprobs.content)
        assert content
        assert any(len(entry.top_logprobs) < 20 for entry in content)  # the first token: "{" or a space
        assert all(math.isfinite(t.logprob) for entry in content for t in entry.top_logprobs)


def test_json_with_thinking_constrains_only_the_answer(server):
    """Free text until the thought's `</think>` ids have come in a row, the schema after them."""
    _needs_llguidance()
    tok = server.tok
    grammar = server.state.json_grammar()
    think_end = tok.encode_special("</think>")
    constraint = grammar.constraint({"enum": ["yes", "no"]}, after=think_end)
    n = server.state.vocab
    for token in tok.encode("free <think> text", special_tokens=False) + think_end[:-1]:
        assert constraint.allowed(n) is None  # any token
        constraint.accept(token)
    constraint.accept(think_end[-1])
    allowed = constraint.allowed(n).tolist()
    assert allowed and all(tok.decode([t]).startswith('"') or tok.decode([t]) in ('"', '"y', '"n')
                           for t in allowed)
    c = _client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"enum": ["yes", "no"]}}}
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, temperature=0, response_format=fmt,
                                  extra_body={"thinking": True})
    message = r.choices[0].message.model_dump()
    if message["content"]:  # the thought ended within the tokens: the answer is the schema's
        assert json.loads(message["content"]) in ("yes", "no")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllms_structured_outputs_constrain_the_answer(server, path):
    """vLLM's structured outputs, both endpoints: `structured_outputs` {choice | regex | json | grammar |
    json_object} and the older guided_choice / guided_regex / guided_json / guided_grammar: a sampled answer (seeded,
    not greedy) is one of the choices, matches the regular expression, is JSON of the schema (given as an object or
    as its text), is in the Lark grammar's language."""
    import re

    _needs_llguidance()
    prompt = {"prompt": "Once upon"} if path == "/v1/completions" else {"messages": CHAT}
    choices = ["yes", "no", "maybe so"]
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}
    cases = [({"guided_choice": choices}, lambda t: t in choices),
             ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
             ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
             ({"structured_outputs": {"regex": "(ab|cd)+!"}}, lambda t: re.fullmatch("(ab|cd)+!", t)),
             ({"guided_json": schema}, lambda t: json.loads(t)["n"] in (1, 2, 3)),
             ({"structured_outputs": {"json": json.dumps(schema)}}, lambda t: set(json.loads(t)) == {"n"}),
             ({"guided_grammar": 'start: "a"+ "!"'}, lambda t: re.fullmatch("a+!", t)),
             # (GBNF, as vLLM's default backend takes a grammar)
             ({"structured_outputs": {"grammar": 'root ::= "b"+ tail\ntail ::= "?"'}},
              lambda t: re.fullmatch(r"b+\?", t)),
             # (any object: a random model's keys run on past max_tokens; its start is the grammar's)
             ({"structured_outputs": {"json_object": True}}, lambda t: t.startswith('{'))]
    for seed, (asked, holds) in enumerate(cases):
        body = {**prompt, **asked, "max_tokens": 60, "temperature": 1.0, "seed": seed}
        r = httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        ended = choice["finish_reason"] == "stop" or "json_object" in str(asked)
        assert ended and holds(text), (asked, text)


@pytest.mark.parametrize("body, param", [
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_json": {}}, "guided_json"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs"),
    ({"structured_outputs": "a"}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_grammar": "root ::= undefined"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "frobnicate"}}, "guided_json"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_bad_structured_outputs_are_400s(server, body, param):
    _needs_llguidance()
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, **body},
                   timeout=TIMEOUT)
    assert _error_of(r, 400)["param"] == param, r.text


def test_bad_response_formats_are_400s(server):
    c = _client(server)
    for fmt in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "x"}},
                {"type": "text", "schema": {"type": "object"}},  # a key moepack does not read: not left unread
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": True, "extra": 1}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}):
        if fmt["type"] == "json_schema" and "schema" in fmt["json_schema"]:
            _needs_llguidance()
        _bad(lambda: c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, response_format=fmt),
             "response_format")


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_no_answer_can_satisfy_is_a_400_before_any_token(server, stream):
    """Schemas llguidance compiles but no answer within max_tokens can satisfy: a $ref to itself (or a loop of
    $defs) allows no JSON value; a required property that recurs forever forces its tokens without end. Each is
    the request's 400 (streamed too: before any 200), never an empty "stop" or an error after the answer began;
    a few forced tokens past a small max_tokens (json_object's "{" at 1) are left to the client."""
    from moepack.format_spec.errors import MoepackError

    _needs_llguidance()
    c = _client(server)
    loop = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    endless = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
    nested = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
    for schema, says in (({"$ref": "#"}, "no JSON value"), (loop, "no JSON value"), (endless, "forces"),
                         (nested, "forces")):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        message = _bad(lambda: c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=200, stream=stream,
                                                         response_format=fmt), "response_format")
        assert says in message, message
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, response_format={"type": "json_object"})
    assert r.choices[0].message.content == "{" and r.choices[0].finish_reason == "length"
    # a schema is probed once (the probe of an endless one holds the GIL ~0.1 s): the same one again costs nothing
    grammar, probes = server.state.json_grammar(), []
    compile_one = grammar.constraint
    grammar.constraint = lambda *a, **k: probes.append(1) or compile_one(*a, **k)
    try:
        for _ in range(3):
            with pytest.raises(MoepackError, match="forces"):
                grammar.check(endless, 200)
    finally:
        del grammar.constraint
    assert len(probes) == 0  # probed by the requests above already


def test_the_probe_cache_is_safe_beside_other_requests_threads(server, monkeypatch):
    """Requests are prepared on several worker threads: one evicting the oldest probed spec while another had chosen
    the same one to evict (or had its own evicted) had been a KeyError, a 500. The interleaving is made here: the
    cache, full, loses its oldest entry to 'another thread' between this one choosing it and popping it."""
    from moepack.serve import grammar as grammar_module

    _needs_llguidance()

    class EvictedMeanwhile(dict):
        def __iter__(self):
            keys = list(dict.__iter__(self))
            dict.pop(self, keys[0])
            return iter(keys)

    grammar = server.state.json_grammar()
    monkeypatch.setattr(grammar_module, "PROBED_SCHEMAS", 2)
    monkeypatch.setattr(grammar, "_forced", EvictedMeanwhile())
    for i in range(4):
        grammar.check(grammar_module.OutputSpec("choice", [f"c{i}"]), 10)
    assert len(grammar._forced) <= 2


def test_without_llguidance_response_format_names_the_extra(server, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llguidance(name, *a, **k):
        if name == "llguidance":
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    monkeypatch.setattr(server.state, "_grammar", None)
    message = _bad(lambda: _client(server).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=2, response_format={"type": "json_object"}), "response_format")
    assert "pip install 'moepack[json]'" in message


# ---- 3. tool calls -----------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}}}}}
TWO_CALLS = ('Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             '<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="query" string="true">Eiffel "tower"'
             '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": 'Eiffel "tower"'})]


@pytest.fixture
def scripted(server, monkeypatch):
    """The generator answers `scripted.text` (in pieces of 7 characters), whatever the prompt; the prompt's ids are
    kept in scripted.prompts."""
    return scripted_generator(server.generator, monkeypatch)


def scripted_generator(generator, monkeypatch):
    """`generator` (a Generator) made to answer Script.text in pieces of 7 characters; the prompts kept in
    Script.prompts (the `scripted` fixture's, tests/test_template_tools.py's)."""
    from moepack.runtime.generate import GenerateResult

    class Script:
        text = ""
        prompts: list = []

    def generate(ids, options, detokenize=None, on_text=None, cancelled=None, **kw):
        Script.prompts.append(list(ids))
        if cancelled is not None:
            cancelled()  # once every check has passed: a stream's 200 goes now
        for i in range(0, len(Script.text), 7):
            if on_text is not None:
                on_text(Script.text[i:i + 7])
        return GenerateResult([1] * 5, Script.text, "stop", {"prefill": {"seconds": 0.01},
                                                              "decode": {"seconds": 0.01}})

    monkeypatch.setattr(generator, "generate", generate)
    Script.prompts = []
    return Script


def _calls(calls):
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_the_models_tool_calls_become_tool_calls(server, scripted):
    scripted.text = TWO_CALLS
    c = _client(server)
    r = c.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, SEARCH])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert _calls(choice.message.tool_calls) == EXPECTED_CALLS
    assert all(call.id.startswith("call_") and call.type == "function" for call in choice.message.tool_calls)
    prompt = server.tok.decode(scripted.prompts[-1])
    assert "## Tools" in prompt and '"name": "get_weather"' in prompt and '"name": "search"' in prompt
    # streamed: the calls come as deltas, the content before them as content
    stream = c.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, SEARCH], stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.setdefault(call.index, [call.function.name, ""])[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))] == EXPECTED_CALLS
    one = c.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, SEARCH], parallel_tool_calls=False)
    assert _calls(one.choices[0].message.tool_calls) == EXPECTED_CALLS[:1]


def test_a_conversation_with_tool_results_is_the_encoders_prompt(server, scripted):
    from moepack.serve.tool_calls import with_prompt_extras
    from moepack.families.deepseek_v4.chat import encode_messages

    scripted.text = "It is sunny."
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}},
                    {"id": "c2", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}]},
                {"role": "tool", "tool_call_id": "c2", "content": "nothing"},
                {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]
    r = _client(server).chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, SEARCH])
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    expected = encode_messages(with_prompt_extras(messages, [WEATHER, SEARCH], None))
    assert server.tok.decode(scripted.prompts[-1]) == expected
    assert "<tool_result>Sunny</tool_result>\n\n<tool_result>nothing</tool_result>" in expected  # call order


def test_tool_choice_required_and_named_prefill_the_call(server, scripted):
    c = _client(server)
    scripted.text = ('get_weather">\n<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
                     '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    r = c.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, SEARCH], tool_choice="required")
    assert server.tok.decode(scripted.prompts[-1]).endswith('</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="')
    assert _calls(r.choices[0].message.tool_calls) == [("get_weather", {"city": "Oslo"})]
    assert r.choices[0].message.content is None
    scripted.text = scripted.text.split('">\n', 1)[1]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, SEARCH], tool_choice=named,
                                  extra_body={"thinking": True})
    assert server.tok.decode(scripted.prompts[-1]).endswith(
        '<think></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n')
    assert _calls(r.choices[0].message.tool_calls) == [("get_weather", {"city": "Oslo"})]
    stream = c.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER], tool_choice=named, stream=True)
    deltas = [call for chunk in stream for call in (chunk.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_short_is_content_as_written(server, scripted, stream):
    """A forced call the answer never finished (max_tokens, a stop string): no tool_calls, and its text, the
    prefilled opening with it, is content; after a finished call, only the unfinished one's text."""
    c = _client(server)
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = (('<｜DSML｜parameter name="city" string="true">Os', named,
              '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
              '<｜DSML｜parameter name="city" string="true">Os'),
             (TWO_CALLS.split("<｜DSML｜invoke name=\"search\">")[0].split('name="', 1)[1]
              + '<｜DSML｜invoke name="sea', "required", '\n<｜DSML｜invoke name="sea'))
    for text, choice, content in cases:
        scripted.text = text
        r = c.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, SEARCH], tool_choice=choice,
                                      stream=stream)
        if stream:
            chunks = [chunk.choices[0].delta for chunk in r if chunk.choices]
            got = "".join(d.content or "" for d in chunks)
            calls = [call.function.name for d in chunks for call in (d.tool_calls or [])]
        else:
            got = r.choices[0].message.content
            calls = [call.function.name for call in r.choices[0].message.tool_calls or []]
        assert got == content
        assert calls == ([] if choice is named else ["get_weather"])


@pytest.mark.parametrize("constraint", [{"response_format": {"type": "json_object"}}, {"guided_choice": ["yes", "no"]},
                                        {"structured_outputs": {"regex": "[ab]+"}}])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_constrained_answer_is_no_forced_tool_call(server, constraint, tool_choice):
    """A forced tool call begins the answer with the call's markup (the prompt's prefill): a response_format or
    structured output would constrain what follows that markup (the call never parsed, its markup the answer's
    content): a 400 naming the constraint's field; with tool_choice auto the answer is the constrained one."""
    _needs_llguidance()
    body = {"messages": CHAT, "tools": [WEATHER], "max_tokens": 8, "temperature": 1, "seed": 3, **constraint}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "tool_choice": tool_choice}, timeout=TIMEOUT)
    assert _error_of(r, 400)["param"] == next(iter(constraint)), r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "tool_choice": "auto"}, timeout=TIMEOUT)
    assert r.status_code == 200 and not r.json()["choices"][0]["message"].get("tool_calls"), r.text


def test_tool_choice_none_leaves_the_tools_out(server, scripted):
    scripted.text = TWO_CALLS
    r = _client(server).chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER], tool_choice="none")
    assert "## Tools" not in server.tok.decode(scripted.prompts[-1])
    assert r.choices[0].message.content == TWO_CALLS and not r.choices[0].message.tool_calls


def test_bad_tools_fields_are_400s(server):
    c = _client(server)
    other = {"type": "function", "function": {"name": "nope"}}
    _bad(lambda: c.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER], tool_choice=other),
         "tool_choice")
    _bad(lambda: c.chat.completions.create(model="tiny", messages=CHAT, tool_choice="required"), "tool_choice")
    _bad(lambda: c.chat.completions.create(model="tiny", messages=CHAT, tools=[{"type": "function"}]), "tools")
    _bad(lambda: c.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER],
                                           parallel_tool_calls="yes"), "parallel_tool_calls")
    _bad(lambda: c.chat.completions.create(model="tiny", messages=[{"role": "tool", "content": {"x": 1}}]),
         "messages")


# ---- 4. endpoints and headers -------------------------------------------------------------------------------------

def test_metrics_count_requests_tokens_errors_and_latencies(server):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        r = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(r.text) for s in family.samples}

    before = scrape()
    c = _client(server)
    r = c.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=5, temperature=0)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", max_tokens=-1)
    after = scrape()

    def grew(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    ok = (("endpoint", "/v1/completions"), ("status", "200"))
    bad = (("endpoint", "/v1/completions"), ("status", "400"))
    assert grew("moepack_requests_total", ok) == 1 and grew("moepack_requests_total", bad) == 1
    assert grew("moepack_errors_total", bad) == 1 and grew("moepack_errors_total", ok) == 0
    assert grew("moepack_prompt_tokens_total") == 4
    assert grew("moepack_generated_tokens_total") == r.usage.completion_tokens
    assert grew("moepack_time_to_first_token_seconds_count") == 1
    assert grew("moepack_time_per_output_token_seconds_count") == r.usage.completion_tokens - 1
    assert grew("moepack_expert_cache_hits_total") + grew("moepack_expert_cache_misses_total") > 0
    assert after[("moepack_requests_in_flight", ())] == 0


def test_tokenize_and_detokenize_as_llama_server(server):
    text = "Hello <｜User｜> world"
    r = httpx.post(f"{server.url}/tokenize", json={"content": text}, timeout=TIMEOUT)
    ids = r.json()["tokens"]
    assert ids == server.tok.encode(text, special_tokens=False, add_bos=False)
    with_bos = httpx.post(f"{server.url}/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert with_bos[-len(ids):] == ids
    pieces = httpx.post(f"{server.url}/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    # a byte-level piece of part of a character is the list of its bytes, as llama-server gives it: joined, the
    # pieces are the text's UTF-8 (a U+FFFD of the text itself stays text)
    unicode_text = "Hello \ufffd 你好 🎉 <|User|> world"
    pieces = httpx.post(f"{server.url}/tokenize", json={"content": unicode_text, "with_pieces": True}).json()["tokens"]
    assert any(isinstance(p["piece"], list) for p in pieces)
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined == unicode_text.encode()
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=TIMEOUT).json()
    assert back == {"content": text, "prompt": text}  # (vLLM's answer names it prompt)
    for path, body, param in (("/tokenize", {"content": 5}, "content"), ("/tokenize", {"text": "x"}, "text"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens")):
        r = httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_tokenizer_endpoints_as_vllm_serves_them_to_lm_evals_remote_tokenizer(server):
    """lm-eval's remote tokenizer (tokenizer_backend auto or remote) first asks GET /tokenizer_info (its eos_token),
    then POST /tokenize {"prompt", "add_special_tokens": false} -> {"tokens"}, takes the eos token's id as the first
    of /tokenize(eos_token), and decodes by /detokenize -> {"prompt"}: vLLM's forms, beside llama-server's."""
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=TIMEOUT).json()
    config = server.generator.c.config
    assert info["eos_token"] == "<｜end▁of▁sentence｜>" and info["bos_token"] == "<｜begin▁of▁sentence｜>"
    assert info["model_max_length"] == config["max_position_embeddings"] and info["add_bos_token"] is True

    def tokenize(body):
        r = httpx.post(f"{server.url}/tokenize", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()
    eos = tokenize({"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos["tokens"] == [config["eos_token_id"]] and eos["count"] == 1  # a special token's spelling is it
    text = "Once upon a time"
    plain = tokenize({"model": "tiny", "prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert plain["tokens"] == server.tok.encode(text, add_bos=False) and plain["max_model_len"] == info[
        "model_max_length"] and "".join(plain["token_strs"]) == text
    assert tokenize({"prompt": text})["tokens"] == [config["bos_token_id"], *plain["tokens"]]  # vLLM's default
    back = httpx.post(f"{server.url}/detokenize", json={"model": "tiny", "tokens": plain["tokens"]},
                      timeout=TIMEOUT).json()
    assert back["prompt"] == text
    for body, param, status in (({"prompt": text, "content": text}, "prompt", 400),
                                ({"prompt": 3}, "prompt", 400), ({"prompt": text, "add_special_tokens": 1},
                                                                 "add_special_tokens", 400),
                                ({"prompt": text, "model": "other"}, "model", 404),
                                ({"content": text, "model": "other"}, "model", 404),  # llama-server's form too
                                ({"prompt": text, "messages": []}, "messages", 400)):
        r = httpx.post(f"{server.url}/tokenize", json=body, timeout=TIMEOUT)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)


def test_one_model_and_an_unknown_one(server):
    c = _client(server)
    model = c.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:  # a name the client chose is not echoed whole
        c.completions.create(model="m" * 100_000, prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and len(e.value.body["message"]) < 200


def test_the_api_key_from_the_environment_or_a_private_file(tmp_path, monkeypatch):
    import os

    import click

    from moepack.cli.serve import resolve_api_key
    from moepack.format_spec.errors import MoepackError

    monkeypatch.delenv("MOEPACK_API_KEY", raising=False)
    assert resolve_api_key(None, None) is None
    monkeypatch.setenv("MOEPACK_API_KEY", " from-env \n")
    assert resolve_api_key(None, None) == "from-env"
    assert resolve_api_key("flag", None) == "flag"
    key = tmp_path / "key"
    key.write_text("  from-file  \nsecond line\n")
    os.chmod(key, 0o600)
    assert resolve_api_key(None, str(key)) == "from-file"
    os.chmod(key, 0o644)
    with pytest.raises(MoepackError, match="readable by others"):
        resolve_api_key(None, str(key))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    os.chmod(empty, 0o600)
    with pytest.raises(MoepackError, match="empty"):
        resolve_api_key(None, str(empty))
    with pytest.raises(click.UsageError):
        resolve_api_key("flag", str(key))
    # a key no HTTP header can carry as it is (not printable ASCII), or an empty one, is refused before the model
    # loads; one with a space inside is a header's too
    assert resolve_api_key("two words", None) == "two words"
    for bad in ("ключ-sk", "", "tab\tkey"):
        with pytest.raises(MoepackError, match="must be printable ASCII"):
            resolve_api_key(bad, None)
    monkeypatch.setenv("MOEPACK_API_KEY", "ключ")
    with pytest.raises(MoepackError, match="must be printable ASCII"):
        resolve_api_key(None, None)
    with pytest.raises(MoepackError, match="must be printable ASCII"):
        make_app(None, "m", api_key="clé")


# ---- 5. reasoning effort ------------------------------------------------------------------------------------------

def test_reasoning_effort_is_what_the_release_encoder_knows(server, scripted):
    from moepack.families.deepseek_v4.chat import REASONING_EFFORT_MAX_PREFIX

    scripted.text = "ok"
    c = _client(server)
    for effort in ("low", "medium", "minimal"):  # OpenAI's, not the release's
        message = _bad(lambda: c.chat.completions.create(model="tiny", messages=CHAT, reasoning_effort=effort,
                                                         extra_body={"thinking": True}), "reasoning_effort")
        assert "'high', 'max'" in message
    assert "thinking" in _bad(lambda: c.chat.completions.create(model="tiny", messages=CHAT,
                                                                reasoning_effort="max"), "reasoning_effort")
    c.chat.completions.create(model="tiny", messages=CHAT, reasoning_effort="max", extra_body={"thinking": True})
    assert REASONING_EFFORT_MAX_PREFIX in server.tok.decode(scripted.prompts[-1])
    c.chat.completions.create(model="tiny", messages=CHAT, reasoning_effort="high")


def test_the_cli_offers_what_the_encoder_knows(tiny_path, tmp_path):
    from click.testing import CliRunner

    from moepack.cli.main import cli as main

    runner = CliRunner()
    low = runner.invoke(main, ["generate", tiny_path, "--chat", "Hi", "--reasoning-effort", "low"])
    assert low.exit_code == 2 and "'low' is not one of 'high', 'max'" in low.output
    no_thinking = runner.invoke(main, ["generate", tiny_path, "--chat", "Hi", "--reasoning-effort", "max",
                                       "--max-new-tokens", "1"])
    assert no_thinking.exit_code != 0
    lines = [line for line in no_thinking.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "thinking" in lines[0] and "Traceback" not in no_thinking.output


# ---- 6. what HTTP clients send beside the fields ----------------------------------------------------------------

def _raw_post(server, body: bytes, path: str = "/v1/completions", **headers) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=body, timeout=TIMEOUT,
                      headers={"Content-Type": "application/json", **headers})


def _error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    return error


def test_an_endpoint_or_method_not_served_is_openais_error_naming_it(server):
    with pytest.raises(openai.NotFoundError) as e:
        _client(server).embeddings.create(model="tiny", input="Hi")
    assert e.value.body["code"] == "unknown_endpoint" and "POST /v1/embeddings" in e.value.body["message"]
    error = _error_of(httpx.get(f"{server.url}/v1/chat/completions", timeout=TIMEOUT), 405)
    assert error["code"] == "method_not_allowed" and "GET /v1/chat/completions" in error["message"]
    error = _error_of(httpx.post(f"{server.url}/v1/completions/", json={"prompt": "x"}, timeout=TIMEOUT,
                                 headers={"Host": "evil.example"}), 404)  # never a redirect to the Host sent
    assert error["code"] == "unknown_endpoint" and "POST /v1/completions/" in error["message"]
    error = _error_of(httpx.get(f"{server.url}/v1/a%0Ab%00c", timeout=TIMEOUT), 404)
    assert error["message"].startswith("GET /v1/a%0Ab%00c: no such endpoint") and error["message"].isprintable()
    preflight = httpx.options(f"{server.url}/v1/chat/completions", timeout=TIMEOUT)
    assert _error_of(preflight, 405)["code"] == "method_not_allowed" and preflight.headers["allow"] == "POST"


def _sse(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Once upon"}),
                                       ("/v1/chat/completions", {"messages": CHAT})])
def test_include_usage_is_a_last_chunk_of_its_own_and_null_on_the_others(server, path, body):
    """OpenAI's stream_options.include_usage: one more chunk before [DONE], choices [], the request's usage; every
    other chunk's usage null (a client reading choices[0] of each chunk but the usage one finds its finish)."""
    body = {**body, "max_tokens": 3, "temperature": 0, "stream": True}
    whole = httpx.post(f"{server.url}{path}", json={**body, "stream": False}, timeout=TIMEOUT).json()
    chunks = _sse(server, path, {**body, "stream_options": {"include_usage": True}})
    *answer, last = chunks
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert all("usage" in c and c["usage"] is None and len(c["choices"]) == 1 for c in answer)
    assert answer[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all("usage" not in c for c in _sse(server, path, body))


def test_a_key_given_twice_is_refused_by_name(server):
    for raw, key in ((b'{"prompt": "Hi", "max_tokens": 2, "max_tokens": 3}', "max_tokens"),
                     (b'{"model": "other", "model": "tiny", "prompt": "Hi"}', "model"),
                     (b'{"prompt": [1, 2], "logit_bias": {"5": 1, "5": -100}}', "5")):
        error = _error_of(_raw_post(server, raw), 400)
        assert error["code"] == "invalid_json" and f"{key}: given twice" in error["message"], error


def test_a_body_in_another_charset_or_content_encoding_is_415_naming_it(server):
    import gzip

    body = json.dumps({"prompt": "caf\u00e9", "max_tokens": 1}).encode()
    for content_type in ("application/json; charset=utf-8", 'application/json;charset="UTF-8"', "application/json",
                         "application/json; charset=utf8"):
        assert _raw_post(server, body, **{"Content-Type": content_type}).status_code == 200, content_type
    assert _raw_post(server, body, **{"Content-Encoding": "identity"}).status_code == 200
    latin = json.dumps({"prompt": "caf\u00e9", "max_tokens": 2}, ensure_ascii=False).encode("latin-1")
    for content_type, named in (("application/json; charset=latin-1", "latin-1"),
                                ("application/json; charset=UTF-16", "UTF-16")):
        error = _error_of(_raw_post(server, latin, **{"Content-Type": content_type}), 415)
        assert error["code"] == "unsupported_media_type" and f"charset {named}" in error["message"]
    for encoding, payload in (("gzip", gzip.compress(body)), ("gzip", body), ("br", body)):
        error = _error_of(_raw_post(server, payload, **{"Content-Encoding": encoding}), 415)
        assert error["code"] == "unsupported_media_type" and f"Content-Encoding {encoding}" in error["message"]


def test_a_logit_bias_key_that_is_no_plain_token_id_is_a_400(server):
    for key in ("\u00b2", "\u0663", "05", "+5", " 5", "-1", "", "9" * 5000):
        r = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT,
                       json={"prompt": [1, 2], "max_tokens": 2, "logit_bias": {key: 1}})
        assert _error_of(r, 400)["param"] == "logit_bias", key


def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(f"{url}/v1/chat/completions", timeout=TIMEOUT, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})


def test_a_browser_client_is_served_from_the_origins_allowed_and_told_the_flag_elsewhere(server):
    """A browser's CORS preflight: refused by default, naming the flag (a page of any site could otherwise have a
    local server generate for it and read the answer); from an origin --allowed-origin names: allowed, and the
    answers carry the headers the page needs to read them (streamed ones too)."""
    error = _error_of(_preflight(server.url, "http://ui.example"), 403)
    assert error["code"] == "cors_not_allowed" and "--allowed-origin" in error["message"]
    # nor does a page run a generation without a preflight (a form's text/plain POST: unread, but it would run)
    for content_type in ("application/json", "text/plain"):
        plain = httpx.post(f"{server.url}/v1/completions", content=json.dumps({"prompt": [1, 2], "max_tokens": 1}),
                           headers={"Origin": "http://ui.example", "Content-Type": content_type}, timeout=TIMEOUT)
        error = _error_of(plain, 403)
        assert error["code"] == "cors_not_allowed" and "--allowed-origin" in error["message"]
        assert "access-control-allow-origin" not in plain.headers
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                      timeout=TIMEOUT).status_code == 200  # (no Origin: not a browser's page)

    allowing = Running(make_app(server.generator, "tiny", log=lambda line: None,
                                allowed_origins=("http://ui.example",)))
    try:
        ok = _preflight(allowing.url, "http://ui.example")
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ui.example"
        assert "POST" in ok.headers["access-control-allow-methods"]
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        assert _preflight(allowing.url, "http://elsewhere.example").status_code == 400
        elsewhere = httpx.post(f"{allowing.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                               headers={"Origin": "http://elsewhere.example"}, timeout=TIMEOUT)
        assert _error_of(elsewhere, 403)["code"] == "cors_not_allowed"
        body = {"messages": CHAT, "max_tokens": 1, "stream": True}
        with httpx.stream("POST", f"{allowing.url}/v1/chat/completions", json=body, timeout=TIMEOUT,
                          headers={"Origin": "http://ui.example"}) as r:
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
            assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
            r.read()
    finally:
        allowing.stop()


def test_an_allowed_origin_that_no_browser_sends_is_a_usage_error(tmp_path):
    from click.testing import CliRunner

    from moepack.cli.main import cli as main

    missing = str(tmp_path / "missing.moepack")  # refused before the container is looked at (never served)
    for origin in ("http://ui.example/", "ui.example", "http://ui.example/app"):
        out = CliRunner().invoke(main, ["serve", missing, "--allowed-origin", origin])
        assert out.exit_code == 2 and "is not an origin" in out.output, out.output
    # a browser extension's pages send their own scheme's origin (they call a local server without a preflight,
    # and would otherwise be refused with no way to name them but `*`)
    for origin in ("chrome-extension://abcdefghijklmnop", "moz-extension://1234-abcd", "tauri://localhost"):
        out = CliRunner().invoke(main, ["serve", missing, "--allowed-origin", origin])
        assert out.exit_code == 1 and "is not an origin" not in out.output, out.output


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllms_benchmark_client_is_served_with_ignore_eos(server, path):
    """vLLM's benchmark client (benchmarks/backend_request_func.py): its request bodies as it sends them
    (completions: repetition_penalty 1.0, logprobs null; both: stream_options.include_usage, `ignore_eos` with
    --ignore-eos) and its stream read as it reads it. ignore_eos generates past the end of sentence: with the end
    of sentence the likeliest token, the answer is still max_tokens long."""
    eos = {str(e): 100 for e in server.generator.eos_ids}
    if path == "/v1/completions":
        body = {"model": "tiny", "prompt": "Once upon", "temperature": 0.0, "repetition_penalty": 1.0,
                "max_tokens": 4, "logprobs": None}
    else:
        body = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                "temperature": 0.0, "max_completion_tokens": 4}
    body.update(stream=True, stream_options={"include_usage": True}, ignore_eos=True, logit_bias=eos)
    output_tokens, finish = None, None
    for data in _sse(server, path, body):
        if choices := data.get("choices"):
            finish = choices[0]["finish_reason"] or finish
        elif usage := data.get("usage"):
            output_tokens = usage.get("completion_tokens")
    assert (output_tokens, finish) == (4, "length")
    stopped = httpx.post(f"{server.url}{path}", json={**body, "stream": False, "stream_options": None,
                                                      "ignore_eos": False}, timeout=TIMEOUT).json()
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"


def test_vllms_sampling_extras_are_served(server):
    """vLLM's extras: repetition_penalty 1, min_p 0, min_tokens 0 and top_k -1 (off) change nothing, and llama.cpp's
    seed -1 (random); min_p 1 keeps only the likeliest token (greedy's answer at any temperature); a value out of
    range is a 400 naming the field, as is ignore_eos with a response_format (the JSON's end is the answer's)."""
    def post(**extra):
        return httpx.post(f"{server.url}/v1/chat/completions", timeout=TIMEOUT,
                          json={"messages": CHAT, "max_tokens": 3, "temperature": 1.0, "seed": 7, **extra})
    plain = post().json()["choices"][0]["message"]
    drawn = {tuple(httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT, json={
        "prompt": "Hi", "max_tokens": 8, "temperature": 2.0, "seed": -1}).json()["choices"][0]["token_ids"])
        for _ in range(3)}
    assert len(drawn) > 1  # seed -1 (llama.cpp's clients): a seed of its own each time, as without one
    for extra in ({"repetition_penalty": 1.0}, {"min_p": 0}, {"min_tokens": 0}, {"top_k": -1},
                  {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}},
                  {"stream": True, "stream_options": {"include_usage": None, "continuous_usage_stats": None}}):
        r = post(**extra)
        assert r.status_code == 200, (extra, r.text)
        if "stream" not in extra:
            assert r.json()["choices"][0]["message"] == plain, extra
    greedy = post(temperature=0)
    assert post(min_p=1, temperature=2.0).json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]
    for name, value in (("repetition_penalty", 0), ("repetition_penalty", 101), ("repetition_penalty", True),
                        ("min_p", 1.5), ("min_p", -0.1), ("min_p", "0.1"),
                        ("min_tokens", -1), ("min_tokens", "0"), ("top_k", -2), ("ignore_eos", "yes"), ("seed", -2)):
        assert _error_of(post(**{name: value}), 400)["param"] == name, (name, value)
    error = _error_of(post(ignore_eos=True, response_format={"type": "json_object"}), 400)
    assert error["param"] == "ignore_eos" and "response_format" in error["message"]


def test_a_bad_message_is_named_by_its_index_in_the_request_with_tools_or_a_response_format(server):
    """tools and response_format go on a system message put first where the conversation has none: a bad message
    is still named by its place in the request's messages (it had been one further on)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for extra in ({}, {"tools": tools}, {"response_format": {"type": "json_object"}}):
        hi = {"role": "user", "content": "hi"}
        for messages, named in (([hi, {"role": "user", "content": None}], "[1].content"),
                                ([{"role": "user", "content": 5}], "[0].content"),
                                ([hi, {"role": "function", "content": "r"}], "[1].role")):
            r = httpx.post(f"{server.url}/v1/chat/completions", timeout=TIMEOUT,
                           json={"messages": messages, "max_tokens": 2, **extra})
            error = _error_of(r, 400)
            assert error["param"] == "messages" and error["message"].startswith(f"messages{named}:"), (extra, error)


def test_an_answer_sent_back_as_the_sdk_dumps_it_is_taken(server):
    """A client's loop that keeps the SDK's message as `message.model_dump()` sends back every key of OpenAI's
    response message, null where unset (refusal, audio, annotations, function_call): taken where they say nothing
    (null, an empty annotations list), refused by name where they say something nothing here renders. A parse()
    answer sent back carries the SDK's `parsed`: taken (its content says it)."""
    c = _client(server)
    answer = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, temperature=0).choices[0].message
    dumped = answer.model_dump()
    assert {"annotations", "function_call"} <= set(dumped)
    for sent in (dumped, {**dumped, "annotations": []}):
        again = c.chat.completions.create(model="tiny", max_tokens=2, messages=CHAT + [sent, {"role": "user",
                                                                                             "content": "more"}])
        assert again.choices[0].message.role == "assistant"
    # chat.completions.parse()'s answer, sent back as it is: the SDK writes its `parsed` beside the content
    from openai.types.chat import ParsedChatCompletionMessage
    parsed = ParsedChatCompletionMessage[dict](role="assistant", content='{"a": 1}', parsed={"a": 1})
    again = c.chat.completions.create(model="tiny", max_tokens=2, messages=CHAT + [parsed, {"role": "user",
                                                                                          "content": "more"}])
    assert again.choices[0].message.role == "assistant"
    for key, value in (("annotations", [{"type": "url_citation"}]), ("function_call", {"name": "f", "arguments": ""})):
        message = _bad(lambda: c.chat.completions.create(model="tiny", max_tokens=2, messages=CHAT + [
            {**dumped, key: value}]), "messages")
        assert message.startswith(f"messages[1].{key}: not a message field moepack renders")


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Once upon"}),
                                       ("/v1/chat/completions", {"messages": CHAT})])
def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far(server, path, body):
    """vLLM's stream_options.continuous_usage_stats (with include_usage, as vLLM reads it; benchmark and monitoring
    clients send it to read exact token counts as they come): every chunk's usage is its choice's so far, its last
    chunk's that choice's whole count, then the usage chunk as include_usage's. Without include_usage it asks for
    nothing more."""
    body = {**body, "max_tokens": 5, "temperature": 1.0, "seed": 3, "n": 2, "stream": True,
            "logit_bias": {str(e): -100 for e in server.generator.eos_ids}}
    chunks = _sse(server, path, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *answer, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    counts: dict[int, list[int]] = {}
    for c in answer:
        usage = c["usage"]
        assert usage["prompt_tokens"] == last["usage"]["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        counts.setdefault(c["choices"][0]["index"], []).append(usage["completion_tokens"])
    assert sorted(counts) == [0, 1]
    assert all(seen == sorted(seen) and seen[-1] == 5 for seen in counts.values()), counts
    assert all("usage" not in c for c in _sse(server, path, {**body, "stream_options": {
        "continuous_usage_stats": True}}))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_min_tokens_holds_the_end_of_sentence_back(server, path):
    """vLLM's min_tokens: with the end of sentence the likeliest token, the answer still has min_tokens tokens
    before it, and a stop string its first tokens spell does not end it before them; over max_tokens or with a
    response_format it is a 400 naming it."""
    prompt = {"prompt": "Once upon"} if path == "/v1/completions" else {"messages": CHAT}
    body = {**prompt, "max_tokens": 6, "temperature": 0, "logit_bias": {str(e): 100 for e in server.generator.eos_ids}}

    def post(**extra):
        return httpx.post(f"{server.url}{path}", json={**body, **extra}, timeout=TIMEOUT)
    for least, tokens in ((0, 1), (3, 4)):  # (the end of sentence counts as a generated token)
        r = post(min_tokens=least).json()
        assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (tokens, "stop"), least
    # a stop string the first tokens spell does not end the answer before min_tokens (vLLM checks none before)
    a = server.tok.encode("a", special_tokens=False, add_bos=False)
    assert len(a) == 1 and server.tok.decode(a) == "a"
    # every token "a", the stop string "a": the first min_tokens tokens' text passed over, as the end of sentence is
    for least, tokens, text in ((0, 1, ""), (3, 4, "aaa")):
        r = post(logit_bias={str(a[0]): 100}, stop=["a"], min_tokens=least).json()
        choice = r["choices"][0]
        said = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        assert (r["usage"]["completion_tokens"], said, choice["finish_reason"]) == (tokens, text, "stop"), least
    for extra in ({"min_tokens": 7}, {"min_tokens": 2, "response_format": {"type": "json_object"}}):
        if "response_format" in extra and path == "/v1/completions":
            continue
        assert _error_of(post(**extra), 400)["param"] == "min_tokens", extra


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_token_ids_end_the_answer_as_the_end_of_sentence(server, path):
    """vLLM's stop_token_ids: the answer ends at the first of them (finish_reason stop, its text not shown), with
    ignore_eos too, not before min_tokens; an id outside the vocabulary, or not a list of ids, is a 400 naming it."""
    prompt = {"prompt": "Once upon"} if path == "/v1/completions" else {"messages": CHAT}
    a, b = (server.tok.encode(c, special_tokens=False, add_bos=False)[0] for c in "ab")

    def post(**extra):
        return httpx.post(f"{server.url}{path}", json={**prompt, "max_tokens": 6, "temperature": 0, **extra},
                          timeout=TIMEOUT)

    def said(r):
        choice = r["choices"][0]
        return (r["usage"]["completion_tokens"], choice["text"] if path == "/v1/completions"
                else choice["message"]["content"], choice["finish_reason"])
    only_b = {"logit_bias": {str(b): 100}}
    assert said(post(**only_b).json()) == (6, "bbbbbb", "length")
    assert said(post(**only_b, stop_token_ids=[a, b]).json()) == (1, "", "stop")
    assert said(post(**only_b, stop_token_ids=[b], ignore_eos=True).json()) == (1, "", "stop")
    assert said(post(**only_b, stop_token_ids=[b], min_tokens=3).json())[0] == 4  # held back for 3 tokens
    for bad in ([10 ** 9], [-1], "3", [1.5]):
        assert _error_of(post(stop_token_ids=bad), 400)["param"] == "stop_token_ids", bad


def _post_said(server, path: str, **body) -> tuple[int, str, str]:
    """(completion tokens, the answer's text, finish_reason) of a temperature-0 request on either endpoint."""
    prompt = {"prompt": "Once upon"} if path == "/v1/completions" else {"messages": CHAT}
    r = httpx.post(f"{server.url}{path}", json={**prompt, "max_tokens": 6, "temperature": 0, **body}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    r = r.json()
    choice = r["choices"][0]
    return (r["usage"]["completion_tokens"], choice["text"] if path == "/v1/completions"
            else choice["message"]["content"], choice["finish_reason"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_include_stop_str_in_output_keeps_the_stop_string(server, path):
    """vLLM's include_stop_str_in_output: the stop string that ended the answer is kept at its end (whole or
    streamed); the tokens after it are not shown either way; not a boolean: a 400 naming it."""
    b = server.tok.encode("b", special_tokens=False, add_bos=False)[0]
    only_b = {"logit_bias": {str(b): 100}, "stop": ["bbb"]}
    assert _post_said(server, path, **only_b) == (3, "", "stop")
    assert _post_said(server, path, **only_b, include_stop_str_in_output=True) == (3, "bbb", "stop")
    assert _post_said(server, path, **only_b, include_stop_str_in_output=False)[1] == ""
    # (a stop token's text kept too, as vLLM detokenizes the token that stopped it; the end of sentence's never)
    stop_b = {"logit_bias": {str(b): 100}, "stop_token_ids": [b]}
    assert _post_said(server, path, **stop_b) == (1, "", "stop")
    assert _post_said(server, path, **stop_b, include_stop_str_in_output=True) == (1, "b", "stop")
    eos = sorted(server.generator.eos_ids)[0]
    assert _post_said(server, path, logit_bias={str(eos): 100}, stop_token_ids=[eos],
                      include_stop_str_in_output=True) == (1, "", "stop")
    prompt = {"prompt": "Once upon"} if path == "/v1/completions" else {"messages": CHAT}
    with httpx.stream("POST", f"{server.url}{path}", timeout=TIMEOUT,
                      json={**prompt, **only_b, "max_tokens": 6, "temperature": 0, "stream": True,
                            "include_stop_str_in_output": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    pieces = [c["choices"][0]["text"] if path == "/v1/completions" else c["choices"][0]["delta"].get("content")
              for c in chunks if c["choices"]]
    assert "".join(p or "" for p in pieces) == "bbb"
    prompt_body = {**prompt, "max_tokens": 2, "include_stop_str_in_output": "yes"}
    assert _error_of(httpx.post(f"{server.url}{path}", json=prompt_body, timeout=TIMEOUT),
                     400)["param"] == "include_stop_str_in_output"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_skip_special_tokens_leaves_them_out_of_the_text(server, path):
    """vLLM's skip_special_tokens: a special token the model generates (here the BOS, forced) is left out of the
    answer's text (by default too, as vLLM's and OpenAI's answers; false shows it, as transformers' decode has it);
    its tokens still count, and the logprobs' tokens still join into the text; spaces_between_special_tokens
    (nothing to change with a fast tokenizer) takes either boolean; another type of either field is a 400 naming
    it."""
    bos = server.tok.bos_id
    assert bos is not None and bos not in server.generator.eos_ids
    bos_text = server.tok.decode([bos])
    forced = {"logit_bias": {str(bos): 100}, "max_tokens": 3}
    assert _post_said(server, path, **forced) == (3, "", "length")
    assert _post_said(server, path, **forced, skip_special_tokens=False) == (3, bos_text * 3, "length")
    assert _post_said(server, path, **forced, skip_special_tokens=True) == (3, "", "length")
    for spaces in (True, False):
        assert _post_said(server, path, **forced, skip_special_tokens=False,
                          spaces_between_special_tokens=spaces)[1] == bos_text * 3
    if path == "/v1/completions":  # (a special token between others: the rest of the text, offsets into it)
        a = server.tok.encode("a", special_tokens=False, add_bos=False)[0]
        r = httpx.post(f"{server.url}{path}", timeout=TIMEOUT, json={
            "prompt": "Once upon", "max_tokens": 8, "temperature": 1, "seed": 5, "logprobs": 0,
            "skip_special_tokens": True, "logit_bias": {str(bos): 100, str(a): 100}}).json()["choices"][0]
        ids, tokens = r["token_ids"], r["logprobs"]["tokens"]
        assert {bos, a} == set(ids)  # (both, drawn at random)
        assert r["text"] == "a" * ids.count(a) == "".join(tokens)
        assert r["logprobs"]["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    for field in ("skip_special_tokens", "spaces_between_special_tokens"):
        prompt = {"prompt": "Once upon"} if path == "/v1/completions" else {"messages": CHAT}
        assert _error_of(httpx.post(f"{server.url}{path}", json={**prompt, field: 1}, timeout=TIMEOUT),
                         400)["param"] == field


def test_skip_special_tokens_leaves_an_echoed_prompt_as_it_is(server):
    """skip_special_tokens is the answer's (as vLLM's): an echoed prompt of token ids keeps its special tokens' text,
    and its logprobs' tokens and text_offsets index that text (they had been the skipped tokens' empty texts at
    offsets into a text without them); the answer's special tokens are still left out, its offsets after the echo."""
    tok, bos = server.tok, server.tok.bos_id
    ids = [bos, *tok.encode("Once", special_tokens=False, add_bos=False), bos,
           *tok.encode("upon", special_tokens=False, add_bos=False)]
    r = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT, json={
        "prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1, "skip_special_tokens": True,
        "logit_bias": {str(bos): 100}}).json()["choices"][0]
    text, logprobs = r["text"], r["logprobs"]
    assert text == tok.decode(ids) and r["token_ids"] == [bos, bos]
    assert logprobs["tokens"] == [tok.decode([i]) for i in ids] + ["", ""]
    assert logprobs["text_offset"] == [len(tok.decode(ids[:i])) for i in range(len(ids))] + [len(text)] * 2


def test_skip_special_tokens_keeps_the_chats_own_markup(tiny_path, tmp_path):
    """A chat's thought end (or tool-call markup) that is a special token of the tokenizer stays in the text the
    answer is split at with skip_special_tokens: the thought still ends there; other special tokens go."""
    from containers import mutate_index

    def end_of_thought_special(index):
        entry = index["tokenizer"]["tokenizer.json"]
        spec = json.loads(entry["data"])
        for token in spec["added_tokens"]:
            token["special"] = token["special"] or token["content"] == "</think>"
        entry["data"] = json.dumps(spec)
    path = str(tmp_path / "m.moepack")
    mutate_index(tiny_path, path, end_of_thought_special)
    g = Generator(path, cache_gib=0.5)
    running = Running(make_app(g, "tiny", log=lambda line: None))
    try:
        tok = PromptTokenizer(g.c)
        end, bos = tok.token_id("</think>"), tok.bos_id
        body = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "thinking": True, "skip_special_tokens": True,
                "logit_bias": {str(end): 100}}
        message = httpx.post(f"{running.url}/v1/chat/completions", json=body,
                             timeout=TIMEOUT).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("", "</think></think>")
        body["logit_bias"] = {str(bos): 100}
        message = httpx.post(f"{running.url}/v1/chat/completions", json=body,
                             timeout=TIMEOUT).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message.get("content") or "") == ("", "")
    finally:
        running.stop()
        g.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_truncate_prompt_tokens_keeps_the_prompts_end(server, path):
    """vLLM's truncate_prompt_tokens k: the prompt's last k tokens are what is prefilled (the answer is that of
    those ids sent as the prompt, usage counts them; echo gives their text), a text prompt's BOS kept in front of
    the last k - 1 (as vLLM's tokenizer truncation keeps it; it had been cut off with the text); -1 the context;
    0, or over the context, a 400 naming it."""
    prompt = {"prompt": "Once upon a time there was"} if path == "/v1/completions" else {"messages": CHAT}

    def post(**extra):
        return httpx.post(f"{server.url}{path}", json={**prompt, "max_tokens": 3, "temperature": 0, **extra},
                          timeout=TIMEOUT)
    whole = post().json()
    n = whole["usage"]["prompt_tokens"]
    assert post(truncate_prompt_tokens=n + 5).json()["choices"] == whole["choices"]
    assert post(truncate_prompt_tokens=-1).json()["choices"] == whole["choices"]
    cut = post(truncate_prompt_tokens=3).json()
    assert cut["usage"]["prompt_tokens"] == 3
    if path == "/v1/completions":
        whole_ids = server.tok.encode(prompt["prompt"], special_tokens=False)
        assert whole_ids[0] == server.tok.bos_id
        ids = whole_ids[:1] + whole_ids[-2:]
        alone = httpx.post(f"{server.url}{path}", json={"prompt": ids, "max_tokens": 3, "temperature": 0},
                           timeout=TIMEOUT).json()
        assert cut["choices"][0]["text"] == alone["choices"][0]["text"]
        echoed = post(truncate_prompt_tokens=3, echo=True, max_tokens=1, logprobs=0).json()["choices"][0]
        text, logprobs = echoed["text"], echoed["logprobs"]
        assert text.startswith(server.tok.decode(ids[1:])) and logprobs["text_offset"][:3] == [0, 0, 1]
        untouched = {"prompt": whole_ids[1:], "truncate_prompt_tokens": 3, "max_tokens": 1}  # (ids: their last 3)
        r = httpx.post(f"{server.url}{path}", json=untouched, timeout=TIMEOUT).json()
        assert r["usage"]["prompt_tokens"] == 3
    for bad in (0, -2, 10 ** 7, "3"):
        assert _error_of(post(truncate_prompt_tokens=bad), 400)["param"] == "truncate_prompt_tokens", bad


def test_add_special_tokens(server):
    """vLLM's add_special_tokens: false leaves the tokenizer's BOS off a completions prompt's text (true, or left
    out, as its config says); a chat's prompt has its own (true would double it): a 400 naming it."""
    def prompt_tokens(**extra) -> int:
        r = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT,
                       json={"prompt": "Once upon", "max_tokens": 1, **extra})
        return r.json()["usage"]["prompt_tokens"]
    plain = len(server.tok.encode("Once upon", special_tokens=False, add_bos=False))
    assert server.tok.add_special_tokens and prompt_tokens() == prompt_tokens(add_special_tokens=True) == plain + 1
    assert prompt_tokens(add_special_tokens=False) == plain
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=TIMEOUT,
                   json={"messages": CHAT, "max_tokens": 1, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    for bad in (True, "no"):
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=TIMEOUT,
                       json={"messages": CHAT, "max_tokens": 1, "add_special_tokens": bad})
        assert _error_of(r, 400)["param"] == "add_special_tokens"


@pytest.mark.parametrize("thinking", [False, True])
def test_continue_final_message_answers_on_from_the_assistants_text(server, thinking):
    """vLLM's continue_final_message (with add_generation_prompt false, as its clients send it): the answer goes on
    from the final assistant message's text: the completion of that prompt's ids, all content (the thought, where
    thinking, was the message's and is closed), streamed alike."""
    messages = [*CHAT, {"role": "assistant", "content": "Once upon", "reasoning_content": "a story" if thinking
                        else None}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False,
            "thinking": thinking, "max_tokens": 5, "temperature": 0}
    ids = server.state.chat_ids(body)[0]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT).json()
    plain = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0},
                       timeout=TIMEOUT).json()
    message = chat["choices"][0]["message"]
    assert message["content"] == plain["choices"][0]["text"] and not message.get("reasoning_content")
    assert chat["usage"] == {**plain["usage"], "completion_tokens_details": {"reasoning_tokens": 0}}
    streamed = _client(server).chat.completions.create(model="tiny", stream=True, **{
        k: v for k, v in body.items() if k in ("messages", "max_tokens", "temperature")},
        extra_body={k: body[k] for k in ("continue_final_message", "add_generation_prompt", "thinking")})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == message["content"]


@pytest.mark.parametrize("which", ["server", "batched"])
def test_several_prompts_in_one_completions_request_are_each_answered_as_alone(server, request, which):
    """OpenAI's batch of prompts (lm-eval's local-completions at a batch size above 1): n choices per prompt, the
    j-th of prompt p at index p * n + j, each the answer that prompt gets alone (greedy, or seeded: the j-th of its
    own seed + j), streamed or whole, one generation at a time or side by side; echo per prompt; usage the
    prompts' tokens summed."""
    ids = server.tok.encode("Far away", special_tokens=False)
    prompts = ["Once upon a time", "Hi", ids]
    server = request.getfixturevalue(which)

    def post(body):
        r = httpx.post(f"{server.url}/v1/completions", json={"max_tokens": 4, **body}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()
    for sampling, n in (({"temperature": 0}, 1), ({"temperature": 1.5, "seed": 11}, 2)):
        alone = [post({"prompt": p, "n": n, **sampling}) for p in prompts]
        batch = post({"prompt": prompts, "n": n, **sampling})
        assert [c["index"] for c in batch["choices"]] == list(range(len(prompts) * n))
        want = [(c["text"], c["token_ids"]) for a in alone for c in a["choices"]]
        assert [(c["text"], c["token_ids"]) for c in batch["choices"]] == want, sampling
        for key in ("prompt_tokens", "completion_tokens"):
            assert batch["usage"][key] == sum(a["usage"][key] for a in alone), key
        chunks = _sse(server, "/v1/completions", {"prompt": prompts, "n": n, "max_tokens": 4, "stream": True,
                                                   **sampling})
        streamed = [""] * len(want)
        for chunk in chunks:
            for choice in chunk["choices"]:
                streamed[choice["index"]] += choice["text"]
        assert streamed == [text for text, _ in want]
    echoed = post({"prompt": prompts[:2], "echo": True, "temperature": 0})["choices"]
    assert [c["text"][:len(p)] for c, p in zip(echoed, prompts[:2])] == prompts[:2]


# ---- 9. vLLM's token-id fields: return_token_ids, return_tokens_as_token_ids, allowed_token_ids, bad_words ---------

def _answer_text(server, ids: list[int]) -> str:
    """The text an answer's ids decode to (the end of sentence's own text is never part of it)."""
    return server.tok.decode([t for t in ids if t not in server.generator.eos_ids])


def _vllm_post(server, path: str, **body) -> dict:
    r = httpx.post(f"{server.url}{path}", json={"max_tokens": 8, **body}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("where", ["server", "batched"])
def test_return_token_ids_are_the_ids_the_text_was_decoded_from(where, request):
    """vLLM's return_token_ids: completions' choices carry their prompt's ids (what /tokenize gives) and their
    generated ids, chat's response its rendered prompt's ids and each choice its generated ids; they decode to the
    text (after an echo's prompt), with n choices, whole or streamed (each chunk the ids whose text it carries: the
    text so far is what the ids so far decode to, the prompt's ids on a choice's first chunk, as vLLM places them),
    one at a time or batched; a stop string cuts the text, not the ids (vLLM's: through the token that ended it)."""
    server = request.getfixturevalue(where)
    c = _client(server)
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Once upon"}, timeout=TIMEOUT).json()["tokens"]
    sampled = {"temperature": 1.0, "seed": 7, "n": 2, "return_token_ids": True}
    for echo in (False, True):
        whole = c.completions.create(model="tiny", prompt="Once upon", max_tokens=8, echo=echo, extra_body=sampled)
        for ch in map(lambda ch: ch.model_dump(), whole.choices):
            assert ch["prompt_token_ids"] == prompt_ids
            assert ch["text"] == "Once upon" * echo + _answer_text(server, ch["token_ids"]) and ch["token_ids"]
        stream = c.completions.create(model="tiny", prompt="Once upon", max_tokens=8, echo=echo, stream=True,
                                      extra_body=sampled)
        texts, ids, firsts = {0: "", 1: ""}, {0: [], 1: []}, {}
        for chunk in stream:
            ch = chunk.choices[0].model_dump()
            i = ch["index"]
            firsts.setdefault(i, ch.get("prompt_token_ids"))
            assert ids[i] == [] or "prompt_token_ids" not in ch
            texts[i] += ch["text"]
            ids[i] += ch["token_ids"]
            assert texts[i] == "Once upon" * echo + _answer_text(server, ids[i])
        assert firsts == {0: prompt_ids, 1: prompt_ids}
        assert [ids[i] for i in (0, 1)] == [ch.model_dump()["token_ids"] for ch in whole.choices]
    chat_body = {"messages": CHAT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    rendered = server.state.chat_ids(dict(chat_body))[0]
    whole = _vllm_post(server, "/v1/chat/completions", **chat_body, return_token_ids=True)
    assert whole["prompt_token_ids"] == rendered
    for ch in whole["choices"]:
        assert ch["message"]["content"] == _answer_text(server, ch["token_ids"])
    chunks = _sse(server, "/v1/chat/completions", {**chat_body, "stream": True, "return_token_ids": True})
    for i in (0, 1):
        mine = [chunk for chunk in chunks if chunk["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == rendered and not any("prompt_token_ids" in m for m in mine[1:])
        assert [t for m in mine for t in m["choices"][0]["token_ids"]] == whole["choices"][i]["token_ids"]
    greedy = _vllm_post(server, "/v1/completions", prompt="Once upon", temperature=0, max_tokens=12,
                        return_token_ids=True)["choices"][0]
    stop = next(_answer_text(server, greedy["token_ids"][:k])[-1] for k in range(3, 12)
                if _answer_text(server, greedy["token_ids"][:k])[-1:].isprintable())
    for stream in (False, True):
        body = {"prompt": "Once upon", "temperature": 0, "max_tokens": 12, "stop": [stop], "return_token_ids": True}
        if stream:
            parts = [ch["choices"][0] for ch in _sse(server, "/v1/completions", {**body, "stream": True})]
            cut = {"text": "".join(p["text"] for p in parts), "token_ids": [t for p in parts for t in p["token_ids"]]}
        else:
            cut = _vllm_post(server, "/v1/completions", **body)["choices"][0]
        spelled = _answer_text(server, cut["token_ids"])
        assert stop not in cut["text"] and spelled.startswith(cut["text"] + stop), stream
        assert greedy["token_ids"][:len(cut["token_ids"])] == cut["token_ids"]


def test_return_tokens_as_token_ids_name_each_logprobs_token_by_its_id(server):
    """vLLM's return_tokens_as_token_ids: each logprobs token (and each alternative) is "token_id:{id}", chat's
    bytes that text's (as vLLM's), completions' top_logprobs keyed so; the ids are those generated, the logprobs
    and text offsets those without the field; streamed alike; without logprobs it changes nothing."""
    base = {"prompt": "Once upon", "temperature": 0, "logprobs": 2, "return_token_ids": True}
    plain = _vllm_post(server, "/v1/completions", **base)["choices"][0]
    named = _vllm_post(server, "/v1/completions", **base, return_tokens_as_token_ids=True)["choices"][0]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in plain["token_ids"]]
    for key in ("token_logprobs", "text_offset"):
        assert named["logprobs"][key] == plain["logprobs"][key], key
    for top in named["logprobs"]["top_logprobs"]:
        assert len(top) == 2 and all(k.startswith("token_id:") and k[9:].isdigit() for k in top)
    chat = {"messages": CHAT, "temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    r = _vllm_post(server, "/v1/chat/completions", **chat)["choices"][0]
    content = r["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in r["token_ids"]]
    for e in content + [t for e in content for t in e["top_logprobs"]]:
        assert e["token"].startswith("token_id:") and e["bytes"] == list(e["token"].encode())
    streamed = [e["token"] for chunk in _sse(server, "/v1/chat/completions", {**chat, "stream": True})
                for e in (chunk["choices"][0]["logprobs"] or {}).get("content") or []]
    assert streamed == [e["token"] for e in content]
    assert _vllm_post(server, "/v1/completions", prompt="Once upon", temperature=0, return_tokens_as_token_ids=True
                      )["choices"][0]["text"] == plain["text"]


@pytest.mark.parametrize("where", ["server", "batched"])
def test_allowed_token_ids_are_the_only_ids_generated(where, request):
    """vLLM's allowed_token_ids: greedy and sampled, chat and completions, one at a time or batched, every generated
    id is one of them; greedy is the generator's own choice among them."""
    server = request.getfixturevalue(where)
    allowed = server.tok.encode_special("lab")  # (three ids, not the end of sentence)
    assert len(allowed) == 3
    direct = server.generator.generate(server.tok.encode("Once upon", special_tokens=False),
                                       GenerateOptions(max_new_tokens=8, allowed_token_ids=tuple(allowed)))
    for path, prompt in (("/v1/completions", {"prompt": "Once upon"}), ("/v1/chat/completions", {"messages": CHAT})):
        for sampling in ({"temperature": 0}, {"temperature": 2.0, "seed": 3, "n": 2}):
            r = _vllm_post(server, path, **prompt, **sampling, allowed_token_ids=allowed, return_token_ids=True)
            for ch in r["choices"]:
                assert ch["token_ids"] and set(ch["token_ids"]) <= set(allowed), (path, sampling)
            if path == "/v1/completions" and not sampling["temperature"]:
                assert r["choices"][0]["token_ids"] == direct.generated_ids


def _bad_word_in(server, ids: list[int]) -> tuple[str, tuple[int, ...]] | None:
    """A word the tokens `ids` spell as bad_words tokenizes it (with or without its space), several tokens long
    where `several`, and that word's token sequence."""
    from moepack.runtime.sampling import bad_word_ids

    for n in (2, 1):
        for k in range(len(ids) - n + 1):
            word = server.tok.decode(ids[k:k + n])
            if word.strip() and "\ufffd" not in word and tuple(ids[k:k + n]) in bad_word_ids(
                    [word], server.tok.encode_special):
                return word, tuple(ids[k:k + n])
    return None


def _holds(ids: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(ids[k:k + len(word)]) == word for k in range(len(ids)))


def test_bad_words_keep_what_greedy_would_say_out_of_the_answer_per_sequence_in_a_batch(batched):
    """vLLM's bad_words: a word (one token, and several) greedy decoding says is never said with it, on either
    endpoint; two requests decoding side by side with different bad_words each keep their own out (and answer as
    they do alone)."""
    server = batched
    body = {"prompt": "Once upon", "temperature": 0, "max_tokens": 12, "return_token_ids": True}
    greedy = _vllm_post(server, "/v1/completions", **body)["choices"][0]["token_ids"]
    words = {}
    for n in (2, 1):
        found = next((k for k in range(len(greedy)) if (w := _bad_word_in(server, greedy[k:k + n]))
                      and len(w[1]) == n), None)
        assert found is not None, n
        words[n] = _bad_word_in(server, greedy[found:found + n])
    for n, (word, ids) in words.items():
        said = _vllm_post(server, "/v1/completions", **body, bad_words=[word])["choices"][0]["token_ids"]
        assert not _holds(said, ids) and said != greedy, word
    chat = {"messages": CHAT, "temperature": 0, "max_tokens": 12, "return_token_ids": True}
    greedy_chat = _vllm_post(server, "/v1/chat/completions", **chat)["choices"][0]["token_ids"]
    word = _bad_word_in(server, greedy_chat)
    assert word is not None
    said = _vllm_post(server, "/v1/chat/completions", **chat, bad_words=[word[0]])["choices"][0]["token_ids"]
    assert not _holds(said, word[1]) and said != greedy_chat
    from concurrent.futures import ThreadPoolExecutor
    asks = [{**body, "bad_words": [words[1][0]]}, {**body, "bad_words": [words[2][0]]}]
    alone = [_vllm_post(server, "/v1/completions", **a)["choices"][0]["token_ids"] for a in asks]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda a: _vllm_post(server, "/v1/completions", **a)["choices"][0]["token_ids"],
                                 asks))
    assert together == alone and not _holds(together[0], words[1][1]) and not _holds(together[1], words[2][1])


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"return_token_ids": "yes"}, "return_token_ids"),
    ("/v1/chat/completions", {"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [512]}, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [1.5]}, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [True]}, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": "5"}, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [5] * ((1 << 18) + 1)}, "allowed_token_ids"),
    ("/v1/chat/completions", {"allowed_token_ids": [5], "response_format": {"type": "json_object"}},
     "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [5], "guided_choice": ["yes", "no"]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"allowed_token_ids": [5], "tools": [WEATHER], "tool_choice": "required"},
     "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [111, 79], "bad_words": ["l", "L"]}, "bad_words"),
    ("/v1/completions", {"allowed_token_ids": [111], "bad_words": ["ll"]}, "bad_words"),  # (none left at step 2)
    ("/v1/completions", {"bad_words": "l"}, "bad_words"),
    ("/v1/completions", {"bad_words": [""]}, "bad_words"),
    ("/v1/completions", {"bad_words": ["  "]}, "bad_words"),
    ("/v1/completions", {"bad_words": [5]}, "bad_words"),
    ("/v1/completions", {"bad_words": ["x" * 257]}, "bad_words"),
    ("/v1/chat/completions", {"bad_words": ["x"] * 257}, "bad_words"),
])
def test_bad_vllm_token_fields_are_400s_naming_them(server, path, extra, param):
    """Each of vLLM's token-id fields checked (type, range, ids within the vocabulary, absurd sizes) and refused
    beside what it cannot work with, a 400 naming it."""
    prompt = {"prompt": "Once upon"} if path == "/v1/completions" else {"messages": CHAT}
    r = httpx.post(f"{server.url}{path}", json={**prompt, "max_tokens": 2, **extra}, timeout=TIMEOUT)
    error = _error_of(r, 400)
    assert error["param"] == param, r.text
    if "allowed_token_ids" in extra and len(extra) > 1:  # refused by name before any work, not where the masks meet
        said = {"allowed_token_ids": "already decides", "bad_words": "ban every one"}[param]
        assert (said if extra["allowed_token_ids"] != [111] else "no token is left") in error["message"], r.text
