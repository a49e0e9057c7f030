"""What every `moepack` command shares: the one-line error convention (reports_errors), --json, the JSON
result printer, the overwrite rule (--force), the argv types that refuse what no option means (nan, infinity,
text that is not valid UTF-8), SIGTERM handled as Ctrl-C."""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import math
import os
import re
import select
import signal
import sys
from dataclasses import dataclass

import click

from moepack.format_spec.errors import MoepackError, error_reason
from moepack.format_spec.files import refuse_replacing_a_special_file
from moepack.format_spec.generation_config import MAX_REPETITION_PENALTY

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def emit(as_json: bool, result: dict, human) -> None:
    if as_json:
        click.echo(json.dumps({"ok": True, **result}, indent=1, default=str))
    else:
        human(result)


PREFILL_MEMORY_HINT = "shorten the prompt, or lower --query-chunk, --queue-depth or --bundle-experts"


def out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: Python's MemoryError, torch's OutOfMemoryError (CUDA), its CPU allocator's
    RuntimeError, a CUDA library's own "out of memory" (what the check before a prefill did not foresee)."""
    if isinstance(e, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(e).__mro__):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text
                                            or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def _first_sentences(text: str, limit: int = 160) -> str:
    """At most `limit` characters of `text`, cut after a sentence where it is longer (torch's CUDA message runs on
    for a paragraph)."""
    if len(text) <= limit:
        return text
    end = text.rfind(". ", 0, limit)
    return text[:end + 1] if end > 0 else text[:limit]


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(message: str) -> str:
    """`message` as one line: the control characters a damaged file or a hostile name puts in it (a key of a GGUF,
    a path with a newline) written as escapes, so the error stays the one line a script reads."""
    return _CONTROL.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), message)


def stdout_closed_by_its_reader() -> bool:
    """Whether stdout is a pipe whose reader has gone (`| head` read what it wanted): poll reports an error on it."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (captured), or no poll on this platform
        return False


def leave_quietly_for_a_closed_stdout():
    """End without an error line where stdout's reader stopped reading (`moepack inspect X | head -1`), status 1
    as click's own output (--help) ends there. Stdout goes to /dev/null first, so that the interpreter's last flush
    of it meets no broken pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    sys.exit(EXIT_ERROR)


