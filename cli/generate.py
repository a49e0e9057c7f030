"""`moepack generate`: prefill a prompt (streamed, layer-major), then decode with an expert cache
(runtime/generate.py). The text goes to stdout as it comes, the figures to stderr; --json prints one object.

Several prompts (--prompt repeated, or --prompts-file) decode together through runtime/batching.py's BatchScheduler,
--max-batch at a time: each one's output is printed as it completes (--json: one JSON line per prompt)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, replace

import click

from moepack.runtime.limits import DEFAULT_MAX_BATCH, MAX_BATCH, MAX_PROMPTS

from .common import (check_container_path, container_argument, context_budget, context_option, continued_kv,
                     emit, force_option, json_option, layer_progress, max_new_tokens_option, model_run_options,
                     out_of_memory, prompt_options, refuse_existing_kv, reports_errors, sampling_options, show_text)

GENERATE_MEMORY_HINT = "lower --cache-gib or --max-new-tokens, or shorten the prompt"


def _prompt_ids(container, prompt, prompt_file, token_ids_file, messages_file, chat, thinking, reasoning_effort,
                continuing: bool, turn_end: int | None = None, template=None):
    """(prompt token ids, tokenizer or None, whether a chat's answer goes on from its final assistant message, left
    open) from whichever of the five prompt options was given; `continuing` a KV whose conversation ends with
    `turn_end` (a chat's: see serve/tokenizer.py chat_prompt_ids); `template` the container's _chat_template, where
    the caller keeps one."""
    from moepack.serve.tokenizer import PromptTokenizer, ends_open, read_prompt_file, read_token_ids

    if token_ids_file is not None:
        return read_token_ids(token_ids_file), _tokenizer_for_text(container), False
    no_prompt = continuing and not prompt and prompt_file is None and messages_file is None and chat is None
    if no_prompt and not PromptTokenizer.carried_by(container):  # a KV's own continuation: nothing to encode
        return [], None, False
    tokenizer = PromptTokenizer(container)
    if messages_file is not None or chat is not None:
        from moepack.format_spec.errors import MoepackError

        if messages_file is not None:
            from moepack.format_spec.untrusted import load_file

            try:
                messages = load_file(messages_file, unique_keys=True)  # (a key twice: which counts? as serve)
            except OSError as e:
                raise MoepackError(f"{messages_file}: cannot read ({e.strerror})") from None
        else:
            messages = [{"role": "user", "content": chat}]
        return _chat_ids(container, tokenizer, messages, thinking, reasoning_effort, continuing, turn_end,
                         template), tokenizer, ends_open(messages)
    if prompt_file is not None:
        prompt = read_prompt_file(prompt_file)
    if continuing:
        tokenizer.add_special_tokens = False  # a continuation: no BOS in the middle of the conversation
    return (tokenizer.encode(prompt) if prompt else []), tokenizer, False


def _tokenizer_for_text(container):
    """The container's tokenizer, for the text of what token-id prompts generate (and --stop): None where it
    carries none, or one that does not load (a warning says so: the ids run all the same)."""
    import warnings

    from moepack.format_spec.errors import MoepackError
    from moepack.serve.tokenizer import PromptTokenizer

    if not PromptTokenizer.carried_by(container):
        return None
    try:
        return PromptTokenizer(container)
    except MoepackError as e:
        warnings.warn(f"{e}: the generated ids are given without their text", stacklevel=2)
        return None


def _chat_template(container) -> Callable:
    """() -> the container's chat template (serve/chat_template.py family_chat_template), compiled at its first call
    and then kept: a compile takes about 0.1 s, once a chat of a --prompts-file's 10,000 would be minutes."""
    from moepack.families import container_family
    from moepack.serve.chat_template import family_chat_template

    family = container_family(container)
    return functools.cache(lambda: family_chat_template(container, family))


def _chat_ids(container, tokenizer, messages, thinking: bool | None, reasoning_effort: str | None,
              continuing: bool = False, turn_end: int | None = None, template=None) -> list[int]:
    """The ids of `messages` (an OpenAI-style list) as the model's chat, as the server encodes them
    (serve/tokenizer.py chat_prompt_ids: its family's chat encoding, or its tokenizer's chat template, `template`
    (_chat_template), with --thinking as the template's enable_thinking; `continuing` a KV: without a first turn's
    BOS); bad messages or options are one line naming the field."""
    from moepack.families import container_family
    from moepack.serve.tokenizer import chat_prompt_ids, warn_of_missing_markup

    family = container_family(container)
    if tokenizer is not None:
        warn_of_missing_markup(family, tokenizer)
    return chat_prompt_ids(family, lambda: tokenizer, messages, thinking=thinking, reasoning_effort=reasoning_effort,
                           template=template or _chat_template(container), continuing=continuing,
                           turn_end=turn_end)


def _chat_answer(container, thinking: bool | None, template: Callable, continued: bool = False):
    """A chat reply's --json fields as the server's message gives them: f(text) -> {"content"} and, where the answer
    had a thought (a chat encoding's thinking mode, a chat template that writes thoughts; not an answer `continued`
    from the final assistant message), its "reasoning_content" (serve/reasoning.py). Asked for once a chat prompt
    was encoded: its template (_chat_template) is there."""
    from moepack.families import container_family
    from moepack.serve.reasoning import chat_thought, split_thinking

    thought = chat_thought(container_family(container), template, thinking, continued)

    def fields(text: str | None) -> dict:
        if text is None:
            return {}
        reasoning, content = split_thinking(text, thought)
        return {"content": content, **({} if reasoning is None else {"reasoning_content": reasoning})}
    return fields


def _not_a_chat(text: str | None) -> dict:
    """A raw prompt's or token ids' output: no chat fields."""
    return {}


def _closing_the_last_turn(last: int, container) -> list[int]:
    """A chat turn continuing a KV whose last token (`last`) did not end its reply (cut by --max-new-tokens, a stop
    string, Ctrl-C): the end-of-sequence id the model ends its turn with (the config's first), as the reply would
    have closed and as --messages gives the same conversation; [] after a reply that ended by itself."""
    from moepack.runtime.generate import model_eos_ids

    if last in model_eos_ids(container):
        return []
    eos = container.config.get("eos_token_id")
    close = eos[0] if isinstance(eos, list) and eos else eos
    return [close] if isinstance(close, int) else []


def _check_prompt_choice(prompts: tuple, prompt_file, token_ids_file, messages_file, chat, prompts_file, thinking,
                         reasoning_effort) -> None:
    """One kind of prompt option (--prompt may repeat); --thinking and --reasoning-effort only where a chat is."""
    given = [bool(prompts), *(x is not None for x in (prompt_file, token_ids_file, messages_file, chat, prompts_file))]
    if sum(given) > 1:
        raise click.UsageError("give at most one of --prompt, --prompt-file, --token-ids, --messages, --chat, "
                               "--prompts-file")
    if messages_file is None and chat is None and prompts_file is None and (
            thinking is not None or reasoning_effort is not None):
        # the chat encoding renders them; a raw prompt or token ids would take them and change nothing (--no-thinking
        # too, now that it is said, not the default)
        raise click.UsageError("--thinking/--no-thinking and --reasoning-effort shape the chat encoding: give --chat "
                               "or --messages (or a --prompts-file of messages)")


# --- several prompts ----------------------------------------------------------------------------------------------

PROMPT_KINDS = ("prompt", "messages", "token_ids")  # a --prompts-file object gives exactly one of these
PROMPT_LINE_FIELDS = {*PROMPT_KINDS, "id", "seed", "max_new_tokens"}
MAX_ID_CHARS = 256


@dataclass
class PromptSpec:
    """One prompt of several: where it came from (for messages), what it is, and its own options."""
    where: str  # "--prompt 2", "FILE line 7"
    text: str | None = None
    messages: list | None = None
    token_ids: list[int] | None = None
    id: str | int | None = None  # the caller's name for it, echoed in --json
    seed: int | None = None
    max_new_tokens: int | None = None


def _prompt_line(value, where: str) -> PromptSpec:
    """A --prompts-file line's JSON value as a PromptSpec (MoepackError naming `where` and the field)."""
    from moepack.format_spec.errors import MoepackError
    from moepack.format_spec.untrusted import int_in_range

    if isinstance(value, str):
        value = {"prompt": value}
    if not isinstance(value, dict):
        raise MoepackError(f"{where}: expected a JSON string (the prompt) or an object with one of "
                           f"{', '.join(PROMPT_KINDS)}, got {type(value).__name__}")
    unknown = sorted(set(value) - PROMPT_LINE_FIELDS)
    if unknown:
        known = ", ".join(sorted(PROMPT_LINE_FIELDS))
        raise MoepackError(f"{where}: unknown field {unknown[0][:40]!r} (known: {known})")
    kinds = [k for k in PROMPT_KINDS if k in value]
    if len(kinds) != 1:
        raise MoepackError(f"{where}: give exactly one of {', '.join(PROMPT_KINDS)}")
    spec = PromptSpec(where)
    kind, prompt = kinds[0], value[kinds[0]]
    if kind == "prompt":
        if not isinstance(prompt, str) or not prompt:
            raise MoepackError(f"{where}: prompt: expected non-empty text" if isinstance(prompt, str) or prompt is None
                               else f"{where}: prompt: expected text, got {type(prompt).__name__}")
        spec.text = prompt
    elif kind == "messages":
        if not isinstance(prompt, list) or not prompt:
            raise MoepackError(f"{where}: messages: expected a non-empty list of {{role, content}}")
        spec.messages = prompt
    else:
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            raise MoepackError(f"{where}: token_ids: expected a non-empty list of integer token ids")
        spec.token_ids = prompt
    if "id" in value:
        spec.id = value["id"]
        if isinstance(spec.id, bool) or not isinstance(spec.id, (str, int)) or len(str(spec.id)) > MAX_ID_CHARS:
            raise MoepackError(f"{where}: id: expected text or an integer of at most {MAX_ID_CHARS} characters")
    if "seed" in value:
        spec.seed = int_in_range(value["seed"], f"{where}: seed", 0, 2**64 - 1)
    if "max_new_tokens" in value:
        spec.max_new_tokens = int_in_range(value["max_new_tokens"], f"{where}: max_new_tokens", 1, 2**31)
    return spec


def read_prompts_file(path: str) -> list[PromptSpec]:
    """A --prompts-file: JSON Lines, one prompt a line (blank lines skipped), each a JSON string (raw text) or an
    object (_prompt_line). MoepackError, in one line naming the file and the line, for anything else: no prompt,
    more than MAX_PROMPTS, a line that is not JSON or not a prompt."""
    from moepack.format_spec.errors import MoepackError
    from moepack.format_spec.untrusted import loads
    from moepack.serve.tokenizer import MAX_PROMPT_BYTES, read_text

    specs = []
    # "\n" only: JSON strings may hold U+2028 and the other breaks str.splitlines() would cut at
    for n, line in enumerate(read_text(path, MAX_PROMPT_BYTES, "prompts").split("\n"), 1):
        if not line.strip():
            continue
        if len(specs) == MAX_PROMPTS:
            raise MoepackError(f"{path}: more than {MAX_PROMPTS} prompts (the limit of one run): split the file")
        where = f"{path} line {n}"
        specs.append(_prompt_line(loads(line, where, max_bytes=MAX_PROMPT_BYTES, unique_keys=True), where))
    if not specs:
        raise MoepackError(f"{path}: no prompt (expected one JSON string or object a line)")
    return specs


@dataclass
class _Queued:
    """A prompt ready for the batch: its ids, options and detokenizer."""
    index: int
    spec: PromptSpec
    ids: list[int]
    options: object  # GenerateOptions
    detokenize: Callable[[list[int]], str] | None
    answer: Callable[[str | None], dict]  # a chat reply's --json fields (_chat_answer; {} for another prompt)


def _prepared(file: str, specs: list[PromptSpec], base, max_context: int | None, thinking: bool | None,
              reasoning_effort: str | None) -> list[_Queued]:
    """Every prompt tokenized and its options made and checked (seed, stop strings, context), before any work: a
    bad one is refused in one line naming it."""
    import torch

    from moepack.format_spec.errors import MoepackError
    from moepack.format_spec.reader import Container
    from moepack.runtime.engine import check_prompt_ids
    from moepack.runtime.generate import SequenceOutput
    from moepack.serve.tokenizer import PromptTokenizer, ends_open

    out = []
    with Container(file) as c:
        config = c.config
        tokenizer = PromptTokenizer(c) if any(s.token_ids is None for s in specs) else _tokenizer_for_text(c)
        vocab = config.get("vocab_size")
        template = _chat_template(c)
        for i, spec in enumerate(specs):
            try:
                if spec.token_ids is not None:
                    ids, detokenize = spec.token_ids, tokenizer.decode if tokenizer is not None else None
                else:
                    ids = (tokenizer.encode(spec.text) if spec.text is not None
                           else _chat_ids(c, tokenizer, spec.messages, thinking, reasoning_effort,
                                             template=template))
                    detokenize = tokenizer.decode
                if isinstance(vocab, int):
                    check_prompt_ids(torch.as_tensor(ids, dtype=torch.long), vocab)
                # --seed S: prompt i samples with S + i (the first with S itself: as it would alone)
                seed = spec.seed if spec.seed is not None else (
                    None if base.seed is None else base.seed if i == 0 else (base.seed + i) % 2**64)
                options = replace(base, seed=seed, max_new_tokens=context_budget(
                    config, max_context, len(ids), spec.max_new_tokens or base.max_new_tokens))
                SequenceOutput(options, set(), detokenize)  # its checks (seed, --stop), as the batch's submit makes
            except MoepackError as e:
                raise MoepackError(f"{spec.where}: {e}") from None
            out.append(_Queued(i, spec, ids, options, detokenize,
                               _chat_answer(c, thinking, template, ends_open(spec.messages))
                               if spec.messages is not None else _not_a_chat))
    return out


def _generate_several(file: str, queued: list[_Queued], max_batch: int, run, as_json: bool) -> None:
    """The prompts decoded together, each one's output printed as it completes (in that order): --json, one line
    {"ok", "index", "id", "generated_ids", "text", ("content", "reasoning_content": a chat's), "finish_reason",
    "stats"} (or {"ok": false, "index", "error"}); else
    a header line and its text on stdout, its figures on stderr. A prompt that fails leaves the others going; the
    command then ends with an error naming how many failed."""
    import time
    from concurrent.futures import as_completed

    from moepack.format_spec.errors import MoepackError, error_reason
    from moepack.runtime.batching import BatchScheduler
    from moepack.runtime.generate import Generator

    failed, tokens = 0, 0
    start = time.perf_counter()
    with Generator(file, run.cache_gib, run.prefill_options()) as g, BatchScheduler(g, max_batch) as batch:
        futures = {batch.submit(q.ids, q.options, q.detokenize): q for q in queued}
        for future in as_completed(futures):
            q = futures[future]
            named = {"index": q.index, **({} if q.spec.id is None else {"id": q.spec.id})}
            try:
                result = future.result()
            except (MoepackError, MemoryError, RuntimeError) as e:
                if isinstance(e, RuntimeError) and not out_of_memory(e):
                    raise
                failed += 1
                message = error_reason(e) if isinstance(e, MoepackError) else f"out of memory ({error_reason(e)})"
                if as_json:
                    click.echo(json.dumps({"ok": False, **named, "error": message}))
                click.echo(f"moepack: error: prompt {q.index} ({q.spec.where}): {message}", err=True)
                continue
            tokens += len(result.generated_ids)
            if as_json:
                click.echo(json.dumps({"ok": True, **named, "generated_ids": result.generated_ids,
                                       "text": result.text, **q.answer(result.text),
                                       "finish_reason": result.finish_reason, "stats": result.stats}, default=str))
                continue
            label = f"prompt {q.index}" + ("" if q.spec.id is None else f" ({q.spec.id})")
            click.echo(f"== {label} ==")
            click.echo(" ".join(map(str, result.generated_ids)) if result.text is None else result.text)
            click.echo(f"{label}: {_figures(result)}", err=True)
    seconds = time.perf_counter() - start
    if not as_json:
        click.echo(f"{len(queued)} prompts: {tokens} tokens generated in {seconds:.2f} s, "
                   f"{tokens / seconds if seconds else 0:.1f} tokens/s together (--max-batch {max_batch})", err=True)
    if failed:
        raise MoepackError(f"{failed} of {len(queued)} prompts failed (each one's error above)")


def _figures(result) -> str:
    """A generation's figures in one line: its prefill, its decode, how it finished."""
    p, d = result.stats["prefill"], result.stats["decode"]
    hit = d.get("expert_cache_hit_rate")
    per_token = d.get("bytes_read_per_token")
    if per_token is None and d.get("tokens"):  # a batched one's: the bytes the steps it was in read, all rows
        per_token = d.get("bytes_read", 0) / d["tokens"]
    batch = f", mean batch {d['mean_batch']:.1f}" if d.get("mean_batch") else ""
    return (f"prefill: {p.get('tokens', 0)} tokens in {p.get('seconds', 0):.2f} s; decode: {d.get('tokens', 0)} "
            f"tokens at {d.get('tokens_per_s') or 0:.1f} tokens/s{batch}, expert cache hit rate "
            f"{'-' if hit is None else f'{hit:.0%}'}, {(per_token or 0) / 2**20:.1f} MiB read per token; "
            f"finish: {result.finish_reason}")


@click.command()
@container_argument
@prompt_options(repeatable=True)  # raw: no chat template
@click.option("--prompts-file", type=click.Path(dir_okay=False),
              help="Several prompts, decoded together (--max-batch at a time): JSON Lines, one a line, each a JSON "
                   "string (raw text, as --prompt) or an object with one of \"prompt\" (text), \"messages\" (as "
                   "--messages, encoded as the chat with --thinking/--reasoning-effort) or \"token_ids\", and "
                   "optionally \"id\" (echoed in --json), \"seed\" and \"max_new_tokens\" (its own). Blank lines "
                   "are skipped.")
@click.option("--messages", "messages_file", type=click.Path(dir_okay=False),
              help="JSON file: an OpenAI-style list of {role, content}, encoded as the model's chat "
                   "(its family's own chat encoding, or the chat template its tokenizer_config carries).")
@click.option("--chat", help="One user turn, encoded as the model's chat (see --messages).")
@click.option("--thinking/--no-thinking", default=None,
              help="With --messages/--chat (or --prompts-file messages): thinking mode (<think>) or chat mode "
                   "(</think>); a chat template's enable_thinking. Default: the chat's own (a chat encoding's chat "
                   "mode, a template's default).")
@click.option("--reasoning-effort", type=click.Choice(["high", "max"]), default=None,
              help="With --messages/--chat/--prompts-file messages in thinking mode: the reasoning-effort prefix "
                   "(a family with its own chat encoding; a chat template takes none).")
@click.option("--continue-from", type=click.Path(file_okay=False),
              help="A KV directory `moepack prefill --kv-out` wrote for this container: the prompt (if any) "
                   "continues it.")
@max_new_tokens_option(128)
@context_option
@sampling_options
@click.option("--kv-out", type=click.Path(file_okay=False),
              help="Directory for the KV after the generation (the prompt and every generated token: a "
                   "--continue-from goes on after the last), in --kv-dtype.")
@click.option("--max-batch", type=click.IntRange(1, MAX_BATCH), default=DEFAULT_MAX_BATCH, show_default=True,
              help="With several prompts: how many decode together, one step feeding each its next token (the "
                   "others wait and join as one ends); each one's KV is counted in the memory check.")
@model_run_options
@force_option
@json_option
@reports_errors(out_of_memory_hint=GENERATE_MEMORY_HINT)
def generate(file, prompt, prompt_file, token_ids_file, messages_file, chat, thinking, reasoning_effort,
             continue_from, max_new_tokens, max_context, sampling, kv_out, prompts_file,
             max_batch, run, force, as_json):
    """Prefill a prompt with the routed experts streamed from FILE, then generate with an expert cache. --prompt is
    raw text (no chat template); --messages and --chat are encoded as the model's chat (its family's own chat
    encoding, or the chat template from its tokenizer_config).

    Several prompts (--prompt given more than once, or --prompts-file) decode together, --max-batch at a time
    (continuous batching: greedy tokens are each prompt's alone). Each one's output is printed as it completes: a
    "== prompt I ==" line (I counts the prompts from 0, in the order given) then its text, its figures on stderr;
    with --json one JSON line per prompt, {"ok", "index", "id", "generated_ids", "text", "finish_reason", "stats"}
    (a chat's also "content" and, where it had a thought, "reasoning_content", as the server's message). Sampling,
    --stop and -c apply to each prompt; with --seed S prompt I samples with S + I (so it repeats alone with --seed
    S+I), unless its line gives its own seed."""
    from moepack.format_spec.errors import MoepackError
    from moepack.format_spec.reader import Container
    from moepack.runtime.generate import GenerateOptions, generate as run_generate

    if any(not p for p in prompt) or chat is not None and not chat:
        raise MoepackError("empty prompt")
    _check_prompt_choice(prompt, prompt_file, token_ids_file, messages_file, chat, prompts_file, thinking,
                         reasoning_effort)
    check_container_path(file)
    if len(prompt) > 1 or prompts_file is not None:
        if continue_from is not None or kv_out is not None:
            raise click.UsageError("--continue-from and --kv-out take one prompt")
        if len(prompt) > MAX_PROMPTS:
            raise MoepackError(f"more than {MAX_PROMPTS} prompts (the limit of one run)")
        specs = (read_prompts_file(prompts_file) if prompts_file is not None
                 else [PromptSpec(f"--prompt {i}", text=p) for i, p in enumerate(prompt)])
        base = GenerateOptions(max_new_tokens=max_new_tokens, **sampling, cache_gib=run.cache_gib)
        queued = _prepared(file, specs, base, max_context, thinking, reasoning_effort)
        _generate_several(file, queued, max_batch, run, as_json)
        return
    prompt = prompt[0] if prompt else None
    refuse_existing_kv(force, kv_out, continue_from, inputs=(file, prompt_file, token_ids_file, messages_file))
    with Container(file) as c:
        kv = continued_kv(continue_from, c)  # a KV continued must be this container's; its tokens count too
        past = 0 if kv is None else kv.manifest["tokens"]["count"]
        closing = _closing_the_last_turn(kv.token_ids[-1], c) if kv is not None and (
            messages_file is not None or chat is not None) else []
        template = _chat_template(c)
        ids, tokenizer, continued = _prompt_ids(c, prompt, prompt_file, token_ids_file, messages_file, chat, thinking,
                                     reasoning_effort, continuing=kv is not None, template=template,
                                     turn_end=(closing or kv.token_ids[-1:] or [None])[-1] if kv else None)
        ids = closing + ids
        answer = (_chat_answer(c, thinking, template, continued) if messages_file is not None or chat is not None
                  else _not_a_chat)
        config = c.config
        if not ids and continue_from is None:
            raise MoepackError("give a prompt: --prompt, --prompt-file, --token-ids, --messages or --chat")
    max_new_tokens = context_budget(config, max_context, past + len(ids), max_new_tokens)
    options = GenerateOptions(max_new_tokens=max_new_tokens, **sampling, cache_gib=run.cache_gib,
                              prefill=run.prefill_options())
    with layer_progress(not as_json) as on_layer:  # the prefill's layers: the bar is gone before the first token
        options = replace(options, prefill=replace(options.prefill, on_layer=on_layer))
        result = run_generate(file, ids, options, continue_from=continue_from,
                              detokenize=tokenizer.decode if tokenizer is not None else None,
                              on_text=None if as_json else show_text, kv_out=kv_out, kv_overwrite=force,
                              kv_dtype=run.kv_dtype)
    out = {"generated_ids": result.generated_ids, "text": result.text, **answer(result.text),
           "finish_reason": result.finish_reason, "stats": result.stats}
    if as_json:
        emit(True, out, None)
        return
    if result.text is None:  # token ids in, no tokenizer: the ids are the output
        click.echo(" ".join(map(str, result.generated_ids)))
    else:
        click.echo()
    click.echo(_figures(result), err=True)
