"""The code's shape: lines per module of the installed package's folders, the longest functions, and the source
files that name a model family outside its own package, to show what a restructuring did (run it on two checkouts
and compare).

    python3 benchmarks/code_shape.py [--root DIR] [--top 15] [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys

# the folders pyproject.toml maps into `moepack` (a checkout lacking one, an older one, skips it), with their
# subpackages (a family's own package: families/qwen3_moe)
PACKAGE_DIRS = ("moepack", "native", "format_spec", "backends", "families", "packer", "runtime", "serve", "tools",
                "cli")
PACKAGE_DIRS += ("v4",)  # DeepSeek-V4's folder in an older checkout (now families/deepseek_v4)
SOURCE_SUFFIXES = (".py", ".c", ".h")

# Names only one model family has, as they appear in code (identifiers and string literals; comments and docstrings
# are not looked at). A source file outside that family's package (families/deepseek_v4/ for DeepSeek-V4,
# families/<name>/ for the others) that holds one of them knows that family: adding a family would touch it.
FAMILY_NAMES = {
    "deepseek-v4": [
        r"(?<![a-z0-9])hc_",   # the mHC residual streams' tensors and functions (hc_attn_fn, hc_head_scale, ...)
        r"mhc",                # manifold hyper-connections, DeepSeek-V4's residual (mhc_native, MhcWeights)
        r"(?<![a-z])compressor",  # CSA / HCA's KV compressors (not zstandard's ZstdCompressor)
        r"(?<![a-z])indexer(?!ror)",  # CSA's Lightning Indexer (not IndexError)
        r"compress_ratio",     # the config's per-layer compression
        r"tid2eid",            # the hash-routed layers' token -> experts table
        r"attn_sink",          # the attention's learned sinks, by the release's name
        r"ffn\.experts\.",     # the release's expert tensor names, built by hand
        r"deepseek",           # the architecture's and the releases' names
    ],
    "qwen3-moe": [
        r"qwen",               # Qwen3MoeForCausalLM, qwen3_moe, llama.cpp's qwen3moe
        # Qwen3-MoE's own config fields (norm_topk_prob is not one: DeepSeek-V4's release config has it too)
        r"decoder_sparse_step", r"mlp_only_layers",
    ],
}
# in string literals only: DeepSeek-V4's expert matrices by the release's names ("w1", f"{p}.w3.weight"); a variable
# named w1 is any SwiGLU's
EXPERT_LITERAL = re.compile(r"(?<![a-z0-9])w[123](?![a-z0-9])")
FAMILY_HOMES = {"deepseek-v4": ("families/deepseek_v4/", "v4/"),  # v4/: in an older checkout
                "qwen3-moe": "families/qwen3_moe/"}


def modules(root: str) -> list[str]:
    found = []
    for folder in PACKAGE_DIRS:
        base = os.path.join(root, folder)
        for here, subfolders, names in os.walk(base):
            subfolders[:] = sorted(d for d in subfolders if os.path.isfile(os.path.join(here, d, "__init__.py")))
            rel = os.path.relpath(here, root)
            found += sorted(os.path.join(rel, f) for f in names if f.endswith(SOURCE_SUFFIXES))
    return found


def code_words(path: str) -> tuple[list[str], list[str]]:
    """(identifiers, string literals) of a source file, comments and docstrings left out. C: the text between
    comments as one identifier-bearing word, and its "..." literals."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not path.endswith(".py"):
        code = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
        return [code], re.findall(r'"(?:[^"\\\n]|\\.)*"', code)
    tree = ast.parse(text, path)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in node.body:  # a bare string statement anywhere in a body is documentation
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                    docstrings.add(id(stmt.value))
    names, strings = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.arg):
            names.append(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.append(node.arg)
        elif isinstance(node, ast.alias):
            names += [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            strings.append(node.value)
    return names, strings


def family_names_in(path: str) -> dict[str, list[str]]:
    """family -> the distinct names of it the file's code holds."""
    names, strings = code_words(path)
    found: dict[str, set[str]] = {}
    for family, patterns in FAMILY_NAMES.items():
        pattern = re.compile("|".join(patterns), re.I)
        for word in names + strings:
            found.setdefault(family, set()).update(m.group(0).lower() for m in pattern.finditer(word))
    found.setdefault("deepseek-v4", set()).update(
        f'"{m.group(0)}"' for s in strings for m in EXPERT_LITERAL.finditer(s))
    return {family: sorted(got) for family, got in found.items() if got}


def family_leaks(root: str, files: list[str]) -> dict[str, dict[str, list[str]]]:
    """file -> {family: names} for every source file outside a family's home that names that family."""
    leaks = {}
    for rel in files:
        named = {family: got for family, got in family_names_in(os.path.join(root, rel)).items()
                 if not rel.startswith(FAMILY_HOMES[family])}
        if named:
            leaks[rel] = named
    return leaks


def functions(path: str, rel: str) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method of a Python module."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((child.end_lineno - child.lineno + 1, f"{rel}:{prefix}{child.name}"))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                out.append((0, ""))  # classes are counted by their methods
                walk(child, f"{prefix}{child.name}.")
    walk(tree, "")
    return [f for f in out if f[1]]


def shape(root: str, top: int) -> dict:
    sizes, funcs, classes = {}, [], {}
    for rel in modules(root):
        path = os.path.join(root, rel)
        with open(path) as f:
            sizes[rel] = sum(1 for _ in f)
        if rel.endswith(".py"):
            funcs += functions(path, rel)
            with open(path) as f:
                for node in ast.walk(ast.parse(f.read())):
                    if isinstance(node, ast.ClassDef):
                        methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                        classes[f"{rel}:{node.name}"] = (len(methods), node.end_lineno - node.lineno + 1)
    funcs.sort(reverse=True)
    largest_classes = sorted(classes.items(), key=lambda kv: -kv[1][1])[:top]
    leaks = family_leaks(root, list(sizes))
    folders: dict[str, int] = {}
    for rel, n in sizes.items():
        folders[rel.split(os.sep)[0]] = folders.get(rel.split(os.sep)[0], 0) + n
    return {"total_lines": sum(sizes.values()), "folders": dict(sorted(folders.items(), key=lambda kv: -kv[1])),
            "modules": dict(sorted(sizes.items(), key=lambda kv: -kv[1])),
            "files_naming_a_family_outside_its_package": leaks,
            "longest_functions": [{"lines": n, "function": name} for n, name in funcs[:top]],
            "largest_classes": [{"class": k, "methods": m, "lines": n} for k, (m, n) in largest_classes]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    s = shape(args.root, args.top)
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    print(f"{s['total_lines']} lines in {len(s['modules'])} modules; by folder:")
    for folder, n in s["folders"].items():
        print(f"  {n:6d}  {folder}/ ({100 * n / s['total_lines']:.0f} %)")
    print("the largest modules:")
    for rel, n in list(s["modules"].items())[:args.top]:
        print(f"  {n:6d}  {rel}")
    print("longest functions:")
    for f in s["longest_functions"]:
        print(f"  {f['lines']:6d}  {f['function']}")
    print("largest classes (methods, lines):")
    for c in s["largest_classes"]:
        print(f"  {c['methods']:3d} {c['lines']:6d}  {c['class']}")
    leaks = s["files_naming_a_family_outside_its_package"]
    print(f"files naming a family outside its package: {len(leaks)} of {len(s['modules'])}")
    for rel, named in leaks.items():
        print(f"  {rel}: " + "; ".join(f"{family} ({', '.join(got)})" for family, got in named.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
