"""The model-free parts of a decode loop: the sampler, the stop matcher and the incremental detokenizer."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from moepack.format_spec.errors import MoepackError
from moepack.packer.synth import tokenizer_json
from moepack.runtime.sampling import (IncrementalDetokenizer, Sampler, StopMatcher, bad_word_ids, finite_rows,
                                      greedy_choices, partial_match_length)

BYTE0 = 3  # synth's tokenizer: ids 3..258 are the bytes 0..255


def random_logits(n=50, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


# --- Sampler ---------------------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    sampler = Sampler()
    for seed in range(20):
        logits = random_logits(seed=seed)
        assert sampler.next_token(logits) == int(torch.argmax(logits))
    tied = torch.tensor([0.0, 5.0, 1.0, 5.0])
    assert sampler.next_token(tied) == 1  # the lowest id among ties, as torch.argmax


def draws(sampler, logits, n):
    return [sampler.next_token(logits) for _ in range(n)]


def test_seeded_sampler_repeats_and_other_seed_differs():
    logits = random_logits() / 3  # flat enough that many tokens are likely
    first = draws(Sampler(temperature=1.0, seed=7), logits, 200)
    assert first == draws(Sampler(temperature=1.0, seed=7), logits, 200)
    assert first != draws(Sampler(temperature=1.0, seed=8), logits, 200)
    assert len(set(first)) > 5


def test_seed_none_is_drawn_once_and_repeatable():
    logits = random_logits() / 3
    sampler = Sampler(temperature=0.8, top_p=0.9)
    assert isinstance(sampler.seed, int)
    assert draws(sampler, logits, 100) == draws(Sampler(temperature=0.8, top_p=0.9, seed=sampler.seed), logits, 100)


def test_same_draws_from_float32_float64_and_noncontiguous_logits():
    logits = random_logits()
    strided = torch.stack([logits, logits], dim=1)[:, 0]  # a non-contiguous view of the same numbers
    expected = draws(Sampler(temperature=1.3, top_k=20, top_p=0.95, seed=3), logits, 100)
    assert draws(Sampler(temperature=1.3, top_k=20, top_p=0.95, seed=3), logits.double(), 100) == expected
    assert draws(Sampler(temperature=1.3, top_k=20, top_p=0.95, seed=3), strided, 100) == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_same_draws_on_cuda():
    logits = random_logits(n=5000)
    expected = draws(Sampler(temperature=1.0, top_p=0.9, seed=11), logits, 100)
    assert draws(Sampler(temperature=1.0, top_p=0.9, seed=11), logits.cuda(), 100) == expected


def test_top_k_1_and_tiny_top_p_are_greedy():
    for seed in range(10):
        logits = random_logits(seed=seed)
        best = int(torch.argmax(logits))
        assert set(draws(Sampler(temperature=2.0, top_k=1, seed=seed), logits, 50)) == {best}
        assert set(draws(Sampler(temperature=2.0, top_p=1e-9, seed=seed), logits, 50)) == {best}
    tied = torch.tensor([0.0, 5.0, 5.0, 1.0])
    assert set(draws(Sampler(temperature=1.0, top_k=1, seed=0), tied, 20)) == {1}


def test_tiny_temperature_is_greedy_not_nan():
    logits = random_logits()
    assert set(draws(Sampler(temperature=1e-300, seed=1), logits, 20)) == {int(torch.argmax(logits))}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical values at p = 1e-4 (the draws are seeded, so this is a fixed check, not a flaky one)
CHI2_CRITICAL = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.75, 7: 29.88}  # p = 0.0001


def test_temperature_1_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 5_000
    counts = torch.bincount(torch.tensor(draws(Sampler(temperature=1.0, seed=42), logits, n)), minlength=8)
    probs = torch.softmax(logits.double(), 0)
    assert chi_square(counts.double(), probs) < CHI2_CRITICAL[7]
    assert float((counts / n - probs).abs().max()) < 0.01


def test_temperature_top_k_top_p_distribution():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    n = 5_000
    # temperature 2, then top-k 4 keeps ids 0-3, then top-p 0.75 keeps the fewest of them reaching 0.75
    kept = torch.softmax(logits[:4].double() / 2, 0)
    m = int((torch.cumsum(kept, 0) < 0.75).sum()) + 1
    assert m == 3  # (the test's own arithmetic: the nucleus is ids 0-2)
    nucleus = kept[:m] / kept[:m].sum()
    got = draws(Sampler(temperature=2.0, top_k=4, top_p=0.75, seed=5), logits, n)
    assert set(got) == set(range(m))
    counts = torch.bincount(torch.tensor(got), minlength=m).double()
    assert chi_square(counts, nucleus) < CHI2_CRITICAL[m - 1]


def test_top_p_reaching_exactly_keeps_the_smallest_set():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    assert set(draws(Sampler(temperature=1.0, top_p=0.5, seed=0), logits, 200)) == {0}
    assert set(draws(Sampler(temperature=1.0, top_p=0.75, seed=0), logits, 200)) == {0, 1}


def test_top_k_ties_at_the_boundary_keep_the_lowest_ids():
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, 0.0])
    assert set(draws(Sampler(temperature=1.0, top_k=3, seed=0), logits, 300)) == {1, 2, 3}


def test_top_k_larger_than_vocab_is_all():
    logits = torch.zeros(3)
    assert set(draws(Sampler(temperature=1.0, top_k=100, seed=0), logits, 200)) == {0, 1, 2}


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"temperature": -0.1}, "--temperature"),
        ({"temperature": float("nan")}, "--temperature"),
        ({"temperature": float("inf")}, "--temperature"),
        ({"temperature": "hot"}, "--temperature"),
        ({"top_p": 0.0}, "--top-p"),
        ({"top_p": 1.5}, "--top-p"),
        ({"top_p": float("nan")}, "--top-p"),
        ({"top_k": -1}, "--top-k"),
        ({"top_k": 2.5}, "--top-k"),
        ({"top_k": True}, "--top-k"),
        ({"seed": -1}, "--seed"),
        ({"seed": 2**64}, "--seed"),
        ({"held_for": -1}, "held_for"),
        ({"held_for": 2, "held_back": (-3,)}, "held_for"),
        ({"repetition_penalty": 0}, "--repetition-penalty"),
        ({"repetition_penalty": 101}, "--repetition-penalty"),
        ({"repetition_penalty": float("nan")}, "--repetition-penalty"),
        ({"min_p": -0.1}, "--min-p"),
        ({"min_p": 1.5}, "--min-p"),
        ({"min_p": float("nan")}, "--min-p"),
        ({"allowed": []}, "allowed_token_ids"),
        ({"allowed": [1, -2]}, "allowed_token_ids"),
        ({"allowed": [1.5]}, "allowed_token_ids"),
        ({"bad_words": [[]]}, "bad_words"),
        ({"bad_words": [[1, -1]]}, "bad_words"),
    ],
)
def test_invalid_options_are_one_line_errors_naming_the_option(kwargs, option):
    with pytest.raises(MoepackError) as e:
        Sampler(**kwargs)
    message = str(e.value)
    assert option in message and "\n" not in message


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_logits_are_an_error(bad, temperature):
    logits = random_logits()
    logits[7] = bad
    with pytest.raises(MoepackError, match="non-finite logits") as e:
        Sampler(temperature=temperature, seed=0).next_token(logits)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_plain_greedy_takes_the_argmax_where_the_logits_are_as_the_float64_path_does(dtype):
    """A plain greedy row's token (greedy_choices: the argmax where the logits are, no float64 copy) is the one
    the general path chooses from the same logits in float64, ties going to the first largest; a row with a nan or
    an inf is refused by next_token as before; the sampler's counts follow the token either way."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(64, 3000, generator=gen).to(dtype)
    rows[::3, 2999] = rows[::3].max(dim=-1).values  # ties with a later id: the first keeps it
    rows[1::3, 0] = rows[1::3].max(dim=-1).values + 1  # the largest first
    bad = rows.clone()
    bad[5, 17], bad[9, 2], bad[11, 0] = float("nan"), float("inf"), float("-inf")
    found = greedy_choices(bad)
    assert [i for i, t in enumerate(found) if t is None] == [5, 9, 11]
    for i, row in enumerate(rows):
        general = Sampler(seed=0, logprobs=0)  # (logprobs: not plain, the float64 path)
        assert not general.plain_greedy
        expected = general.next_token(row)
        plain = Sampler(seed=0)
        assert plain.plain_greedy and plain.next_token(row) == expected
        assert found[i] in (None, expected) and (found[i] is None) == (i in (5, 9, 11))
        batched = Sampler(seed=0)
        assert batched.next_token(row, greedy_choices(rows)[i]) == expected and batched.counts == {expected: 1}
    for i in (5, 9, 11):
        with pytest.raises(MoepackError, match="non-finite logits"):
            Sampler(seed=0).next_token(bad[i], found[i])


