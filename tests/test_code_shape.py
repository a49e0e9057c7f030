"""benchmarks/code_shape.py's count of the files that name a model family outside its package: names in code and
string literals count, comments and docstrings do not, a family's own package does not."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def code_shape():
    spec = importlib.util.spec_from_file_location("code_shape", os.path.join(ROOT, "benchmarks", "code_shape.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_family_names_in_code_count_and_comments_do_not(tmp_path):
    for package in ("runtime", "families/deepseek_v4", "families", "families/qwen3_moe", "native"):
        write(tmp_path, f"{package}/__init__.py", "")
    write(tmp_path, "runtime/mixes.py", "def f(w):\n    return w.hc_attn_fn\n")
    write(tmp_path, "runtime/names.py", 'def name(p):\n    return f"{p}.w3.weight"\n')
    write(tmp_path, "runtime/docs_only.py", '"""The indexer, the compressor, tid2eid."""\n# a Qwen comment\nw1 = 1\n')
    write(tmp_path, "runtime/errors.py", "try:\n    pass\nexcept IndexError:\n    import zstandard\n"
                                          "    zstandard.ZstdDecompressor()\n")
    write(tmp_path, "runtime/qwen_config.py", "def f(cfg):\n    return cfg['decoder_sparse_step']\n")
    write(tmp_path, "families/deepseek_v4/model.py", "TID = 'tid2eid'\n")  # DeepSeek-V4's home
    write(tmp_path, "families/qwen3_moe/config.py", "ARCH = 'Qwen3MoeForCausalLM'\n")  # Qwen3-MoE's home
    write(tmp_path, "families/qwen3_moe/odd.py", "def f(x):\n    return x.attn_sink\n")  # another family's name
    write(tmp_path, "native/mix.c", "/* the indexer */\nstatic void hc_pre(void) {}\n")
    shape = code_shape().shape(str(tmp_path), top=5)
    leaks = shape["files_naming_a_family_outside_its_package"]
    assert leaks == {"runtime/mixes.py": {"deepseek-v4": ["hc_"]},
                     "runtime/names.py": {"deepseek-v4": ['"w3"']},
                     "runtime/qwen_config.py": {"qwen3-moe": ["decoder_sparse_step"]},
                     "families/qwen3_moe/odd.py": {"deepseek-v4": ["attn_sink"]},
                     "native/mix.c": {"deepseek-v4": ["hc_"]}}
    assert shape["folders"]["runtime"] == sum(n for rel, n in shape["modules"].items() if rel.startswith("runtime/"))


def test_no_file_names_a_family_outside_its_package():
    """Issue 39's count, 0: the registry, the converter, the container check of verify / prefill / generate and
    `moepack chat`, decode, generate, the expert runner, the server, the GGUF writer and reader, the
    synthetic-checkpoint writer, the planner, the benchmarks, the CLI, the native kernels, the backends and
    moepack.kv ask the family, never name it (DeepSeek-V4's mHC and Lightning Indexer kernels, its GGUF mapping and
    each family's synthetic presets are in its own package)."""
    leaks = code_shape().shape(ROOT, top=1)["files_naming_a_family_outside_its_package"]
    assert leaks == {}
