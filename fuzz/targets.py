"""What the harness does with one input, and how it judges the outcome.

Each input goes through what a user would do with it. A container: open it (strict validation), `moepack inspect`'s
summary, walk every block and expert span, `moepack verify`, then read and decode every tensor region by region
(as the runtime does). A KV directory: open the manifest, `moepack kv inspect` (which checks every complete layer),
stream the complete layers one by one, `read_kv`, identity and prompt checks.

Good outcomes: no error, or moepack's own error (a MoepackError, message non-empty and one line). Anything else is
a failure: another exception type, a multi-line or empty message, a read outside the region a tensor belongs to,
and (judged by the engine that runs this) a hang, a crash or an allocation beyond the worker's memory cap.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import traceback

from corpus import BUNDLE_MAGIC, MAIN_MEMBER, REPO, unpack_bundle

from moepack.families.deepseek_v4.kv import KVDirectory, inspect_kv, make_identity, read_kv
from moepack.format_spec.decode import decode_group
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container
from moepack.format_spec.summary import summarize
from moepack.format_spec.verify import verify_container

# what pyproject.toml installs as moepack
_PACKAGE_DIRS = ("format_spec", "families", "backends", "packer", "runtime", "cli", "moepack")
_FOREIGN_IDENTITY = make_identity("deepseek_v4", {"num_hidden_layers": 1}, container_index_xxh3=1)


class ReadOutsideRegion(AssertionError):
    """Raised by the checking pread when a read made after validation does not lie inside one region."""


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


EXERCISES = {"container": exercise_container, "kv": exercise_kv}


def materialize(target: str, data: bytes, scratch: str) -> str:
    """Put the input where the operations read it, in a fresh folder (no file of an earlier input may linger): a
    container file, a multi-part container's files, or a KV directory, unpacked from their bundle."""
    folder = os.path.join(scratch, target)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
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
