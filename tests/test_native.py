"""The compiled kernels' sources (native/*.c, *.h) and their loader (native/loader.py): every source builds without a
warning, a library is compiled once per machine into the cache and loaded from it afterwards, processes building at
once leave one whole library each, any change to what a build depends on gives another library, and a cache that
can't be written (or holds a damaged file) never stops a kernel from loading."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import moepack.families.deepseek_v4
from moepack import native
from moepack.native import loader

# a model family's own operations' kernels, in its package, built through this loader from their paths
FAMILY_DIR = os.path.dirname(os.path.abspath(moepack.families.deepseek_v4.__file__))
MHC_C, INDEXER_C = os.path.join(FAMILY_DIR, "mhc.c"), os.path.join(FAMILY_DIR, "indexer.c")


def _compiler() -> str:
    cc = native.c_compiler()
    if cc is None:
        pytest.skip("no C compiler here ($CC, cc, gcc, clang)")
    return cc


def _usable() -> str:
    if os.environ.get(native.NATIVE_ENV, "1") == "0":
        pytest.skip(f"compiled kernels are disabled ({native.NATIVE_ENV}=0)")
    return _compiler()


def _run(code: str, cache: str, extra_env: dict | None = None, timeout: int = 300) -> dict:
    """Run `code` in a fresh `python3 -c` with the cache at `cache`; the JSON it prints last."""
    env = {**os.environ, native.CACHE_ENV: str(cache), **(extra_env or {})}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _files(cache) -> dict[str, tuple[int, int]]:
    d = os.path.join(cache, "native")
    return {n: (os.stat(os.path.join(d, n)).st_ino, os.stat(os.path.join(d, n)).st_mtime_ns) for n in os.listdir(d)}


@pytest.mark.parametrize("arch", [("-march=native",), ()], ids=["native", "generic"])
@pytest.mark.parametrize("source", native.sources() + [MHC_C, INDEXER_C])
def test_every_source_compiles_without_warnings(tmp_path, source, arch):
    cc = _compiler()
    done = subprocess.run([cc, *native.CFLAGS, *arch, "-I", native.SOURCE_DIR, "-o", str(tmp_path / "lib.so"),
                           os.path.join(native.SOURCE_DIR, source)], capture_output=True, text=True, timeout=120)
    assert "-Wall" in native.CFLAGS and "-Werror" in native.CFLAGS and "-ffp-contract=off" in native.CFLAGS
    assert done.returncode == 0, done.stderr


def test_sources_share_code_through_headers():
    """The prelude and the nibble-group code are headers the sources include, each one file."""
    texts = {name: native.read_source(name) for name in native.sources()}
    assert len(texts) == 6
    texts.update({os.path.basename(path): native.read_source(path) for path in (MHC_C, INDEXER_C)})  # by path
    for header, users in (("block_prelude.h", {"q8_0_quantize.c", "mxfp4_quantize.c"}),
                          ("nibble_group.h", {"fp4_decode.c", "fp4_linear.c"}),
                          ("token_matmul.h", {"token_matmul.c", "indexer.c", "fp8_decode.c"})):
        assert os.path.exists(os.path.join(native.SOURCE_DIR, header))
        assert {n for n, t in texts.items() if f'#include "{header}"' in t} == users
    assert not any("@" in t and "@NIBBLE" in t for t in texts.values())  # no text substitution left


# The kernels of all eight libraries (DeepSeek-V4's two from its package), as the codecs, the runtime and the family
# load them; the builds they report, as JSON.
LOAD_ALL = """
import json
from moepack.format_spec import quant_fp4, quant_q8_0, quants, source_formats
from moepack.runtime import expert_decode
from moepack.backends import token_kernels
from moepack.families.deepseek_v4 import indexer_native, mhc_native, model
for load in (quant_q8_0.native_quantize_chunk, quant_fp4.native_mxfp4_quantize_chunk, source_formats._fp8_native,
             expert_decode._native_kernels, expert_decode._fused_kernel,
             lambda: mhc_native.kernel(model.hc_mix_weights), token_kernels.token_kernels,
             indexer_native.indexer_kernel):
    load()
