"""README's table of config groups is generated from configs/ (scripts/readme_options.py): it lists every option
file and the default config.yaml picks, and cannot drift from them."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_options", REPO / "scripts" / "readme_options.py")
readme_options = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_options)


def test_readme_lists_every_option_of_every_config_group():
    readme = (REPO / "README.md").read_text()
    assert readme_options.with_table(readme, readme_options.render()) == readme, \
        "README.md's option table differs from configs/: run python scripts/readme_options.py"
    table = readme.split(readme_options.BEGIN)[1].split(readme_options.END)[0]
    for group, options in readme_options.groups_on_disk(REPO / "configs").items():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{group}` |"))
        assert all(f"`{o}`" in row for o in options), group
    assert "| `dataset` | " in table and "| `digits` | " in table  # config.yaml's default data set


def test_the_default_column_follows_config_yaml_and_a_new_group_must_be_described(tmp_path):
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "configs", configs)
    text = (configs / "config.yaml").read_text()
    (configs / "config.yaml").write_text(text.replace("  - dataset: digits\n", "  - dataset: mnist\n", 1))
    row = next(line for line in readme_options.render(configs).splitlines() if line.startswith("| `dataset` |"))
    assert "| `mnist` | " in row
    (configs / "augment").mkdir()
    (configs / "augment" / "none.yaml").write_text("{}\n")
    with pytest.raises(SystemExit, match="augment"):
        readme_options.render(configs)