def test_finite_rows_is_isfinite_all_over_any_values():
    """finite_rows is isfinite().all() of each row, the largest and most negative values of a dtype in every
    position included, a nan, an inf or a -inf anywhere."""
    top = torch.finfo(torch.float32).max
    rows = torch.full((6, 4096), top)
    rows[1] = -top
    rows[2, ::2] = -top
    rows[3, 100], rows[4, 0], rows[5, 4095] = float("nan"), float("-inf"), float("inf")
    assert finite_rows(rows).tolist() == torch.isfinite(rows).all(dim=-1).tolist() == [True] * 3 + [False] * 3
    wide = torch.full((2, 100), 1e300, dtype=torch.float64)
    wide[1, 3] = float("nan")
    assert finite_rows(wide).tolist() == [True, False]
    assert finite_rows(rows.double()).tolist() == [True] * 3 + [False] * 3
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        noisy = torch.randn(40, 997, generator=gen).to(dtype)
        for row in range(0, 40, 2):
            at = int(torch.randint(997, (), generator=gen))
            noisy[row, at] = [float("nan"), float("inf"), -float("inf")][row % 3]
        assert finite_rows(noisy).tolist() == torch.isfinite(noisy).all(dim=-1).tolist()


@pytest.mark.parametrize("kwargs", [dict(temperature=0.5), dict(logit_bias={1: 2.0}), dict(presence_penalty=0.5),
                                    dict(frequency_penalty=0.5), dict(repetition_penalty=1.2), dict(logprobs=2),
                                    dict(held_back=(3,), held_for=2), dict(allowed=[1, 2]), dict(bad_words=[[4]])])