print(json.dumps(quants.native_kernels()))
"""
LIBRARIES = {"Q8_0", "MXFP4", "moepack_fp8_decode", "moepack_fp4_decode", "moepack_fp4_linear", "moepack_mhc",
             "moepack_token_matmul", "moepack_indexer"}


def test_a_second_process_loads_every_library_from_the_cache(tmp_path):
    """The first process compiles into an empty cache; the next compiles nothing (the compiler, a wrapper logging
    every call but `--version`, is not run) and loads the very same files."""
    cc = shutil.which(_usable())
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *--version*) ;; *) echo "$*" >> "{log}" ;; esac\n'
                       f'exec "{cc}" "$@"\n')
    wrapper.chmod(0o755)
    cache = tmp_path / "cache"
    env = {"CC": str(wrapper)}
    first = _run(LOAD_ALL, cache, env)
    assert set(first) == LIBRARIES
    for name, b in first.items():
        assert b["compiled"] and not b["cached"], (name, b)
        assert b["path"] == os.path.join(cache, "native", os.path.basename(b["path"]))
        assert os.path.basename(b["path"]).startswith(f"{name}-") and b["path"].endswith(".so")
    compiles = log.read_text().splitlines()
    assert len(compiles) >= len(LIBRARIES)
    files = _files(cache)
    assert sorted(files) == sorted(os.path.basename(b["path"]) for b in first.values())

    log.unlink()
    second = _run(LOAD_ALL, cache, env)
    for name, b in second.items():
        assert b["compiled"] and b["cached"], (name, b)
        assert b["path"] == first[name]["path"] and b["flags"] == first[name]["flags"]
    assert not log.exists()  # the compiler only said its version
    assert _files(cache) == files  # same files, same inodes, same mtimes


BUILD_ALL = """
import json, os, sys, time
from moepack import native
ready, other = sys.argv[1], sys.argv[2]
open(ready, "w").close()
while not os.path.exists(other):  # both processes start building at the same moment
    time.sleep(0.001)
for source in native.sources():
    native.native_library(source[:-2], native.read_source(source))
