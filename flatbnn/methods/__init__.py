"""Posterior methods: how weights are inferred and averaged. One file per method."""

from flatbnn.methods.base import Method, RunContext
from flatbnn.methods.deep_ensemble import DeepEnsemble
from flatbnn.methods.map import MAP
from flatbnn.methods.mc_dropout import MCDropout
from flatbnn.methods.sgld import SGLD
from flatbnn.methods.swag import SWAG

__all__ = ["Method", "RunContext", "MAP", "SWAG", "SGLD", "MCDropout", "DeepEnsemble"]
