"""Flatness variants: where the gradient is evaluated. One file per variant."""

from flatbnn.flatness.asam import ASAM
from flatbnn.flatness.base import Flatness
from flatbnn.flatness.fsam import FisherSAM
from flatbnn.flatness.geometry import Geometry
from flatbnn.flatness.none import NoFlatness
from flatbnn.flatness.random import RandomSAM
from flatbnn.flatness.sam import SAM

__all__ = ["ASAM", "FisherSAM", "Flatness", "Geometry", "NoFlatness", "RandomSAM", "SAM"]
