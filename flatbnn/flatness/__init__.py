"""Flatness variants: where the gradient is evaluated. One file per variant."""

from flatbnn.flatness.base import Flatness
from flatbnn.flatness.none import NoFlatness
from flatbnn.flatness.sam import SAM

__all__ = ["Flatness", "NoFlatness", "SAM"]
