"""Resolve the SRC of `moepack convert SRC`: a local checkpoint directory, or a Hugging Face model repo id.

A hub repo is read through huggingface_hub, which gives us its cache (a second run downloads nothing, an interrupted
run only fetches the files it had not finished), HF_TOKEN / HF_HUB_OFFLINE / HF_ENDPOINT / HF_HOME handling, Xet
transfers and its byte-rate progress bars. What this module adds:

* pinning: the branch or tag is resolved to its commit sha first (HfApi.resolve_revision, which also records it in
  the cache, so that HF_HUB_OFFLINE=1 later resolves the same branch to the same sha) and only that sha is
  downloaded, so the container's provenance records exactly what was read;
* timeouts: huggingface_hub's shared HTTP client waits forever by default; every request through it gets a connect
  timeout (HF_HUB_ETAG_TIMEOUT) and a read timeout (HF_HUB_DOWNLOAD_TIMEOUT), and API calls are retried;
* only the files a conversion needs: config.json, model.safetensors.index.json, the shards the index lists (or the
  top-level ``*.safetensors`` of an unsharded repo), the tokenizer files and generation_config.json -- never
  ``original/``, README, ``*.bin`` or duplicate consolidated weights;
* checks before and after the download (every shard the index lists is in the repo / on disk) and one-line
  MoepackErrors for everything a user can meet: unknown repo or revision, gated or private repo, bad token,
  network down, offline with nothing cached, a file the repo lacks.

``iter_shards_as_they_arrive`` downloads the shards one at a time in a background thread, in the order the caller
will read them, and hands each one over as soon as it is complete, so conversion can overlap the download.
``open_source(..., stream=True)`` is what `moepack convert` reads: the tensors of a hub checkpoint known from the
hub's safetensors metadata before any shard is here, the shards fetched in the order the conversion needs them (into
a scratch folder, each deleted once converted, with keep_source=False).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

from moepack.format_spec import untrusted
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.files import remove_stale_temporaries, temporary_prefix

from .source import INDEX_FILE, index_weight_map, weight_files

# The small files a conversion reads besides the shards, in the order they are fetched.
SMALL_FILES = ("config.json", INDEX_FILE, "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")
# What a conversion needs from a repo, as huggingface_hub allow_patterns (documentation; the download itself asks for
# the exact names, so that a sub-folder's or a duplicate's *.safetensors is never fetched).
ALLOW_PATTERNS = ("*.safetensors",) + SMALL_FILES

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
_FULL_SHA = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ResolvedSource:
    """A checkpoint directory ready to convert, and where it came from.

    provenance = {"source": repo id or absolute path, "revision": 40-hex commit sha (None for a local directory),
                  "files": {name: {"size": int, "sha256": hex str or None}}}; sha256 is the LFS sha256 the hub
    reports (None for files the hub keeps in git, and for every file of a local directory).
    """

    local_dir: str
    provenance: dict = field(default_factory=dict)


def looks_like_repo_id(src: str) -> bool:
    return bool(_REPO_ID.match(src)) and ".." not in src and "--" not in src and len(src) <= 96 + 1 + 96


def resolve_source(src: str, revision: str | None = None, progress: bool = True, *,
                   cache_dir: str | None = None) -> ResolvedSource:
    """A local directory (used as is) or a hub repo id ``owner/name`` (downloaded, pinned, into the HF cache).

    `cache_dir` defaults to huggingface_hub's (HF_HUB_CACHE, else HF_HOME/hub). Raises MoepackError (one line)."""
    if os.path.exists(src):
        return _resolve_local(src, revision)
    if os.path.lexists(src):  # (exists() is False for it: not a repo id to look up)
        raise MoepackError(f"{src}: a symbolic link that leads nowhere (a loop, or its target is gone)")
    if not looks_like_repo_id(src):
        raise MoepackError(f"{src}: no such directory (and not a Hugging Face repo id, which is owner/name)")
    plan = _HubPlan.make(src, revision, cache_dir)
    if plan.offline:
        return plan.source()
    with _hub_errors(plan.repo, plan.revision):
        _snapshot(plan, plan.small + plan.shards, progress)
    plan.finish()
    return plan.source()