def test_a_sampler_that_changes_or_reads_the_logits_is_not_plain_greedy(kwargs):
    sampler = Sampler(seed=0, **kwargs)
    assert not sampler.plain_greedy
    if "held_for" in kwargs:  # (held back only until held_for tokens were chosen)
        for _ in range(2):
            sampler.next_token(random_logits())
        assert sampler.plain_greedy


# --- StopMatcher -----------------------------------------------------------------------------------------------


def run_matcher(matcher, pieces, eos_at=None):
    """Feed one token per piece (the eos token at index eos_at); return what was given out, piece by piece."""
    text, out = "", []
    for i, piece in enumerate(pieces):
        token = 0 if i == eos_at else 1
        text += piece
        out.append(matcher.feed(token, text))
        if matcher.finish_reason:
            break
    else:
        out.append(matcher.flush(text))
    return out


def test_stop_string_over_several_tokens_is_held_back_and_cut():
    matcher = StopMatcher(["</answer>"], eos_ids={0})
    out = run_matcher(matcher, ["The sum is 4", ".</", "ans", "wer", ">", " and more"])
    assert out == ["The sum is 4", ".", "", "", ""]  # "</", "</ans", "</answer" held back; then it stops
    assert matcher.finish_reason == "stop" and matcher.stop_string == "</answer>"
    assert matcher.text == "The sum is 4."


def test_held_back_tail_is_released_when_it_is_not_a_stop_string():
    matcher = StopMatcher(["STOP"], eos_ids=set())
    out = run_matcher(matcher, ["a S", "T", "x", "yz"])
    assert out == ["a ", "", "STx", "yz", ""]
    assert matcher.finish_reason is None and matcher.text == "a STxyz"


def test_flush_gives_out_the_held_tail_when_tokens_run_out():
    matcher = StopMatcher(["STOP"], eos_ids=set())
    assert run_matcher(matcher, ["go ST"]) == ["go ", "ST"]
    assert matcher.finish_reason is None and matcher.text == "go ST"


def test_earliest_of_several_stop_strings_wins():
    matcher = StopMatcher(["world", "lo w"], eos_ids=set())
    run_matcher(matcher, ["hel", "lo world"])
    assert matcher.text == "hel" and matcher.stop_string == "lo w"


def test_stop_string_in_one_token_with_text_after_it():
    matcher = StopMatcher(["\n\n"], eos_ids=set())
    run_matcher(matcher, ["one", " line\n\nnext"])
    assert matcher.text == "one line" and matcher.finish_reason == "stop"


def test_eos_stops_without_its_text_and_releases_the_held_tail():
    matcher = StopMatcher(["STOP"], eos_ids={0, 9})
    out = run_matcher(matcher, ["hi S", "</s>", "never"], eos_at=1)
    assert out == ["hi ", "S"]
    assert matcher.finish_reason == "stop" and matcher.stop_string is None and matcher.text == "hi S"
    assert matcher.feed(1, "hi S</s>never") == ""  # stays stopped


def test_eos_as_first_token():
    matcher = StopMatcher([], eos_ids={2})
    assert matcher.feed(2, "") == "" and matcher.finish_reason == "stop" and matcher.text == ""


def test_a_stop_string_before_a_minimum_length_does_not_stop_one_ending_after_does():
    """vLLM's min_tokens: no stop string is acted on before the minimum length (one that ends in a token fed
    unarmed is passed over and its text given out), but one that begins before it and ends after it stops there;
    a sequence with a minimum length keeps going past a stop string its first tokens spell (SequenceOutput)."""
    from moepack.runtime.generate import GenerateOptions, SequenceOutput

    matcher = StopMatcher(["ab", "abc!"], eos_ids=set())
    shown = [matcher.feed(1, "xab", armed=False), matcher.feed(2, "xabz", armed=False),
             matcher.feed(3, "xabzab", armed=True)]
    assert shown == ["x", "abz", ""] and matcher.finish_reason == "stop" and matcher.text == "xabz"
    later = StopMatcher(["abc"], eos_ids=set())
    assert later.feed(1, "xa", armed=False) + later.feed(2, "xab", armed=False) == "x"
    assert later.feed(3, "xabc", armed=True) == "" and later.text == "x" and later.stop_string == "abc"

    text = {5: "a", 6: "b", 7: "c"}

    def answer(stop: str, least: int, tokens: tuple[int, ...]) -> tuple[list[int], str]:
        """The tokens a SequenceOutput takes of `tokens` (each the likeliest in turn) and its answer's text."""
        options = GenerateOptions(max_new_tokens=6, stop=(stop,), min_new_tokens=least, stop_at_eos=False)
        out = SequenceOutput(options, set(), detokenize=lambda ids: "".join(text[i] for i in ids))
        for token in tokens:
            logits = torch.full((8,), -10.0)
            logits[token] = 10.0
            if out.take(logits):
                break
        return out.generated, out.result({}).text
    assert answer("a", 0, (5, 6, 5, 7)) == ([5], "")
    assert answer("a", 2, (5, 6, 5, 7)) == ([5, 6, 5], "ab")
    # as vLLM (and the end of sentence): a stop string ending in the min_new_tokens-th token's text is passed over
    assert answer("b", 2, (5, 6, 6, 7)) == ([5, 6, 6], "ab")


