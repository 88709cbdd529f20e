"""``flatness=none``: the gradient at the current weights (plain SGD / Adam / ...)."""

from flatbnn.flatness.base import Flatness


class NoFlatness(Flatness):
    name = "none"

    def gradient(self, params, loss_fn, batch, backprop, scaling=None):
        loss = backprop.forward(loss_fn, batch)
        backprop.backward(loss)
        return loss.detach()