def hub_revision(revision: str | None) -> str:
    """The revision to resolve (None: the default branch), refused where it cannot name a branch, tag or commit:
    empty (a script's unset variable, taken for main), or a path out of the cache's refs folder (`../refs/main`
    read another ref offline), or with whitespace or control characters (git refuses all of these in ref names)."""
    from huggingface_hub import constants

    if revision is None:
        return constants.DEFAULT_REVISION
    bad = (not revision or ".." in revision or revision.startswith(("/", "-")) or revision.endswith(("/", "."))
           or "//" in revision or any(ch.isspace() or ord(ch) < 32 or ch in "\\~^:?*[" for ch in revision))
    if bad:
        raise MoepackError(f"--revision {revision!r}: not a branch, tag or commit name")
    return revision


def fetch_config(repo: str, revision: str | None = None, *, cache_dir: str | None = None) -> str:
    """The path of hub repo `repo`'s config.json, downloading that file alone into the Hugging Face cache (what
    `moepack plan` needs of a repo). With HF_HUB_OFFLINE=1, or when the hub cannot be reached, the cached copy is
    used (huggingface_hub's local_files_only); MoepackError (one line) when there is none."""
    from huggingface_hub import HfApi, constants, hf_hub_download

    if not looks_like_repo_id(repo):
        raise MoepackError(f"{repo}: not a Hugging Face repo id (owner/name)")
    _install_timeouts()
    rev = hub_revision(revision)
    if constants.is_offline_mode():
        cached = _cached_file(repo, "config.json", rev, cache_dir)
        if cached is None:
            raise MoepackError(f"HF_HUB_OFFLINE is set and {repo}@{rev}'s config.json is not in the local cache "
                               f"({cache_dir or constants.HF_HUB_CACHE}); fetch it once with network access")
        return cached
    with _hub_errors(repo, rev):
        # the commit first, as convert asks it (hf_hub_download retries an unreachable hub itself for half a minute,
        # each try a warning on stderr, and the tries here would triple that): the hub out of reach, the cached copy
        try:
            sha = _with_retries(lambda: HfApi().resolve_revision(repo, revision=rev, cache_dir=cache_dir)).resolved
        except Exception as e:
            if not _transient(e):
                raise
            cached = _cached_file(repo, "config.json", rev, cache_dir)
            if cached is None:  # the hub's failure is the one to name
                raise
            return cached
        return _with_retries(lambda: hf_hub_download(repo, "config.json", revision=sha or rev, cache_dir=cache_dir))


