"""`moepack chat FILE`: an interactive chat in the terminal over one container opened once (runtime/generate.py's
Generator: the non-routed weights stay resident and the expert cache warm from one turn to the next).

Each turn encodes the whole conversation as DeepSeek-V4's chat (families/deepseek_v4/chat.py, the path of `generate
--chat`: message content stays plain text) and prefills it again: the Generator's decode state is not kept between
generations, and a layer-major prefill of the history costs one read of the experts the prompt routes to, most of them
cached.

Ctrl-C while a reply is generated stops it at the next layer or token; the reply is kept in the history as far as
it was shown (one stopped before its first token drops the user's message too). At the prompt, Ctrl-C twice in a
row, /exit or Ctrl-D leaves (status 0); /reset clears the history (the --system message stays)."""

from __future__ import annotations

import json
import re
import os
import select
import signal
import sys
from contextlib import suppress
from dataclasses import replace

import click

from .common import (check_container_path, container_argument, context_budget, context_option, json_option,
                     max_new_tokens_option, model_run_options, reports_errors, sampling_options, show_text)

PROMPT = ">>> "
HELP_LINE = "/reset clears the history, /exit or Ctrl-D leaves, Ctrl-C stops a reply, /help"
COMMANDS = {"/exit": "leave", "/reset": "clear the history", "/help": "this list"}
# a line whose first word looks so is a command: a mistyped one is named, not sent to the model as a question
COMMAND_WORD = re.compile(r"/[A-Za-z?][\w?-]*")


def _command(line: str) -> tuple[str | None, str]:
    """The chat command a typed line is (None: text for the model), and the text to send. A line of text that
    must start with a slash is typed with two ("//x" sends "/x"); a path ("/usr/lib ...") is text as it is."""
    if line.startswith("//"):
        return None, line[1:]
    words = line.split()
    if not words or not COMMAND_WORD.fullmatch(words[0]):
        return None, line
    name = "/help" if words[0] == "/?" else words[0]
    if name not in COMMANDS:
        raise click.UsageError(f"{words[0][:40]}: no such command ({', '.join(COMMANDS)}; a line of text starting "
                               "with / is typed with //)")
    if len(words) > 1:
        raise click.UsageError(f"{name} takes nothing after it")
    return name, line


class _Keyboard:
    """The typed lines and Ctrl-C, wherever the kernel delivers the signal. SIGINT goes to any thread that does not
    block it (a reader's, torch's): Python's handler then runs in the main thread only once that executes again,
    which a main thread asleep in read() never does. So Ctrl-C only sets `pressed` (a reply's generation asks it
    between layers and tokens: no KeyboardInterrupt in the middle of the model's arithmetic), and the prompt waits
    with select() on stdin and the signal module's wakeup pipe, which the signal's C handler writes to on any
    thread."""

    def __init__(self):
        self.pressed = False
        self._pending = b""
        self._wake_read, self._wake_write = os.pipe()
        for fd in (self._wake_read, self._wake_write):
            os.set_blocking(fd, False)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_write)
        self._old_handler = signal.signal(signal.SIGINT, self._press)

    def _press(self, signum, frame) -> None:
        self.pressed = True

    def close(self) -> None:
        signal.signal(signal.SIGINT, self._old_handler)
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self._wake_read)
        os.close(self._wake_write)

    def stop_asked(self) -> bool:
        return self.pressed

    def read_line(self) -> str | None:
        """The next line (without its end), None at the end of the input (Ctrl-D); KeyboardInterrupt for Ctrl-C."""
        stdin = sys.stdin.fileno()
        while b"\n" not in self._pending:
            if self.pressed:
                self.pressed = False
                raise KeyboardInterrupt
            ready = select.select([stdin, self._wake_read], [], [])[0]
            if self._wake_read in ready:
                with suppress(BlockingIOError):
                    while os.read(self._wake_read, 512):
                        pass
            if stdin in ready:
                chunk = os.read(stdin, 65536)
                if not chunk:  # end of input; a last line without its newline still counts
                    if not self._pending:
                        return None
                    chunk = b"\n"
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode("utf-8", "replace").rstrip("\r")


def _read_line(keyboard: _Keyboard) -> str | None:
    """The next line typed after the prompt (on stderr: stdout holds the replies), None to leave: Ctrl-D, or
    Ctrl-C twice in a row."""
    interrupted = False
    while True:
        click.echo(PROMPT, nl=False, err=True)
        try:
            return keyboard.read_line()
        except KeyboardInterrupt:
            click.echo(err=True)
            if interrupted:
                return None
            interrupted = True
            click.echo("(Ctrl-C again, /exit or Ctrl-D to leave)", err=True)


def _assistant_message(text: str, thinking: bool | None, chat_encoding) -> dict:
    """The reply as the history keeps it: in a chat encoding's thinking mode the thought (before </think>) is its
    reasoning, which the encoder drops from earlier turns (a chat template's reply is kept as it came: Qwen3's
    template drops an earlier turn's thought itself)."""
    from moepack.serve.reasoning import ThoughtMarks, split_thinking

    if thinking and chat_encoding is not None:
        reasoning, answer = split_thinking(text, ThoughtMarks(chat_encoding.THINK_END))
        return {"role": "assistant", "content": answer, "reasoning_content": reasoning}
    return {"role": "assistant", "content": text}


