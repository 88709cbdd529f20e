"""Console-script targets whose module imports nothing heavy, so each can act before the slow imports."""

from __future__ import annotations


def train() -> None:
    """``flatbnn-train``: the stop handlers first, then the slow imports. A console script pointing at
    ``flatbnn.train:cli`` imports torch and Hydra before any of our code runs, so a Ctrl-C there was a traceback and
    exit 1 (``python train.py`` and ``python -m flatbnn.train`` install them first too)."""
    from flatbnn.cli import exit_on_stop_signals
    exit_on_stop_signals()
    from flatbnn.train import cli
    cli()