def _cached_file(repo: str, name: str, revision: str, cache_dir: str | None) -> str | None:
    """The Hugging Face cache's copy of a repo's file at `revision` (a branch as its cached ref says), or None."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo, name, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except Exception:  # noqa: BLE001 - huggingface_hub's own types: not cached, a bad cache entry
        return None


SCRATCH_AHEAD = 1  # shards downloaded ahead of the one being converted when each is deleted after its conversion


def open_source(src: str, revision: str | None = None, progress: bool = True, stream: bool = False,
                keep_source: bool = True, scratch_parent: str | None = None):
    """(source, provenance) for any source the converter takes: a llama.cpp deepseek4 GGUF file (or its first
    split), a local checkpoint directory, a hub repo id. The source is a GGUFSource, a CheckpointDir or (a hub repo
    with `stream`, shards still to download) a StreamedCheckpoint; close it.

    `keep_source=False` (hub repos only, with `stream`): the shards go to a scratch folder in `scratch_parent`,
    each deleted once the caller release()s it, the folder when the source closes."""
    from .gguf_source import GGUFSource, is_gguf
    from .source import CheckpointDir

    local = is_gguf(src) or os.path.lexists(src)
    if local and not keep_source:
        raise MoepackError(f"--no-keep-source deletes the shards it downloads; {src} is a local file or directory, "
                           f"which is never deleted")
    if is_gguf(src):
        if revision is not None:
            raise MoepackError(f"--revision {revision} applies to Hugging Face repos, but {src} is a GGUF file")
        source = GGUFSource(src)
        return source, source.provenance
    if local or not stream:
        resolved = resolve_source(src, revision=revision, progress=progress)
        return CheckpointDir(resolved.local_dir), resolved.provenance
    if not looks_like_repo_id(src):
        raise MoepackError(f"{src}: no such directory (and not a Hugging Face repo id, which is owner/name)")
    scratch = None
    if not keep_source and _offline():
        # the scratch folder is a cache of its own, empty: offline, nothing could come into it
        raise MoepackError(f"--no-keep-source downloads {src}'s shards into a scratch folder and deletes each once "
                           f"converted, but HF_HUB_OFFLINE is set: convert from the local cache without "
                           f"--no-keep-source, or unset HF_HUB_OFFLINE")
    if not keep_source:  # a killed conversion's downloads: its rerun downloads what it still needs again
        remove_stale_temporaries(scratch_parent or tempfile.gettempdir(), ("moepack-download",))
        scratch = tempfile.mkdtemp(prefix=temporary_prefix("moepack-download"), dir=scratch_parent)
    try:
        plan = _HubPlan.make(src, revision, scratch)
        source = plan.source()
        if all(plan.has_file(s) for s in plan.shards):  # offline, or every shard already in the cache
            return CheckpointDir(source.local_dir), source.provenance
        return _streamed(plan, progress, scratch), source.provenance
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def _streamed(plan: "_HubPlan", progress: bool, scratch: str | None):
    """A StreamedCheckpoint of `plan`'s shards: every tensor from the hub's safetensors metadata (a shard already in
    the cache: from its own header), checked against the index's weight map."""
    from huggingface_hub import HfApi

    from .source import SourceTensor, StreamedCheckpoint, check_weight_map, read_safetensors_header

    def listing(shard: str) -> dict[str, tuple[str, tuple, int]]:
        if plan.has_file(shard):
            header = read_safetensors_header(os.path.join(plan.snapshot_dir, shard))
            return {k: (t.dtype, t.shape, t.length) for k, t in header.items()}
        with _hub_errors(plan.repo, plan.revision):
            meta = _with_retries(lambda: HfApi().parse_safetensors_file_metadata(
                plan.repo, shard, revision=plan.sha, timeout=_api_timeout()))
        out = {}
        for key, info in meta.tensors.items():
            begin, end = info.data_offsets
            out[key] = (info.dtype, tuple(info.shape), end - begin)
        return out

    with ThreadPoolExecutor(8, thread_name_prefix="moepack-hub-metadata") as pool:
        shard_listings = dict(zip(plan.shards, pool.map(listing, plan.shards)))
    tensors: dict[str, SourceTensor] = {}
    for shard, entries in shard_listings.items():
        for key, (dtype, shape, length) in entries.items():
            if key in tensors:
                raise MoepackError(f"{plan.repo}: tensor {key} is in both {os.path.basename(tensors[key].file)} "
                                   f"and {shard}")
            # the offset is the file's own header's to say, once the shard is here
            tensors[key] = SourceTensor(key, dtype, shape, os.path.join(plan.snapshot_dir, shard), -1, length)
    index = os.path.join(plan.snapshot_dir, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = untrusted.load_file(index, INDEX_FILE)["weight_map"]  # checked by _index_shards already
        check_weight_map(weight_map, tensors, where=f"{plan.repo}: ")

    def start_feed(order: list[str], ahead: int | None) -> ShardFeed:
        return ShardFeed(plan.source(), order, plan, progress, ahead=ahead)

    return StreamedCheckpoint(plan.snapshot_dir, tensors, {s: plan.files[s]["size"] for s in plan.shards},
                              start_feed, scratch=scratch, ahead=SCRATCH_AHEAD if scratch is not None else None)


# ----------------------------------------------------------------------------------------------------------- local


def _resolve_local(src: str, revision: str | None) -> ResolvedSource:
    path = os.path.abspath(src)
    if revision is not None:
        raise MoepackError(f"--revision {revision} applies to Hugging Face repos, but {src} is a local directory")
    if not os.path.isdir(path):
        raise MoepackError(f"{src}: not a directory" + (" (nor a GGUF file: too short for its magic)"
                                                        if src.endswith(".gguf") else ""))
    listing = [n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))]
    names = [n for n in SMALL_FILES if n in listing]
    shards = weight_files(listing, lambda: _index_shards(os.path.join(path, INDEX_FILE), where=path))
    for shard in shards:
        if not os.path.isfile(os.path.join(path, shard)):
            raise MoepackError(f"{path}: {INDEX_FILE} lists shard {shard}, which is not in the directory")
    files = {n: {"size": os.path.getsize(os.path.join(path, n)), "sha256": None} for n in names + shards}
    return ResolvedSource(local_dir=path, provenance={"source": path, "revision": None, "files": files})