def test_empty_stop_string_is_an_error():
    with pytest.raises(MoepackError, match="--stop"):
        StopMatcher(["ok", ""], eos_ids=set())


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab<>/", max_size=4), max_size=12),
    stop=st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=4), max_size=3),
)
def test_stop_matcher_agrees_with_a_plain_search(pieces, stop):
    """The plain search runs after each token, as the text streams: the first token whose text completes a stop
    string ends the answer before the earliest one found then (a longer one that starts earlier but would end
    later never completes: with pieces "ab", "a" and stops "b", "aba" the answer is "a")."""
    matcher = StopMatcher(stop, eos_ids=set())
    out = run_matcher(matcher, pieces)
    text, stopped = "", False
    for piece in pieces:
        text += piece
        cuts = [text.find(s) for s in stop if s in text]
        if cuts:
            text, stopped = text[: min(cuts)], True
            break
    assert "".join(out) == matcher.text == text
    assert matcher.finish_reason == ("stop" if stopped else None)


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab<>/", max_size=4), max_size=12),
    stop=st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=5), max_size=6),
)
def test_the_stop_automaton_holds_back_exactly_the_tail_that_may_begin_a_stop_string(pieces, stop):
    """After each piece (until a stop) the text given out is all of it but its longest tail that begins a stop
    string: what a search over every stop string holds back."""
    matcher, text = StopMatcher(stop, eos_ids=set()), ""
    for piece in pieces:
        text += piece
        matcher.feed(1, text)
        if matcher.finish_reason:
            assert matcher.stop_string in stop and text.startswith(matcher.text + matcher.stop_string)
            break
        assert matcher.text == text[:len(text) - partial_match_length(text, stop)]


# --- IncrementalDetokenizer ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_tokenizer():
    return Tokenizer.from_str(json.dumps(tokenizer_json()))


def detokenize(decode, ids):
    detok = IncrementalDetokenizer(decode)
    pieces = [detok.add(i) for i in ids]
    return pieces, detok.flush()


def test_multibyte_characters_split_across_tokens_never_show_replacement(byte_tokenizer):
    def decode(ids):
        return byte_tokenizer.decode(ids, skip_special_tokens=False)

    text = "naïve €5 — 日本語 🎉🧪 ok"
    ids = [BYTE0 + b for b in text.encode("utf-8")]  # one token per byte: every multi-byte character is split
    pieces, rest = detokenize(decode, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text and rest == ""
    assert pieces[ids.index(BYTE0 + 0xF0) :][:4] == ["", "", "", "🎉"]  # held back, then the whole character


def test_flush_gives_out_an_unfinished_character(byte_tokenizer):
    def decode(ids):
        return byte_tokenizer.decode(ids, skip_special_tokens=False)

    ids = [BYTE0 + b for b in "ok€".encode("utf-8")[:-1]]  # the last byte of € never comes
    pieces, rest = detokenize(decode, ids)
    assert "".join(pieces) == "ok" and rest == "\ufffd"


def test_tokens_that_make_no_text_keep_the_window_short(byte_tokenizer):
    """A long run of tokens that decode to nothing (special tokens skip_special_tokens leaves out) or to bytes that
    never complete a character: each token decodes a window of a few tokens, not all of them (that had been
    quadratic: a client forcing a special token for 100,000 tokens held the worker for minutes), and the pieces
    still join into the whole decode."""
    skipped = BYTE0 + 0x100  # (any id the decode below leaves out)
    lone = BYTE0 + 0x80  # a continuation byte: never a character's start
    for run, expect in (([skipped] * 5000, ""), ([lone] * 5000, None)):
        decoded = []

        def decode(ids):
            decoded.append(len(ids))
            return byte_tokenizer.decode([i for i in ids if i != skipped], skip_special_tokens=False)

        ids = [BYTE0 + ord("a"), *run, BYTE0 + ord("b")]
        pieces, rest = detokenize(decode, ids)
        whole = decode(ids)
        assert "".join(pieces) + rest == whole == (f"a{expect}b" if expect is not None else whole)
        assert sum(decoded[:-1]) < 40 * len(ids)  # (each window at most MAX_HELD_TOKENS + the last piece's)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
def test_pieces_concatenate_to_the_full_decode(byte_tokenizer, text):
    def decode(ids):
        return byte_tokenizer.decode(ids, skip_special_tokens=False)

    ids = byte_tokenizer.encode(text, add_special_tokens=False).ids
    pieces, rest = detokenize(decode, ids)
    assert "".join(pieces) + rest == decode(ids) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces)


