"""The parts of a decode loop that never touch the model: choosing the next token from the logits, deciding when
to stop, and turning token ids into printable text one token at a time.

A loop uses them like this (`text` is all the text generated so far, never the prompt's):

    detok, stops, text = IncrementalDetokenizer(tok.decode), StopMatcher(stop, eos_ids), ""
    for _ in range(max_tokens):
        token = sampler.next_token(logits)
        text += detok.add(token)
        print(stops.feed(token, text), end="")
        if stops.finish_reason:
            break
        logits = ...  # the model's next step
    else:
        print(stops.flush(text + detok.flush()), end="")
    finish_reason = stops.finish_reason or "length"  # stops.text is the whole answer
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from moepack.format_spec.errors import MoepackError
from moepack.format_spec.generation_config import MAX_REPETITION_PENALTY

NUCLEUS_CANDIDATES = 1024  # the likeliest tokens a top-p nucleus is first looked for among (see Sampler._choose)
REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of a character not yet complete
# tokens held back at most (a character's 4 bytes, a SentencePiece space, with room): past it what they make goes out
MAX_HELD_TOKENS = 8
# ... where they made characters and end inside one (tokens each ending inside a character, as a byte-level BPE can
# merge the end of one with the start of the next): given out early, the unfinished one would be cut in two
MAX_UNFINISHED_TOKENS = 128


NOT_FINITE = "the model produced non-finite logits (nan or inf): cannot choose the next token"


def _finite(largest: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Whether each row is all finite, from its largest value: a nan makes that nan (max propagates it), an inf
    +inf, a -inf the row's smallest -inf. Two reductions, where torch's isfinite writes a mask over the whole row
    (~1 ms a 129K row on a CPU)."""
    return torch.isfinite(largest) & torch.isfinite(logits.amin(dim=-1))


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Whether each row of `logits` ([rows, vocab]) is all finite."""
    return _finite(logits.amax(dim=-1), logits)


def greedy_choices(logits: torch.Tensor) -> list[int | None]:
    """Each row's greedy token (its first largest logit, as Sampler's argmax of the same values in float64), or None
    where the row is not all finite (Sampler.next_token then refuses it), found where the logits are with one copy
    to the host of a few numbers a row: a device's rows need not come to the host whole."""
    largest, first = logits.max(dim=-1)  # (the first of equal largest values, as argmax)
    tokens = torch.where(_finite(largest, logits), first, -1).tolist()
    return [None if t < 0 else t for t in tokens]