def _index_shards(index_path: str, where: str) -> list[str]:
    """The shard names an index lists, sorted; MoepackError if the index is unreadable or points outside."""
    try:
        index = untrusted.load_file(index_path, INDEX_FILE)
    except MoepackError as e:
        raise MoepackError(f"{where}: {e}") from None
    except OSError as e:
        raise MoepackError(f"{where}: cannot read {INDEX_FILE} ({e.strerror or e})") from None
    return index_weight_map(index, f"{where}: ")[1]


# ------------------------------------------------------------------------------------------------------------- hub


@dataclass
class _HubPlan:
    """A hub repo pinned to one commit: which files to fetch and what the hub says about them."""

    repo: str
    revision: str  # as asked (branch, tag or sha)
    sha: str
    cache_dir: str
    snapshot_dir: str
    small: list[str]
    shards: list[str]
    files: dict  # name -> {"size", "sha256"}
    offline: bool

    @classmethod
    def make(cls, repo: str, revision: str | None, cache_dir: str | None) -> "_HubPlan":
        from huggingface_hub import constants

        _install_timeouts()
        rev = hub_revision(revision)
        cache = os.path.abspath(os.path.expanduser(cache_dir or constants.HF_HUB_CACHE))
        if _offline():
            return cls._from_cache(repo, rev, cache)
        return cls._from_hub(repo, rev, cache)

    # -- online: ask the hub, fetch the small files, check the index against the repo before any big download

    @classmethod
    def _from_hub(cls, repo: str, rev: str, cache: str) -> "_HubPlan":
        from huggingface_hub import HfApi

        with _hub_errors(repo, rev):
            # the branch's commit, recorded in the cache's refs for offline runs; then the file listing at it
            resolved = _with_retries(lambda: HfApi().resolve_revision(repo, revision=rev, cache_dir=cache))
            sha = str(resolved.resolved or "").lower()
            if _FULL_SHA.match(sha):
                info = _with_retries(lambda: HfApi().model_info(repo, revision=sha, files_metadata=True,
                                                                timeout=_api_timeout()))
                sha = (info.sha or "").lower()
        if not _FULL_SHA.match(sha):
            raise MoepackError(f"{repo}@{rev}: the hub did not report a commit sha "
                               f"(is HF_ENDPOINT a Hugging Face hub?)")
        listed = {}
        for s in info.siblings or []:
            lfs = s.lfs
            size = lfs.size if lfs is not None else s.size
            listed[s.rfilename] = {"size": size, "sha256": lfs.sha256.lower() if lfs is not None else None}
        at = f"{repo}@{sha[:12]}"
        if "config.json" not in listed:
            raise MoepackError(f"{at}: the repo has no config.json")
        small = [n for n in SMALL_FILES if n in listed]
        plan = cls(repo=repo, revision=rev, sha=sha, cache_dir=cache, snapshot_dir="", small=small, shards=[],
                   files={}, offline=False)
        plan.files = {n: listed[n] for n in small}
        with _hub_errors(repo, rev):
            plan.snapshot_dir = _snapshot(plan, small, progress=False)
        for name in small:
            plan.check_file(name)
        shards = weight_files([n for n in listed if "/" not in n],
                              lambda: _index_shards(os.path.join(plan.snapshot_dir, INDEX_FILE), where=at))
        absent = [s for s in shards if s not in listed]
        if absent:
            more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
            raise MoepackError(f"{at}: {INDEX_FILE} lists shard {absent[0]}{more}, which the repo does not have")
        if not shards:
            raise MoepackError(f"{at}: the repo has no *.safetensors weights at its top level")
        plan.shards = shards
        plan.files = {n: listed[n] for n in small + shards}
        return plan

    # -- offline (HF_HUB_OFFLINE=1): the same answer from the cache alone

    @classmethod
    def _from_cache(cls, repo: str, rev: str, cache: str) -> "_HubPlan":
        from huggingface_hub import HfApi
        from huggingface_hub.file_download import repo_folder_name

        from .source import missing_numbered_shards

        not_cached = (f"HF_HUB_OFFLINE is set and {repo}@{rev} is not in the local cache ({cache}); "
                      f"download it once with network access")
        try:
            sha = str(HfApi().resolve_revision(repo, revision=rev, cache_dir=cache, local_files_only=True).resolved)
        except Exception:
            raise MoepackError(not_cached) from None
        sha = sha.strip().lower()
        storage = os.path.join(cache, repo_folder_name(repo_id=repo, repo_type="model"))
        snap = os.path.join(storage, "snapshots", sha)
        if not _FULL_SHA.match(sha) or not os.path.isdir(snap):
            raise MoepackError(not_cached)
        at = f"{repo}@{sha[:12]}"
        small = [n for n in SMALL_FILES if os.path.isfile(os.path.join(snap, n))]
        missing = [] if "config.json" in small else ["config.json"]
        if not missing:
            shards = weight_files(os.listdir(snap), lambda: _index_shards(os.path.join(snap, INDEX_FILE), where=at))
            if not shards:
                missing.append("*.safetensors")
            if INDEX_FILE not in small:
                missing += missing_numbered_shards(shards)  # no index: the shards' own numbering
            missing += [s for s in shards if not os.path.isfile(os.path.join(snap, s))]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise MoepackError(f"HF_HUB_OFFLINE is set and the cached snapshot of {at} is incomplete (missing "
                               f"{missing[0]}{more}); rerun with network access to finish the download")
        files = {}
        for n in small + shards:
            p = os.path.join(snap, n)
            files[n] = {"size": os.path.getsize(p), "sha256": _sha256_from_blob_name(p)}
        return cls(repo=repo, revision=rev, sha=sha, cache_dir=cache, snapshot_dir=snap, small=small, shards=shards,
                   files=files, offline=True)

    def source(self) -> ResolvedSource:
        return ResolvedSource(local_dir=self.snapshot_dir,
                              provenance={"source": self.repo, "revision": self.sha, "files": dict(self.files)})

    def has_file(self, name: str) -> bool:
        """Whether the file is in the snapshot at the size the hub reported."""
        p = os.path.join(self.snapshot_dir, name)
        want = self.files.get(name, {}).get("size")
        return os.path.isfile(p) and (want is None or os.path.getsize(p) == want)

    def check_file(self, name: str) -> str:
        """The downloaded file's path, after checking it is there at the size the hub reported."""
        p = os.path.join(self.snapshot_dir, name)
        if not os.path.isfile(p):
            raise MoepackError(f"{self.repo}@{self.sha[:12]}: {name} is missing after the download")
        if not self.has_file(name):
            want = self.files[name]["size"]
            raise MoepackError(f"{self.repo}@{self.sha[:12]}: {name} is {os.path.getsize(p)} bytes, the hub says "
                               f"{want}; delete it from {self.cache_dir} and retry")
        return p

    def finish(self) -> None:
        """Check every shard arrived."""
        for name in self.shards:
            self.check_file(name)


