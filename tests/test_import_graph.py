"""The package's import graph: no circles, and each folder imports only the folders below it.

Every import in every module counts, those inside functions too (a lazy import is still a
dependency, only deferred); imports under ``if TYPE_CHECKING:`` do not (they never run). The
folders stack up as

    models   files, names, errors: imports no other folder of llmlocal
    native   the kernels: may import models
    engine   plans, loads and runs models: may import models and native
    quant    makes GGUF files: may import the engine (its public API and the model code it
             calibrates), models, native
    app      the CLI, the TUI, the server's command, the benchmarks: may import everything

so a module never reaches up into a client of its own folder (the benchmarks and the memory
check are the app's, not the engine's).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("models", "native", "engine", "quant", "app")  # each may import those before it


def _modules() -> dict[str, Path]:
    mods = {}
    for folder in LAYERS:
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(["llmlocal", *parts])] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    skip.update(id(n) for n in ast.walk(stmt))
    return skip


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]) -> list[str]:
    """The llmlocal modules an import statement loads (a submodule, or the package whose
    attribute it takes); an extension module (a compiled file beside the sources) is a leaf."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = []
        for alias in node.names:
            sub = f"{prefix}.{alias.name}"
            if sub in mods:
                names.append(sub)
            elif prefix in mods and mods[prefix].name == "__init__.py" and any(mods[prefix].parent.glob(f"{alias.name}.*.so")):
                continue  # a compiled submodule
            else:
                names.append(prefix)
    out = []
    for name in names:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in mods and name != module:
            out.append(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree)
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                deps.update(_targets(module, path, node, mods))
        graph[module] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_graph_sees_the_imports_it_should() -> None:
    """The walker is not blind: known edges, a lazy one included, and no TYPE_CHECKING one."""
    graph = _graph()
    assert "llmlocal.engine.plan" in graph["llmlocal.engine.engine"]
    assert "llmlocal.engine.backends.paged" in graph["llmlocal.engine.engine"]  # imported inside Engine.load
    assert "llmlocal.app.serve.server" not in graph["llmlocal.app.serve.openai_api"]  # Handler, for its type hints only
    assert "llmlocal.native.cpu.runtime" in graph["llmlocal.native.cpu.linear"]


def test_no_module_imports_itself_through_others() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_each_folder_imports_only_the_folders_below_it() -> None:
    upward: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, deps in _graph().items():
        mine = LAYERS.index(module.split(".")[1])
        for dep in deps:
            theirs = LAYERS.index(dep.split(".")[1])
            if theirs > mine:
                upward[(module.split(".")[1], dep.split(".")[1])].append(f"{module} -> {dep}")
    assert not upward, "imports reaching up: " + "; ".join(f"{a} -> {b}: {', '.join(v[:3])}" for (a, b), v in upward.items())
