"""flatbnn's parts in a plain PyTorch loop: your model, loss and torch.optim optimiser; a Fisher-SAM step (SAM,
ASAM: the same call); SWAG collection and sampling; flatbnn's metrics on your predictions.
Run: python docs/examples/own_loop.py"""
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from flatbnn import SWAG, Backprop, FisherSAM, attach, metrics


def sam_step(model, optimizer, sam, backprop, x, y):
    """The gradient at the perturbed weights w + eps, the update at w (train.py's step, bit for bit)."""
    optimizer.zero_grad(set_to_none=True)
    loss = sam.gradient(model.named_parameters(), lambda b: F.cross_entropy(model(b[0]), b[1]), (x, y), backprop)
    optimizer.step()
    return loss


def main(epochs: int = 10, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    data = load_digits()
    x, y = torch.tensor(data.data, dtype=torch.float32) / 16, torch.tensor(data.target)
    (x_train, y_train), (x_test, y_test) = (x[:1400], y[:1400]), (x[1400:], y[1400:])
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    sam, backprop = FisherSAM(rho=0.1, eta=1.0), Backprop(model, torch.device("cpu"))
    swag = attach(SWAG(max_rank=5, num_samples=8, bn_refresh=False), model, optimizer)  # your model, your optimiser
    for epoch in range(epochs):
        for batch in torch.randperm(len(x_train)).split(64):
            sam_step(model, optimizer, sam, backprop, x_train[batch], y_train[batch])
        if epoch >= epochs // 2:
            swag.collect()  # running moments + the last max_rank deviations of the weights
    samples = torch.stack([s["test"] for s in swag.predict({"test": [(x_test, y_test)]})])  # K sampled weights
    log_probs = metrics.predictive_log_probs(samples)  # log of the mean probability over the K samples
    probs = log_probs.exp()
    return {"accuracy": metrics.accuracy(probs, y_test), "nll": metrics.nll(log_probs, y_test),
            "ece": metrics.ece(probs, y_test, n_bins=15), "n_collected": swag.n_collected,
            **metrics.misclassification_metrics(probs, y_test)}  # AUROC: positives = correct, score = max prob


if __name__ == "__main__":
    print(main())