def test_a_long_run_of_tokens_each_ending_inside_a_character_loses_none():
    """Tokens that each end inside a character (the end of one merged with the start of the next, as a byte-level
    BPE may): held past MAX_HELD_TOKENS while they make characters, every character comes out whole."""
    for text, cuts in (("000\x80\x80\x80\x80\u0800\u0800", [1, 2, 3, 4, 6, 8, 10, 12, 13, 15, 16]),
                       ("\u0800" * 40, range(1, 120, 3)), ("\U0001f389" * 30, range(2, 120, 4))):
        raw = text.encode("utf-8")  # (each cut inside a character, but for the zeros')
        chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)]) if a < b]
        assert sum(1 for c in chunks if c[-1] >= 0x80) >= 8  # (a run as long as MAX_HELD_TOKENS, or longer)

        def decode(ids):
            return b"".join(chunks[i] for i in ids).decode("utf-8", errors="replace")

        pieces, rest = detokenize(decode, list(range(len(chunks))))
        assert "".join(pieces) + rest == text and rest == "" and all("\ufffd" not in p for p in pieces)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), text=st.text(max_size=30))
def test_any_split_of_the_bytes_into_tokens(data, text):
    """Tokens that hold any run of bytes (as merged byte-level BPE tokens do), not one byte each."""
    raw = text.encode("utf-8")
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(raw) - 1)), max_size=len(raw))))
    chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)]) if a < b]

    def decode(ids):
        return b"".join(chunks[i] for i in ids).decode("utf-8", errors="replace")

    pieces, rest = detokenize(decode, list(range(len(chunks))))
    assert "".join(pieces) + rest == text
    if "\ufffd" not in text:
        assert rest == "" and all("\ufffd" not in p for p in pieces)


def test_penalties_follow_openais_definitions():
    """mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c[j]: how often j was generated."""
    logits = torch.tensor([3.0, 2.5, 0.0])
    s = Sampler(frequency_penalty=0.4)
    assert [s.next_token(logits) for _ in range(3)] == [0, 0, 1]  # 3 - 0.4 > 2.5 > 3 - 0.8
    s = Sampler(presence_penalty=0.6)
    assert [s.next_token(logits) for _ in range(3)] == [0, 1, 0]  # 2.4 < 2.5, then 1.9 < 2.4
    assert Sampler(frequency_penalty=0.1, presence_penalty=0.1).adjust(logits.double()).tolist() == [3.0, 2.5, 0.0]
    with pytest.raises(MoepackError, match="presence"):
        Sampler(presence_penalty=2.5)


def test_logit_bias_and_logprobs():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    s = Sampler(logit_bias={3: 10.0}, logprobs=2)
    assert s.next_token(logits) == 3
    expected = torch.log_softmax(torch.tensor([1.0, 2.0, 0.5, 9.0], dtype=torch.float64), 0)
    assert s.last_logprobs.logprob == pytest.approx(float(expected[3]))
    assert [t for t, _ in s.last_logprobs.top] == [3, 1]
    assert Sampler(logprobs=0).next_token(logits) == 1
    with pytest.raises(MoepackError, match="logit-bias"):
        Sampler(logit_bias={1: 200})


def test_held_back_ids_are_masked_until_enough_tokens_were_chosen():
    """A minimum length (the server's min_tokens): the held-back ids (the end of sentence) are never chosen before
    `held_for` tokens, then are again; greedy and sampled alike."""
    logits = torch.tensor([0.0, 5.0, 1.0, 4.5])
    for temperature in (0.0, 1.0):
        sampler = Sampler(temperature=temperature, seed=1, held_back=(1, 3), held_for=3)
        first = [sampler.next_token(logits) for _ in range(3)]
        assert not {1, 3} & set(first)
        assert temperature or sampler.next_token(logits) == 1


