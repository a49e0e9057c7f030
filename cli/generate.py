"""`moepack generate`: prefill a prompt (streamed, layer-major), then decode with an expert cache
(runtime/generate.py). The text goes to stdout as it comes, the figures to stderr; --json prints one object."""

from __future__ import annotations

from dataclasses import replace

import click

from .common import (check_container_path, container_argument, context_budget, context_option, emit, force_option,
                     json_option, layer_progress, max_new_tokens_option, model_run_options, prompt_options,
                     refuse_existing_kv, reports_errors, sampling_options, show_text)

GENERATE_MEMORY_HINT = "lower --cache-gib or --max-new-tokens, or shorten the prompt"


def _prompt_ids(container, prompt, prompt_file, token_ids_file, messages_file, chat, thinking, reasoning_effort,
                continuing: bool):
    """(prompt token ids, tokenizer or None) from whichever of the five prompt options was given."""
    from moepack.serve.tokenizer import PromptTokenizer, read_prompt_file, read_token_ids

    given = [x is not None for x in (prompt, prompt_file, token_ids_file, messages_file, chat)]
    if sum(given) > 1:
        raise click.UsageError("give at most one of --prompt, --prompt-file, --token-ids, --messages, --chat")
    if messages_file is None and chat is None and (thinking or reasoning_effort is not None):
        # the chat encoding renders them; a raw prompt or token ids would take them and change nothing
        raise click.UsageError("--thinking and --reasoning-effort shape the chat encoding: give --chat or --messages")
    tokenizer = None
    if token_ids_file is None:
        tokenizer = PromptTokenizer(container)
    if token_ids_file is not None:
        return read_token_ids(token_ids_file), tokenizer
    if messages_file is not None or chat is not None:
        from moepack.families import family_of_architecture
        from moepack.format_spec.errors import MoepackError
        from moepack.v4 import chat as chat_encoding

        if messages_file is not None:
            from moepack.format_spec.untrusted import load_file

            try:
                messages = load_file(messages_file)
            except OSError as e:
                raise MoepackError(f"{messages_file}: cannot read ({e.strerror})") from None
        else:
            messages = [{"role": "user", "content": chat}]
        family = family_of_architecture(container.architecture)
        if family is not None:  # its own chat template (serve/chat_template.py), not DeepSeek-V4's encoding
            return _family_chat_ids(container, family, messages, thinking, reasoning_effort, tokenizer), tokenizer
        chat_encoding.check_reasoning_effort(reasoning_effort, thinking)  # "max" needs --thinking
        segments = chat_encoding.encode_message_segments(messages, thinking=thinking,
                                                         reasoning_effort=reasoning_effort)
        return tokenizer.encode_segments(segments), tokenizer  # message content stays plain text
    if prompt_file is not None:
        prompt = read_prompt_file(prompt_file)
    if continuing:
        tokenizer.add_special_tokens = False  # a continuation: no BOS in the middle of the conversation
    return (tokenizer.encode(prompt) if prompt else []), tokenizer


def _family_chat_ids(container, family, messages, thinking: bool, reasoning_effort, tokenizer) -> list[int]:
    """A family model's conversation through its chat template, tokenized as apply_chat_template does;
    --thinking is the template's enable_thinking (left to the template's default without it)."""
    from moepack.format_spec.errors import MoepackError
    from moepack.serve.chat_template import family_chat_template

    if reasoning_effort is not None:
        raise MoepackError(f"--reasoning-effort: DeepSeek-V4's, not a {family.name} model's")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise MoepackError("--messages: expected a non-empty JSON list of {role, content} objects")
    extra = {"enable_thinking": True} if thinking else {}
    return tokenizer.encode_special(family_chat_template(container, family).render(messages, **extra))


@click.command()
@container_argument
@prompt_options  # raw: no chat template
@click.option("--messages", "messages_file", type=click.Path(dir_okay=False),
              help="JSON file: an OpenAI-style list of {role, content}, encoded as the model's chat "
                   "(DeepSeek-V4's encoding, or a family's chat template).")
