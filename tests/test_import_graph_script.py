"""scripts/import_graph.py on made-up trees: it finds each kind of circle and each import running back up, with the
counts its drawing prints, and the same checks report an upward import planted in a copy of flatbnn itself."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts" / "import_graph.py")
ig = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ig)

# A tiny "flatbnn" (sub-package names from the real LAYERS): data/a <-> data/b (one import relative, one inside a
# function), data/__init__ imports data/reg, which imports its package back (the old registry pattern), metrics/m
# imports engine/e lazily (up: metrics sits below engine), engine/e imports data and metrics (down: allowed), zzz is
# in no layer.
TREE = {
    "__init__.py": "",
    "data/__init__.py": "from flatbnn.data import reg\n",
    "data/reg.py": "from flatbnn.data import DataBundle\n",
    "data/a.py": "from . import b\n",
    "data/b.py": "def f():\n    import flatbnn.data.a.thing\n",
    "metrics/__init__.py": "",
    "metrics/m.py": "import os\n\ndef g():\n    from flatbnn.engine.e import run\n",
    "engine/__init__.py": "",
    "engine/e.py": "from ..data.a import x\nfrom flatbnn.metrics import __version__\n",
    "zzz/__init__.py": "",
    "zzz/q.py": "from flatbnn import data\n",
}


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "flatbnn" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checks_on_a_made_up_tree(tmp_path: Path) -> None:
    graph = ig.import_graph(ig.package_dir_of(_write(tmp_path, TREE)))
    assert graph["flatbnn.data.b"] == {"flatbnn.data.a"}  # `import flatbnn.data.a.thing`: the module, lazily
    assert graph["flatbnn.engine.e"] == {"flatbnn.data.a", "flatbnn.metrics"}  # `..data.a` resolved

    found = ig.circles(graph)
    assert [(c.package, c.modules) for c in found] == [
        (None, ["flatbnn.data.a", "flatbnn.data.b"]),
        ("flatbnn.data", ["flatbnn.data.reg"]),
    ]
    assert found[0].cycles == [["flatbnn.data.a", "flatbnn.data.b", "flatbnn.data.a"]]
    assert found[1].cycles == [["flatbnn.data", "flatbnn.data.reg", "flatbnn.data"]]
    assert ig.upward_imports(graph) == [("flatbnn.metrics.m", "flatbnn.engine.e")]
    assert ig.unplaced(graph) == ["flatbnn.zzz", "flatbnn.zzz.q"]
    assert ig.package_edges(graph) == {
        "flatbnn": set(), "data": set(), "metrics": {"engine"}, "engine": {"data", "metrics"}, "zzz": {"data"},
    }
    assert ig.node_circles(graph) == [["engine", "metrics"]]  # metrics/m -> engine/e -> metrics: packages too


def test_drawing_counts_and_marks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ig.main(["--root", str(_write(tmp_path, TREE))]) == 0
    text = capsys.readouterr().out
    assert "circles: 2 (1 between modules, 1 through a package __init__)" in text
    assert "  data/a.py -> data/b.py -> data/a.py" in text
    assert "  data/__init__.py <-> 1 of its modules that import it (reg)" in text
    assert "circles between the nodes drawn (packages importing each other): 1\n  engine <-> metrics" in text
    assert "imports running back up: 1\n  metrics/m.py -> engine/e.py" in text
    assert "modules in no layer (add them to LAYERS in scripts/import_graph.py): 2" in text
    assert "    4  metrics  ^engine" in text and "    8  engine   data, metrics" in text
    assert "[2 circles inside]" in text

    assert ig.main(["--root", str(tmp_path / "flatbnn"), "--markdown"]) == 0  # the package folder itself works too
    md = capsys.readouterr().out
    assert "  n_metrics -.->|up| n_engine" in md and "  n_engine --> n_data" in md
    # links top layer first: zzz->data, engine->data, engine->metrics, metrics->engine (the one red one)
    assert "  linkStyle 3 stroke:#d22" in md
    assert "  class n_data knot" in md


def test_a_cycle_of_three_lists_each_cycle(tmp_path: Path) -> None:
    # transforms -> imagefolder -> ood -> transforms, and imagefolder -> transforms: one knot, two cycles (issue 35)
    files = {"__init__.py": "", "data/__init__.py": "", "data/transforms.py": "from flatbnn.data import imagefolder\n",
             "data/imagefolder.py": "from flatbnn.data import ood, transforms\n",
             "data/ood.py": "from flatbnn.data.transforms import T\n"}
    (knot,) = ig.circles(ig.import_graph(ig.package_dir_of(_write(tmp_path, files))))
    assert knot.cycles == [
        ["flatbnn.data.imagefolder", "flatbnn.data.transforms", "flatbnn.data.imagefolder"],
        ["flatbnn.data.imagefolder", "flatbnn.data.ood", "flatbnn.data.transforms", "flatbnn.data.imagefolder"],
    ]


def test_an_upward_import_planted_in_flatbnn_is_reported(tmp_path: Path) -> None:
    # the real tree and the real LAYERS: one function-local import of reproduce from metrics is the only finding
    shutil.copytree(REPO / "flatbnn", tmp_path / "flatbnn", ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    planted = tmp_path / "flatbnn" / "metrics" / "reliability.py"
    planted.write_text(planted.read_text() + "\n\ndef _planted():\n    from flatbnn.reproduce.aggregate import x\n")
    graph = ig.import_graph(ig.package_dir_of(tmp_path))
    assert ig.upward_imports(graph) == [("flatbnn.metrics.reliability", "flatbnn.reproduce.aggregate")]
    assert ig.circles(graph) == []


def test_two_packages_of_one_layer_importing_each_other_are_a_circle(tmp_path: Path) -> None:
    # tools/a -> evaluate -> tools/b: no module circle, and tools and evaluate share a layer (no upward import), yet
    # the two packages import each other -- the shape of the old bench <-> reproduce knot
    files = {"__init__.py": "", "evaluate.py": "from flatbnn.tools import b\n", "tools/__init__.py": "",
             "tools/a.py": "from flatbnn import evaluate\n", "tools/b.py": ""}
    graph = ig.import_graph(ig.package_dir_of(_write(tmp_path, files)))
    assert ig.circles(graph) == [] and ig.upward_imports(graph) == []
    assert ig.node_circles(graph) == [["evaluate", "tools"]]


def test_the_window_moved_back_into_bench_is_reported(tmp_path: Path) -> None:
    # the real tree and LAYERS: a bench module that imports reproduce again (as bench/window_host.py did) is an
    # import running back up and a circle of the two packages (reproduce/cost.py imports bench)
    shutil.copytree(REPO / "flatbnn", tmp_path / "flatbnn", ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    planted = tmp_path / "flatbnn" / "bench" / "reference.py"
    planted.write_text(planted.read_text() + "\n\ndef _planted():\n    from flatbnn.reproduce import launch\n")
    graph = ig.import_graph(ig.package_dir_of(tmp_path))
    assert ig.upward_imports(graph) == [("flatbnn.bench.reference", "flatbnn.reproduce.launch")]
    assert ig.node_circles(graph) == [["bench", "reproduce"]] and ig.circles(graph) == []  # no module circle


def test_bad_root_and_write_elsewhere_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ig.main(["--root", str(tmp_path)]) == 2
    assert "neither" in capsys.readouterr().err
    assert ig.main(["--root", str(_write(tmp_path, TREE)), "--write"]) == 2
    assert "leave out --root" in capsys.readouterr().err
