"""flatbnn: flat-seeking Bayesian deep learning = flatness variant x posterior method."""

__version__ = "0.1.0"
