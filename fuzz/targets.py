"""What the harness does with one input, and how it judges the outcome.

Each input goes through what a user would do with it. A container: open it (strict validation), `moepack inspect`'s
summary, walk every block and expert span, `moepack verify`, then read and decode every tensor region by region
(as the runtime does). A KV directory: open the manifest, `moepack kv inspect` (which checks every complete layer),
stream the complete layers one by one, `read_kv`, identity and prompt checks. A checkpoint directory: `moepack plan
DIR`, then `moepack convert DIR` into a scratch folder, and, where that succeeds, the container opened and verified
and `moepack verify --source DIR` run on it. A GGUF (one file or its splits): the same convert and verify.

Good outcomes: no error, or moepack's own error (a MoepackError, message non-empty and one line). Anything else is
a failure: another exception type, a multi-line or empty message, a read outside the region a tensor belongs to,
a conversion that fails but leaves a file under the output's name, one that succeeds but writes a container that
`Container` or `verify` refuses or whose `verify --source` cannot read its source, a `keep` conversion that
succeeds but does not hold its source's tensors bit for bit, and (judged by the engine that runs this) a hang, a
crash or an allocation beyond the worker's memory cap.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import traceback

import xxhash

from corpus import BUNDLE_MAGIC, MAIN_MEMBER, REPO, unpack_bundle

from moepack.cli.common import one_line
from moepack.families.deepseek_v4.kv import KVDirectory, inspect_kv, make_identity, read_kv
from moepack.format_spec.decode import decode_group
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container
from moepack.format_spec.summary import summarize
from moepack.format_spec.verify import verify_container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.fidelity import compare_with_source

# what pyproject.toml installs as moepack
_PACKAGE_DIRS = ("format_spec", "families", "backends", "packer", "runtime", "cli", "moepack")
_FOREIGN_IDENTITY = make_identity("deepseek_v4", {"num_hidden_layers": 1}, container_index_xxh3=1)


class ReadOutsideRegion(AssertionError):
    """Raised by the checking pread when a read made after validation does not lie inside one region."""


class HalfWrittenOutput(AssertionError):
    """A conversion failed but left a file under the output's final name."""


class ConvertedButRefused(AssertionError):
    """A conversion succeeded but wrote a container that moepack's own reader or `verify` refuses."""


class SourceCheckRefused(AssertionError):
    """A conversion succeeded but `verify --source` refuses the source it was converted from."""


class KeptTensorsDiffer(AssertionError):
    """A `keep` conversion succeeded but `verify --source` finds a tensor that is not its source's, bit for bit."""


def _install_read_check() -> None:
    """Every read a validated container makes (tensor bytes, verify's chunks) must lie inside one of its regions:
    the validator's whole point is that a file's numbers can never steer a read elsewhere."""
    if getattr(Container.pread, "_checks_regions", False):
        return
    unchecked = Container.pread

    def pread(self, offset, length, part=0):
        regions = getattr(self, "regions", None)
        if regions is not None and length and not any(
                r.part == part and r.offset <= offset and offset + length <= r.end for r in regions):
            raise ReadOutsideRegion(f"read [{offset}, +{length}) of part {part} lies outside every region")
        return unchecked(self, offset, length, part)

    pread._checks_regions = True
    Container.pread = pread


_install_read_check()


def exercise_container(path: str, stage: list[str]) -> None:
    stage[0] = "open"
    with Container(path) as c:
        stage[0] = "inspect"
        json.dumps(summarize(c))
        json.dumps(c.parts_summary())
        for block in c.blocks:  # the reads a prefill plans: every run of experts, cut where a part file changes
            for first, count in block.split_runs([(0, len(block.experts))] if block.experts else []):
                span = block.expert_read(first, count)
                if span.part == 0:
                    block.expert_span(first, count)
        for number in range(len(c.layers)):
            c.layer(number)
    stage[0] = "verify"
    verify_container(path)
    stage[0] = "decode"
    with Container(path) as c:
        for region in c.regions:
            decode_group(region.tensors, lambda t: c.tensor_bytes(t.name, check=False))
        for name in c.tensors:
            c.read_tensor(name)


def exercise_kv(path: str, stage: list[str]) -> None:
    stage[0] = "open"
    directory = KVDirectory(path)
    stage[0] = "inspect"
    json.dumps(inspect_kv(path, verify=True))
    stage[0] = "stream"
    for layer in range(directory.num_layers):
        if directory.layer_complete(layer):
            directory.layer(layer)
    directory.result()
    stage[0] = "identity"
    directory.check_identity(directory.identity)
    directory.check_prompt(directory.token_ids)
    try:
        directory.check_identity(_FOREIGN_IDENTITY)
    except MoepackError:
        pass
    if not directory.incomplete_layers():
        stage[0] = "read"
        kv = read_kv(path, expect_identity=directory.identity, expect_prompt=directory.token_ids)
        kv.new_tokens(list(kv.token_ids) + [0])


def exercise_checkpoint(path: str, stage: list[str]) -> None:
    from moepack.cli.plan_bench import plan

    stage[0] = "plan"
    with plan.make_context("plan", [path, "--json"]) as context, contextlib.redirect_stdout(io.StringIO()):
        plan.callback.__wrapped__(**context.params)  # (under reports_errors, which would exit)
    convert_and_check(path, stage)


# The policies a source input is converted under (picked by a hash of its files: a replay converts it the same way);
# `keep` most often, being the one whose output verify --source must find identical to its source.
_SOURCE_POLICIES = ("keep", "keep", "keep", "bf16", "fp4", "nvfp4", "q8", "q2")


