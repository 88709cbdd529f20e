"""Layers shared by methods: mean-field Gaussian (Bayesian) Linear / Conv2d."""

from flatbnn.nn.bayesian import (ESTIMATORS, BayesConv2d, BayesLinear, NoiseBank, bayesian_layers, bayesianize,
                                 find_bank, gaussian_kl)

__all__ = ["BayesConv2d", "BayesLinear", "ESTIMATORS", "NoiseBank", "bayesian_layers", "bayesianize",
           "find_bank", "gaussian_kl"]
