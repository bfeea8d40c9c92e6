"""No import circles anywhere in zb/, not even inside a package and not even through imports made inside
functions or under TYPE_CHECKING (issue 23: zb/swarm was one: worker <-> first, later, checkpoints)."""

from __future__ import annotations

import ast
from pathlib import Path

from zb.testing.procs import REPO


def _modules() -> dict[str, Path]:
    out = {}
    for path in (REPO / "zb").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[module].update(t for t in targets if t in modules and t != module)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_of_zb_imports_itself_back():
    assert _cycles(_edges(_modules())) == []


def test_the_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# docs/architecture.md, "Packages and the rules between them": a package imports only lower layers;
# the base modules import only base modules.
LAYERS = {
    "testing": 7,   # zb.testing: what tests and scripts share; the top layer, nothing in zb imports it
    "cli": 6, "swarm": 5, "generate": 5, "train": 4, "export": 4, "diloco": 3, "status": 3, "elastic": 2,
    "models": 1, "data": 1, "collectives": 1, "net": 1, "ckpt": 1, "monitor": 1,
}
BASE = {"errors", "config_schema", "config", "config_checks", "config_prime", "model_sizes", "position", "fingerprint",
        "local_world", "shard_rows", "metrics", "events", "log", "progress", "dial", "addresses", "stop_signals", "process_exit",
        "secret", "signed_store", "store_clients", "rendezvous_store", "resources", "overlap_modes", "sparse_scheme", "torch_log",
        "__main__"}


def _package(module: str) -> str:
    parts = module.split(".")
    return "zb" if len(parts) == 1 else parts[1]


def test_packages_import_only_lower_layers():
    modules = _modules()
    known = set(LAYERS) | BASE | {"zb"}
    assert {_package(m) for m in modules} <= known, "a new package: give it a layer here and in docs/architecture.md"
    wrong = []
    for module, targets in _edges(modules).items():
        src = _package(module)
        for target in targets:
            dst = _package(target)
            if dst in (src, "zb") or src == "__main__":
                continue
            if src in BASE:
                ok = dst in BASE
            else:
                ok = dst in BASE or LAYERS[dst] < LAYERS[src]
            if not ok:
                wrong.append(f"{module} -> {target}")
    assert wrong == []
