"""``flatness=none``: the gradient at the current weights (plain SGD / Adam / ...)."""

from flatbnn.flatness.base import Flatness


class NoFlatness(Flatness):
    name = "none"

    def __init__(self, rho: float = 0.0, m: int = 1, rho_schedule: str = "constant"):
        # the shared keys are accepted (and have no effect) so that an experiment setting
        # flatness.rho still composes with flatness=none, e.g. `--multirun flatness=none,sam`
        super().__init__(rho=0.0, m=1)

    def gradient(self, params, loss_fn, batch, backprop, scaling=None, perturb=None):
        loss = backprop.forward(loss_fn, batch)
        backprop.backward(loss)
        return loss.detach()

    def describe(self) -> dict:
        return {"name": self.name}