def _snapshot(plan: _HubPlan, names: list[str], progress: bool) -> str:
    import glob

    from huggingface_hub import snapshot_download

    return snapshot_download(plan.repo, revision=plan.sha, cache_dir=plan.cache_dir,
                             allow_patterns=[glob.escape(n) for n in names], tqdm_class=_tqdm_class(progress))


@functools.lru_cache(maxsize=None)
def _tqdm_class(progress: bool):
    """progress=True: huggingface_hub's bars (they honour HF_HUB_DISABLE_PROGRESS_BARS and stay off when stderr is not
    a terminal), with bytes/s on the byte bars -- snapshot_download's aggregate bars only show a rate for Xet
    transfers. progress=False: no bars at all."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class RateBars(hf_tqdm):
        def __init__(self, *args, **kwargs):
            fmt = kwargs.get("bar_format")
            if kwargs.get("unit") == "B" and fmt:
                kwargs["bar_format"] = ("{l_bar}{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]"
                                        if "{total_fmt" in fmt else "{desc}: {n_fmt}B [{elapsed}, {rate_fmt}]")
            super().__init__(*args, **kwargs)

    class QuietBars(hf_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return RateBars if progress else QuietBars


def _sha256_from_blob_name(path: str) -> str | None:
    """In huggingface_hub's cache an LFS file's blob is named by its sha256 (the hub's etag for LFS files)."""
    try:
        name = os.path.basename(os.readlink(path))
    except OSError:
        return None
    return name if _SHA256.match(name) else None


# ------------------------------------------------------------------------------------------- shards as they arrive


class ShardFeed:
    """Shards of a resolved source, handed over one by one as their download completes (see
    iter_shards_as_they_arrive). Iterating yields (shard name, path) in download order; `wait(name)` blocks for one
    shard. A failed download raises its MoepackError from `wait` / the iteration. Use as a context manager, or call
    close(), to stop the download thread early.

    `ahead`: download shard k only once shard k - ahead has been waited for (bounds the shards on disk that no one
    has started to read; None: download as fast as the network allows)."""

    def __init__(self, source: ResolvedSource, shards: list[str], plan: _HubPlan | None, progress: bool,
                 ahead: int | None = None):
        self.source = source
        self.shards = list(shards)
        self._plan = plan
        self._progress = progress
        self._ahead = ahead
        self._waited = -1  # the furthest shard (by position) a reader has waited for
        self._moved = threading.Condition()
        self._done = {s: threading.Event() for s in self.shards}
        self._paths: dict[str, str] = {}
        self._errors: dict[str, MoepackError] = {}
        self._stop = threading.Event()
        self._thread = None
        if plan is None or plan.offline:  # everything is already on disk
            for s in self.shards:
                self._paths[s] = os.path.join(source.local_dir, s)
                self._done[s].set()
        else:
            self._thread = threading.Thread(target=self._run, name="moepack-shard-download", daemon=True)
            self._thread.start()

    @property
    def local_dir(self) -> str:
        return self.source.local_dir

    @property
    def provenance(self) -> dict:
        return self.source.provenance

    def _run(self) -> None:
        from huggingface_hub import hf_hub_download

        plan = self._plan
        failed: MoepackError | None = None
        for position, shard in enumerate(self.shards):
            if self._ahead is not None:
                with self._moved:
                    self._moved.wait_for(lambda: position <= self._waited + self._ahead or self._stop.is_set())
            if failed is None and self._stop.is_set():
                failed = MoepackError(f"{plan.repo}: download of {shard} cancelled")
            if failed is None:
                try:
                    with _hub_errors(plan.repo, plan.revision):
                        hf_hub_download(plan.repo, shard, revision=plan.sha, cache_dir=plan.cache_dir,
                                        tqdm_class=_tqdm_class(self._progress))
                    self._paths[shard] = plan.check_file(shard)
                except MoepackError as e:
                    failed = e
                except BaseException as e:  # never leave a waiter hanging
                    why = _one_line(e) or type(e).__name__
                    failed = MoepackError(f"{plan.repo}: downloading {shard} failed ({why})")
            if failed is not None:
                self._errors[shard] = failed
            self._done[shard].set()

    def wait(self, shard: str, timeout: float | None = None) -> str:
        """The local path of `shard` once it is completely downloaded."""
        event = self._done.get(shard)
        if event is None:
            raise MoepackError(f"{shard} is not a shard of {self.source.provenance.get('source')}")
        with self._moved:
            self._waited = max(self._waited, self.shards.index(shard))
            self._moved.notify_all()
        if not event.wait(timeout):
            raise MoepackError(f"timed out waiting for {shard} to download")
        if shard in self._errors:
            raise self._errors[shard]
        return self._paths[shard]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        for shard in self.shards:
            yield shard, self.wait(shard)

    def close(self, wait: bool = True) -> None:
        """Stop downloading after the file in progress (waiting for it unless wait=False; the thread is a daemon)."""
        self._stop.set()
        with self._moved:
            self._moved.notify_all()
        if wait and self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "ShardFeed":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait=exc_type is None)