@click.option("--chat", help="One user turn, encoded as the model's chat (see --messages).")
@click.option("--thinking/--no-thinking", default=False, show_default=True,
              help="With --messages/--chat: thinking mode (<think>) or chat mode (</think>).")
@click.option("--reasoning-effort", type=click.Choice(["high", "max"]), default=None,
              help="With --messages/--chat in thinking mode: the reasoning-effort prefix.")
@click.option("--continue-from", type=click.Path(file_okay=False),
              help="A KV directory `moepack prefill --kv-out` wrote for this container: the prompt (if any) "
                   "continues it.")
@max_new_tokens_option(128)
@context_option
@sampling_options
@click.option("--kv-out", type=click.Path(file_okay=False),
              help="Directory for the KV after the generation (the prompt and the generated tokens), in --kv-dtype.")
@model_run_options
@force_option
@json_option
@reports_errors(out_of_memory_hint=GENERATE_MEMORY_HINT)
def generate(file, prompt, prompt_file, token_ids_file, messages_file, chat, thinking, reasoning_effort,
             continue_from, max_new_tokens, max_context, temperature, top_p, top_k, seed, stop, kv_out, run, force,
             as_json):
    """Prefill a prompt with the routed experts streamed from FILE, then generate with an expert cache. --prompt is
    raw text (no chat template); --messages and --chat are encoded as the model's chat (DeepSeek-V4's encoding, or
    a family's chat template from its tokenizer_config)."""
    from moepack.format_spec.errors import MoepackError
    from moepack.format_spec.reader import Container
    from moepack.runtime.generate import GenerateOptions, generate as run_generate

    if prompt is not None and not prompt or chat is not None and not chat:
        raise MoepackError("empty prompt")
    check_container_path(file)
    refuse_existing_kv(force, kv_out, continue_from)
    with Container(file) as c:
        ids, tokenizer = _prompt_ids(c, prompt, prompt_file, token_ids_file, messages_file, chat, thinking,
                                     reasoning_effort, continuing=continue_from is not None)
        config = c.config
    if not ids and continue_from is None:
        raise MoepackError("give a prompt: --prompt, --prompt-file, --token-ids, --messages or --chat")
    past = 0
    if continue_from is not None:
        from moepack.v4.kv import inspect_kv

        past = inspect_kv(continue_from, verify=False)["tokens"]  # the manifest only: the KV's tokens count too
    max_new_tokens = context_budget(config, max_context, past + len(ids), max_new_tokens)
    options = GenerateOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              seed=seed, stop=tuple(stop), cache_gib=run.cache_gib,
                              prefill=run.prefill_options())
    with layer_progress(not as_json) as on_layer:  # the prefill's layers: the bar is gone before the first token
        options = replace(options, prefill=replace(options.prefill, on_layer=on_layer))
        result = run_generate(file, ids, options, continue_from=continue_from,
                              detokenize=tokenizer.decode if tokenizer is not None else None,
                              on_text=None if as_json else show_text, kv_out=kv_out, kv_overwrite=force,
                              kv_dtype=run.kv_dtype)
    out = {"generated_ids": result.generated_ids, "text": result.text, "finish_reason": result.finish_reason,
           "stats": result.stats}
    if as_json:
        emit(True, out, None)
        return
    if result.text is None:  # token ids in, no tokenizer: the ids are the output
        click.echo(" ".join(map(str, result.generated_ids)))
    else:
        click.echo()
    p, d = result.stats["prefill"], result.stats["decode"]
    hit = d["expert_cache_hit_rate"]
    click.echo(f"prefill: {p.get('tokens', 0)} tokens in {p.get('seconds', 0):.2f} s; decode: {d['tokens']} tokens "
               f"at {d['tokens_per_s'] or 0:.1f} tokens/s, expert cache hit rate "
               f"{'-' if hit is None else f'{hit:.0%}'}, {(d['bytes_read_per_token'] or 0) / 2**20:.1f} MiB read "
               f"per token; finish: {result.finish_reason}", err=True)