print(json.dumps(native.native_builds()))
"""


def test_processes_building_at_once_leave_one_library_each(tmp_path):
    _usable()
    cache = tmp_path / "cache"
    env = {**os.environ, native.CACHE_ENV: str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_ALL, str(tmp_path / f"ready{i}"),
                               str(tmp_path / f"ready{1 - i}")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in (0, 1)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    names = {s[:-2] for s in native.sources()}
    for builds in results:
        assert set(builds) == names and all(b["compiled"] for b in builds.values()), builds
    files = os.listdir(cache / "native")
    assert not [f for f in files if not f.endswith(".so")], files  # no temporary file left behind
    assert sorted(f.rsplit("-", 1)[0] for f in files) == sorted(names)  # one library per name
    for name in names:  # and both processes loaded that one
        assert results[0][name]["path"] == results[1][name]["path"]


def test_any_change_to_a_build_input_gives_another_key(tmp_path, monkeypatch):
    cc = _compiler()
    copy = tmp_path / "src"
    shutil.copytree(native.SOURCE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    source = native.read_source("q8_0_quantize.c")
    key = native.build_key(source, cc, native.CFLAGS)
    assert native.build_key(source, cc, native.CFLAGS, str(copy)) == key  # the contents count, not the folder
    changed = source.replace("HALF_DOWN 0.49999997f", "HALF_DOWN 0.49999996f")
    assert changed != source and native.build_key(changed, cc, native.CFLAGS) != key  # a monkeypatched source
    prelude = copy / "block_prelude.h"
    prelude.write_bytes(prelude.read_bytes().replace(b"#define GROUP 16", b"#define GROUP 16 "))  # one byte
    assert native.build_key(source, cc, native.CFLAGS, str(copy)) != key  # a header the source includes
    assert native.build_key(native.read_source(MHC_C), cc, native.CFLAGS, str(copy)) == \
        native.build_key(native.read_source(MHC_C), cc, native.CFLAGS)  # not a header it doesn't include
    assert native.build_key(source, cc, (*native.CFLAGS, "-march=native")) != key  # the flags
    monkeypatch.setattr(loader, "cpu_identity", lambda: "another CPU")
    assert native.build_key(source, cc, native.CFLAGS) != key  # the CPU
    monkeypatch.undo()
    monkeypatch.setattr(loader, "_compiler_identity", lambda cc: ("/usr/bin/cc", "cc 99.0"))
    assert native.build_key(source, cc, native.CFLAGS) != key  # the compiler

    monkeypatch.undo()
    if os.environ.get(native.NATIVE_ENV, "1") == "0":
        return
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    a = native.build("Q8_0", source)
    b = native.build("Q8_0", source, str(copy))
    assert a["library"] is not None and b["library"] is not None and a["path"] != b["path"]
    assert not a["cached"] and not b["cached"] and native.build("Q8_0", source)["cached"]


def test_an_unwritable_cache_builds_in_a_temporary_directory(tmp_path, monkeypatch):
    _usable()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(native.CACHE_ENV, str(blocker / "cache"))  # under a file: not even root can create it
    built = native.build("moepack_mhc", native.read_source(MHC_C))
    assert built["library"] is not None and not built["cached"] and built["path"] is None
    assert "cache_error" in built
    assert built["library"].hc_mix_weights  # loaded, though its file is gone


def test_a_damaged_library_in_the_cache_is_built_again(tmp_path, monkeypatch):
    """A file under a library's name that doesn't load (a truncated copy, say) is replaced by a fresh build."""
    cc = _usable()
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    source = native.read_source(MHC_C)
    os.makedirs(tmp_path / "native")
    damaged = {str(tmp_path / "native" / f"moepack_mhc-{native.build_key(source, cc, (*native.CFLAGS, *arch))}.so")
               for arch in loader.ARCH_FLAGS}
    for path in damaged:  # never loaded in this process (dlopen would hand back a library loaded from that path)
        with open(path, "wb") as f:
            f.write(b"not a library")
    built = native.build("moepack_mhc", source)
    assert built["library"] is not None and not built["cached"] and built["path"] in damaged
    with open(built["path"], "rb") as f:
        assert f.read(4) == b"\x7fELF"
    assert not [f for f in os.listdir(tmp_path / "native") if not f.endswith(".so")]


def test_where_march_native_fails_the_generic_build_is_cached(tmp_path, monkeypatch):
    _usable()
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(loader, "ARCH_FLAGS", (("-march=no-such-cpu",), ()))
    first = native.build("moepack_mhc", native.read_source(MHC_C))
    assert first["library"] is not None and not first["cached"] and "cache_error" not in first
    assert "-march=no-such-cpu" not in first["flags"] and first["path"].startswith(str(tmp_path))
    assert native.build("moepack_mhc", native.read_source(MHC_C))["cached"]


def test_a_build_sweeps_out_what_killed_builds_left(tmp_path, monkeypatch):
    """Temporary files over an hour old are a killed build's; younger ones may be another process's, at work."""
    _usable()
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    os.makedirs(tmp_path / "native")
    stale, fresh = tmp_path / "native" / ".Q8_0-x.so.abc.tmp", tmp_path / "native" / ".Q8_0-x.so.def.tmp"
    stale.write_bytes(b"")
    fresh.write_bytes(b"")
    os.utime(stale, (os.path.getmtime(stale) - 7200,) * 2)
    assert native.build("moepack_mhc", native.read_source(MHC_C))["library"] is not None
    assert not stale.exists() and fresh.exists()


def test_native_off_or_no_compiler_builds_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.build("moepack_mhc", native.read_source(MHC_C))["library"] is None
    assert native.native_library("moepack_native_test", native.read_source(MHC_C)) is None
    assert "disabled" in native.native_builds()["moepack_native_test"]["reason"]
    monkeypatch.delenv(native.NATIVE_ENV)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    build = native.build("moepack_mhc", native.read_source(MHC_C))
    assert build["library"] is None and "no C compiler" in build["reason"]
    assert not os.path.exists(tmp_path / "native")
    loader._native.pop("moepack_native_test")
