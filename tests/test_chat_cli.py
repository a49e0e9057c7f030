"""`moepack chat` in a pseudo-terminal: prompts, streamed replies, the kept history, /reset, Ctrl-C stopping a reply,
Ctrl-C twice and Ctrl-D leaving with status 0, and a greedy reply equal to `moepack generate --chat`'s."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from moepack.cli.main import cli

from containers import tiny_keep_container

PROMPT = b">>> "


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return tiny_keep_container(tmp_path_factory)


class Terminal:
    """`python -m moepack ARGS` on a pseudo-terminal: what it prints, read up to a pattern; keys typed."""

    def __init__(self, *args: str):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the chat, its stdin/stdout/stderr the terminal
            os.environ["TERM"] = "dumb"  # no bracketed-paste escapes from readline
            os.execv(sys.executable, [sys.executable, "-m", "moepack", *args])
        self.pending = b""

    def read_until(self, pattern: bytes, timeout: float = 120) -> bytes:
        """Everything printed up to and including `pattern`."""
        end = time.monotonic() + timeout
        while pattern not in self.pending:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                raise AssertionError(f"no {pattern!r} within {timeout} s; got {self.pending!r}")
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # the child closed the terminal
                chunk = b""
            if not chunk:
                raise AssertionError(f"the chat ended before {pattern!r}; got {self.pending!r}")
            self.pending += chunk
        cut = self.pending.index(pattern) + len(pattern)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def exit_status(self, timeout: float = 60) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if select.select([self.fd], [], [], 0.05)[0]:
                try:
                    os.read(self.fd, 4096)  # drain, so the child never blocks on a full terminal
                except OSError:
                    pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError("the chat did not exit")


def _reply(printed: bytes, typed: bytes) -> str:
    """The reply text in what a turn printed: after the echo of the typed line, before the line that ends it."""
    after_echo = printed.split(typed + b"\r\n", 1)[1]
    reply = after_echo.rsplit(b"\r\n(cut at", 1)[0]
    return reply.replace(b"\r\n", b"\n").decode("utf-8")


def test_two_turns_reset_and_ctrl_d_in_a_pseudo_terminal(container):
    term = Terminal("chat", container, "-n", "8")
    banner = term.read_until(PROMPT)
    assert b"/reset" in banner and b"Ctrl-C" in banner
    term.type(b"Hello\r")
    first = term.read_until(PROMPT)
    assert b"(cut at 8 tokens" in first  # the reply ran its 8 tokens, then the prompt came back
    term.type(b"And again?\r")
    second = term.read_until(PROMPT)
    term.type(b"/reset\r")
    assert b"(history cleared)" in term.read_until(PROMPT)
    term.type(b"Hello\r")
    after_reset = term.read_until(PROMPT)
    term.type(b"\x04")  # Ctrl-D
    assert term.exit_status() == 0

    # greedy by default: the first reply is `generate --chat`'s on the same message, and after /reset it is again
    r = CliRunner().invoke(cli, ["generate", container, "--chat", "Hello", "-n", "8", "--json"])
    assert r.exit_code == 0, r.output
    expected = json.loads(r.output)["text"].replace("\r\n", "\n")
    assert _reply(first, b"Hello") == expected
    assert _reply(after_reset, b"Hello") == expected
    assert _reply(second, b"And again?")  # a reply streamed for the second turn too


def test_the_history_grows_each_turn_and_reset_clears_it(container):
    """--json: one line per reply with its stats; each turn's prompt holds the earlier turns, /reset drops them."""
    lines = "Hello\nAnd again?\n/reset\nHello\n/exit\n"
    p = subprocess.run([sys.executable, "-m", "moepack", "chat", container, "-n", "4", "--json", "--system", "Be brief."],
                       input=lines, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    replies = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(replies) == 3 and all(r["ok"] for r in replies)
    prompt_tokens = [r["stats"]["prefill"]["tokens"] for r in replies]
    assert prompt_tokens[1] > prompt_tokens[0] + len(replies[0]["generated_ids"])  # the first turn and its reply
    assert prompt_tokens[2] == prompt_tokens[0]  # after /reset: the system message and the one question
    assert replies[2]["generated_ids"] == replies[0]["generated_ids"]


def test_ctrl_c_stops_a_long_reply_and_twice_at_the_prompt_leaves(container):
    term = Terminal("chat", container, "-n", "100000")
    term.read_until(PROMPT)
    term.type(b"Hi\r")
    term.read_until(b"Hi\r\n")
    # the reply has started streaming (its first bytes are out), then Ctrl-C
    deadline = time.monotonic() + 120
    while not term.pending and time.monotonic() < deadline:
        ready, _, _ = select.select([term.fd], [], [], 1)
        if ready:
            term.pending += os.read(term.fd, 4096)
    assert term.pending, "no reply streamed"
    started = time.monotonic()
    term.type(b"\x03")
    stopped = term.read_until(b"(stopped)", timeout=30)
    assert time.monotonic() - started < 30  # at once: within a token, not at the end of 100000
    assert PROMPT not in stopped  # the prompt comes back after the stop, not before
    term.read_until(PROMPT)
    term.type(b"\x03")
    assert b"Ctrl-C again" in term.read_until(b"leave)")
    term.type(b"\x03")
    assert term.exit_status() == 0


def test_chat_refuses_what_it_has_no_use_for(container, tmp_path):
    """--kv-dtype: the chat writes no KV; a checkpoint directory gets the convert command to run."""
    r = CliRunner().invoke(cli, ["chat", container, "--kv-dtype", "bf16"])
    assert r.exit_code == 2 and "--kv-dtype" in r.output and "writes none" in r.output
    (tmp_path / "config.json").write_text("{}")
    p = subprocess.run([sys.executable, "-m", "moepack", "chat", str(tmp_path)], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=60)
    assert p.returncode == 1 and p.stderr.count("\n") == 1
    assert f"moepack convert {tmp_path} --fp4" in p.stderr


def test_a_stopped_reply_stays_in_the_history_as_far_as_it_was_shown(container):
    """--json on pipes, Ctrl-C as the signal a terminal sends: the stopped reply's text is the assistant turn the
    next prompt carries, token for token."""
    from moepack.format_spec.reader import Container
    from moepack.serve.tokenizer import PromptTokenizer
    from moepack.families.deepseek_v4.chat import encode_message_segments

    # The tiny random model ends its greedy reply to "Hi" by itself after about 2,500 tokens: the Ctrl-C must land
    # well inside that on this machine, so the wait comes from the decode speed measured here, aimed at ~100 tokens
    # (a busy machine's speed may change several times between the calibration and the chat).
    calibration = subprocess.run([sys.executable, "-m", "moepack", "generate", container, "--prompt", "Hi", "-n", "100",
                                  "--json"], capture_output=True, text=True, timeout=120)
    tokens_per_s = json.loads(calibration.stdout)["stats"]["decode"]["tokens_per_s"]
    chat = subprocess.Popen([sys.executable, "-m", "moepack", "chat", container, "-n", "100000", "--json"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert b"moepack chat" in chat.stderr.readline()  # the banner: the container is open
        replies = []
        for line in (b"Hi\n", b"Again\n"):
            chat.stdin.write(line)
            chat.stdin.flush()
            time.sleep(0.2 + 100 / tokens_per_s)  # the prompt's prefill, then ~100 tokens into the reply
            chat.send_signal(signal.SIGINT)
            replies.append(json.loads(chat.stdout.readline()))
        chat.stdin.close()
        assert chat.wait(timeout=60) == 0
    finally:
        chat.kill()
    first, second = replies
    # the first reply was stopped part-way; the second may end by itself before its Ctrl-C (the tiny random model's
    # end of sentence): what it checks is the prompt it was given
    assert first["finish_reason"] == "cancelled" and first["generated_ids"]
    assert second["finish_reason"] in ("cancelled", "stop")
    with Container(container) as c:
        tokenizer = PromptTokenizer(c)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first["text"]},
               {"role": "user", "content": "Again"}]
    assert second["stats"]["prefill"]["tokens"] == len(tokenizer.encode_segments(encode_message_segments(history)))


def test_a_refused_turn_is_a_json_line_too(container):
    """--json on pipes, a line a turn: a turn the context cap refuses gets its {"ok": false} line (a program reading
    one line a turn had waited forever), and the chat goes on to the next."""
    p = subprocess.run([sys.executable, "-m", "moepack", "chat", container, "-c", "64", "-n", "2", "--json"],
                       input="a long first message, " * 4 + "over the context cap\nhi\n", capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in p.stdout.splitlines()]
    assert lines[0]["ok"] is False and "context cap" in lines[0]["error"], lines
    assert len(lines) == 2 and lines[1]["ok"] is True, lines


def test_a_mistyped_command_is_named_and_not_sent_to_the_model(container):
    """A line whose first word looks like a command is one: an unknown one (or a known one with words after it) is
    an error line, sent to no model; "//x" sends "/x"; a path is text. /help lists the commands."""
    lines = "/rest\n/reset now\n/help\n//reset\n/tmp/a.txt hi\n/exit\n"
    p = subprocess.run([sys.executable, "-m", "moepack", "chat", container, "-n", "2", "--json"],
                       input=lines, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = [json.loads(line) for line in p.stdout.splitlines()]
    assert [o["ok"] for o in out] == [False, False, True, True], out
    assert out[0]["error"].startswith("/rest: no such command (/exit, /reset, /help;")
    assert out[1]["error"] == "/reset takes nothing after it"
    assert "/reset: clear the history" in p.stderr
    from moepack.families.deepseek_v4.chat import encode_message_segments
    from moepack.format_spec.reader import Container
    from moepack.serve.tokenizer import PromptTokenizer
    with Container(container) as c:
        tokenizer = PromptTokenizer(c)
    first = [{"role": "user", "content": "/reset"}]  # the first turn sent: the ones before it were refused
    history = [*first, {"role": "assistant", "content": out[2]["text"]}, {"role": "user", "content": "/tmp/a.txt hi"}]
    for o, messages in zip(out[2:], (first, history)):
        assert o["stats"]["prefill"]["tokens"] == len(tokenizer.encode_segments(encode_message_segments(messages)))
