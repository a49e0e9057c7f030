"""The package's import graph, as installed: every `import` of a moepack module anywhere in a module (at the top or
inside a function) is an edge. The layers are cli -> serve / tools -> runtime (packer beside it) -> model families
(families: the registry, and each family in its own package, families/deepseek_v4, families/qwen3_moe) -> backends ->
format_spec -> native: nothing imports a layer above its own; serve and tools never import each other nor packer, packer
and runtime never import each other, a family's package never imports another's (a family holds no other family's
names); and no module imports itself back through others (no cycles, not even through a function-level import)."""

from __future__ import annotations

import ast
import importlib.util
import os

import pytest

# layer of each subpackage: a module may import its own layer's modules and lower layers' only
LAYERS = {
    "moepack.native": 0,
    "moepack.format_spec": 1,
    # the device backends, below the model families: nothing in a backend imports a family
    "moepack.backends": 2,
    "moepack.families": 3,  # the model families, each in its own package (deepseek_v4, qwen3_moe), and their registry
    "moepack.runtime": 4,  # runs models; its benchmark-tuning lookups are runtime/tuning.py
    "moepack.packer": 4,
    "moepack.kv": 4,  # the transformers consumer of a KV directory
    "moepack.serve": 5,  # the OpenAI-compatible server and the tokenizer
    "moepack.tools": 5,  # the planner and the measurements (moepack plan, moepack bench)
    "moepack.cli": 6,
    "moepack.__main__": 6,
}
SIBLINGS_APART = {("moepack.runtime", "moepack.packer"), ("moepack.packer", "moepack.runtime"),
                  # the server and the tools share nothing but the runtime below them, and write no containers
                  ("moepack.serve", "moepack.tools"), ("moepack.tools", "moepack.serve"),
                  ("moepack.serve", "moepack.packer"), ("moepack.tools", "moepack.packer")}


def package_modules() -> dict[str, str]:
    """Module name -> source file, for every module of the installed package."""
    modules = {}
    root = importlib.util.find_spec("moepack")
    for base in root.submodule_search_locations:
        for name in os.listdir(base):
            if name.endswith(".py"):
                stem = name[:-3]
                modules["moepack" if stem == "__init__" else f"moepack.{stem}"] = os.path.join(base, name)
    for sub in sorted({m.split(".")[1] for m in LAYERS} - {"kv", "__main__"}):
        spec = importlib.util.find_spec(f"moepack.{sub}")
        if spec is None:
            continue
        for base in spec.submodule_search_locations:
            for folder, subfolders, names in os.walk(base):  # a family's own package too (families/qwen3_moe)
                subfolders[:] = [d for d in subfolders if os.path.isfile(os.path.join(folder, d, "__init__.py"))]
                inner = os.path.relpath(folder, base)
                package = f"moepack.{sub}" + ("" if inner == "." else "." + inner.replace(os.sep, "."))
                for name in names:
                    if name.endswith(".py"):
                        stem = name[:-3]
                        modules[package if stem == "__init__" else f"{package}.{stem}"] = os.path.join(folder, name)
    return modules