class Sampler:
    """Temperature, then min-p, then top-k, then top-p (nucleus), then one draw from a seeded generator (vLLM's
    order); temperature 0 is greedy. The same seed and logits give the same tokens on any device: the work is done on
    the CPU in float64. `min_p`: the tokens less likely than min_p x the likeliest's probability are left out.

    Before choosing, the logits are adjusted (`adjust`): `logit_bias` ({token id: bias}) added, a
    `repetition_penalty` r applied to every token the sequence holds (the ids it `saw`, its prompt, and those
    generated: a positive logit divided by r, a negative one multiplied, as transformers and vLLM do), OpenAI's
    `presence_penalty` (once per token already generated) and `frequency_penalty` (per time it was generated)
    subtracted, a `constraint` (serve/grammar.py: a JSON schema's allowed next tokens) masks the rest out, and the
    `held_back` ids are masked out until `held_for` tokens were chosen (a minimum length: the end of sentence held
    back), unless the constraint allows nothing else. `allowed` (vLLM's allowed_token_ids): no other id can be chosen;
    `bad_words` (vLLM's, as token sequences: bad_word_ids): a sequence's last token is masked out wherever the tokens
    chosen so far end with its others (a one-token word: always), a lookup per distinct word length and token.
    `logprobs` k (>= 0): each token's log-probability under those adjusted logits (before the temperature) and the
    k likeliest alternatives are kept in `last_logprobs` (a TokenLogprob)."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None, *,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: dict[int, float] | None = None, logprobs: int | None = None, constraint=None,
                 held_back: tuple[int, ...] = (), held_for: int = 0, repetition_penalty: float = 1.0,
                 min_p: float = 0.0, allowed: Sequence[int] | None = None, bad_words: Sequence[Sequence[int]] = ()):
        if not is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
            raise MoepackError(f"--temperature must be a finite number >= 0, got {temperature!r}")
        if not is_number(top_p) or not 0 < top_p <= 1:  # NaN fails the comparison too
            raise MoepackError(f"--top-p must be a number in (0, 1], got {top_p!r}")
        if not is_int(top_k) or top_k < 0:
            raise MoepackError(f"--top-k must be an integer >= 0 (0 = off), got {top_k!r}")
        if seed is None:
            seed = secrets.randbits(63)  # drawn once and kept in .seed so that the run can be repeated
        elif not is_int(seed) or not 0 <= seed < 2**64:
            raise MoepackError(f"--seed must be an integer in [0, 2**64), got {seed!r}")
        for flag, value in (("--presence-penalty", presence_penalty), ("--frequency-penalty", frequency_penalty)):
            if not is_number(value) or not -2 <= value <= 2:  # OpenAI's range
                raise MoepackError(f"{flag} must be a number in [-2, 2], got {value!r}")
        if not is_number(repetition_penalty) or not 0 < repetition_penalty <= MAX_REPETITION_PENALTY:
            raise MoepackError(f"--repetition-penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                               f"got {repetition_penalty!r}")
        if not is_number(min_p) or not 0 <= min_p <= 1:
            raise MoepackError(f"--min-p must be a number in [0, 1] (0 = off), got {min_p!r}")
        bias = dict(logit_bias or {})
        if any(not is_int(t) or t < 0 or not is_number(b) or not -100 <= b <= 100 for t, b in bias.items()):
            raise MoepackError("--logit-bias: token ids >= 0 with biases in [-100, 100]")
        check_alternatives("--logprobs", logprobs)
        if not is_int(held_for) or held_for < 0 or any(not is_int(t) or t < 0 for t in held_back):
            raise MoepackError(f"held_for (a minimum length) must be an integer >= 0 and held_back token ids, got "
                               f"{held_for!r}")
        if allowed is not None and (not len(allowed) or any(not is_int(t) or t < 0 for t in allowed)):
            raise MoepackError(f"allowed_token_ids must be token ids (integers >= 0), at least one, got {allowed!r}")
        if any(not len(w) or any(not is_int(t) or t < 0 for t in w) for w in bad_words):
            raise MoepackError(f"bad_words must be non-empty sequences of token ids, got {bad_words!r}")
        self.temperature, self.top_p, self.top_k, self.seed = float(temperature), float(top_p), top_k, seed
        self.presence_penalty, self.frequency_penalty = float(presence_penalty), float(frequency_penalty)
        self.repetition_penalty, self.min_p = float(repetition_penalty), float(min_p)
        self.seen: set[int] = set()  # the sequence's ids before its first generated one (the repetition penalty's)
        # seen and the generated ids as a mask over the vocabulary, built at the first step and then kept: a step
        # that walked a 128K-token prompt's ids in Python took longer than a decode step
        self._repeated: torch.Tensor | None = None
        self.logit_bias, self.logprobs, self.constraint = bias, logprobs, constraint
        self.counts: dict[int, int] = {}  # how often each token was generated (the penalties' c[j])
        # the bias and the counts as tensors over the vocabulary, built at the first step and then kept: rebuilt
        # from the dicts at every step, a 150K-entry logit_bias cost 0.1 s a token and the counts grew with the answer
        self._bias: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (ids, biases, the vocabulary)
        self._counted: torch.Tensor | None = None
        self.chosen = 0  # tokens chosen so far
        self.held_back, self.held_for = tuple(held_back), held_for
        self.last_logprobs: TokenLogprob | None = None
        self.allowed = None if allowed is None else sorted(set(allowed))
        self._allowed: tuple[torch.Tensor, int] | None = None  # (the ids within the vocabulary, the vocabulary)
        # bad words by the length of what comes before their last token: {length: {those tokens: last tokens}}
        self._bad_after: dict[int, dict[tuple[int, ...], set[int]]] = {}
        for word in bad_words:
            self._bad_after.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), set()).add(word[-1])
        self._recent: list[int] = []  # the last chosen tokens, as many as the longest bad word's prefix
        self._keep_recent = max(self._bad_after, default=0)
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)

    def saw(self, token_ids) -> None:
        """The sequence's ids before its first generated one (a continued KV's, the prompt's): the repetition
        penalty's tokens, with those generated."""
        self.seen.update(int(t) for t in token_ids)
        self._repeated = None

    def adjust(self, x: torch.Tensor) -> torch.Tensor:
        """The logits the choice is made from: bias, penalties and the constraint's mask applied (float64, CPU)."""
        if self.logit_bias:
            if self._bias is None or self._bias[2] != len(x):
                ids = [t for t in self.logit_bias if t < len(x)]
                self._bias = (torch.tensor(ids, dtype=torch.long),
                              torch.tensor([self.logit_bias[t] for t in ids], dtype=torch.float64), len(x))
            x = x.clone()
            x[self._bias[0]] += self._bias[1].to(x.dtype)
        if self.repetition_penalty != 1 and (self.seen or self.counts):
            penalized = torch.where(x > 0, x / self.repetition_penalty, x * self.repetition_penalty)
            x = torch.where(self._repeated_mask(len(x)), penalized, x)
        if self.counts and (self.presence_penalty or self.frequency_penalty):
            c = self._counts(len(x)).to(x.dtype)  # mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty
            x = torch.where(c > 0, x - (c * self.frequency_penalty + self.presence_penalty), x)
        if self.constraint is not None:
            allowed = self.constraint.allowed(len(x))  # the ids allowed next (few, in JSON), None: any
            if allowed is not None:
                if not len(allowed):
                    raise MoepackError("the output constraint allows no next token")
                x = _only(x, allowed)
        if self.allowed is not None or self._bad_after:
            x = self._masked(x)
        if self.held_for and self.held_back and self.chosen < self.held_for:
            held = x.clone()
            held[[t for t in self.held_back if t < len(x)]] = -math.inf
            # (a constraint that allows nothing but the end of sentence has the last word: no token is left)
            x = held if _any_left(held) else x
        return x

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits or reads more of them than their largest (no bias, penalty,
        constraint, allowed ids, bad words, token still held back, logprobs): its token is their argmax, which
        greedy_choices takes where the logits are, for many rows at once."""
        return (self.temperature == 0 and self.logprobs is None and not self.logit_bias and self.constraint is None
                and self.repetition_penalty == 1 and not self.presence_penalty and not self.frequency_penalty
                and self.allowed is None and not self._bad_after
                and not (self.held_for and self.held_back and self.chosen < self.held_for))

    def next_token(self, logits: torch.Tensor, chosen: int | None = None) -> int:
        """The next token from `logits` ([vocab]). `chosen`: greedy_choices' token for them, where plain_greedy
        (the same token, found with the other rows of a batch)."""
        if logits.dim() != 1 or logits.numel() == 0:
            raise ValueError(f"expected logits of shape [vocab], got {list(logits.shape)}")
        if chosen is None and self.plain_greedy:
            chosen = greedy_choices(logits[None])[0]
        if chosen is not None:
            return self._taken(chosen)
        # float32 -> float64 is exact, so every device's logits become the same numbers here
        x = logits.detach().to(device="cpu", dtype=torch.float64)
        if not bool(finite_rows(x[None])[0]):
            raise MoepackError(NOT_FINITE)
        x = self.adjust(x)
        token = self._choose(x)
        if self.logprobs is not None:
            self.last_logprobs = TokenLogprob.of(token, x, self.logprobs)
        return self._taken(token)

    def _taken(self, token: int) -> int:
        """The sequence's bookkeeping of its chosen `token` (the penalties' counts, the constraint's state)."""
        self.counts[token] = self.counts.get(token, 0) + 1
        self.chosen += 1
        if self._counted is not None and token < len(self._counted):
            self._counted[token] += 1
        if self._repeated is not None:
            self._repeated[token] = True
        if self.constraint is not None:
            self.constraint.accept(token)
        if self._keep_recent:
            self._recent.append(token)
            del self._recent[:-self._keep_recent]
        return token

    def _masked(self, x: torch.Tensor) -> torch.Tensor:
        """x with only the allowed ids left and the bad words' last tokens that would complete one masked out."""
        if self.allowed is not None:
            if self._allowed is None or self._allowed[1] != len(x):
                self._allowed = (torch.tensor([t for t in self.allowed if t < len(x)], dtype=torch.long), len(x))
            x = _only(x, self._allowed[0])
        banned = [t for length, words in self._bad_after.items() if length <= len(self._recent)
                  for t in words.get(tuple(self._recent[len(self._recent) - length:]), ()) if t < len(x)]
        if banned:
            x = x.clone()
            x[banned] = -math.inf
        if not _any_left(x):
            raise MoepackError(f"{'bad_words' if self._bad_after else 'allowed_token_ids'}: no token is left to choose "
                               "(allowed_token_ids, bad_words and any output constraint applied)")
        return x

    def _counts(self, vocab: int) -> torch.Tensor:
        """How often each of the `vocab` ids was generated (ids outside the vocabulary left out)."""
        if self._counted is None or len(self._counted) != vocab:
            self._counted = torch.zeros(vocab, dtype=torch.float64)
            kept = {t: c for t, c in self.counts.items() if 0 <= t < vocab}
            self._counted[list(kept)] = torch.tensor(list(kept.values()), dtype=torch.float64)
        return self._counted

    def _repeated_mask(self, vocab: int) -> torch.Tensor:
        """Which of the `vocab` ids the sequence holds (seen or generated; ids outside the vocabulary left out)."""
        if self._repeated is None or len(self._repeated) != vocab:
            self._repeated = torch.zeros(vocab, dtype=torch.bool)
            self._repeated[[t for t in self.seen.union(self.counts) if 0 <= t < vocab]] = True
        return self._repeated

    def _choose(self, x: torch.Tensor) -> int:
        if self.temperature == 0:
            return int(torch.argmax(x))
        if 0 < self.top_k < len(x):
            return self._draw(x, _likeliest(x, self.top_k)[: self.top_k])
        # no top-k: never a sort of the whole vocabulary (a float64 sort of 129K logits took ~10 ms a token on a
        # CPU, whatever the device: the logits are chosen from here)
        scaled = (x - x.max()) / self.temperature  # (the largest subtracted first: a tiny temperature gives -inf)
        kept = scaled >= math.log(self.min_p) if self.min_p > 0 else None  # min-p: p / p_max = exp(scaled)
        weights = torch.exp(scaled) if kept is None else torch.where(kept, torch.exp(scaled), 0.0)
        if self.top_p >= 1:  # no nucleus: the inverse CDF over the kept tokens in id order
            cumulative = torch.cumsum(weights, dim=0)
            u = torch.rand((), generator=self._generator, dtype=torch.float64) * cumulative[-1]
            return min(int(torch.searchsorted(cumulative, u, right=True)), len(x) - 1)
        # the nucleus is a prefix of the kept tokens by descending logit: most often within the likeliest few
        # hundred (their sort ~1 ms); where it is not (a flat distribution), the whole order, as a top-k's
        count = len(x) if kept is None else int(kept.sum())
        k = min(NUCLEUS_CANDIDATES, count)
        # (short of the kept ones, only those above the k-th: every token tied with it comes after them in the
        # order, however many there are)
        order = _likeliest(x, k, ties=k == count)[:count]
        cumulative = torch.cumsum(weights[order] / weights.sum(), dim=0)
        if k == count or len(order) and cumulative[-1] >= self.top_p:
            return self._draw_nucleus(order, cumulative)
        return self._draw(x, torch.sort(x, descending=True, stable=True).indices)

    def _draw(self, x: torch.Tensor, order: torch.Tensor) -> int:
        """One of `order` (ids by descending logit), after min-p and top-p on their probabilities."""
        if self.min_p > 0:
            # p / p_max = exp((x - x_max) / T): a prefix of the order (the likeliest always kept)
            kept = (x[order] - x[order[0]]) / self.temperature >= math.log(self.min_p)
            order = order[: max(1, int(kept.sum()))]
        # subtract the largest logit before dividing: a tiny temperature then gives -inf, never inf - inf = nan
        probs = torch.softmax((x[order] - x[order[0]]) / self.temperature, dim=0)
        return self._draw_nucleus(order, torch.cumsum(probs, dim=0))

    def _draw_nucleus(self, order: torch.Tensor, cumulative: torch.Tensor) -> int:
        """One of the first tokens of `order` whose probabilities (`cumulative`, their running sums) reach top_p."""
        # the nucleus: the first n tokens whose probabilities sum to at least top_p (never fewer than one)
        n = int(torch.searchsorted(cumulative, torch.tensor(self.top_p, dtype=torch.float64))) + 1
        cumulative = cumulative[: min(n, len(cumulative))]
        # inverse CDF on the kept tokens; scaling u by their total renormalises without dividing each one.
        # right=True: a token whose probability underflowed to 0 adds no step to the CDF, so u never lands on it.
        u = torch.rand((), generator=self._generator, dtype=torch.float64) * cumulative[-1]
        i = int(torch.searchsorted(cumulative, u, right=True))
        return int(order[min(i, len(cumulative) - 1)])