def reports_errors(fn=None, *, out_of_memory_hint: str | None = None):
    """Turn MoepackError (and OS-level failures, and running out of memory) into one line + exit status 1.
    `out_of_memory_hint`: what the command's user can do about the last."""
    if fn is None:
        return functools.partial(reports_errors, out_of_memory_hint=out_of_memory_hint)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            return fn(*args, **kwargs)
        except MoepackError as e:
            message = str(e)
        except OSError as e:
            if isinstance(e, BrokenPipeError) and stdout_closed_by_its_reader():
                leave_quietly_for_a_closed_stdout()
            message = f"{str(e.filename) + ': ' if e.filename else ''}{e.strerror or e}"
        except KeyboardInterrupt:  # outputs are written under temporary names: nothing partial is left
            if as_json:
                click.echo(json.dumps({"ok": False, "error": "interrupted"}))
            click.echo("moepack: error: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except (MemoryError, RuntimeError) as e:
            if not out_of_memory(e):
                raise
            message = f"out of memory ({_first_sentences(error_reason(e))})"
            message += f": {out_of_memory_hint}" if out_of_memory_hint else ""
        message = one_line(message)
        if as_json:
            click.echo(json.dumps({"ok": False, "error": message}))
        click.echo(f"moepack: error: {message}", err=True)
        sys.exit(EXIT_ERROR)

    return wrapper


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object for machines.")
force_option = click.option("--force", is_flag=True,
                            help="Replace outputs that exist (a file is replaced only once its new one is complete).")


def refuse_existing(force: bool, *paths: str | None, inputs: tuple = (), writes: re.Pattern | None = None) -> None:
    """The overwrite rule of every command that writes: an output that exists (a file, or a directory that is
    not empty) is refused before any work unless --force; an output that would replace one of the command's
    `inputs` is refused even so (refuse_replacing_an_input; `writes`: see there)."""
    for path in paths:
        if path is None:
            continue
        if not path:  # not the current directory: an empty name is a script's missing variable
            raise MoepackError("an output path is empty")
        refuse_replacing_an_input(path, inputs, writes)
        refuse_replacing_a_special_file(path)
        if force or not os.path.lexists(path):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            try:
                if not os.listdir(path):
                    continue
            except OSError:
                pass
        raise MoepackError(f"{path} exists: pass --force to replace it")


@contextlib.contextmanager
def layer_progress(enabled: bool, what: str = "prefill"):
    """Yields PrefillOptions.on_layer for a bar of a prefill's layers (bytes read, their rate, the layer in the
    description) on a terminal, else None."""
    from moepack.packer.progress import bars_wanted, progress_bar

    if not bars_wanted(enabled):
        yield None
        return
    bar = progress_bar(None, what)

    def on_layer(layer: int, layers: int, nbytes: int) -> None:
        bar.set_description_str(f"{what} layer {layer + 1}/{layers}", refresh=False)
        bar.update(nbytes)
        bar.refresh()  # every layer shows, however fast (tqdm draws at most every 0.1 s by itself)
    try:
        yield on_layer
    finally:
        bar.close()


def refuse_existing_kv(force: bool, kv_out: str | None, continue_from: str | None,
                       inputs: tuple[str | None, ...] = ()) -> None:
    """The rule for --kv-out: continuing a KV in place (--kv-out is --continue-from) is no overwrite; a KV
    directory keeps the files that are not its own (kv_directory carries them over), so only those are at stake."""
    from moepack.families.kv_directory import KV_FILE

    if kv_out == "" or continue_from == "":
        raise MoepackError("an output path is empty" if kv_out == "" else "--continue-from is empty")
    in_place = kv_out is not None and continue_from is not None and (
        os.path.realpath(kv_out) == os.path.realpath(continue_from))
    if not in_place:
        refuse_existing(force, kv_out, inputs=(*inputs, (continue_from, KV_FILE)), writes=KV_FILE)


# The files of a checkpoint directory: what its converter reads (an output of that name inside it would replace the
# source's own), and what synth may write into its output directory.
CHECKPOINT_FILE = re.compile(r".*\.(safetensors|gguf|json|jinja|model|txt)")


def _input_files(path: str) -> list[str]:
    """The files an input path stands for: itself, a container's parts (PATH.partK), a split GGUF's siblings."""
    found = [path]
    found += glob.glob(glob.escape(path) + ".part*")
    split = re.fullmatch(r"(.*)-\d{5}-of-(\d{5})\.gguf", path)
    if split:
        found += glob.glob(f"{glob.escape(split[1])}-*-of-{split[2]}.gguf")
    return found


def refuse_replacing_an_input(out: str, inputs: tuple, writes: re.Pattern | None = None) -> None:
    """An output path that would replace one of the command's inputs is refused, --force or not: the input would
    be lost. An input is a path, or (a directory, the pattern of the file names read in it; default
    CHECKPOINT_FILE). Refused: the output is the input (its file, its parts, a split GGUF's siblings), a file
    read in an input directory, or a directory holding the input; `writes`, for an output directory that keeps
    what it does not write (synth's checkpoint, a KV directory): the names written there, and only an input
    among them is at stake."""
    out_real, out_exists = os.path.realpath(out), os.path.exists(out)
    for entry in inputs:
        given, reads = entry if isinstance(entry, tuple) else (entry, CHECKPOINT_FILE)
        if not given or not os.path.exists(given):
            continue
        for path in _input_files(given):
            real = os.path.realpath(path)
            same = out_real == real or (out_exists and os.path.samefile(out, path))
            holds = real.startswith(out_real.rstrip(os.sep) + os.sep) and (
                writes is None or (os.path.dirname(real) == out_real and writes.fullmatch(os.path.basename(real))))
            inside = (os.path.isdir(real) and os.path.dirname(out_real) == real and os.path.exists(out_real)
                      and reads.fullmatch(os.path.basename(out_real)) is not None)
            if same or holds or inside:
                what = ("is" if same else "holds" if holds else "is a file of")
                raise MoepackError(f"{out} {what} the input {given}: writing there would destroy it (choose "
                                   f"another output)")


def prompt_options(fn=None, *, repeatable: bool = False):
    """--prompt, --prompt-file, --token-ids: the prompt of `prefill` and `generate`. `repeatable`: --prompt may be
    given several times (the command gets a tuple)."""
    if fn is None:
        return functools.partial(prompt_options, repeatable=repeatable)
    more = " Repeat it for several prompts, decoded together (--max-batch)." if repeatable else ""
    for option in reversed((
            click.option("-p", "--prompt", multiple=repeatable,
                         help="Prompt text (tokenized with the tokenizer the container carries)." + more),
            click.option("--prompt-file", type=click.Path(dir_okay=False),
                         help="File holding the prompt text (UTF-8)."),
            click.option("--token-ids", "token_ids_file", type=click.Path(dir_okay=False),
                         help="File of token ids: a JSON array or whitespace-separated integers."))):
        fn = option(fn)
    return fn


def check_threads(ctx, param, value):
    """--threads (and convert's --workers): at most MAX_THREADS_PER_CPU per CPU of this machine (more only adds
    switching; 100,000 threads could not be started)."""
    import os

    from moepack.runtime.limits import MAX_THREADS_PER_CPU

    most = MAX_THREADS_PER_CPU * (os.cpu_count() or 1)
    if value is not None and value > most:
        raise click.BadParameter(f"{value} is more than {MAX_THREADS_PER_CPU} per CPU of this machine's "
                                 f"{os.cpu_count()} (at most {most})")
    return value



# One spelling of dtypes for every flag: torch's name (float32, bfloat16, ...), and the container's storage type
# name (F32, BF16, ...) and the short one (f32, bf16) as its synonyms, in any case.
_DTYPE_NAMES = {"float32": ("F32", "f32"), "bfloat16": ("BF16", "bf16"), "float16": ("F16", "f16"),
                "float8_e4m3": ("F8_E4M3", "f8_e4m3")}


class Dtype(click.ParamType):
    """A dtype flag taking any spelling of `allowed` (torch names) and giving the callee's: "torch" (float32),
    "storage" (F32) or "short" (f32). `extra` words (e.g. auto) pass as they are."""

    name = "dtype"

    def __init__(self, allowed: tuple[str, ...], give: str = "torch", extra: tuple[str, ...] = ()):
        self.allowed, self.give, self.extra = allowed, give, extra
        self._lookup = {w: w for w in extra}
        for torch_name in allowed:
            for spelling in (torch_name, *_DTYPE_NAMES[torch_name]):
                self._lookup[spelling.lower()] = torch_name

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join((*self.extra, *self.allowed)) + "]"

    def convert(self, value, param, ctx):
        torch_name = self._lookup.get(str(value).lower())
        if torch_name is None:
            self.fail(f"{value!r} is not one of {', '.join((*self.extra, *self.allowed))} (or their storage names "
                      f"{', '.join(_DTYPE_NAMES[a][0] for a in self.allowed)})", param, ctx)
        if torch_name in self.extra or self.give == "torch":
            return torch_name
        return _DTYPE_NAMES[torch_name][0 if self.give == "storage" else 1]


class FiniteFloat(click.FloatRange):
    """Every float option's type: a finite number (click's FLOAT and FloatRange take "nan" and "inf", which no
    option means: a NaN passes every range check and reaches the arithmetic), within [min, max] where given."""

    name = "float"

    def convert(self, value, param, ctx):
        number = click.types.FloatParamType.convert(self, value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number (nan and inf are refused)", param, ctx)
        return super().convert(number, param, ctx)

    def _describe_range(self) -> str:
        return "" if self.min is None and self.max is None else super()._describe_range()


class Text(click.types.StringParamType):
    """Every text option's type: valid Unicode. Python decodes argv bytes that are not UTF-8 to lone surrogates,
    which fail far from here (a tokenizer, an encoder, stdout)."""

    name = "text"

    def convert(self, value, param, ctx):
        text = super().convert(value, param, ctx)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            self.fail(f"not valid UTF-8 (a lone surrogate or undecodable byte at character {e.start})", param, ctx)
        return text


# A string option that holds a file name (undecodable bytes in a file name are kept: the OS takes them back).
PATH_TEXT = click.types.StringParamType()


def untrusted_argv_types(group: click.Group) -> None:
    """Give every option of every command under `group` the types above: a float option declared with click's own
    FLOAT or FloatRange becomes a FiniteFloat of the same range, a plain string option (click.STRING) Text. One
    place, so an option added anywhere (another module's command too) refuses nan and broken UTF-8."""
    commands = [group]
    while commands:
        command = commands.pop()
        if isinstance(command, click.Group):
            commands.extend(command.commands.values())
        for param in command.params:
            kind = param.type
            if isinstance(kind, click.types.FloatParamType) and not isinstance(kind, FiniteFloat):
                param.type = FiniteFloat(getattr(kind, "min", None), getattr(kind, "max", None),
                                         getattr(kind, "min_open", False), getattr(kind, "max_open", False))
            elif kind is click.STRING and isinstance(param, click.Option):
                param.type = Text()


def one_line_warnings() -> None:
    """moepack's own warnings (a bench cache ignored, O_DIRECT refused) as one line, `moepack: warning: ...`, not
    Python's two (the file and line, then the source line); a library's keep Python's format."""
    import warnings

    python_format = warnings.formatwarning
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder holding cli/, runtime/, ...
    ours = {"cli", "runtime", "packer", "families", "backends", "format_spec", "native", "moepack"}

    def formatwarning(message, category, filename, lineno, line=None):
        if os.path.relpath(os.path.abspath(filename), root).split(os.sep)[0] in ours:
            return f"moepack: warning: {one_line(str(message))}\n"
        return python_format(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning


def quiet_native_logs() -> None:
    """torch's C++ side logs to stderr on its own, before the exception it raises (c10d's failed rendezvous of an
    expert-parallel rank: an error line, a retry warning and a C++ backtrace): only fatal ones are shown, the error
    itself comes as one line. Set before torch is imported (it reads TORCH_CPP_LOG_LEVEL once); a user's own
    setting stays."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")


def show_text(piece: str) -> None:
    """A generation's text as it streams (its on_text): written to stdout at once."""
    sys.stdout.write(piece)
    sys.stdout.flush()


def sigterm_as_interrupt() -> None:
    """SIGTERM (a `kill`, a supervisor stopping the job) ends a command as Ctrl-C does: KeyboardInterrupt, so the
    same cleanup runs (temporary files removed, partial outputs kept for a resume) and the exit status is 130."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread (a command called from a thread): its caller owns the signals
        pass


# ------------------------------------------------------------------------------------------------------------------
# The options every command that runs the model shares (prefill, generate, chat, serve): declared once, here.

@dataclass(frozen=True)
class ModelRun:
    """What the shared options say: where and how the model runs."""

    device: str = "cpu"
    threads: int | None = None
    io_mode: str = "auto"
    compute_dtype: str = "auto"
    kv_dtype: str = "F32"
    cache_gib: float | None = None  # None: the Generator sizes the default budget per generation
    device_resident: bool = False
    expert_backend: str = "auto"

    def prefill_options(self, **more):
        """The PrefillOptions of these options (and `more` of the command's own)."""
        from moepack.runtime.engine import PrefillOptions

        return PrefillOptions(device=self.device, io_mode=self.io_mode, compute_dtype=self.compute_dtype,
                              device_resident=self.device_resident, expert_backend=self.expert_backend, **more)


# option name -> (parameter, click option); the help says what each means on every command
def _run_option_table():
    from moepack.runtime.limits import MAX_CACHE_GIB

    return {
        "threads": click.option(
            "-t", "--threads", type=click.IntRange(min=1), default=None, callback=check_threads,
            help="CPU threads for compute and decode (default: torch's, one per core, at most the CPUs this process "
                 "may use: its affinity and its cgroups' CPU quota). Fewer when other work shares the cores: a busy "
                 "core stalls every multi-threaded op (docs/benchmarks.md)."),
        "io_mode": click.option(
            "--io", "io_mode", type=click.Choice(["auto", "direct", "buffered", "mmap", "host"]), default="auto",
            show_default=True,
            help="How the container is read. auto: page-cache streaming when it fits in the memory this process "
                 "may use, else O_DIRECT; host: the weights held in host RAM (pinned for a GPU) for the process."),
        "device": click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N."),
        "compute_dtype": click.option(
            "--compute-dtype", type=Dtype(("float32", "bfloat16"), extra=("auto",)), default="auto",
            show_default=True,
            help="The layers' matmuls: float32 (exact) or bfloat16 (the attention's projections and the shared "
                 "expert; streams, norms and router stay float32): 2-4x faster on CPUs with AVX512-BF16 or AMX and "
                 "on GPUs. auto: what `moepack bench compute` measured on this CPU, else bfloat16 where it has "
                 "native bf16 dot products, else float32 (the choice and why are in --json's stats)."),
        "kv_dtype": click.option(
            "--kv-dtype", type=Dtype(("float32", "bfloat16", "float8_e4m3"), give="storage"), default="float32",
            show_default=True,
            help="Storage type of the attended-over tensors of a KV written to disk (--kv-out: keys and values, "
                 "and the compressed entries of a family that has them; the layers' working state stays F32)."),
        "cache_gib": click.option(
            "--cache-gib", type=FiniteFloat(0, MAX_CACHE_GIB), default=None,
            help="Byte budget of the decode's routed-expert cache, kept across generations (0: every selected "
                 "expert read for every token; default: every routed expert, within a quarter of the memory this "
                 "process may use and what the rest of the generation leaves). With --device cuda the cache is on "
                 "the device (default: within half of its free memory): experts kept decoded where the budget "
                 "holds them all so (an FP4 expert takes 4x its stored bytes), else as their stored bytes where "
                 "those are smaller, decoded in each step."),
        "device_resident": click.option(
            "--device-resident", is_flag=True,
            help="Hold the weights in the compute device's memory (checked once as they load): the prefill is pure "
                 "compute. Refused in one line where they do not fit."),
        "expert_backend": click.option(
            "--expert-backend", type=click.Choice(["auto", "grouped", "per-expert"]), default="auto",
            show_default=True,
            help="The prefill's routed experts. grouped: each read's experts decoded together and run as grouped "
                 "GEMMs (a GPU's way); per-expert: one expert at a time on CPU threads with the compiled FP4 "
                 "kernels; auto: grouped on a GPU, per-expert on a CPU."),
    }


RUN_OPTION_NAMES = ("threads", "io_mode", "device", "compute_dtype", "kv_dtype", "cache_gib", "device_resident",
                    "expert_backend")


def model_run_options(fn=None, *, unused: dict[str, str] | None = None):
    """The shared options of every command that runs the model, given to the command as one `run` (a ModelRun);
    --threads is applied before the command runs. `unused`: {parameter: why this command has no use for it}: the
    option is still declared (the same spelling everywhere), its help says why, and a value other than its
    default is a usage error naming the option and the reason."""
    if fn is None:
        return functools.partial(model_run_options, unused=unused)
    unused = unused or {}
    defaults = ModelRun()

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        values = {name: kwargs.pop(name) for name in RUN_OPTION_NAMES}
        for name, why in unused.items():
            if values[name] != getattr(defaults, name):
                flag = "--io" if name == "io_mode" else "--" + name.replace("_", "-")
                raise click.UsageError(f"{flag}: {why}")
        import torch

        from moepack.runtime.io import usable_cpus

        if values["threads"] is not None:
            torch.set_num_threads(values["threads"])
        elif torch.get_num_threads() > (usable := usable_cpus()):  # torch counts cores, not a cgroup's CPU quota
            torch.set_num_threads(usable)
        return fn(*args, run=ModelRun(**values), **kwargs)

    table = _run_option_table()
    for name in reversed(RUN_OPTION_NAMES):
        option = table[name]
        if name in unused:  # the same option, its help replaced by why this command refuses it
            option = _with_help(option, f"Not on this command: {unused[name]}.")
        wrapper = option(wrapper)
    return wrapper


def _with_help(option_decorator, text: str):
    """`option_decorator` (a click.option) with its help replaced by `text`."""
    def apply(fn):
        fn = option_decorator(fn)
        fn.__click_params__[-1].help = text
        return fn
    return apply


def check_container_path(path: str) -> None:
    """A GGUF file or a checkpoint directory where a container is expected: one line with the `moepack convert`
    command that makes the container."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            raise MoepackError(f"{path} is a checkpoint directory, not a moepack container: convert it first, "
                               f"e.g. `moepack convert {path} --fp4`")
        raise MoepackError(f"{path} is a directory, not a moepack container")
    if not os.path.isfile(path):  # missing, a FIFO, a device (opening a FIFO would wait for a writer): the
        return  # command's own open says what is wrong
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return
    if magic == b"GGUF":
        raise MoepackError(f"{path} is a GGUF file, not a moepack container: convert it first, e.g. "
                           f"`moepack convert {path} --fp4`")


def container_argument(fn):
    """The FILE argument of a command that reads a container (a directory too, to say it is a checkpoint)."""
    return click.argument("file", type=click.Path())(fn)


# ------------------------------------------------------------------------------------------------------------------
# Sampling: the same options and defaults in `generate` and `chat`. The CLI samples greedily unless told otherwise
# (reproducible output for the same command); the server takes a request's omitted temperature as OpenAI's 1.0.

DEFAULT_TEMPERATURE = 0.0


SAMPLING_OPTION_NAMES = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop")


def sampling_options(fn):
    """--temperature, --top-p, --top-k, --min-p, --repetition-penalty, --seed, --stop: given to the command as one
    `sampling` dict of GenerateOptions' fields (stop a tuple)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        sampling = {name: kwargs.pop(name) for name in SAMPLING_OPTION_NAMES}
        sampling["stop"] = tuple(sampling["stop"])
        return fn(*args, sampling=sampling, **kwargs)
    for option in reversed((
            click.option("--temperature", type=FiniteFloat(min=0), default=DEFAULT_TEMPERATURE, show_default=True,
                         help="0: greedy (the CLI's default; the server's is OpenAI's 1.0 for a request that omits "
                              "it)."),
            click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=1.0, show_default=True,
                         help="Sample from the likeliest tokens whose probabilities add up to this (1: off)."),
            click.option("--top-k", type=int, default=0, show_default=True, help="0: off."),
            click.option("--min-p", type=FiniteFloat(0, 1), default=0.0, show_default=True,
                         help="Leave out the tokens less likely than this times the likeliest one's probability "
                              "(0: off)."),
            click.option("--repetition-penalty", type=FiniteFloat(0, MAX_REPETITION_PENALTY, min_open=True),
                         default=1.0, show_default=True,
                         help="Make every token the prompt or the answer holds less likely (a positive logit "
                              "divided by it, a negative one multiplied; 1: off)."),
            click.option("--seed", type=int, default=None, help="Sampling seed (default: drawn, and reported)."),
            click.option("--stop", multiple=True,
                         help="Stop when this text is generated (repeatable); it is not printed."))):
        wrapper = option(wrapper)
    return wrapper


def max_new_tokens_option(default: int):
    return click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), default=default, show_default=True,
                        help="Tokens to generate at most.")


context_option = click.option(
    "-c", "--max-context", type=click.IntRange(min=2), default=None,
    help="Cap on prompt tokens + new tokens (default: the model's context, max_position_embeddings): a prompt that "
         "fills it is refused, and the generation stops (finish 'length') where it reaches it.")


def context_cap(config: dict, max_context: int | None) -> int | None:
    """-c, else the model's context (max_position_embeddings), else None."""
    model_context = config.get("max_position_embeddings")
    return max_context or (model_context if isinstance(model_context, int) and model_context >= 1 else None)


def check_prefill_context(config: dict, max_context: int | None, tokens: int) -> None:
    """A prefill's tokens (a KV's continued included) within the context cap: positions past the model's context
    were computed without a word, where generate refuses them."""
    cap = context_cap(config, max_context)
    if cap is not None and tokens > cap:
        which = "-c/--max-context" if max_context else "the model context, max_position_embeddings; -c raises it"
        raise MoepackError(f"the prompt's {tokens} tokens exceed the context cap of {cap} ({which})")


def continued_kv(continue_from: str | None, container):
    """The KV directory to continue, opened once (its manifest only: another model's KV named as such), or None."""
    if continue_from is None:
        return None
    from moepack.families import kv_format_for
    from moepack.families.kv_directory import KVDirectory, identity_of_container

    return KVDirectory(continue_from, kv_format_for, identity_of_container(container))


def continued_tokens(continue_from: str | None, container) -> int:
    """The tokens a KV directory to continue holds, 0 for none."""
    kv = continued_kv(continue_from, container)
    return 0 if kv is None else kv.manifest["tokens"]["count"]


def context_budget(config: dict, max_context: int | None, prompt_tokens: int, max_new_tokens: int) -> int:
    """The new tokens a generation may make under the context cap (-c, else the model's context): at most
    max_new_tokens; MoepackError where the prompt alone fills the cap."""
    cap = context_cap(config, max_context)
    if cap is None:
        return max_new_tokens
    if prompt_tokens >= cap:
        raise MoepackError(f"the prompt's {prompt_tokens} tokens fill the context cap of {cap} "
                           f"({'-c/--max-context' if max_context else 'the model context'})")
    return min(max_new_tokens, cap - prompt_tokens)
