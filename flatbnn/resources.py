"""Where flatbnn's data files are: ``configs/`` (the Hydra config groups), ``rows/`` (the paper-row specs) and
``results/paper/`` (the papers' numbers).

In the repository they sit at the top (a checkout, or an editable install of it). A wheel carries copies inside the
package -- ``flatbnn/configs``, ``flatbnn/rows``, ``flatbnn/results_paper`` -- mapped there at build time by setup.py;
nothing moves in the repository. Every reader asks this module, so both layouts work.

A user's own configs, without touching the shipped ones: ``flatbnn-train --config-dir DIR`` adds DIR to Hydra's
search path (new options in the same groups, e.g. ``DIR/experiment/mine.yaml`` -> ``experiment=mine``);
``--config-path DIR --config-name NAME`` replaces the primary config.
"""

from __future__ import annotations

from pathlib import Path

# configs/config.yaml's `metrics: default` is a dataclass in Hydra's ConfigStore: every composition finds configs/
# here, so importing this module registers it
from flatbnn import schema  # noqa: F401

PACKAGE = Path(__file__).resolve().parent
_INSTALLED = (PACKAGE / "configs").is_dir()

#: the repository root when this package is a checkout's (run from the source tree or installed editable);
#: None when it is an installed wheel
CHECKOUT: Path | None = None if _INSTALLED else PACKAGE.parent

CONFIGS_DIR = PACKAGE / "configs" if _INSTALLED else PACKAGE.parent / "configs"
ROWS_DIR = PACKAGE / "rows" if _INSTALLED else PACKAGE.parent / "rows"
PAPER_DIR = PACKAGE / "results_paper" if _INSTALLED else PACKAGE.parent / "results" / "paper"


def project_root() -> Path:
    """Where the reproduce tools write ``outputs/`` and ``results/``: the checkout; for an installed wheel the
    current directory (as Hydra writes ``outputs/`` where it is run)."""
    return CHECKOUT if CHECKOUT is not None else Path.cwd()


def group_options(group: str, configs_dir: Path | None = None) -> dict[str, dict]:
    """The options of config group ``group`` (``configs/<group>/<name>.yaml``) by name, each file read as Hydra
    reads it (OmegaConf's YAML: ``1.0e6`` is a number; ``defaults`` not followed; an empty file is ``{}``). The lists that follow the configs -- the classes a group
    offers, the step proofs' cases, the benchmark's rows -- are read from here, never written out by hand."""
    from omegaconf import OmegaConf

    folder = Path(configs_dir or CONFIGS_DIR) / group
    return {f.stem: OmegaConf.to_container(OmegaConf.load(f), resolve=False) or {} for f in sorted(folder.glob("*.yaml"))}


def own_targets(group: str, configs_dir: Path | None = None) -> dict[str, str]:
    """``{option: _target_}`` of the options of ``group`` that name a class of their own (a top-level ``_target_``;
    an option that only sets keys of another, ``swag_diag`` of ``swag``, or a preset, ``f_swag``, names none)."""
    return {name: str(node["_target_"]) for name, node in group_options(group, configs_dir).items()
            if isinstance(node, dict) and node.get("_target_")}
