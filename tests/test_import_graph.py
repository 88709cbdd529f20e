"""The import graph of flatbnn: no cycles between modules, no import that runs back up the layering.

Read from the source with ``ast`` (no module is imported, so no torch: well under a second). Module-level and
function-local imports count alike: a lazy import is still a dependency, only a hidden one.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "flatbnn"

# The layers, lowest first: a module may import from its own layer and the layers below it, never from above.
# One entry per sub-package or root module of flatbnn (a dotted entry places one module on its own); the order is
# what the code needs, read off its imports:
#   resources/atomic_io/runlog/utils: leaf helpers (paths, atomic writes, the run log's warn, dict flattening)
#   nn: Bayesian layers; models: architectures; data: data sets and loaders (no model, no engine)
#   metrics: what is measured on predictions; flatness: the perturbation seam (SAM, ...); optim: optimisers and
#   schedules; methods: the posterior seam, composed from flatness and optim
#   engine: build / train / checkpoint, method-agnostic; toys: small studies that drive engine.backprop;
#   api: the public hooks; cli: the entry points' shared error lines and exit codes
#   bench, reproduce: benchmarks, campaigns, aggregation above the engine
#   entry points: train.py, evaluate.py, torchrun, and reproduce/eval_job.py (one eval job, run as
#   ``python -m flatbnn.reproduce.eval_job``: it calls evaluate.py's routine; nothing imports it)
LAYERS: list[set[str]] = [
    {"resources", "atomic_io", "runlog", "utils"},
    {"nn"},
    {"models"},
    {"data"},
    {"metrics"},
    {"flatness"},
    {"optim"},
    {"methods"},
    {"engine"},
    {"toys"},
    {"api"},
    {"cli"},
    {"bench", "reproduce"},
    {"train", "evaluate", "torchrun", "reproduce.eval_job"},
]


def _module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """{module: modules of the package it imports}, every ``import`` statement (top-level or inside a function).

    ``from flatbnn.data import cifar`` is an edge to ``flatbnn.data.cifar`` when that is a module, else to
    ``flatbnn.data`` (its ``__init__``). The implicit import of a parent package is not an edge.
    """
    files = {_module_name(p, package_dir): p for p in sorted(package_dir.rglob("*.py"))}
    root = package_dir.name
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolved against the importing module's package
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import flatbnn.a.b.c` of an attribute path: its module
                    target = target.rpartition(".")[0]
                if target.split(".")[0] == root and target != name:
                    graph[name].add(target)
    for name in files:
        graph.setdefault(name, set())
    return dict(graph)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth <= number of modules (~150)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(graph, set(c)) for c in sorted(components)]


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One concrete cycle inside a strongly connected component: a -> b -> ... -> a (shortest from its first module)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"not a cycle: {component}")


def layer_of(module: str) -> int:
    parts = module.split(".")[1:]
    if not parts:  # flatbnn/__init__.py: the lazy top-level namespace, above everything it re-exports
        return len(LAYERS)
    for n in range(len(parts), 0, -1):  # the most specific entry: "reproduce.eval_job" before "reproduce"
        for i, layer in enumerate(LAYERS):
            if ".".join(parts[:n]) in layer:
                return i
    top = parts[0]
    raise AssertionError(f"{module}: flatbnn.{top} is in no layer of LAYERS (tests/test_import_graph.py): add it")


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


@lru_cache(maxsize=1)
def _graph() -> dict[str, set[str]]:  # read once for the three tests (~0.3 s)
    return import_graph()


def test_graph_sees_lazy_imports() -> None:
    # the reader itself: a function-local import is an edge (train.py imports reproduce.launch inside a function)
    graph = _graph()
    assert "flatbnn.reproduce.launch" in graph["flatbnn.train"]
    assert "flatbnn.engine.run" in graph and len(graph) > 100
    assert any(t.startswith("flatbnn.data") for t in graph["flatbnn.engine.run"])


def test_no_import_cycles() -> None:
    found = cycles(_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_upward_imports() -> None:
    found = upward_imports(_graph())
    assert not found, "imports that run back up the layers (LAYERS in this file):\n" + "\n".join(
        f"{a} -> {b}" for a, b in found
    )


def drawing(package_dir: Path = PACKAGE_DIR) -> str:
    """The layers (top first), what each imports from below, the cycles and the upward imports, as text for
    docs/ARCHITECTURE.md: ``python tests/test_import_graph.py [PACKAGE_DIR]``."""
    graph = import_graph(package_dir)
    present = {m.split(".")[1] if "." in m else "" for m in graph}
    lines = []
    for i in reversed(range(len(LAYERS))):
        names = sorted(n for n in LAYERS[i] if n.split(".")[0] in present)
        if not names:
            continue
        below = sorted({b.split(".")[1] for a, bs in graph.items() for b in bs
                        if "." in a and layer_of(a) == i and "." in b and layer_of(b) < i})
        lines.append(f"{' | '.join(names):<42} -> {', '.join(below) or '-'}")
    found_cycles, found_up = cycles(graph), upward_imports(graph)
    lines.append(f"cycles: {len(found_cycles)}")
    lines += [f"  {' -> '.join(c)}" for c in found_cycles]
    lines.append(f"upward imports: {len(found_up)}")
    lines += [f"  {a} -> {b}" for a, b in found_up]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(drawing(Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE_DIR))
