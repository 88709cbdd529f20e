"""Benchmark helpers: minimal loops of the reference implementations (``reference.py``) that
``scripts/benchmark.py --reference`` times beside our engine on the same model, batch and data."""
