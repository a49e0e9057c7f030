"""`moepack perplexity`: the perplexity of a text under a container (runtime/perplexity.py), llama-perplexity's
measure: how a quantization policy compares with another on the same text."""

from __future__ import annotations

from dataclasses import replace

import click

from moepack.format_spec.errors import MoepackError
from moepack.runtime.limits import MAX_CHUNK_TOKENS

from .common import (PREFILL_MEMORY_HINT, check_container_path, container_argument, context_cap, emit, json_option,
                     layer_progress, model_run_options, prompt_options, reports_errors)


@click.command()
@container_argument
@prompt_options
@click.option("--ctx", type=click.IntRange(3, MAX_CHUNK_TOKENS), default=512, show_default=True,
              help="Tokens per window (llama-perplexity's -c; the same value compares with its figures). Each window "
                   "is scored on its second half.")
@click.option("--windows", "max_windows", type=click.IntRange(min=1), default=None,
              help="Score at most this many windows, from the text's start (llama-perplexity's --chunks).")
@click.option("--tokens-per-pass", type=click.IntRange(min=1), default=8192, show_default=True,
              help="Tokens of windows prefilled together in one pass over the model (each weight read once per "
                   "pass); fewer where the memory check says they do not fit.")
@model_run_options(unused={"cache_gib": "perplexity runs prefills only, and the cache is the decode's",
                           "kv_dtype": "perplexity keeps no KV"})
@json_option
@reports_errors(out_of_memory_hint=PREFILL_MEMORY_HINT)
def perplexity(file, prompt, prompt_file, token_ids_file, ctx, max_windows, tokens_per_pass, run, as_json):
    """The perplexity of a text (--prompt-file, --prompt, or its --token-ids) under FILE, as llama-perplexity
    measures it: the text cut into windows of --ctx tokens, a BOS first in each where the model has one, each
    window's second half scored; the windows prefilled --tokens-per-pass at a time, layer by layer."""
    from moepack.format_spec.reader import Container
    from tqdm import tqdm

    from moepack.packer.progress import bars_wanted
    from moepack.runtime.perplexity import perplexity as run_perplexity
    from moepack.serve.tokenizer import PromptTokenizer, read_prompt_file, read_token_ids

    if sum(x is not None for x in (prompt, prompt_file, token_ids_file)) != 1:
        raise click.UsageError("give exactly one of --prompt, --prompt-file, --token-ids")
    check_container_path(file)
    with Container(file) as c:
        config = c.config
        cap = context_cap(config, None)
        if cap is not None and ctx > cap:  # (before the text is read: a window is a prompt of --ctx tokens)
            raise MoepackError(f"--ctx {ctx} exceeds the model's context of {cap} tokens (max_position_embeddings)")
        tokenizer = PromptTokenizer(c) if token_ids_file is None or PromptTokenizer.carried_by(c) else None
    bos = tokenizer.bos_id if tokenizer is not None and tokenizer.add_special_tokens else None
    if token_ids_file is not None:
        ids = read_token_ids(token_ids_file)
    else:
        text = read_prompt_file(prompt_file) if prompt_file is not None else prompt
        ids = tokenizer.encode(text, special_tokens=False, add_bos=False)  # (llama-perplexity's: spellings stay text)
    options = run.prefill_options(load_progress=not as_json)
    bar = tqdm(desc="windows", unit="window", dynamic_ncols=True, leave=False) if bars_wanted(not as_json) else None

    def on_pass(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)
    try:
        with layer_progress(not as_json) as on_layer:
            result = run_perplexity(file, ids, ctx, replace(options, on_layer=on_layer), bos_id=bos,
                                    tokens_per_pass=tokens_per_pass, max_windows=max_windows, on_pass=on_pass)
    finally:
        if bar is not None:
            bar.close()
    emit(as_json, result, lambda r: click.echo(human(r)))


def human(r: dict) -> str:
    """The result in a line (perplexity_stderr None: one token scored, which tells no uncertainty)."""
    stderr = r["perplexity_stderr"]
    spread = "(one token: no uncertainty)" if stderr is None else f"+/- {stderr:.4f}"
    return (f"perplexity {r['perplexity']:.4f} {spread} over {r['tokens_scored']} tokens ({r['windows']} windows of "
            f"{r['ctx']}{', BOS first' if r['bos'] else ''}; {r['passes']} passes over the model, "
            f"{r['tokens_per_s']:.1f} tokens/s)")
