"""Posterior methods: how weights are inferred and averaged. One file per method."""

from flatbnn.methods.base import Method, RunContext
from flatbnn.methods.map import MAP

__all__ = ["Method", "RunContext", "MAP"]
