"""Everything else is declared in pyproject.toml. This file only adds what pyproject.toml cannot say: the wheel
carries the repository's data folders inside the package (flatbnn/resources.py finds them in either layout), while
the repository keeps them where they are; and the commit it was built from (flatbnn/build_info.py)."""

import importlib.util
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))

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


def _build_info_module():
    """flatbnn/build_info.py, loaded by path: flatbnn's dependencies need not be installed to build it."""
    spec = importlib.util.spec_from_file_location("flatbnn_build_info", os.path.join(HERE, "flatbnn", "build_info.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithCommit(build_py):
    """build_py, then the commit of the checkout being built into the build's copy of the package."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install is the checkout: git answers there
            return
        info = _build_info_module()
        info.write(os.path.join(self.build_lib, "flatbnn"), info.at_build(HERE))


data_packages = _data_packages()
setup(
    cmdclass={"build_py": BuildPyWithCommit},
    packages=find_packages(include=["flatbnn", "flatbnn.*"]) + data_packages,
    package_dir=SHIPPED,
    package_data={p: ["*.yaml"] for p in data_packages},
)
