"""flatbnn: flat-seeking Bayesian deep learning = flatness variant x posterior method.

Inside your own loop (docs/examples/own_loop.py), the same classes ``train.py`` composes::

    from flatbnn import SAM, ASAM, FisherSAM, RandomSAM, Backprop, SWAG, attach, metrics

    sam, backprop = FisherSAM(rho=0.1, eta=1.0), Backprop(model, device)
    loss = sam.gradient(model.named_parameters(), loss_fn, (x, y), backprop)   # gradient left in p.grad
    optimizer.step()

Names are imported on first use, so ``import flatbnn`` (and the torch-free ``flatbnn.reproduce`` tools) stay light.
"""

from importlib import import_module

from flatbnn.build_info import VERSION as __version__  # noqa: F401 (the package's version, declared there)

# public name -> the module that defines it (the engine's own classes, never copies)
_PUBLIC = {
    "SAM": "flatbnn.flatness.sam", "ASAM": "flatbnn.flatness.asam", "FisherSAM": "flatbnn.flatness.fsam",
    "RandomSAM": "flatbnn.flatness.random", "NoFlatness": "flatbnn.flatness.none",
    "Backprop": "flatbnn.engine.backprop",
    "SWAG": "flatbnn.methods.swag", "MAP": "flatbnn.methods.map", "SGLD": "flatbnn.methods.sgld",
    "attach": "flatbnn.api", "SWAGModel": "flatbnn.api", "keep_bn_stats": "flatbnn.api",
    "SAMOptimizer": "flatbnn.optim.sam_optimizer", "FisherSAMOptimizer": "flatbnn.optim.sam_optimizer",
}
_SUBMODULES = ("metrics", "flatness", "methods", "models")


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    if name in _SUBMODULES:
        return import_module(f"flatbnn.{name}")
    raise AttributeError(f"module 'flatbnn' has no attribute {name!r}")


__all__ = [*_PUBLIC, *_SUBMODULES]
