"""The code's shape: lines per module of the installed package's folders and the longest functions, to show what
a restructuring did (run it on two checkouts and compare).

    python3 benchmarks/code_shape.py [--root DIR] [--top 15] [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

PACKAGE_DIRS = ("moepack", "native", "format_spec", "v4", "packer", "runtime", "cli")


def modules(root: str) -> list[str]:
    found = []
    for folder in PACKAGE_DIRS:
        base = os.path.join(root, folder)
        if os.path.isdir(base):
            found += sorted(os.path.join(folder, f) for f in os.listdir(base) if f.endswith((".py", ".c", ".h")))
    return found


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
    return {"total_lines": sum(sizes.values()), "modules": dict(sorted(sizes.items(), key=lambda kv: -kv[1])),
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
    print(f"{s['total_lines']} lines in {len(s['modules'])} modules; the largest:")
    for rel, n in list(s["modules"].items())[:args.top]:
        print(f"  {n:6d}  {rel}")
    print("longest functions:")
    for f in s["longest_functions"]:
        print(f"  {f['lines']:6d}  {f['function']}")
    print("largest classes (methods, lines):")
    for c in s["largest_classes"]:
        print(f"  {c['methods']:3d} {c['lines']:6d}  {c['class']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
