"""The import graph of flatbnn: no circles between modules, no import that runs back up the layering, every module in
a layer, and docs/ARCHITECTURE.md's drawing current.

The graph reader, the layers (``LAYERS``) and the checks live in scripts/import_graph.py (one home, also the drawing
in the docs); the script reads the source with ``ast`` (nothing is imported, so no torch: well under a second).
tests/test_import_graph_script.py shows the checks catch a circle and an upward import.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


@lru_cache(maxsize=1)
def _graph() -> dict[str, set[str]]:  # read once for the tests below (~0.3 s)
    return import_graph.import_graph(REPO / "flatbnn")


def test_graph_sees_lazy_imports() -> None:
    # the reader itself: a function-local import is an edge (train.py imports reproduce.launch inside a function)
    graph = _graph()
    assert "flatbnn.reproduce.launch" in graph["flatbnn.train"]
    assert "flatbnn.engine.run" in graph and len(graph) > 100
    assert any(t.startswith("flatbnn.data") for t in graph["flatbnn.engine.build"])


def test_no_import_cycles() -> None:
    found = import_graph.circles(_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c.cycles[0]) for c in found)


def test_no_upward_imports() -> None:
    found = import_graph.upward_imports(_graph())
    assert not found, "imports that run back up the layers (LAYERS in scripts/import_graph.py):\n" + "\n".join(
        f"{a} -> {b}" for a, b in found
    )


def test_no_packages_import_each_other() -> None:
    # bench <-> reproduce was such a knot: no module circle and no upward import while both shared a layer
    found = import_graph.node_circles(_graph())
    assert not found, "packages (LAYERS entries) importing each other: " + "; ".join(" <-> ".join(k) for k in found)


def test_the_gpu_window_sits_above_the_benchmark_code_it_runs() -> None:
    # the window runs the self-check (bench) and then the campaign (reproduce): it lives in reproduce, above bench,
    # and bench imports nothing of reproduce (what cost.py and campaign.py read of bench stays below them)
    graph = _graph()
    assert "flatbnn.bench.selfcheck" in graph["flatbnn.reproduce.window"]
    assert {"flatbnn.bench.variants", "flatbnn.bench.selfcheck"} <= graph["flatbnn.reproduce.cost"]
    assert "flatbnn.bench.mps" in graph["flatbnn.reproduce.campaign"]
    assert import_graph.layer_of("flatbnn.bench.selfcheck") < import_graph.layer_of("flatbnn.reproduce.window")
    assert not [b for a, targets in graph.items() if a.startswith("flatbnn.bench") for b in targets
                if b.startswith("flatbnn.reproduce")]


def test_every_module_in_a_layer() -> None:
    found = import_graph.unplaced(_graph())
    assert not found, f"modules in no layer: add their sub-package to LAYERS in scripts/import_graph.py: {found}"


def test_architecture_drawing_current() -> None:
    # Package level (plus the circles and upward imports, none today): splitting or adding a module inside a
    # package leaves the block as it is; a new sub-package or a new import between two of them changes it.
    block = import_graph.doc_block((REPO / "docs" / "ARCHITECTURE.md").read_text())
    assert block == import_graph.markdown(_graph()), (
        "docs/ARCHITECTURE.md's import graph is out of date: run python scripts/import_graph.py --write"
    )


def test_evaluation_and_analysis_do_not_pull_in_the_training_run_machinery() -> None:
    # evaluate.py and scripts/analyze.py need build (config -> data, model, method) and the final evaluation, not
    # the run dir's lock, resume policy or orchestration (engine/run_dir.py, engine/lock.py, engine/run.py)
    graph = _graph()

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for m in graph.get(todo.pop(), ()):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen

    training_only = {"flatbnn.engine.run", "flatbnn.engine.run_dir", "flatbnn.engine.lock"}
    assert "flatbnn.engine.build" in reachable("flatbnn.evaluate")
    assert not reachable("flatbnn.evaluate") & training_only
    assert not reachable("flatbnn.engine.build") & training_only