def iter_shards_as_they_arrive(src: str, revision: str | None = None, progress: bool = True, *,
                               cache_dir: str | None = None, order: list[str] | None = None) -> ShardFeed:
    """Resolve `src` like resolve_source, but return before the shards are downloaded: a background thread fetches
    them one at a time (in `order`, default: sorted, i.e. index order) and the returned ShardFeed hands each over as
    soon as it is complete. config.json, the index and the tokenizer files are already on disk when this returns, and
    `feed.provenance` is final. A local directory (or an offline cached snapshot) yields its shards at once."""
    if os.path.exists(src):
        source = _resolve_local(src, revision)
        shards = _ordered([n for n in source.provenance["files"] if n.endswith(".safetensors")], order, src)
        return ShardFeed(source, shards, None, progress)
    if not looks_like_repo_id(src):
        raise MoepackError(f"{src}: no such directory (and not a Hugging Face repo id, which is owner/name)")
    plan = _HubPlan.make(src, revision, cache_dir)
    return ShardFeed(plan.source(), _ordered(plan.shards, order, src), plan, progress)


def _ordered(shards: list[str], order: list[str] | None, src: str) -> list[str]:
    if order is None:
        return sorted(shards)
    if sorted(order) != sorted(shards):
        raise MoepackError(f"{src}: the requested shard order does not name exactly the checkpoint's shards")
    return list(order)