def _only(x: torch.Tensor, ids) -> torch.Tensor:
    """x with every id but `ids` at -inf (a new tensor: cheaper than masking the whole vocabulary)."""
    kept = torch.full_like(x, -math.inf)
    kept[ids] = x[ids]
    return kept


def _any_left(x: torch.Tensor) -> bool:
    """Whether a token is left to choose: adjusted logits are finite or -inf (checked finite first, every change
    finite), so their largest tells, without an isfinite mask over the vocabulary."""
    return bool(x.max() > -math.inf)


def bad_word_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as the token sequences a Sampler bans (`encode`: text -> ids, no special tokens added): each
    word without its leading spaces as the text's start spells it, and after one space as the text's middle does,
    that one only where it starts with another token and has as many (a tokenizer whose words carry their space)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(encode(word.lstrip()))
        if not alone:
            raise MoepackError(f"bad_words: {word[:40]!r} has no tokens")
        spaced = tuple(encode(" " + word.lstrip()))
        out.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return tuple(out)


def _likeliest(x: torch.Tensor, k: int, ties: bool = True) -> torch.Tensor:
    """The ids of the k largest logits and of all tied with the k-th (`ties` False: only those above it), by
    descending logit, ties in id order (a stable sort: top-k 1 and a tiny top-p pick what argmax picks); only
    they are sorted, not the whole vocabulary."""
    least = torch.topk(x, k).values[-1]
    candidates = torch.nonzero(x >= least if ties else x > least).flatten()
    return candidates[torch.sort(x[candidates], descending=True, stable=True).indices]


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


