"""Everything else is declared in pyproject.toml. This file only adds what pyproject.toml cannot say: the wheel
carries the repository's data folders inside the package (flatbnn/resources.py finds them in either layout), while
the repository keeps them where they are."""

import os

from setuptools import find_packages, setup

# package inside the wheel -> folder in the repository
SHIPPED = {"flatbnn.configs": "configs", "flatbnn.rows": "rows", "flatbnn.results_paper": "results/paper"}


def _data_packages() -> list[str]:
    """Each shipped folder and its subfolders (configs/hydra/launcher, ...) as packages of YAML files."""
    out = []
    for package, folder in SHIPPED.items():
        for here, dirs, _ in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
            rel = os.path.relpath(here, folder)
            out.append(package if rel == "." else package + "." + rel.replace(os.sep, "."))
    return out


data_packages = _data_packages()
setup(
    packages=find_packages(include=["flatbnn", "flatbnn.*"]) + data_packages,
    package_dir=SHIPPED,
    package_data={p: ["*.yaml"] for p in data_packages},
)
