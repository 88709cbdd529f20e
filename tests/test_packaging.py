"""The package's data folders in both layouts (a checkout; an installed wheel), and the console scripts it declares.
The wheel itself is built, installed and run outside the checkout by .ci/wheel_check.sh."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shutil
from pathlib import Path

import pytest

from flatbnn import resources

REPO = Path(__file__).resolve().parents[1]


def _shipped() -> dict[str, str]:
    """setup.py's SHIPPED: package inside the wheel -> folder in the repository."""
    tree = ast.parse((REPO / "setup.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "SHIPPED")
    return ast.literal_eval(node.value)


def test_data_folders_are_found_in_the_checkout_and_in_the_wheels_layout(tmp_path):
    shipped = _shipped()
    by_folder = {"configs": resources.CONFIGS_DIR, "rows": resources.ROWS_DIR, "results/paper": resources.PAPER_DIR}
    assert set(shipped.values()) == set(by_folder)
    # a checkout: the repository's own folders, and outputs go into it
    assert resources.CHECKOUT == REPO and resources.project_root() == REPO
    for folder, found in by_folder.items():
        assert found == REPO / folder and found.is_dir(), folder

    # the wheel's layout: flatbnn/<last part of the package name>, as setup.py maps them
    pkg = tmp_path / "site-packages" / "flatbnn"
    pkg.mkdir(parents=True)
    shutil.copy(Path(resources.__file__), pkg / "resources.py")
    for package in shipped:
        (pkg / package.split(".")[-1]).mkdir()
    spec = importlib.util.spec_from_file_location("installed_resources", pkg / "resources.py")
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    assert installed.CHECKOUT is None
    found = {"configs": installed.CONFIGS_DIR, "rows": installed.ROWS_DIR, "results/paper": installed.PAPER_DIR}
    for package, folder in shipped.items():
        assert found[folder] == pkg / package.split(".")[-1], (package, folder)


def test_console_scripts_name_functions_that_exist():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"flatbnn-train", "flatbnn-eval", "flatbnn-reproduce"} <= set(scripts)
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr, None)), (name, target)


def test_a_script_row_refuses_in_one_line_where_the_package_is_installed(tmp_path, monkeypatch, capsys):
    """The toy reproductions are scripts/ of a checkout; an installed wheel does not ship them: exit 2, one line,
    nothing run or written (not a shell's 'No such file' after creating the row's output dir)."""
    import subprocess

    from flatbnn.reproduce import scripts as row_scripts
    from flatbnn.reproduce.spec import load_row

    ran = []
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: ran.append(a) or 0)
    monkeypatch.setattr(row_scripts, "OUTPUT_ROOT", tmp_path)
    monkeypatch.setattr(resources, "CHECKOUT", None)
    assert row_scripts.run_script_row(load_row("bsam_logreg"), "smoke") == 2
    assert ran == [] and list(tmp_path.iterdir()) == []
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "installed package does not ship" in err and "clone" in err, err


def test_a_missing_matplotlib_fails_the_diagram_instead_of_skipping_it(tmp_path, monkeypatch):
    """matplotlib is a declared dependency: a run that asks for a reliability diagram must not print 'skipped' and
    go on without it (a broken install would then pass unnoticed)."""
    import sys

    import torch

    from flatbnn.engine.results import save_reliability_diagram
    from flatbnn.metrics.evaluate import EvalConfig

    probs, targets = torch.tensor([[0.8, 0.2], [0.3, 0.7]]), torch.tensor([0, 1])
    save_reliability_diagram(probs, targets, tmp_path / "ok.png", EvalConfig())
    assert (tmp_path / "ok.png").stat().st_size > 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError):
        save_reliability_diagram(probs, targets, tmp_path / "missing.png", EvalConfig())
    assert not (tmp_path / "missing.png").exists()
