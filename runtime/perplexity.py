"""`moepack perplexity`: llama.cpp's perplexity measure (llama-perplexity) over the layer-major prefill, the number
a quantization is judged by.

The text's ids are cut into windows of `ctx` tokens as llama-perplexity cuts them (windows_of: a BOS first in each
where the model has one; a last part shorter than a window is left out), so the figures compare. Each window is
scored on its second half: the log-probability of each token at positions ctx // 2 + 1 .. ctx - 1 after the tokens
before it in its window, so that every scored token has at least half a window of context. The perplexity is exp of
the scored tokens' mean negative log-probability; its uncertainty, as llama.cpp's, that of the mean over the scored
tokens (none where one token is scored).

The windows go through the model several at a time (StreamingPrefill.run_many: `tokens_per_pass` tokens per pass,
each window attending within itself): every weight is read once per pass, not once per window. Each pass's LM head
runs over every position of its windows (run_many's prompt_logprobs, a slice of the vocabulary at a time), the first
half's scores then left out.

    result = perplexity("model.moepack", ids, ctx=512, bos_id=0)
    result["perplexity"], result["perplexity_stderr"], result["tokens_scored"]
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container

from .engine import PrefillOptions, StreamingPrefill, check_prompt_ids, prompt_ids

DEFAULT_TOKENS_PER_PASS = 8192


def windows_of(ids: torch.Tensor, ctx: int, bos_id: int | None, max_windows: int | None = None) -> list[torch.Tensor]:
    """The text's windows of `ctx` tokens each, llama-perplexity's: window k holds the text's tokens k x ctx on, and
    where `bos_id` is given the BOS first in its place (the text then read as BOS + text: ctx - 1 of the text's tokens
    a window, the one after each window's last in none); at most `max_windows` of them."""
    if ctx < 3:  # (a window's second half holds a scored token from 3 on)
        raise MoepackError(f"--ctx must be at least 3, got {ctx}")
    bos = [] if bos_id is None else [torch.tensor([bos_id])]
    count = (len(ids) + len(bos)) // ctx
    if count == 0:
        raise MoepackError(f"the text is {len(ids)} tokens: a window of --ctx {ctx} needs {ctx - len(bos)} of them "
                           "(give a longer text or a smaller --ctx)")
    count = count if max_windows is None else min(count, max_windows)
    return [torch.cat([*bos, ids[k * ctx:(k + 1) * ctx - len(bos)]]) for k in range(count)]


def _windows_that_fit(engine: StreamingPrefill, per_pass: int, ctx: int) -> int:
    """The most windows, up to `per_pass`, whose pass the prefill's memory check lets through (one window that does
    not fit is refused, naming --ctx)."""
    def fits(windows: int) -> bool:
        try:
            engine.check_memory(windows * ctx, windows * ctx)
            return True
        except MoepackError as e:
            if windows == 1:
                raise MoepackError(f"one window of --ctx {ctx} tokens does not fit: {e}") from None
            return False
    if fits(per_pass):
        return per_pass
    fits(1)  # (raises where not even one window fits)
    low, high = 1, per_pass  # low fits, high does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def perplexity(path: str, token_ids, ctx: int = 512, options: PrefillOptions | None = None,
               bos_id: int | None = None, tokens_per_pass: int = DEFAULT_TOKENS_PER_PASS,
               max_windows: int | None = None, on_pass: Callable[[int, int], None] | None = None) -> dict:
    """The perplexity of the text `token_ids` (without a BOS: `bos_id` puts one first in each window) under the
    container at `path` (the module's docstring). `on_pass(windows done, windows)` after each pass."""
    ids = prompt_ids(token_ids)
    if tokens_per_pass < 1:
        raise MoepackError(f"--tokens-per-pass must be at least 1, got {tokens_per_pass}")
    if max_windows is not None and max_windows < 1:
        raise MoepackError(f"--windows must be at least 1, got {max_windows}")
    windows = windows_of(ids, ctx, bos_id, max_windows)
    first = ctx // 2  # the first scored token's position is first + 1
    per_pass = max(1, tokens_per_pass // ctx)
    nll: list[float] = []
    start, bytes_read, passes = time.perf_counter(), 0, 0
    with Container(path) as c:
        engine = StreamingPrefill(c, options or PrefillOptions())
        try:
            vocab = engine.family.shape.vocab_size
            if bos_id is not None and not 0 <= bos_id < vocab:
                raise MoepackError(f"BOS id {bos_id} is outside the vocabulary of {vocab}")
            check_prompt_ids(ids, vocab)  # the whole text's: an id in a part no window scores is no less wrong
            per_pass = _windows_that_fit(engine, min(per_pass, len(windows)), ctx)
            for at in range(0, len(windows), per_pass):
                group = windows[at:at + per_pass]
                results = engine.run_many(group, keep_kv=False, prompt_logprobs=[0] * len(group))
                engine.after_prompt()
                passes += 1
                bytes_read += results[0].stats.get("bytes_read", 0)
                for result in results:  # entry j scores the window's token j + 1
                    nll.extend(-entry.logprob for entry in result.prompt_logprobs[first:])
                if on_pass is not None:
                    on_pass(min(at + per_pass, len(windows)), len(windows))
        finally:
            engine.close()
    seconds = time.perf_counter() - start
    values = torch.tensor(nll, dtype=torch.float64)
    mean = float(values.mean())
    # the mean's standard error, carried to the perplexity (llama.cpp's ppl * its uncertainty); one token scored
    # has none (None: not a certain 0)
    stderr = float(values.std(unbiased=True) / math.sqrt(len(values))) if len(values) > 1 else None
    tokens = len(windows) * ctx
    return {"perplexity": math.exp(mean), "perplexity_stderr": None if stderr is None else math.exp(mean) * stderr,
            "nll_mean": mean, "ctx": ctx, "windows": len(windows), "tokens": tokens, "tokens_scored": len(nll),
            "text_tokens": len(ids), "passes": passes, "windows_per_pass": per_pass,
            "bos": bos_id is not None, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
            "bytes_read": bytes_read}