def check_alternatives(name: str, k) -> None:
    """How many likeliest alternatives a log-probability carries (None: no log-probabilities): an integer in
    [0, MAX_TOP_LOGPROBS], else a MoepackError naming `name`."""
    if k is not None and (not is_int(k) or not 0 <= k <= MAX_TOP_LOGPROBS):
        raise MoepackError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}")


@dataclass(frozen=True)
class TokenLogprob:
    """One chosen token's log-probability and the `top` likeliest (token id, log-probability) pairs, from the
    log_softmax of the logits the sampler chose from (bias, penalties and constraint applied; no temperature)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None  # where asked for (vLLM's prompt_logprobs): 1 + how many others score at least as high

    @staticmethod
    def of(token: int, x: torch.Tensor, k: int, ranked: bool = False) -> "TokenLogprob":
        lp = torch.log_softmax(x, dim=0)
        top = torch.topk(lp, min(k, len(lp))) if k else None
        # a token the constraint rules out (-inf) is no alternative (nor valid JSON: a 500 for /v1 clients)
        pairs = () if top is None else tuple((i, v) for i, v in zip(top.indices.tolist(), top.values.tolist())
                                             if v != float("-inf"))
        return TokenLogprob(token, float(lp[token]), pairs, int((x >= x[token]).sum()) if ranked else None)


class NextTokenScores:
    """The prompt's own log-probabilities (OpenAI's echo with logprobs, lm-eval's loglikelihood): for each scored
    position, the log-probability of the token that follows it and its k likeliest tokens, under the model's plain
    logits (no sampling adjustment). The logits come a slice of the vocabulary at a time (the LM head is never applied
    whole: a prompt's [N, vocab] would be gigabytes): a running logsumexp, the next token's logit taken from the slice
    that holds it, and a running top k. `ranked` (vLLM's prompt_logprobs): each next token's rank too, counted over
    the slices once more once its logit is known (`count`: a second pass of the head)."""

    def __init__(self, next_ids: torch.Tensor, k: int, ranked: bool = False):
        n, device = len(next_ids), next_ids.device
        self.next_ids, self.k = next_ids, k
        # float32 whatever torch's default dtype (a bfloat16 default had rounded every running score)
        self.logsumexp = torch.full((n,), -math.inf, dtype=torch.float32, device=device)
        self.next_logit = torch.zeros(n, dtype=torch.float32, device=device)
        # (-inf: no token yet; a vocabulary under k tokens leaves some, which are no alternatives)
        self.top_values = torch.full((n, k), -math.inf, dtype=torch.float32, device=device)
        self.top_ids = torch.zeros(n, k, dtype=torch.long, device=device)
        self.ranks = torch.zeros(n, dtype=torch.long, device=device) if ranked else None

    def add(self, rows: slice, logits: torch.Tensor, first_id: int) -> None:
        """The float32 logits [rows, width] of vocabulary ids first_id .. first_id + width - 1 for the scored
        positions `rows`."""
        width = logits.shape[1]
        self.logsumexp[rows] = torch.logaddexp(self.logsumexp[rows], torch.logsumexp(logits, dim=1))
        local = self.next_ids[rows] - first_id
        inside = (local >= 0) & (local < width)
        taken = logits.gather(1, local.clamp(0, width - 1)[:, None])[:, 0]
        self.next_logit[rows] = torch.where(inside, taken, self.next_logit[rows])
        if self.k:
            top = logits.topk(min(self.k, width), dim=1)
            values = torch.cat([self.top_values[rows], top.values], dim=1)
            ids = torch.cat([self.top_ids[rows], top.indices + first_id], dim=1)
            best = values.topk(self.k, dim=1)
            self.top_values[rows], self.top_ids[rows] = best.values, ids.gather(1, best.indices)

    def count(self, rows: slice, logits: torch.Tensor) -> None:
        """The second pass's slice (as add's, every slice again in any order): the tokens scoring at least as high
        as each next token (itself included), as vLLM ranks them."""
        self.ranks[rows] += (logits >= self.next_logit[rows, None]).sum(dim=1)

    def entries(self) -> list["TokenLogprob"]:
        """Each scored position's TokenLogprob: of the token after it, with its k likeliest (and its rank, where
        ranked)."""
        logprobs = (self.next_logit - self.logsumexp).cpu().tolist()
        top_values = (self.top_values - self.logsumexp[:, None]).cpu().tolist()
        top_ids = self.top_ids.cpu().tolist()
        ranks = self.ranks.cpu().tolist() if self.ranks is not None else [None] * len(logprobs)
        return [TokenLogprob(token, logprob, tuple((i, v) for i, v in zip(ids, values) if v != -math.inf), rank)
                for token, logprob, ids, values, rank in zip(self.next_ids.tolist(), logprobs, top_ids, top_values,
                                                             ranks)]


class StopMatcher:
    """Decides when generation stops and which text is safe to show. Feed it each generated token with all the
    text decoded so far (text only ever grows at its end, as the detokenizer's pieces add up). It stops on an
    eos token (whose own text, e.g. "</s>", is never part of the answer) or when a stop string appears; the
    answer then ends just before the stop string, as in OpenAI's API (`include_stop`: just after it, as vLLM's
    include_stop_str_in_output). Until then it holds back a tail of the text that could be the start of a stop
    string. Running out of tokens ("length") is the caller's to decide."""

    def __init__(self, stop: list[str], eos_ids: set[int], include_stop: bool = False):
        if any(not s for s in stop):
            raise MoepackError("--stop: an empty stop string would stop before the first token")
        self.stop = list(dict.fromkeys(stop))
        self._automaton = StopAutomaton(self.stop)
        self._state = 0  # the automaton's state after self._seen
        self.eos_ids = set(eos_ids)
        self.include_stop = include_stop
        self.finish_reason: str | None = None  # "stop" once stopped
        self.stop_string: str | None = None  # the stop string that stopped it (None for eos)
        self.text = ""  # all the text given out so far: the answer, once stopped or flushed
        self._seen = ""  # the text of the previous feed

    def feed(self, token_id: int, text: str, armed: bool = True) -> str:
        """Take the token just generated and the text so far (including that token's); return the new text
        that is safe to show. After a stop, check finish_reason; later feeds return "". Not `armed` (a minimum
        length not reached yet: vLLM's min_tokens): a stop string ending in this token's text does not stop it, as
        vLLM checks none before then (one that begins before and ends later does)."""
        if self.finish_reason:
            return ""
        if token_id in self.eos_ids:
            self.finish_reason = "stop"
            return self._give_out(len(self._seen))  # the held-back tail was not a stop string after all
        return self._check(text, final=False, armed=armed)

    def flush(self, text: str | None = None) -> str:
        """No more tokens (the caller ran out of them): the text not yet given out, still cut at a stop string."""
        if self.finish_reason:
            return ""
        return self._check(self._seen if text is None else text, final=True)

    def _check(self, text: str, final: bool, armed: bool = True) -> str:
        # a stop string wholly inside the previous text would have stopped it then: only the new characters are
        # fed (the text only grows at its end), and of the stop strings ending in them the earliest-starting wins
        previous, self._seen = len(self._seen), text
        automaton, state, hit = self._automaton, self._state, None
        for end in range(previous + 1, len(text) + 1):
            state = automaton.step(state, text[end - 1])
            length = automaton.longest_match[state]
            if length and armed and (hit is None or end - length < hit[0]):
                hit = (end - length, length)
        self._state = state
        if hit is not None:
            cut, length = hit
            self.finish_reason, self.stop_string = "stop", text[cut:cut + length]
            return self._give_out(cut + length if self.include_stop else cut)
        return self._give_out(len(text) if final else len(text) - automaton.depth[state])

    def _give_out(self, end: int) -> str:
        piece = self._seen[len(self.text) : end]
        self.text += piece
        return piece


