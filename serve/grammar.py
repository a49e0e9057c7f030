"""Constrained decoding: the tokens a JSON schema (or any JSON object; or, vLLM's structured outputs, a regular
expression, a choice of strings or a Lark grammar: OutputSpec) allows next, as a mask on the logits before each
token is chosen (runtime/sampling.py `Sampler(constraint=...)`).

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
from typing import NamedTuple

import numpy as np
import torch

from moepack.format_spec.errors import MoepackError

INSTALL_HINT = "pip install 'moepack[json]'"
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}  # response_format json_object: any JSON object
FORCED_REFUSED = 1000  # forced tokens past max_tokens that refuse a schema (an endless one forces 10,000s)
PROBED_SCHEMAS = 256  # schemas whose probe (check) is kept
_UNPROBED = object()


class GrammarUnavailable(MoepackError):
    """llguidance is not installed."""


class OutputSpec(NamedTuple):
    """What the answer must be: `kind` "json" (value: a JSON schema, a dict), "regex" (a regular expression the whole
    answer matches), "choice" (a list of strings: the answer is one of them) or "grammar" (a Lark grammar in
    llguidance's dialect, or GBNF); `field`: the request field that asked for it (its errors name it)."""
    kind: str
    value: object
    field: str = "response_format"

    @property
    def what(self) -> str:
        return {"json": "JSON schema", "regex": "regular expression", "choice": "choice", "grammar": "grammar"}[
            self.kind]

    @classmethod
    def of(cls, spec: "dict | OutputSpec") -> "OutputSpec":
        """`spec` as an OutputSpec: a dict is a JSON schema (response_format's)."""
        return spec if isinstance(spec, OutputSpec) else cls("json", spec)

    def grammar(self, llg) -> str:
        """llguidance's grammar of it (ValueError where it cannot make one)."""
        if self.kind == "json":
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(self.value), defaults=JSON_STYLE)
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":  # (each a Lark string literal: JSON's escapes)
            return llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.value))
        # (a GBNF grammar, `root ::= ...`, as vLLM's default backend and llama.cpp take it, is converted to Lark as
        # vLLM's guidance backend converts it; a Lark grammar is left as it is)
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(self.value)
        except Exception as e:  # noqa: BLE001 - the converter's own errors (GbnfToLarkError, a rule not found)
            raise ValueError(f"the GBNF grammar could not be read: {e}") from None
        return llg.LLMatcher.grammar_from_lark(lark)


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

    def constraint(self, spec: "dict | OutputSpec", after: list[int] | None = None) -> "JsonConstraint":
        """A fresh constraint for `spec` (an OutputSpec, or a JSON schema as a dict); `after`: free text until these
        token ids have been generated in a row (a thought ending in `</think>`), the spec from then on.
        MoepackError for one llguidance refuses."""
        spec = OutputSpec.of(spec)
        llg = _llguidance()
        try:
            grammar = spec.grammar(llg)
        except ValueError as e:
            raise MoepackError(f"the {spec.what} is not usable: {(str(e).splitlines() or [''])[0][:200]}") from None
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            why = (matcher.get_error().splitlines() or [""])[0][:200]
            raise MoepackError(f"the {spec.what} is not usable: {why}")
        return JsonConstraint(matcher, self.vocab_size, after, spec.field)

    def check(self, spec: "dict | OutputSpec", max_tokens: int) -> None:
        """MoepackError for a schema that compiles but no answer of at most `max_tokens` tokens can satisfy: one
        no JSON value satisfies (a `$ref` to itself: llguidance allows nothing but the end), or one whose first
        tokens are forced past max_tokens (a required property that must recur forever: endless; a few forced
        tokens past a small max_tokens are the client's to cut short). An endless schema forces as many tokens as
        llguidance follows (10,000s): a max_tokens past that meets it mid-answer, a 400 naming response_format.
        Another OutputSpec alike (a regex, choice or grammar no answer matches)."""
        spec = OutputSpec.of(spec)
        key = json.dumps([spec.kind, spec.value], sort_keys=True)
        forced = self._forced.get(key, _UNPROBED)
        if forced is _UNPROBED:  # (probed once a spec: the probe holds the GIL up to ~0.1 s on an endless one)
            matcher = self.constraint(spec).matcher
            matcher.compute_bitmask()
            forced = None if matcher.is_error() else len(matcher.compute_ff_tokens())
            forced = None if matcher.is_error() else forced  # (the forced tokens' walk may end in an error itself)
            # (requests are prepared on several threads: another may evict the same oldest spec meanwhile, or this
            # one, which had been a KeyError, a 500)
            if len(self._forced) >= PROBED_SCHEMAS:
                self._forced.pop(next(iter(self._forced), None), None)
            self._forced[key] = forced
        if forced is None:
            raise MoepackError("no JSON value satisfies the schema (does it only refer to itself?)"
                               if spec.kind == "json" else f"no answer satisfies the {spec.what}")
        if forced >= max(max_tokens, FORCED_REFUSED):
            raise MoepackError(f"the {spec.what} forces the answer's first {forced} tokens, and max_tokens is "
                               f"{max_tokens}: no answer could complete it (does a required part recur without end?)")


class JsonConstraint:
    """One generation's state in the grammar: `allowed(n)` the ids the next token may be (n: the logits' length),
    `accept(token)` after each token is chosen."""

    def __init__(self, matcher, vocab_size: int, after: list[int] | None = None, field: str = "response_format"):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.field = field  # the request field that asked (its errors name it)
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
            raise MoepackError(f"{self.field}: the answer's token {token} is outside its grammar ({reason})")

    def done(self) -> bool:
        return self.waiting_for is None and self.matcher.is_stopped()
