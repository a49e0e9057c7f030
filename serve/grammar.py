"""Constrained decoding: the tokens a JSON schema (or any JSON object) allows next, as a mask on the logits before
each token is chosen (runtime/sampling.py `Sampler(constraint=...)`).

    grammar = JsonGrammar.for_container(container, tokenizer_json)   # once per container (about 1 s at 129K ids)
    constraint = grammar.constraint(schema)                           # per generation (about 1 ms to compile)
    Sampler(..., constraint=constraint)

Built on llguidance (MIT, no dependencies of its own; the optional extra `moepack[json]`). Why llguidance and not
xgrammar or outlines-core: docs/benchmarks.md "Constrained decoding" (benchmarks/json_grammar_cost.py): per token its
mask costs microseconds (noise beside a decode step), a schema compiles in about a millisecond (outlines-core:
over a second per schema, and 2.7 ms per token), and it builds from the container's tokenizer.json alone
(xgrammar needs transformers, triton and tvm-ffi installed beside it).

The JSON is written compactly with a space after `,` and `:` (as json.dumps writes it): whitespace the schema does
not need is not allowed, so a model cannot pad the answer with blanks until it runs out of tokens. A schema's own
`x-guidance` options override that.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from moepack.format_spec.errors import MoepackError

INSTALL_HINT = "pip install 'moepack[json]'"
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}  # response_format json_object: any JSON object
FORCED_REFUSED = 1000  # forced tokens past max_tokens that refuse a schema (an endless one forces 10,000s)
PROBED_SCHEMAS = 256  # schemas whose probe (check) is kept


class GrammarUnavailable(MoepackError):
    """llguidance is not installed."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarUnavailable(f"JSON output needs the llguidance library: {INSTALL_HINT}") from None
    return llguidance


class JsonGrammar:
    """The vocabulary's side of constrained decoding (llguidance's tokenizer over the container's tokenizer.json),
    built once; `constraint(schema)` gives one generation's mask."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        llg = _llguidance()
        self.vocab_size = vocab_size
        self._forced: dict[str, int | None] = {}  # a schema's JSON -> its forced tokens (None: no value allowed)
        try:
            self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids) or None)
        except Exception as e:  # llguidance's own errors: the tokenizer it cannot use
            raise MoepackError(f"the container's tokenizer cannot drive constrained decoding: {e}") from None

    def constraint(self, schema: dict, after: list[int] | None = None) -> "JsonConstraint":
        """A fresh constraint for `schema` (a JSON schema as a dict); `after`: free text until these token ids have
        been generated in a row (a thought ending in `</think>`), the schema from then on. MoepackError for a
        schema llguidance refuses."""
        llg = _llguidance()
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
        except ValueError as e:
            raise MoepackError(f"the JSON schema is not usable: {str(e).splitlines()[0][:200]}") from None
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise MoepackError(f"the JSON schema is not usable: {matcher.get_error().splitlines()[0][:200]}")
        return JsonConstraint(matcher, self.vocab_size, after)

    def check(self, schema: dict, max_tokens: int) -> None:
        """MoepackError for a schema that compiles but no answer of at most `max_tokens` tokens can satisfy: one
        no JSON value satisfies (a `$ref` to itself: llguidance allows nothing but the end), or one whose first
        tokens are forced past max_tokens (a required property that must recur forever: endless; a few forced
        tokens past a small max_tokens are the client's to cut short). An endless schema forces as many tokens as
        llguidance follows (10,000s): a max_tokens past that meets it mid-answer, a 400 naming response_format."""
        key = json.dumps(schema, sort_keys=True)
        if key not in self._forced:  # (probed once a schema: the probe holds the GIL up to ~0.1 s on an endless one)
            matcher = self.constraint(schema).matcher
            matcher.compute_bitmask()
            forced = None if matcher.is_error() else len(matcher.compute_ff_tokens())
            if len(self._forced) >= PROBED_SCHEMAS:
                self._forced.pop(next(iter(self._forced)))
            self._forced[key] = None if matcher.is_error() else forced
        forced = self._forced[key]
        if forced is None:
            raise MoepackError("no JSON value satisfies the schema (does it only refer to itself?)")
        if forced >= max(max_tokens, FORCED_REFUSED):
            raise MoepackError(f"the schema forces the answer's first {forced} tokens, and max_tokens is "
                               f"{max_tokens}: no answer could complete it (does a required property recur "
                               "without end?)")


class JsonConstraint:
    """One generation's state in the grammar: `allowed(n)` the ids the next token may be (n: the logits' length),
    `accept(token)` after each token is chosen."""

    def __init__(self, matcher, vocab_size: int, after: list[int] | None = None):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.waiting_for = list(after) if after else None  # free text until these ids
        self._tail: list[int] = []  # the last ids generated while waiting

    def allowed(self, n: int) -> torch.Tensor | None:
        """The ids the next token may be (a LongTensor), None while the text runs free."""
        if self.waiting_for is not None:
            return None
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(np.flatnonzero(bits[:n]))

    def accept(self, token: int) -> None:
        if self.waiting_for is not None:
            self._tail = (self._tail + [token])[-len(self.waiting_for):]
            if self._tail == self.waiting_for:
                self.waiting_for = None
            return
        if not self.matcher.consume_token(token):
            reason = (self.matcher.get_error().splitlines() or [""])[0][:200]
            raise MoepackError(f"response_format: the answer's token {token} is outside the schema's grammar "
                               f"({reason})")

    def done(self) -> bool:
        return self.waiting_for is None and self.matcher.is_stopped()