# ---------------------------------------------------------------------------------------------------------- errors


def _one_line(e: object) -> str:
    return " ".join(str(e).split())[:300]


API_ATTEMPTS = 3  # a hub API call that timed out, lost its connection or met a 5xx / 429 is tried this often
RETRY_PAUSE_S = 1.0  # ... with pauses of 1 s, then 2 s: a stalled endpoint ends within 3 x timeout + 3 s


def _http():
    try:
        import httpx2 as http  # huggingface_hub >= 2
    except ImportError:  # pragma: no cover - older huggingface_hub (httpx)
        import httpx as http
    return http


def _install_timeouts() -> None:
    """Connect and read timeouts on every request of huggingface_hub's shared client. Its calls pass timeout=None
    unless told otherwise (a stalled endpoint would hold `convert` forever): a request hook gives such a request
    HF_HUB_ETAG_TIMEOUT to connect, and to read an API call's answer (the metadata HF_HUB_ETAG_TIMEOUT is for, as
    _api_timeout), HF_HUB_DOWNLOAD_TIMEOUT to read a file; a request with its own timeout keeps it."""
    from huggingface_hub import get_session

    hooks = get_session().event_hooks
    if _default_timeouts not in hooks["request"]:
        hooks["request"] = [*hooks["request"], _default_timeouts]


def _default_timeouts(request) -> None:
    from huggingface_hub import constants

    given = request.extensions.get("timeout") or {}
    if all(v is None for v in given.values()):
        api_call = str(request.url).startswith(constants.ENDPOINT.rstrip("/") + "/api/")
        read = float(constants.HF_HUB_ETAG_TIMEOUT if api_call else constants.HF_HUB_DOWNLOAD_TIMEOUT)
        request.extensions["timeout"] = {"connect": float(constants.HF_HUB_ETAG_TIMEOUT), "read": read,
                                         "write": read, "pool": read}


def _api_timeout() -> float:
    """Seconds a hub API call may wait: HF_HUB_ETAG_TIMEOUT (huggingface_hub's own setting for its metadata calls,
    10 by default); downloads keep HF_HUB_DOWNLOAD_TIMEOUT, which huggingface_hub applies itself."""
    from huggingface_hub import constants

    return float(constants.HF_HUB_ETAG_TIMEOUT)


def _transient(exc: BaseException) -> bool:
    """A failure worth another try: a timeout, a dropped or refused connection, HTTP 5xx or 429."""
    http = _http()
    for e in _chain(exc):
        if isinstance(e, (http.TimeoutException, http.NetworkError, ConnectionError, TimeoutError)):
            return True
        response = getattr(e, "response", None)
        if response is not None and (response.status_code >= 500 or response.status_code == 429):
            return True
    return False


def _with_retries(call):
    """call(), tried up to API_ATTEMPTS times while it fails transiently, with growing pauses."""
    for attempt in range(API_ATTEMPTS):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - _hub_errors names it after the last try
            if attempt == API_ATTEMPTS - 1 or not _transient(e):
                raise
            time.sleep(RETRY_PAUSE_S * 2 ** attempt)


class _hub_errors:
    """Turn whatever huggingface_hub / the network raises into one MoepackError line."""

    def __init__(self, repo: str, revision: str):
        self.repo, self.revision = repo, revision

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, MoepackError):
            return False
        raise MoepackError(_describe(exc, self.repo, self.revision)) from None


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    pending = [exc]
    while pending:
        e = pending.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        pending += [e.__cause__, e.__context__]
    return out


