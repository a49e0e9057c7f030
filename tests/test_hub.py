"""packer/hub.py against a fake Hugging Face hub (no network: a ThreadingHTTPServer on 127.0.0.1).

The fake hub implements what huggingface_hub 2.4 calls for `model_info` / `snapshot_download` / `hf_hub_download`:
  GET  /api/models/{repo}/revision/{rev}[?blobs=True]   repo info: sha, siblings (+ size, blobId, lfs with blobs)
  GET  /api/models/{repo}/tree/{rev}?recursive=True     the tree listing snapshot_download caches per commit
  HEAD/GET /{repo}/resolve/{rev}/{file}                 git files: 200 + ETag, X-Repo-Commit, Content-Length;
                                                        LFS files: 302 to a "CDN" + X-Linked-Etag/-Size, X-Repo-Commit
  GET  http://localhost:{port}/cdn/{sha256}             the "CDN" (another host name: no Authorization may reach it),
                                                        with Range (206) support
and the hub's error headers (X-Error-Code: RepoNotFound / RevisionNotFound / EntryNotFound / GatedRepo).

Each resolution runs in a subprocess, with HF_ENDPOINT, HF_HOME, HF_TOKEN, HF_HUB_OFFLINE set before huggingface_hub
is imported (it reads them at import time), exactly as a user's `moepack convert` would; HF_HOME is a tmp directory,
so the user's cache and token are never touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from moepack.packer import hub as hub_module

MAIN_SHA = "a" * 8 + "1" * 32
OLD_SHA = "b" * 8 + "2" * 32
REPO = "acme/tiny-moe"
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
NEEDED = {"config.json", "model.safetensors.index.json", "tokenizer.json", "generation_config.json", *SHARDS}
TOKEN = "hf_testtoken123"


# ------------------------------------------------------------------------------------------------- the checkpoint


def _st_bytes(tensors: dict, tmp: str) -> bytes:
    save_file(tensors, tmp)
    with open(tmp, "rb") as f:
        return f.read()


def make_checkpoint(tmp_path, seed: int, shards=SHARDS, index_extra=(), big: str | None = None) -> dict[str, bytes]:
    """A two-shard fake checkpoint plus files a conversion must not fetch; shard `big` gets 24 MiB of tensors
    (more than huggingface_hub's 10 MiB download chunk, so that a cut connection has something to resume from)."""
    rng = np.random.default_rng(seed)
    scratch = str(tmp_path / f"scratch-{seed}.safetensors")
    files: dict[str, bytes] = {}
    weight_map = {}
    for i, shard in enumerate(shards):
        shape = (3072, 1024) if shard == big else (8, 4)
        tensors = {f"model.layers.{i}.mlp.experts.{e}.w1.weight": rng.standard_normal(shape, np.float32)
                   for e in range(2)}
        files[shard] = _st_bytes(tensors, scratch)
        weight_map.update({k: shard for k in tensors})
    for name in index_extra:  # shards the index lists but the repo lacks
        weight_map[f"model.layers.9.{name}.weight"] = name
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    files["config.json"] = json.dumps({"model_type": "tiny_moe", "seed": seed}).encode()
    files["tokenizer.json"] = json.dumps({"version": "1.0", "model": {"type": "BPE"}}).encode()
    files["generation_config.json"] = b'{"do_sample": false}'
    files["README.md"] = b"# not needed\n"
    files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    files["original/huge.bin"] = os.urandom(256 << 10)  # must never be fetched
    return files


def _is_lfs(path: str) -> bool:
    return path.endswith((".safetensors", ".bin"))


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# --------------------------------------------------------------------------------------------------- the fake hub


class FakeRepo:
    def __init__(self, commits: dict, refs: dict, private: bool = False, gated: bool = False):
        self.commits = commits  # sha -> {path: bytes}
        self.refs = refs  # branch / tag -> sha
        self.private = private  # needs `Authorization: Bearer TOKEN` everywhere, else 401 RepoNotFound
        self.gated = gated  # info and tree are public; file downloads need TOKEN (401 without, 403 with another)

    def sha_for(self, rev: str) -> str | None:
        if rev in self.refs:
            return self.refs[rev]
        return rev if rev in self.commits else None


class FakeHub:
    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        self.log: list[dict] = []
        self.cdn: dict[str, bytes] = {}  # sha256 -> bytes
        self.drop_once: set[str] = set()  # file names whose first content GET is cut half way
        self.fail_once: set[str] = set()  # file names whose first content GET answers 500
        self.delay: dict[str, float] = {}  # file name -> seconds to wait before sending its content
        self.api_stall = 0.0  # seconds every repo-info call waits before answering (a stalled endpoint)
        self.api_fail = 0  # this many repo-info calls answer 503 first (a transient failure)
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def add_repo(self, repo_id: str, repo: FakeRepo) -> None:
        self.repos[repo_id] = repo
        for files in repo.commits.values():
            for path, data in files.items():
                if _is_lfs(path):
                    self.cdn[hashlib.sha256(data).hexdigest()] = data

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- log queries

    def requests(self, kind: str | None = None) -> list[dict]:
        with self.lock:
            return [r for r in self.log if kind is None or r["kind"] == kind]

    def content_gets(self) -> list[str]:
        """Names of the files whose bytes were sent (a resolve GET of a git file, or a CDN GET)."""
        return [r["file"] for r in self.requests() if r["method"] == "GET" and r["kind"] in ("resolve", "cdn")
                and r.get("status") in (200, 206)]

    def clear(self) -> None:
        with self.lock:
            self.log.clear()

    # -- request handling

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlsplit(h.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        entry = {"method": h.command, "path": url.path, "query": parse_qs(url.query), "host": h.headers.get("Host"),
                 "auth": h.headers.get("Authorization"), "range": h.headers.get("Range"), "kind": "other",
                 "t0": time.time()}
        with self.lock:
            self.log.append(entry)
        try:
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api(h, entry, f"{parts[2]}/{parts[3]}", parts[4:])
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._resolve(h, entry, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head)
            elif parts[:1] == ["cdn"] and len(parts) == 2:
                self._cdn(h, entry, parts[1], head)
            else:
                self._error(h, entry, 404, None, "Not found")
        except (BrokenPipeError, ConnectionResetError):
            pass
        entry["t1"] = time.time()

    def _send(self, h, entry, status: int, headers: dict, body: bytes = b"", head: bool = False,
              cut: bool = False) -> None:
        entry["status"] = status
        h.send_response(status)
        headers = {"Content-Length": str(len(body)), **headers}
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if head:
            return
        if cut:  # send half, then drop the connection
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        h.wfile.write(body)

    def _error(self, h, entry, status, code, message, extra=None, head=False) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._send(h, entry, status, headers, json.dumps({"error": message}).encode(), head=head)

    def _auth_ok(self, h) -> bool:
        return h.headers.get("Authorization") == f"Bearer {TOKEN}"

    def _repo_or_error(self, h, entry, repo_id, head=False):
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not self._auth_ok(h)):
            status = 404 if repo is None else 401  # the hub's answer to a private repo without access
            self._error(h, entry, status, "RepoNotFound", "Repository not found", head=head)
            return None
        return repo

    def _api(self, h, entry, repo_id, rest) -> None:
        entry["kind"] = "tree" if rest[:1] == ["tree"] else "info"
        if entry["kind"] == "info" and self.api_stall:
            time.sleep(self.api_stall)
            return
        if entry["kind"] == "info" and self.api_fail:
            with self.lock:
                self.api_fail -= 1
            return self._error(h, entry, 503, None, "Service unavailable")
        repo = self._repo_or_error(h, entry, repo_id)
        if repo is None:
            return
        if rest[:1] == ["revision"] and len(rest) == 2:
            rev = rest[1]
        elif rest[:1] == ["tree"] and len(rest) >= 2:
            rev = rest[1]
        elif not rest:
            rev = "main"
        else:
            return self._error(h, entry, 404, None, "Not found")
        sha = repo.sha_for(rev)
        if sha is None:
            return self._error(h, entry, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        files = repo.commits[sha]
        if entry["kind"] == "info":
            blobs = entry["query"].get("blobs", ["false"])[0].lower() == "true"
            siblings = []
            for path, data in sorted(files.items()):
                s = {"rfilename": path}
                if blobs:
                    s.update(size=len(data), blobId=_blob_id(data))
                    if _is_lfs(path):
                        s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                siblings.append(s)
            body = {"_id": "0" * 24, "id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.private,
                    "gated": "manual" if repo.gated else False, "disabled": False, "downloads": 0, "likes": 0,
                    "tags": [], "lastModified": "2026-01-01T00:00:00.000Z", "siblings": siblings}
        else:
            body, dirs = [], set()
            for path, data in sorted(files.items()):
                for i in range(1, path.count("/") + 1):
                    d = "/".join(path.split("/")[:i])
                    if d not in dirs:
                        dirs.add(d)
                        body.append({"type": "directory", "oid": _blob_id(d.encode()), "size": 0, "path": d})
                e = {"type": "file", "oid": _blob_id(data), "size": len(data), "path": path}
                if _is_lfs(path):
                    e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                body.append(e)
        self._send(h, entry, 200, {"Content-Type": "application/json"}, json.dumps(body).encode())

    def _resolve(self, h, entry, repo_id, rev, path, head) -> None:
        entry.update(kind="resolve", file=path, rev=rev)
        repo = self._repo_or_error(h, entry, repo_id, head=head)
        if repo is None:
            return
        sha = repo.sha_for(rev)
        if sha is None:
            return self._error(h, entry, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head=head)
        if repo.gated and not self._auth_ok(h):
            status = 403 if h.headers.get("Authorization") else 401
            msg = (f"Access to model {repo_id} is restricted and you are not in the authorized list."
                   if status == 403 else f"Access to model {repo_id} is restricted. You must have access to it and "
                   "be authenticated to access it. Please log in.")
            return self._error(h, entry, status, "GatedRepo", msg, {"X-Repo-Commit": sha}, head=head)
        files = repo.commits[sha]
        if path not in files:
            return self._error(h, entry, 404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": sha}, head=head)
        data = files[path]
        if _is_lfs(path):
            sha256 = hashlib.sha256(data).hexdigest()
            headers = {"Location": f"http://localhost:{self.port}/cdn/{sha256}", "X-Repo-Commit": sha,
                       "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(data)), "ETag": f'"{_blob_id(data)}"'}
            return self._send(h, entry, 302, headers, head=head)
        if not head and self._inject(h, entry, path):
            return
        headers = {"Content-Type": "application/octet-stream", "ETag": f'"{_blob_id(data)}"', "X-Repo-Commit": sha,
                   "Accept-Ranges": "bytes"}
        self._send(h, entry, 200, headers, data, head=head)

    def _cdn(self, h, entry, sha256, head) -> None:
        entry["kind"] = "cdn"
        data = self.cdn.get(sha256)
        if data is None:
            return self._error(h, entry, 404, None, "NoSuchKey", head=head)
        name = next(p for repo in self.repos.values() for files in repo.commits.values() for p, d in files.items()
                    if d is data or d == data)
        entry["file"] = name
        if not head and self._inject(h, entry, name):
            return
        headers = {"Content-Type": "application/octet-stream", "ETag": f'"{sha256}"', "Accept-Ranges": "bytes"}
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start_s, _, end_s = rng[len("bytes="):].partition("-")
            start = int(start_s)
            end = int(end_s) if end_s else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self._send(h, entry, 206, headers, data[start: end + 1], head=head)
        cut = False
        with self.lock:
            if name in self.drop_once:
                self.drop_once.discard(name)
                cut = True
        self._send(h, entry, 200, headers, data, head=head, cut=cut)

    def _inject(self, h, entry, name) -> bool:
        """Failure injection for content requests; True if the response was sent."""
        if name in self.delay:
            time.sleep(self.delay[name])
        with self.lock:
            fail = name in self.fail_once
            self.fail_once.discard(name)
        if fail:
            self._error(h, entry, 500, None, "Internal Error")
            return True
        return False


# --------------------------------------------------------------------------------------------------------- harness

DRIVER = r"""
import json, os, sys, time
from moepack.format_spec.errors import MoepackError
from moepack.packer import hub

args = json.loads(sys.argv[1])
hub.RETRY_PAUSE_S = args.get("retry_pause_s", hub.RETRY_PAUSE_S)
try:
    if args.get("feed"):
        got = []
        with hub.iter_shards_as_they_arrive(args["src"], args.get("revision"), progress=False) as feed:
            for shard, path in feed:
                got.append({"shard": shard, "path": path, "t": time.time(), "size": os.path.getsize(path)})
        out = {"local_dir": feed.local_dir, "provenance": feed.provenance, "got": got}
    else:
        r = hub.resolve_source(args["src"], args.get("revision"), progress=args.get("progress", False))
        out = {"local_dir": r.local_dir, "provenance": r.provenance}
    out["listing"] = sorted(os.path.relpath(os.path.join(d, f), out["local_dir"])
                            for d, _, fs in os.walk(out["local_dir"]) for f in fs)
except MoepackError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(1)
print(json.dumps(out))
"""


class Result:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.rc = proc.returncode
        self.stderr = proc.stderr
        lines = proc.stdout.strip().splitlines()
        self.data = json.loads(lines[-1]) if lines else {}
        assert "Traceback" not in proc.stderr, proc.stderr

    @property
    def error(self) -> str:
        assert self.rc == 1 and "error" in self.data, (self.rc, self.data, self.stderr)
        msg = self.data["error"]
        assert "\n" not in msg and msg.strip() == msg and msg, msg
        return msg

    @property
    def ok(self) -> dict:
        assert self.rc == 0, (self.rc, self.data, self.stderr)
        return self.data


@pytest.fixture
def hub(tmp_path):
    h = FakeHub()
    yield h
    h.close()


@pytest.fixture
def checkpoints(tmp_path):
    return make_checkpoint(tmp_path, 0), make_checkpoint(tmp_path, 1)


@pytest.fixture
def tiny(hub, checkpoints):
    main, old = checkpoints
    hub.add_repo(REPO, FakeRepo({MAIN_SHA: main, OLD_SHA: old}, {"main": MAIN_SHA, "v1.0": OLD_SHA}))
    return main, old


def hub_env(tmp_path, endpoint: str) -> dict:
    """The environment of a process that talks to the fake hub only (its own HF_HOME, no proxy, short timeouts)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_")) and "proxy" not in k.lower()}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_UPDATE_CHECK="1", NO_PROXY="*", HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    return env


def run(tmp_path, endpoint: str, src: str, revision: str | None = None, *, offline=False, token=None, feed=False,
        progress=False, cwd=None, env_extra=None, retry_pause_s=0.01) -> Result:
    """The hub's API in a process of its own (huggingface_hub reads its settings from the environment as it loads),
    with pauses between API attempts of `retry_pause_s`, 2 x that, ... (the tests count attempts, one times them)."""
    env = hub_env(tmp_path, endpoint)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if token:
        env["HF_TOKEN"] = token
    env.update(env_extra or {})
    args = json.dumps({"src": src, "revision": revision, "feed": feed, "progress": progress,
                       "retry_pause_s": retry_pause_s})
    cwd = cwd or tmp_path / "cwd"
    os.makedirs(cwd, exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", DRIVER, args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    return Result(proc)


def _sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _check_provenance(prov: dict, files: dict, sha: str, repo: str = REPO) -> None:
    assert prov["source"] == repo and prov["revision"] == sha
    assert set(prov["files"]) == NEEDED
    for name, meta in prov["files"].items():
        assert meta["size"] == len(files[name])
        assert meta["sha256"] == (_sha256(files[name]) if name.endswith(".safetensors") else None)


# ----------------------------------------------------------------------------------------------------------- tests


def test_branch_pins_sha_and_fetches_only_needed_files(tmp_path, hub, tiny):
    main, _ = tiny
    out = run(tmp_path, hub.url, REPO).ok
    assert os.path.basename(out["local_dir"]) == MAIN_SHA
    assert set(out["listing"]) == NEEDED
    for name in NEEDED:
        with open(os.path.join(out["local_dir"], name), "rb") as f:
            assert f.read() == main[name]
    assert load_file(os.path.join(out["local_dir"], SHARDS[1]))  # a real safetensors file
    _check_provenance(out["provenance"], main, MAIN_SHA)
    # The branch was resolved once (HfApi.resolve_revision), then the file listing (with its metadata) and every
    # file were read at the sha.
    infos = hub.requests("info")
    assert [r["path"] for r in infos] == [f"/api/models/{REPO}/revision/main", f"/api/models/{REPO}/revision/{MAIN_SHA}"]
    assert infos[1]["query"].get("blobs") == ["True"] or infos[1]["query"].get("blobs") == ["true"]
    assert {r["rev"] for r in hub.requests("resolve")} == {MAIN_SHA}
    # Never the README, the .gitattributes or original/huge.bin; every needed file exactly once.
    fetched = [r["file"] for r in hub.requests("resolve")]
    assert not {"README.md", ".gitattributes", "original/huge.bin"} & set(fetched)
    assert sorted(hub.content_gets()) == sorted(NEEDED)
    # LFS bytes came from the "CDN" (after the hub's 302), and no token was involved.
    assert {r["file"] for r in hub.requests("cdn")} == set(SHARDS)
    assert all(r["auth"] is None for r in hub.requests())
    # refs/main now points at the sha (what offline mode reads).
    ref = tmp_path / "hf_home" / "hub" / "models--acme--tiny-moe" / "refs" / "main"
    assert ref.read_text() == MAIN_SHA


def test_second_call_is_served_from_cache(tmp_path, hub, tiny):
    first = run(tmp_path, hub.url, REPO).ok
    hub.clear()
    second = run(tmp_path, hub.url, REPO).ok
    assert second == first
    # Only the branch -> sha look-up and the listing at the sha; no tree listing, no HEAD, no file bytes.
    assert [r["kind"] for r in hub.requests()] == ["info", "info"]


def test_tag_and_sha_revisions(tmp_path, hub, tiny):
    main, old = tiny
    out = run(tmp_path, hub.url, REPO, "v1.0").ok
    assert os.path.basename(out["local_dir"]) == OLD_SHA
    _check_provenance(out["provenance"], old, OLD_SHA)
    with open(os.path.join(out["local_dir"], "config.json"), "rb") as f:
        assert f.read() == old["config.json"]
    assert {r["rev"] for r in hub.requests("resolve")} == {OLD_SHA}
    hub.clear()
    out = run(tmp_path, hub.url, REPO, MAIN_SHA).ok
    _check_provenance(out["provenance"], main, MAIN_SHA)
    assert [r["path"] for r in hub.requests("info")] == [f"/api/models/{REPO}/revision/{MAIN_SHA}"]


def test_offline_resolves_from_cache_to_the_same_sha(tmp_path, hub, tiny):
    online = run(tmp_path, hub.url, REPO).ok
    run(tmp_path, hub.url, REPO, "v1.0").ok
    hub.clear()
    offline = run(tmp_path, hub.url, REPO, offline=True).ok
    assert offline == online  # same snapshot, same sha, same sizes and LFS sha256s
    assert run(tmp_path, hub.url, REPO, "v1.0", offline=True).ok["provenance"]["revision"] == OLD_SHA
    assert run(tmp_path, hub.url, REPO, MAIN_SHA, offline=True).ok["provenance"] == online["provenance"]
    msg = run(tmp_path, hub.url, REPO, "dev", offline=True).error  # a branch never downloaded
    assert "HF_HUB_OFFLINE" in msg and f"{REPO}@dev" in msg
    assert hub.requests() == []


def test_offline_with_incomplete_cache(tmp_path, hub, tiny):
    out = run(tmp_path, hub.url, REPO).ok
    path = os.path.join(out["local_dir"], SHARDS[1])  # as if the run had stopped before this shard: no blob, no link
    os.unlink(os.path.realpath(path))
    os.unlink(path)
    msg = run(tmp_path, hub.url, REPO, offline=True).error
    assert "incomplete" in msg and SHARDS[1] in msg and "HF_HUB_OFFLINE" in msg
    # Online again, only the missing shard is fetched.
    hub.clear()
    assert run(tmp_path, hub.url, REPO).ok == out
    assert hub.content_gets() == [SHARDS[1]]


def test_offline_with_empty_cache(tmp_path, hub, tiny):
    msg = run(tmp_path, hub.url, REPO, offline=True).error
    assert "HF_HUB_OFFLINE" in msg and REPO in msg and "not in the local cache" in msg
    assert hub.requests() == []


def test_unknown_repo(tmp_path, hub, tiny):
    msg = run(tmp_path, hub.url, "acme/no-such-model").error
    assert "acme/no-such-model" in msg and "no model repo" in msg
    assert hub.requests("info")[0]["status"] == 404


def test_unknown_revision(tmp_path, hub, tiny):
    msg = run(tmp_path, hub.url, REPO, "no-such-branch").error
    assert "'no-such-branch'" in msg and "revision" in msg and REPO in msg


def test_index_lists_a_shard_the_repo_lacks(tmp_path, hub):
    files = make_checkpoint(tmp_path, 2, index_extra=["model-00003-of-00003.safetensors"])
    hub.add_repo("acme/broken", FakeRepo({MAIN_SHA: files}, {"main": MAIN_SHA}))
    msg = run(tmp_path, hub.url, "acme/broken").error
    assert "model-00003-of-00003.safetensors" in msg and "acme/broken" in msg
    assert not set(SHARDS) & set(hub.content_gets())  # found out before any shard was downloaded


def test_a_single_file_beside_an_index_is_the_one_fetched(tmp_path, hub):
    """transformers loads model.safetensors where there is one, before an index: so does the plan, online and from
    the cache offline; the index's shards are not fetched."""
    files = make_checkpoint(tmp_path, 2)
    files["model.safetensors"] = make_checkpoint(tmp_path, 3)[SHARDS[0]]
    hub.add_repo("acme/both", FakeRepo({MAIN_SHA: files}, {"main": MAIN_SHA}))
    for offline in (False, True):
        r = run(tmp_path, hub.url, "acme/both", offline=offline)
        assert r.rc == 0, r.data
        assert [n for n in r.data["provenance"]["files"] if n.endswith(".safetensors")] == ["model.safetensors"]
    assert not set(SHARDS) & set(hub.content_gets())


def test_server_down(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    msg = run(tmp_path, f"http://127.0.0.1:{port}", REPO).error
    assert msg.startswith("network unavailable") and f"127.0.0.1:{port}" in msg and "HF_HUB_OFFLINE=1" in msg


def test_a_stalled_endpoint_ends_in_one_line_within_a_minute(tmp_path, hub, tiny):
    """The repo-info call times out (HF_HUB_ETAG_TIMEOUT, 1 s here, as every API call's: the downloads' 10 s is
    not theirs), is tried API_ATTEMPTS times, then one line: 3 x 1 s + pauses of 1 and 2 s, and the start."""
    hub.api_stall = 120
    started = time.monotonic()
    msg = run(tmp_path, hub.url, REPO, env_extra={"HF_HUB_ETAG_TIMEOUT": "1"},
              retry_pause_s=hub_module.RETRY_PAUSE_S).error
    took = time.monotonic() - started
    assert "timed out" in msg and hub.url in msg and took < 14, took
    assert len(hub.requests("info")) == hub_module.API_ATTEMPTS


def test_a_transient_failure_is_retried(tmp_path, hub, tiny):
    hub.api_fail = hub_module.API_ATTEMPTS - 1  # fails, fails, then answers
    assert run(tmp_path, hub.url, REPO).ok
    assert len(hub.requests("info")) >= hub_module.API_ATTEMPTS


def test_token_is_sent_as_bearer(tmp_path, hub, checkpoints):
    main, _ = checkpoints
    hub.add_repo("acme/private", FakeRepo({MAIN_SHA: main}, {"main": MAIN_SHA}, private=True))
    out = run(tmp_path, hub.url, "acme/private", token=TOKEN).ok
    _check_provenance(out["provenance"], main, MAIN_SHA, repo="acme/private")
    on_hub = [r for r in hub.requests() if r["kind"] != "cdn"]
    assert on_hub and all(r["auth"] == f"Bearer {TOKEN}" for r in on_hub)
    assert all(r["auth"] is None for r in hub.requests("cdn"))  # never sent off the hub's host
    # Without the token a private repo looks like a missing one.
    msg = run(tmp_path / "no-token", hub.url, "acme/private").error
    assert "acme/private" in msg and "HF_TOKEN" in msg


@pytest.mark.parametrize("token,status", [(None, 401), ("hf_someoneelse", 403)])
def test_gated_repo(tmp_path, hub, checkpoints, token, status):
    hub.add_repo("acme/gated", FakeRepo({MAIN_SHA: checkpoints[0]}, {"main": MAIN_SHA}, gated=True))
    msg = run(tmp_path, hub.url, "acme/gated", token=token).error
    assert "acme/gated is a gated repo" in msg and f"HTTP {status}" in msg and "HF_TOKEN" in msg
    # ...and with an authorised token it downloads.
    assert run(tmp_path, hub.url, "acme/gated", token=TOKEN).ok["provenance"]["revision"] == MAIN_SHA


def test_dropped_connection_resumes_with_range(tmp_path, hub):
    files = make_checkpoint(tmp_path, 4, big=SHARDS[1])
    hub.add_repo(REPO, FakeRepo({MAIN_SHA: files}, {"main": MAIN_SHA}))
    hub.drop_once.add(SHARDS[1])  # the connection drops after half of the 24 MiB
    out = run(tmp_path, hub.url, REPO).ok
    with open(os.path.join(out["local_dir"], SHARDS[1]), "rb") as f:
        assert f.read() == files[SHARDS[1]]
    ranged = [r for r in hub.requests("cdn") if r["range"]]
    assert [r["file"] for r in ranged] == [SHARDS[1]] and ranged[0]["status"] == 206
    start = int(ranged[0]["range"].removeprefix("bytes=").removesuffix("-"))
    assert 0 < start <= len(files[SHARDS[1]]) // 2  # picked up where the received bytes ended, not from 0


def test_interrupted_run_only_fetches_what_is_missing(tmp_path, hub, tiny):
    hub.fail_once.add(SHARDS[1])
    msg = run(tmp_path, hub.url, REPO).error
    assert "HTTP 500" in msg and REPO in msg
    first = hub.content_gets()
    hub.clear()
    out = run(tmp_path, hub.url, REPO).ok
    assert SHARDS[1] in hub.content_gets() and not set(hub.content_gets()) & set(first)
    assert set(out["listing"]) == NEEDED


def test_local_directory(tmp_path, hub):
    d = tmp_path / "ckpt"
    d.mkdir()
    files = make_checkpoint(tmp_path, 3)
    for name in NEEDED:
        (d / name).write_bytes(files[name])
    out = run(tmp_path, hub.url, str(d)).ok
    assert out["local_dir"] == str(d) and out["provenance"]["source"] == str(d)
    assert out["provenance"]["revision"] is None
    assert out["provenance"]["files"] == {n: {"size": len(files[n]), "sha256": None} for n in NEEDED}
    # A relative path that happens to look like owner/name is a directory if it exists.
    (tmp_path / "cwd" / "acme").mkdir(parents=True)
    os.symlink(d, tmp_path / "cwd" / "acme" / "tiny-moe")
    assert run(tmp_path, hub.url, REPO).ok["provenance"]["source"] == str(tmp_path / "cwd" / "acme" / "tiny-moe")
    assert hub.requests() == []
    assert "--revision" in run(tmp_path, hub.url, str(d), "main").error
    assert "no such directory" in run(tmp_path, hub.url, "./nope").error
    (d / SHARDS[1]).unlink()
    assert SHARDS[1] in run(tmp_path, hub.url, str(d)).error


def test_progress_bars(tmp_path, hub, tiny):
    # TQDM_POSITION=-1 makes huggingface_hub draw its bars although stderr is a pipe here.
    quiet = run(tmp_path / "quiet", hub.url, REPO, progress=False, env_extra={"TQDM_POSITION": "-1"})
    assert quiet.ok and quiet.stderr.strip() == ""
    shown = run(tmp_path / "shown", hub.url, REPO, progress=True, env_extra={"TQDM_POSITION": "-1"})
    assert shown.ok and "B/s" in shown.stderr  # bytes per second on the byte bars


def test_shards_as_they_arrive(tmp_path, hub, tiny):
    main, _ = tiny
    hub.delay[SHARDS[1]] = 0.6
    out = run(tmp_path, hub.url, REPO, feed=True).ok
    assert [g["shard"] for g in out["got"]] == SHARDS
    assert [g["size"] for g in out["got"]] == [len(main[s]) for s in SHARDS]
    _check_provenance(out["provenance"], main, MAIN_SHA)
    assert set(out["listing"]) == NEEDED
    # The first shard was handed over while the second was still downloading.
    last = next(r for r in hub.requests("cdn") if r["file"] == SHARDS[1] and r["method"] == "GET")
    assert out["got"][0]["t"] < last["t1"]
    # Downloads in index order, one at a time: shard 2's bytes were asked for after shard 1's were sent.
    first = next(r for r in hub.requests("cdn") if r["file"] == SHARDS[0] and r["method"] == "GET")
    assert first["t1"] <= last["t0"]
    # Once complete, the branch ref is written and the cache answers offline.
    hub.clear()
    assert run(tmp_path, hub.url, REPO, offline=True).ok["provenance"] == out["provenance"]


def test_shards_as_they_arrive_failure(tmp_path, hub, tiny):
    hub.fail_once.add(SHARDS[1])
    msg = run(tmp_path, hub.url, REPO, feed=True).error
    assert "HTTP 500" in msg


# ------------------------------------------------------------------------------------ convert from the hub, streamed

V4_REPO = "acme/v4-tiny"
V4_SHA = "c" * 8 + "3" * 32


@pytest.fixture(scope="module")
def v4_release(tmp_path_factory):
    """A synthetic V4 checkpoint in the release layout, sharded as the release is (a shard about a layer, 26 of
    them), and its local conversion (the reference)."""
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.synth import synth_checkpoint

    base = tmp_path_factory.mktemp("v4hub")
    src = base / "src"
    layers = 16
    overrides = {"num_hidden_layers": layers, "layer_types": ["sliding_attention"] * layers,
                 "mlp_layer_types": ["hash_moe"] + ["moe"] * (layers - 1), "num_nextn_predict_layers": 0}
    synth_checkpoint(src, "tiny", "release", seed=5, progress=False, shard_bytes=1 << 20, config_overrides=overrides)
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    convert_checkpoint(str(src), str(base / "local.moepack"), policy="fp4", progress=False)
    return files, str(base / "local.moepack")


def _same_tensors(a: str, b: str) -> None:
    from moepack.format_spec.reader import Container

    with Container(a) as x, Container(b) as y:
        assert list(x.tensors) == list(y.tensors)
        for name in x.tensors:
            assert x.tensor_bytes(name) == y.tensor_bytes(name), name


def _hub_convert(tmp_path, hub, out: str, *flags) -> dict:
    proc = subprocess.run([sys.executable, "-m", "moepack", "convert", V4_REPO, "-o", out, "--fp4", "--json", *flags],
                          env=hub_env(tmp_path, hub.url), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_convert_from_the_hub_as_the_shards_arrive(tmp_path, hub, v4_release):
    files, local = v4_release
    shards = sorted(n for n in files if n.endswith(".safetensors"))
    assert len(shards) >= 4
    hub.add_repo(V4_REPO, FakeRepo({V4_SHA: files}, {"main": V4_SHA}))
    for shard in shards:
        hub.delay[shard] = 0.05  # a download slower than the conversion of a shard
    kept = _hub_convert(tmp_path, hub, str(tmp_path / "kept.moepack"))
    _same_tensors(str(tmp_path / "kept.moepack"), local)  # the same container as from a local directory
    assert kept["disk"]["source_kept"] and kept["disk"]["source_peak_bytes"] == sum(len(files[s]) for s in shards)
    cached = [p for p in (tmp_path / "hf_home").rglob("*.safetensors")]
    assert len(cached) == len(shards)  # in the Hugging Face cache, for the next run
    # The tensors were known from the hub's metadata (a ranged read of each shard's header) before the download.
    ranged = [r for r in hub.requests("cdn") if r["method"] == "GET" and (r["range"] or "").startswith("bytes=0-")]
    assert {r["file"] for r in ranged} >= set(shards)


def test_convert_no_keep_source_deletes_each_shard_once_converted(tmp_path, hub, v4_release):
    files, local = v4_release
    shards = sorted(n for n in files if n.endswith(".safetensors"))
    source_bytes = sum(len(files[s]) for s in shards)
    hub.add_repo(V4_REPO, FakeRepo({V4_SHA: files}, {"main": V4_SHA}))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    r = _hub_convert(tmp_path, hub, str(out_dir / "lean.moepack"), "--no-keep-source")
    _same_tensors(str(out_dir / "lean.moepack"), local)
    # nothing of the source is left: not in the Hugging Face cache, not in a scratch folder
    assert not list((tmp_path / "hf_home").rglob("*.safetensors")) and os.listdir(out_dir) == ["lean.moepack"]
    disk = r["disk"]
    assert not disk["source_kept"]
    # never the whole source at once: shards were deleted before later ones came
    largest = sorted((len(files[s]) for s in shards), reverse=True)
    assert disk["source_peak_bytes"] <= sum(largest[:6]) < source_bytes / 3
    # measured on the filesystem: the output plus a few shards, not the output plus the source
    assert disk["peak_bytes"] < r["bytes_out"] + source_bytes / 2


def test_a_shard_unlike_the_hubs_metadata_is_refused(tmp_path):
    """A shard whose own header disagrees with the metadata the conversion was planned from (it changed on the hub
    between the two) is refused by name; one that agrees is read at its header's offsets."""
    from moepack.format_spec.errors import MoepackError
    from moepack.packer.source import SourceTensor, StreamedCheckpoint

    snap = tmp_path / "snapshot"
    snap.mkdir()
    (snap / "config.json").write_text("{}")
    shard = snap / "s.safetensors"
    save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(shard))

    class Feed:
        def wait(self, name):
            return str(snap / name)

        def close(self, wait=True):
            pass

    for shape, agrees in (((3, 2), False), ((2, 3), True)):
        listed = {"a": SourceTensor("a", "F32", shape, str(shard), -1, 24)}
        source = StreamedCheckpoint(str(snap), listed, {"s.safetensors": shard.stat().st_size},
                                    lambda order, ahead: Feed())
        source.fetch(["s.safetensors"])
        if agrees:
            assert source.read(listed["a"]) == np.arange(6, dtype=np.float32).tobytes()
        else:
            with pytest.raises(MoepackError, match=r"^s\.safetensors: tensor a is not what the hub's metadata said"):
                source.read(listed["a"])
        source.close()


def test_offline_snapshot_without_an_index_names_its_missing_numbered_shard(tmp_path, hub, tiny):
    """A snapshot holding no model.safetensors.index.json and only some of its numbered shards converted what was
    there, to end in a layer that lacks experts: the shards' own numbering names the one missing."""
    out = run(tmp_path, hub.url, REPO).ok
    for name in ("model.safetensors.index.json", SHARDS[1]):
        path = os.path.join(out["local_dir"], name)
        os.unlink(os.path.realpath(path))
        os.unlink(path)
    msg = run(tmp_path, hub.url, REPO, offline=True).error
    assert "incomplete" in msg and f"missing {SHARDS[1]}" in msg and "HF_HUB_OFFLINE" in msg


def test_no_keep_source_offline_is_refused_naming_both(tmp_path, hub, tiny):
    """--no-keep-source downloads into a scratch folder of its own: offline, that folder is an empty cache, and the
    refusal said the repo was not in the local cache, naming the scratch folder, though it was in HF_HOME's."""
    run(tmp_path, hub.url, REPO).ok
    env = dict(hub_env(tmp_path, hub.url), HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "moepack", "convert", REPO, "-o", str(tmp_path / "x.moepack"), "--keep",
                        "--no-keep-source"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert "--no-keep-source" in p.stderr and "HF_HUB_OFFLINE" in p.stderr and "scratch" in p.stderr
    assert not [f for f in os.listdir(tmp_path) if "moepack-download" in f]


def test_a_revision_that_names_no_ref_is_refused(tmp_path, hub, tiny):
    """`--revision ""` (a script's unset variable) was taken for main, and offline `../refs/main` was read as a path
    under the cache's refs folder, resolving to main's snapshot; neither names a branch, tag or commit."""
    from moepack.format_spec.errors import MoepackError
    from moepack.packer.hub import hub_revision

    run(tmp_path, hub.url, REPO).ok
    for revision in ("", "../refs/main", "a b", "-x", "main\n", "x/", "a//b", "v1.", "a~1"):
        with pytest.raises(MoepackError) as refused:
            hub_revision(revision)
        assert str(refused.value) == f"--revision {revision!r}: not a branch, tag or commit name"
    for revision, offline in (("", False), ("../refs/main", True)):  # (as a conversion meets them)
        msg = run(tmp_path, hub.url, REPO, revision, offline=offline).error
        assert msg == f"--revision {revision!r}: not a branch, tag or commit name", msg
    assert run(tmp_path, hub.url, REPO, MAIN_SHA, offline=True).ok
    assert hub_revision("refs/pr/1") == "refs/pr/1" and hub_revision(MAIN_SHA) == MAIN_SHA