def test_a_constraint_that_allows_only_a_held_back_id_has_the_last_word():
    """A minimum length held against a constraint that allows nothing but the end of sentence (a JSON answer
    complete): the end of sentence is chosen, with a finite logprob, not a token outside the constraint (every
    logit -inf had given a NaN log-probability and an arbitrary id)."""
    class OnlyTheEnd:
        def allowed(self, n):
            return torch.tensor([3])

        def accept(self, token):
            assert token == 3

    for temperature, min_p in ((0.0, 0.0), (0.7, 0.0), (0.7, 0.1)):
        sampler = Sampler(temperature, seed=1, min_p=min_p, held_back=(3,), held_for=5, constraint=OnlyTheEnd(),
                          logprobs=2)
        assert sampler.next_token(random_logits(10)) == 3
        assert sampler.last_logprobs.logprob == 0.0 and sampler.last_logprobs.top == ((3, 0.0),)


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_is_transformers_over_the_prompt_and_the_answer(penalty):
    """Every token the sequence holds (the ids it saw, its prompt, and those generated) adjusted as transformers'
    RepetitionPenaltyLogitsProcessor adjusts them over its input_ids: a positive logit divided, a negative one
    multiplied; the others untouched."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    sampler = Sampler(repetition_penalty=penalty, presence_penalty=0.0)
    prompt = [3, 7, 7, 11, 40]
    sampler.saw(prompt)
    generated = []
    for step in range(6):
        logits = random_logits(seed=step).double()
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + generated]), logits[None].clone())
        assert torch.equal(sampler.adjust(logits), theirs[0]), step
        generated.append(sampler.next_token(logits.float()))
    assert Sampler(repetition_penalty=1.0).adjust(random_logits().double()).equal(random_logits().double())


def test_a_steps_repetition_penalty_does_not_walk_the_prompts_ids_again():
    """A step's repetition penalty does not walk the prompt's ids again (on a 128K-token prompt a Python pass over
    every id, each step, had taken longer than the decode step): after the first step the ids are not read, and
    the penalized logits are those of a step that walks them."""
    class Unread:  # the ids held, which may be asked whether there are any, and nothing else
        def __bool__(self):
            return True

        def __iter__(self):
            raise AssertionError("the prompt's ids walked again")

        def __getattr__(self, name):
            raise AssertionError(f"the prompt's ids read again ({name})")

    vocab = 60_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    prompt = range(0, vocab, 2)
    sampler = Sampler(repetition_penalty=1.3)
    sampler.saw(prompt)
    sampler.adjust(logits)  # (the first step builds what the next ones take)
    sampler.seen = Unread()
    chosen = [sampler.next_token(logits.float()) for _ in range(3)]
    held = torch.zeros(vocab, dtype=torch.bool)
    held[[*prompt, *chosen]] = True
    want = torch.where(held, torch.where(logits > 0, logits / 1.3, logits * 1.3), logits)
    assert torch.equal(sampler.adjust(logits), want)


def test_min_p_keeps_the_tokens_transformers_min_p_keeps_after_the_temperature():
    """min_p after the temperature: the tokens at least min_p x the likeliest's probability are drawn, with their
    probabilities renormalized (transformers' MinPLogitsWarper keeps the same set); min_p 1 is greedy."""
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = torch.tensor([2.0, 1.6, 1.2, 0.4, -0.5, -1.0, 1.9, -3.0])
    temperature, min_p, n = 1.5, 0.4, 5_000
    tempered = (logits.double() / temperature)[None]
    kept_mask = torch.isfinite(MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), tempered.clone()))[0]
    kept = torch.nonzero(kept_mask).flatten().tolist()
    assert 1 < len(kept) < len(logits)  # (the test's own arithmetic: min_p leaves some out)
    got = draws(Sampler(temperature=temperature, min_p=min_p, seed=3), logits, n)
    assert set(got) == set(kept)
    probs = torch.softmax(tempered[0][kept], 0)
    counts = torch.bincount(torch.tensor([kept.index(t) for t in got]), minlength=len(kept)).double()
    assert chi_square(counts, probs) < CHI2_CRITICAL[len(kept) - 1]
    assert set(draws(Sampler(temperature=3.0, min_p=1.0, seed=0), logits, 200)) == {0}
    # with top-k: both keep a prefix of the likeliest, so the fewer of the two stand
    assert set(draws(Sampler(temperature=temperature, min_p=min_p, top_k=2, seed=0), logits, 300)) == {0, 6}


@pytest.mark.parametrize("held", ["\ufffd", "\u20ac".encode()[:2]], ids=["replacement-char", "unfinished-char"])
def test_the_text_held_back_for_a_character_is_not_lost_at_the_end_of_sentence(byte_tokenizer, held):
    """A generation whose last text before its eos token is held back by the detokenizer (a U+FFFD the model wrote,
    or the bytes of a character that never completes): the answer, and what was streamed, end with it as the
    decode of the tokens before the eos has it; the eos token's own text never shows."""
    from moepack.runtime.generate import GenerateOptions, SequenceOutput

    def decode(ids):
        return byte_tokenizer.decode(ids, skip_special_tokens=False)

    eos = 1
    tail = held.encode() if isinstance(held, str) else held
    ids = [BYTE0 + b for b in b"ok" + tail]
    for stop in ((), ("\ufffd",), ("k\ufffd",)):
        shown = []
        out = SequenceOutput(GenerateOptions(max_new_tokens=10, stop=stop), {eos}, decode, on_text=shown.append)
        for token in [*ids, eos]:
            logits = torch.full((BYTE0 + 256,), -50.0)
            logits[token] = 0.0
            if out.take(logits):
                break
        result = out.result({})
        whole = decode(ids)
        expected = whole[:whole.index(stop[0])] if stop else whole
        assert (result.text, result.finish_reason) == (expected, "stop"), stop
        assert "".join(shown) == result.text and result.generated_ids == [*ids, eos][:len(result.generated_ids)]