def convert_and_check(src: str, stage: list[str]) -> None:
    """`moepack convert SRC` into a fresh folder beside the input; where it succeeds, the container opened and
    verified and compared with its source (`verify --source`)."""
    policy = _SOURCE_POLICIES[_files_hash(src if os.path.isdir(src) else os.path.dirname(src))
                              % len(_SOURCE_POLICIES)]
    out = os.path.join(os.path.dirname(os.path.abspath(src)), "output", "model.moepack")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    stage[0] = "convert"
    try:
        convert_checkpoint(src, out, policy=policy, progress=False)
    except BaseException:
        # (OUT.partial and its journal are kept on purpose: a rerun resumes from them)
        left = [n for n in os.listdir(os.path.dirname(out)) if n.startswith("model.moepack") and ".partial" not in n]
        if left:
            raise HalfWrittenOutput(f"the failed conversion left {left}") from None
        raise
    stage[0] = "output"
    try:
        with Container(out) as c:
            json.dumps(summarize(c))
        verify_container(out)
    except MoepackError as e:
        raise ConvertedButRefused(f"convert succeeded, but its output is refused: {e}") from None
    stage[0] = "compare"
    try:
        check = compare_with_source(out, src, progress=False)
    except MoepackError as e:
        raise SourceCheckRefused(f"convert succeeded, but verify --source cannot read its source: {e}") from None
    if policy == "keep" and not check["ok"]:
        raise KeptTensorsDiffer(f"verify --source after a keep conversion: {check['failures'][:3]}")


def _files_hash(folder: str) -> int:
    digest = xxhash.xxh3_64()
    for name in sorted(os.listdir(folder)):
        digest.update(name.encode())
        with open(os.path.join(folder, name), "rb") as f:
            digest.update(f.read())
    return digest.intdigest()


SOURCE_TARGETS = ("checkpoint", "gguf")
EXERCISES = {"container": exercise_container, "kv": exercise_kv, "checkpoint": exercise_checkpoint,
             "gguf": convert_and_check}


def materialize(target: str, data: bytes, scratch: str) -> str:
    """Put the input where the operations read it, in a fresh folder (no file of an earlier input may linger): a
    container file, a multi-part container's files, a KV or checkpoint directory, or a GGUF's files, unpacked from
    their bundle. A source's folder is `<target>/source`, its conversion goes to `<target>/output`."""
    folder = os.path.join(scratch, target)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    if target in SOURCE_TARGETS:
        files = unpack_bundle(data)
        source = os.path.join(folder, "source")
        os.makedirs(source)
        for name, content in files.items():
            with open(os.path.join(source, name), "wb") as f:
                f.write(content)
        if target == "checkpoint":
            return source
        # the GGUF converted: the first file (a split's first part), or a name that is none when the input has none
        return os.path.join(source, min(files, default="missing.gguf"))
    if target == "kv":
        files = unpack_bundle(data)
    elif data.startswith(BUNDLE_MAGIC):
        files = {("input.moepack" if name == MAIN_MEMBER else f"input.moepack.{name}"): content
                 for name, content in unpack_bundle(data).items()}
    else:
        files = {"input.moepack": data}
    for name, content in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(content)
    return folder if target == "kv" else os.path.join(folder, "input.moepack")


def innermost_project_frame(frames) -> str:
    """'families/deepseek_v4/kv.py:612 _decode_layer' for the deepest frame in moepack's own code (not the harness, not
    a test); `frames` is a list of (filename, line, function), outermost first."""
    for filename, line, function in reversed(frames):
        relative = os.path.relpath(os.path.abspath(filename), REPO)
        if relative.split(os.sep)[0] in _PACKAGE_DIRS:
            return f"{relative}:{line} {function}"
    return "(no moepack frame)"


def run_one(target: str, path: str) -> dict:
    """Run the operations on one materialized input and judge the outcome."""
    stage = ["start"]
    try:
        EXERCISES[target](path, stage)
    except MoepackError as e:
        message = str(e)
        if target in SOURCE_TARGETS:  # only the command line shows these, as one line (control characters escaped)
            message = one_line(message)
        if message and "\n" not in message:
            return {"status": "error", "stage": stage[0], "message": message}
        return _failure(e, stage[0], "empty message" if not message else "multi-line message")
    except Exception as e:  # noqa: BLE001 - every other exception (MemoryError, RecursionError too) is a finding
        return _failure(e, stage[0])
    return {"status": "ok", "stage": stage[0], "message": ""}


def _failure(e: BaseException, stage: str, problem: str | None = None) -> dict:
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(e.__traceback__)]
    kind = type(e).__name__ + (f" ({problem})" if problem else "")
    frame = innermost_project_frame(frames)
    return {"status": "failure", "stage": stage, "kind": kind, "frame": frame, "key": f"{kind} @ {frame}",
            "message": f"{type(e).__name__}: {str(e)[:500]}",
            "traceback": "".join(traceback.format_exception(e))[-8000:]}


_VOLATILE = [(re.compile(r"[0-9a-f]{16}"), "H"), (re.compile(r"\d+"), "N"), (re.compile(r"'[^']*'"), "'S'"),
             (re.compile(r'"[^"]*"'), '"S"')]


def behaviour_signature(target: str, outcome: dict, scratch: str) -> str:
    """What kind of thing happened, with the input's numbers and names stripped: a new signature means the input
    reached behaviour the corpus had not shown yet (the mutation engine's only guidance)."""
    message = outcome.get("kind") or outcome["message"].replace(scratch, "<input>")
    for pattern, replacement in _VOLATILE:
        message = pattern.sub(replacement, message)
    return f"{target}|{outcome['status']}|{outcome['stage']}|{message[:120]}"