class StopAutomaton:
    """Aho-Corasick over the stop strings: fed the text a character at a time, it knows the longest stop string
    ending there and the longest tail of the text that begins one (what to hold back), in time per character
    independent of how many stop strings there are (10,000 of them cost what one does)."""

    def __init__(self, patterns: list[str]):
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]  # a state's length: the tail of the text it stands for
        own = [0]  # the length of the stop string that ends exactly at a state, else 0
        for pattern in patterns:
            state = 0
            for ch in pattern:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = self.goto[state][ch] = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    own.append(0)
                state = nxt
            own[state] = len(pattern)
        self.fail = [0] * len(self.goto)  # the longest proper suffix of a state that is a state too
        self.longest_match = own[:]  # the longest stop string that is a suffix of a state
        queue = deque(self.goto[0].values())
        while queue:  # breadth first: a state's suffix link is shorter, so is done before it
            state = queue.popleft()
            self.longest_match[state] = max(own[state], self.longest_match[self.fail[state]])
            for ch, child in self.goto[state].items():
                if state:
                    self.fail[child] = self.step(self.fail[state], ch)
                queue.append(child)

    def step(self, state: int, ch: str) -> int:
        while state and ch not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(ch, 0)


class IncrementalDetokenizer:
    """Token ids in, printable text out, one token at a time, never splitting a character: with byte-level BPE a
    token can hold part of a UTF-8 character, which decodes to U+FFFD until the rest arrives.

    It keeps two offsets into the ids: text before `_prefix` is given out and done with; ids[_prefix:_read]
    decode to text already given out too, but are decoded again as the context of the newer ids, because a
    token's text can depend on its neighbours (SentencePiece's leading space, a character's bytes split across
    tokens). Only the short window from `_prefix` on is decoded each time, never the whole answer: tokens that make
    no text (special tokens left out of it) or bytes that never complete a character are held back for at most
    MAX_HELD_TOKENS, then given out as they decode (nothing, or U+FFFD), so the window stays short (a run of them
    had grown it without bound: a decode per token over all of them, quadratic in the answer); tokens that make
    characters but each end inside the next one, for at most MAX_UNFINISHED_TOKENS. A run given out keeps back
    the tokens that begin its last character (_before_last), which may still complete."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        """The text this token completes; "" while it ends in an unfinished character."""
        self._ids.append(token_id)
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        new = text[len(done) :]
        # (characters made, then one unfinished: not a run of U+FFFD, bytes that make none)
        unfinished = len(new) >= 2 and new[-1] == REPLACEMENT != new[-2]
        if (not new or new.endswith(REPLACEMENT)) and len(self._ids) - self._read < (
                MAX_UNFINISHED_TOKENS if unfinished else MAX_HELD_TOKENS):
            return ""  # hold these bytes back until the character is complete
        read, made = self._before_last(text) if new.endswith(REPLACEMENT) else (len(self._ids), text)
        self._prefix, self._read = self._read, read
        return made[len(done) :]

    def _before_last(self, text: str) -> tuple[int, str]:
        """The end of the ids before the tokens that make `text`'s last character (U+FFFD: one unfinished, or bytes
        that make none) and their text, so that those tokens stay held while what comes before them goes out:
        bytes that make no character (a U+FFFD each) are given out at MAX_HELD_TOKENS, and a character begun in
        the last tokens of such a run had come out as U+FFFD, its rest as another. The latest end whose text is
        the start of `text` without its last character (a token may hold bytes of both); none: all the ids."""
        for end in range(len(self._ids) - 1, max(self._read, len(self._ids) - MAX_HELD_TOKENS), -1):
            made = self._decode(self._ids[self._prefix : end])
            if len(made) < len(text) and text.startswith(made):
                return end, made
        return len(self._ids), text

    def flush(self) -> str:
        """Whatever is still held back (a character that never completed comes out as U+FFFD)."""
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]


def is_number(value) -> bool:
    """An int or float from JSON or Python (a bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value) -> bool:
    """An int (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def partial_match_length(text: str, targets) -> int:
    """The length of the longest end of `text` that begins one of `targets` (without being all of it): what to
    hold back from a stream until the next piece tells whether that target follows."""
    longest = max((len(t) for t in targets), default=1)
    for k in range(min(longest - 1, len(text)), 0, -1):
        if any(t.startswith(text[-k:]) for t in targets):
            return k
    return 0