@click.command()
@container_argument
@click.option("--system", help="A system message in front of the conversation (kept by /reset).")
@click.option("--thinking/--no-thinking", default=None,
              help="Thinking mode (<think>: the reply starts with its thought) or chat mode (</think>); a chat "
                   "template's enable_thinking. Default: the chat's own (a chat encoding's chat mode, a template's "
                   "default).")
@max_new_tokens_option(1024)
@context_option
@sampling_options
@model_run_options(unused={"kv_dtype": "chat keeps its KV in memory (float32) and writes none"})
@json_option
@reports_errors(out_of_memory_hint="lower --cache-gib or --max-new-tokens, or /reset the conversation")
def chat(file, system, thinking, max_new_tokens, max_context, sampling, run, as_json):
    """Chat with the model in FILE in the terminal: each reply streams as it is generated; the conversation is kept
    (encoded as the model's chat: its family's chat encoding, or its chat template) until /reset. /exit or Ctrl-D
    leaves; Ctrl-C stops a reply, which stays in the history as far as it was shown. With --json each reply is one
    JSON line instead of streamed text."""
    from moepack.runtime.generate import GenerateOptions

    check_container_path(file)
    reply = GenerateOptions(max_new_tokens=max_new_tokens, **sampling)
    keyboard = _Keyboard()
    try:
        _converse(file, run, reply, system, thinking, max_context, as_json, keyboard)
    finally:
        keyboard.close()


def _say_refused(message: str, as_json: bool) -> None:
    click.echo(f"moepack: error: {message}", err=True)
    if as_json:  # (a program reading a line a turn gets this turn's too)
        click.echo(json.dumps({"ok": False, "error": message}))


def _converse(file, run, reply, system, thinking, max_context, as_json, keyboard):
    """The chat's loop: `reply` the GenerateOptions of every reply (its max_new_tokens cut to the context cap)."""
    from moepack.format_spec.errors import MoepackError
    from moepack.runtime.generate import Generator
    from moepack.serve.chat_template import family_chat_template
    from moepack.serve.tokenizer import PromptTokenizer, chat_prompt_ids, warn_of_missing_markup
    from moepack.families import container_family

    start = [] if system is None else [{"role": "system", "content": system}]
    messages = list(start)
    with Generator(file, run.cache_gib, prefill=run.prefill_options()) as generator:
        family = container_family(generator.c)
        chat_encoding = family.chat_encoding  # the family's own chat encoder, or None: its chat template
        template = family_chat_template(generator.c, family) if chat_encoding is None else None  # (no chat: said now)
        tokenizer = PromptTokenizer(generator.c)
        warn_of_missing_markup(family, tokenizer)
        click.echo(f"moepack chat: {file} ({HELP_LINE})", err=True)
        while True:
            line = _read_line(keyboard)
            if line is None:
                return
            try:
                command, line = _command(line)
            except click.UsageError as e:  # nothing is sent: the conversation goes on as it was
                _say_refused(e.message, as_json)
                continue
            if command == "/exit":
                return
            if command == "/reset":
                messages = list(start)
                click.echo("(history cleared)", err=True)
                continue
            if command == "/help":
                click.echo("\n".join(f"{name}: {what}" for name, what in COMMANDS.items()), err=True)
                continue
            if not line.strip():
                continue
            turn = [*messages, {"role": "user", "content": line}]
            try:
                ids = chat_prompt_ids(family, lambda: tokenizer, turn, thinking=thinking, template=lambda: template)
                budget = context_budget(generator.c.config, max_context, len(ids), reply.max_new_tokens)
                result = generator.generate(ids, replace(reply, max_new_tokens=budget), detokenize=tokenizer.decode,
                                            on_text=None if as_json else show_text, cancelled=keyboard.stop_asked)
            except MoepackError as e:  # the turn is refused (the context cap, the memory), the conversation goes on
                _say_refused(str(e) + ("; /reset to start over" if len(turn) > 1 else ""), as_json)
                continue
            keyboard.pressed = False  # it stopped this reply: not also a Ctrl-C at the next prompt
            if as_json:
                click.echo(json.dumps({"ok": True, "text": result.text, "finish_reason": result.finish_reason,
                                       "generated_ids": result.generated_ids, "stats": result.stats}, default=str))
            else:
                click.echo()
                if result.finish_reason == "cancelled":
                    click.echo("(stopped)", err=True)
                elif result.finish_reason == "length":
                    click.echo(f"(cut at {budget} tokens: -n or -c)", err=True)
            if result.finish_reason == "cancelled" and not result.generated_ids:
                continue  # stopped before a word: the question goes too
            messages = [*turn, _assistant_message(result.text, thinking, chat_encoding)]