def test_next_token_scores_keep_float32_whatever_the_default_dtype():
    """NextTokenScores' running scores are float32 whatever torch's default dtype: a bfloat16 default had rounded
    each slice's logsumexp and top k (logprobs 1e-2 off, a greedy token's logprob no longer its top's)."""
    from moepack.runtime.sampling import NextTokenScores

    logits = torch.randn(5, 23, generator=torch.Generator().manual_seed(0)) * 4
    next_ids = torch.tensor([3, 0, 22, 7, 11])
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        scores = NextTokenScores(next_ids, 3)
        for first in range(0, 23, 7):  # vocabulary slices of 7 ids
            scores.add(slice(0, 5), logits[:, first:first + 7], first)
        entries = scores.entries()
    finally:
        torch.set_default_dtype(before)
    want = torch.log_softmax(logits.double(), dim=1)
    torch.testing.assert_close(torch.tensor([e.logprob for e in entries], dtype=torch.float64),
                               want.gather(1, next_ids[:, None])[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor([[v for _, v in e.top] for e in entries], dtype=torch.float64),
                               want.topk(3, dim=1).values, atol=1e-5, rtol=0)
    for e in entries:  # lm-eval's is_greedy: a top token's logprob is its own, to the bit
        assert all(v == e.logprob for i, v in e.top if i == e.token)


def test_a_steps_bias_and_penalties_do_not_walk_their_dicts_again():
    """logit_bias, the presence and frequency penalties and a minimum length cost a step the same however many
    entries the bias has and however long the answer is: after the first step neither the bias nor the counts are
    walked (a 150K-entry logit_bias rebuilt at every step had taken 0.1 s of the worker a token, and the counts
    grew with the answer: quadratic), and the logits are OpenAI's adjustment of them."""
    class Unwalked(dict):  # written and read by id, never walked
        def _walked(self, *args):
            raise AssertionError("walked again")
        __iter__ = keys = values = items = _walked

    vocab = 60_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    bias = {t: float(t % 7 - 3) for t in range(0, vocab + 9, 3)}  # (ids past the vocabulary left out)
    sampler = Sampler(1.0, seed=2, logit_bias=bias, presence_penalty=0.5, frequency_penalty=-0.3, held_back=(4,),
                      held_for=40)
    for _ in range(2):  # (the first steps build what the next ones take: the counts' at the first with any)
        sampler.next_token(logits.float())
    sampler.logit_bias, sampler.counts = Unwalked(bias), Unwalked(sampler.counts)
    chosen = [sampler.next_token(logits.float()) for _ in range(50)]
    assert 4 not in chosen[:38]
    want = logits.clone()
    kept = [t for t in bias if t < vocab]
    want[kept] += torch.tensor([bias[t] for t in kept], dtype=torch.float64)
    counted = dict(dict.items(sampler.counts))
    want[list(counted)] -= torch.tensor(list(counted.values()), dtype=torch.float64) * -0.3 + 0.5
    assert sum(counted.values()) == 52 and torch.equal(sampler.adjust(logits), want)


def test_a_nucleus_among_the_likeliest_is_drawn_without_sorting_the_vocabulary(monkeypatch):
    """No top-k: the top-p nucleus is looked for among the likeliest NUCLEUS_CANDIDATES tokens and drawn from as the
    whole sorted vocabulary would give it (a float64 sort of a 129K vocabulary had taken ~10 ms a token, on any
    device); top-p 1 sorts nothing; a nucleus past those tokens (a flat distribution) sorts the whole, as before."""
    from moepack.runtime import sampling

    sorted_sizes = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda t, *a, **k: sorted_sizes.append(t.numel()) or real_sort(t, *a, **k))
    vocab, likely = 20_000, [15_000, 17, 9_999, 4, 12_345, 700]
    logits = torch.full((vocab,), -30.0)
    logits[likely] = torch.tensor([4.0, 3.5, 3.0, 2.0, 1.0, 0.5])
    n = 6_000
    probs = torch.softmax(logits.double() / 0.9, 0)[likely]
    m = int((torch.cumsum(probs, 0) < 0.9).sum()) + 1  # the nucleus: the likeliest m of them
    got = draws(Sampler(temperature=0.9, top_p=0.9, seed=7), logits, n)
    assert set(got) <= set(likely[:m]) and max(sorted_sizes) <= 2 * sampling.NUCLEUS_CANDIDATES
    counts = torch.tensor([got.count(t) for t in likely[:m]], dtype=torch.float64)
    assert chi_square(counts, probs[:m] / probs[:m].sum()) < CHI2_CRITICAL[m - 1]
    sorted_sizes.clear()
    got = draws(Sampler(temperature=0.9, seed=7), logits, n)  # top-p 1: the whole distribution, in id order
    assert not sorted_sizes and set(got) <= set(likely)
    counts = torch.tensor([got.count(t) for t in likely], dtype=torch.float64)
    assert chi_square(counts, probs / probs.sum()) < CHI2_CRITICAL[5]  # (6 outcomes)
    flat = torch.randn(vocab, generator=torch.Generator().manual_seed(1))
    order = torch.sort(flat, descending=True, stable=True).indices
    nucleus = order[: int((torch.cumsum(torch.softmax(flat.double()[order], 0), 0) < 0.5).sum()) + 1]
    assert len(nucleus) > sampling.NUCLEUS_CANDIDATES  # (the test's own arithmetic: past the candidates)
    sorted_sizes.clear()
    got = draws(Sampler(temperature=1.0, top_p=0.5, seed=3), flat, 300)
    assert set(got) <= set(nucleus.tolist()) and vocab in sorted_sizes


def test_allowed_token_ids_are_the_only_ones_chosen_greedy_and_sampled():
    """vLLM's allowed_token_ids: greedy takes the likeliest of them, a draw (top-k, top-p, min-p alike) only ever
    one of them, and the logprobs' alternatives are among them; ids past the vocabulary are left out."""
    logits = random_logits(50)
    allowed = [3, 17, 41, 10_000]
    best = max(allowed[:3], key=lambda t: float(logits[t]))
    sampler = Sampler(allowed=allowed, logprobs=5)
    assert sampler.next_token(logits) == best and {t for t, _ in sampler.last_logprobs.top} <= set(allowed)
    for kw in ({}, {"top_k": 2}, {"top_p": 0.5}, {"min_p": 0.01}):
        sampler = Sampler(temperature=1.5, seed=3, allowed=allowed, **kw)
        assert set(draws(sampler, logits, 200)) <= set(allowed), kw
    assert len(set(draws(Sampler(temperature=5.0, seed=3, allowed=allowed), logits, 300))) == 3