def imports_of(module: str, path: str, known: set[str]) -> set[str]:
    """The moepack modules `module` imports anywhere in its source."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from package import module` imports that module; `from module import name` the module
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import moepack.runtime.engine` names the module itself
                target = target.rpartition(".")[0]
            if target.startswith("moepack") and target != module:
                found.add(target)
    return found


def layer_of(module: str) -> tuple[str, int] | None:
    for prefix, rank in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return prefix, rank
    return None  # the root package `moepack` (its version and error type): importable from anywhere


def graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    return {m: imports_of(m, p, known) for m, p in modules.items()}


def test_the_package_has_every_layer():
    modules = graph()
    for prefix in ("moepack.native", "moepack.format_spec", "moepack.backends", "moepack.families",
                   "moepack.families.deepseek_v4",
                   "moepack.families.qwen3_moe", "moepack.runtime", "moepack.packer", "moepack.serve",
                   "moepack.tools", "moepack.cli"):
        assert any(m.startswith(prefix) for m in modules), f"{prefix} not found in the installed package"


def test_no_module_imports_a_layer_above_its_own():
    violations = []
    for module, targets in graph().items():
        mine = layer_of(module)
        for target in targets:
            theirs = layer_of(target)
            if mine is None or theirs is None:
                if mine is None and theirs is not None and module == "moepack" and theirs[1] > 1:
                    violations.append(f"{module} -> {target}")  # the root imports only errors-level modules
                continue
            if theirs[1] > mine[1] or (mine[0], theirs[0]) in SIBLINGS_APART:
                violations.append(f"{module} -> {target}")
    assert not violations, "imports against the layering:\n" + "\n".join(sorted(violations))


def test_the_runtime_only_runs_models():
    """The server, the tokenizer, the planner and the measurements live in their own rooms (issue 39): none of
    their modules is back in moepack.runtime, and the runtime reaches the measurements only through tuning.py."""
    modules = graph()
    moved = {"serve", "serve_metrics", "tool_calls", "grammar", "tokenizer", "plan", "bench"}
    back = sorted(m for m in modules if m.startswith("moepack.runtime.") and m.rpartition(".")[2] in moved)
    assert not back, f"back in the runtime: {back}"
    for room in ("moepack.serve.app", "moepack.serve.tokenizer", "moepack.tools.plan", "moepack.tools.bench"):
        assert room in modules, f"{room} not found"
    readers = sorted(m for m, targets in modules.items() if "moepack.runtime.tuning" in targets)
    assert "moepack.runtime.engine" in readers and "moepack.runtime.expert_runner" in readers, readers


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `edges`, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("edges, cyclic", [({"a": {"b"}, "b": {"c"}, "c": set()}, False),
                                           ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
                                           ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False)])
def test_the_cycle_finder_finds_cycles(edges, cyclic):
    assert (find_cycle(edges) is not None) == cyclic


def test_a_function_level_import_is_an_edge(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from moepack.cli import main\n    from . import sibling\n")
    got = imports_of("moepack.runtime.m", str(src), {"moepack.cli.main", "moepack.runtime.sibling", "moepack.cli"})
    assert got == {"moepack.cli.main", "moepack.runtime.sibling"}


def test_deepseek_v4_and_the_backends_have_their_own_packages():
    """DeepSeek-V4 is a family in its own package, its forward included, and the device kernels are backends
    (issue 39): the old DeepSeek-V4 package is gone, and none of the moved modules is back in moepack.runtime."""
    modules = graph()
    moved_from_runtime = ("device_copier", "grouped_experts", "mhc_native", "model", "token_kernels", "token_layer")
    assert not [m for m in modules if m.split(".")[:2] == ["moepack", "v4"]]
    back = [stem for stem in moved_from_runtime if f"moepack.runtime.{stem}" in modules]
    assert not back, f"back in the runtime: {back}"
    assert "moepack.families.deepseek_v4.model" in modules and "moepack.families.deepseek_v4.config" in modules
    # DeepSeek-V4's own operations' kernels (mHC, the Lightning Indexer) are the family's, not the backends'
    assert {"moepack.families.deepseek_v4.mhc_native", "moepack.families.deepseek_v4.indexer_native"} <= set(modules)
    assert "moepack.backends.mhc_native" not in modules


def test_a_family_imports_no_other_family():
    """A family's package (families/<name>/) imports no other family's: the registry, moepack.families itself, is
    the one module that knows them all."""
    modules = package_modules()
    families = {m for m, path in modules.items()
                if m.startswith("moepack.families.") and path.endswith("__init__.py") and m.count(".") == 2}
    assert "moepack.families.deepseek_v4" in families and len(families) >= 2, families

    def family_of(module):
        return next((f for f in families if module == f or module.startswith(f + ".")), None)

    crossing = sorted(f"{m} -> {t}" for m, targets in graph().items() for t in targets
                      if family_of(m) and family_of(t) and family_of(m) != family_of(t))
    assert not crossing, "a family importing another:\n" + "\n".join(crossing)


def test_the_model_calls_operations_not_the_token_kernels():
    """DeepSeek-V4's model and decode call backends/ops.py's operations (which choose the compiled CPU kernel or
    torch), never backends/token_kernels.py itself (issue 39); its compiled token path (token_layer,
    indexer_native) is the kernels' own user. No backend module imports a family."""
    modules = graph()
    for module in ("moepack.families.deepseek_v4.model", "moepack.families.deepseek_v4.decode"):
        assert "moepack.backends.ops" in modules[module], module
        assert "moepack.backends.token_kernels" not in modules[module], f"{module} calls token_kernels directly"
    assert not [t for m, targets in modules.items() if m.startswith("moepack.backends.") for t in targets
                if t.startswith("moepack.families")]


def private_names_used(path: str) -> list[str]:
    """`module._name` in a source file, for a module it imports (import x / from p import x): another module's
    private name, which binds the two where no interface says so."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported
            and node.attr.startswith("_") and not node.attr.startswith("__")]


def test_no_module_uses_another_modules_private_names(tmp_path):
    """The compiled token path once used 14 private names of other modules (issue 39): the kernels' C entry points
    and the model's helpers it takes are public now, and no module of the package reaches into another's."""
    found = {m: got for m, p in package_modules().items() if (got := private_names_used(p))}
    assert found == {}
    sample = tmp_path / "m.py"
    sample.write_text("from moepack.families.deepseek_v4 import model\nimport torch\n"
                      "x = model._grow_state\ny = torch.nn\nz = self._own\n")
    assert private_names_used(str(sample)) == ["3: model._grow_state"]