def _describe(exc: Exception, repo: str, revision: str) -> str:
    from huggingface_hub import constants, errors

    http = _http()

    def err(name):  # a class that never matches when this huggingface_hub lacks it
        return getattr(errors, name, None) or type(name, (Exception,), {})

    GatedRepoError, HfHubHTTPError = err("GatedRepoError"), err("HfHubHTTPError")
    HFValidationError = err("HFValidationError")
    IncompleteSnapshotError, OfflineModeIsEnabled = err("IncompleteSnapshotError"), err("OfflineModeIsEnabled")
    RepositoryNotFoundError, RevisionNotFoundError = err("RepositoryNotFoundError"), err("RevisionNotFoundError")
    RemoteEntryNotFoundError = err("RemoteEntryNotFoundError")
    chain = _chain(exc)

    def find(*types):
        return next((e for e in chain if isinstance(e, types)), None)

    endpoint = constants.ENDPOINT
    url = f"{endpoint}/{repo}"
    if find(OfflineModeIsEnabled):
        return (f"HF_HUB_OFFLINE is set and {repo}@{revision} is not (completely) in the local cache; "
                f"download it once with network access")
    if (e := find(GatedRepoError)) is not None:
        code = e.response.status_code if e.response is not None else "401/403"
        return (f"{repo} is a gated repo (HTTP {code}): accept its terms at {url} and set HF_TOKEN to a token "
                f"of an account that has access")
    if find(RevisionNotFoundError):
        return f"{repo}: revision {revision!r} not found on the hub (give a branch, a tag or a commit sha)"
    if (e := find(RepositoryNotFoundError)) is not None:
        return (f"{repo}: no such local directory, and the hub has no model repo {repo} (if it is private, set "
                f"HF_TOKEN to a token with access)")
    if (e := find(RemoteEntryNotFoundError)) is not None:
        name = str(e.response.url).rsplit("/", 1)[-1] if e.response is not None else "a file"
        return f"{repo}@{revision}: the repo does not have {name}"
    if (e := find(HfHubHTTPError)) is not None and e.response is not None:
        code = e.response.status_code
        server_msg = e.response.headers.get("X-Error-Message")
        detail = f": {_one_line(server_msg)}" if server_msg else ""
        if code == 401:
            return f"{repo}: the hub rejected the token (HTTP 401{detail}); check HF_TOKEN"
        if code == 403:
            return f"{repo}: access denied by the hub (HTTP 403{detail}); check HF_TOKEN and the repo's access rights"
        if code >= 500:
            return f"{repo}: the hub at {endpoint} failed (HTTP {code}); try again later (a rerun resumes)"
        return f"{repo}: the hub answered HTTP {code}{detail} for {e.response.url}"
    if (e := find(http.TimeoutException)) is not None:
        return (f"cannot reach the Hugging Face hub at {endpoint} (timed out); check the network, or set "
                f"HF_HUB_OFFLINE=1 to use an already downloaded snapshot")
    if (e := find(http.ProxyError)) is not None:
        return f"cannot reach the Hugging Face hub at {endpoint} through the proxy ({_one_line(e)})"
    if (e := find(http.ConnectError, http.NetworkError, ConnectionError)) is not None:
        why = _one_line(e) or "connection failed"
        return (f"network unavailable: cannot reach the Hugging Face hub at {endpoint} ({why}); "
                f"check the network, or set HF_HUB_OFFLINE=1 to use an already downloaded snapshot")
    if (e := find(http.TransportError)) is not None:
        return f"download from {endpoint} failed ({type(e).__name__}: {_one_line(e)}); rerun to resume"
    if (e := find(IncompleteSnapshotError)) is not None:
        return f"{repo}@{revision}: the cached snapshot is incomplete and the hub cannot be reached"
    if (e := find(HFValidationError)) is not None:
        return f"{repo}: not a valid Hugging Face repo id ({_one_line(e)})"
    if (e := find(OSError)) is not None:
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        return f"{repo}: download failed: {_one_line(e.strerror or e)}{where}"
    return f"{repo}: download failed ({type(exc).__name__}: {_one_line(exc)})"