def _banned_by(generated: list[int], words) -> set[int]:
    """The reference: the last token of every word whose other tokens end what was generated."""
    return {w[-1] for w in words if len(w) - 1 <= len(generated) and list(w[:-1]) == generated[len(generated) - len(w)
                                                                                             + 1:]}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), min_size=1, max_size=6), st.integers(0, 2**32))
def test_bad_words_mask_exactly_the_tokens_that_would_complete_one(words, seed):
    """vLLM's bad_words as token sequences: at every step the tokens masked out are the last tokens of the words
    whose other tokens end the generated ones (a one-token word always), no more; so no word is ever generated
    (unless nothing else is left: then an error, never a banned token)."""
    logits = torch.zeros(6, dtype=torch.float64)
    sampler = Sampler(temperature=1.0, seed=seed, bad_words=words)
    generated: list[int] = []
    for _ in range(30):
        want = _banned_by(generated, words)
        if len(want) == 6:
            with pytest.raises(MoepackError, match="bad_words: no token is left"):
                sampler.next_token(logits)
            return
        masked = {t for t, v in enumerate(sampler.adjust(logits).tolist()) if v == float("-inf")}
        assert masked == want, generated
        generated.append(sampler.next_token(logits))
    assert not any(tuple(w) == tuple(generated[i:i + len(w)]) for w in words for i in range(len(generated)))


def test_bad_words_change_the_greedy_answer_and_keep_what_they_hold_short():
    """Greedy with token 2 the likeliest and 3 next: the word (2, 2) makes the answer alternate, the word (2,)
    bans 2 always; what a step looks at is the longest word's prefix, however long the answer (never the answer)."""
    logits = torch.tensor([0.0, 0.0, 5.0, 4.0, 3.0])
    assert draws(Sampler(bad_words=[(2, 2)]), logits, 6) == [2, 3, 2, 3, 2, 3]
    assert draws(Sampler(bad_words=[(2,)]), logits, 3) == [3, 3, 3]
    assert draws(Sampler(bad_words=[(2, 3), (3, 2, 2)]), logits, 5) == [2, 2, 2, 2, 2]
    sampler = Sampler(temperature=1.0, seed=0, bad_words=[(1, 2, 3), (4,)])
    draws(sampler, logits, 500)
    assert len(sampler._recent) == 2
    with pytest.raises(MoepackError, match="bad_words: no token is left") as e:
        Sampler(allowed=[2, 3], bad_words=[(2,), (3,)]).next_token(logits)
    assert "\n" not in str(e.value)


def test_bad_word_ids_are_vllms_two_spellings_of_each_word():
    """Each word without its leading spaces, and after one space where that is another first token and as many
    tokens (a tokenizer whose words carry their space: "Hello" and " Hello" differ); a word that has no tokens is
    an error naming bad_words."""
    vocab = {"hello": [5], " hello": [6], "two words": [1, 2], " two words": [3, 4, 2], "same": [7], " same": [7],
             "": []}

    def encode(text):
        return vocab[text]
    assert bad_word_ids(["hello", "  two words", "same"], encode) == ((5,), (6,), (1, 2), (7,))
    with pytest.raises(MoepackError, match="bad_words"):
        bad_word_ids(["   "], encode)


# bytes that make characters and bytes that make none: ASCII, continuation bytes, lead bytes, never-valid ones
SOME_BYTES = [0x61, 0x80, 0x9F, 0xBF, 0xC3, 0xE2, 0xE4, 0xED, 0xF0, 0xF4, 0xFF]


def test_a_character_begun_after_bytes_that_make_none_comes_out_whole():
    """Bytes that make no character (a U+FFFD each: a model's stray byte tokens), then a character split across
    tokens: the run is given out at MAX_HELD_TOKENS, but the tokens that begin the character stay held (the 😀 had
    come out as U+FFFD, its rest as another)."""
    chunks = [b"\xe2", b"\x82", b"\xff", b"\xac", b"\xff", b"\xf0", b"\x9f", b"\x98", b"\x80", b"a"]

    def decode(ids):
        return b"".join(chunks[i] for i in ids).decode("utf-8", errors="replace")

    pieces, rest = detokenize(decode, list(range(len(chunks))))
    assert "".join(pieces) + rest == decode(range(len(chunks))) == "\ufffd" * 4 + "😀a"


@settings(max_examples=300, deadline=None)
@given(data=st.data(), raw=st.lists(st.sampled_from(SOME_BYTES), max_size=40).map(bytes))
def test_any_split_of_any_bytes_gives_the_whole_decode(data, raw):
    """Any bytes, valid UTF-8 or not, in tokens of any length, some making no text (special tokens left out)."""
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(raw) - 1)), max_size=len(raw))))
    chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)]) if a < b]
    for at in data.draw(st.lists(st.integers(0, len(chunks)), max_size=3)):
        chunks.insert(at, b"")

    def decode(ids):
        return b"".join(chunks[i] for i in ids).decode("utf-8", errors="replace")

    pieces, rest = detokenize(decode, list(range(len(chunks))))
    assert "".join(pieces) + rest == decode(range(len(chunks)))
