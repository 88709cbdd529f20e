"""Real data: ResNet-20-FRN on a 5,000-image subset of the real CIFAR-10, 2 epochs on CPU.

Measured at this budget (see the issue note): SGD ~0.27 test accuracy; the same net with
BatchNorm+ReLU instead of FRN/TLU ~0.31; an MLP ~0.44 after 4 epochs. FRN nets start slowly (per-
example normalisation), so the bar here is 'clearly learns': at least twice chance.
"""

import pytest

from helpers import run_cfg

pytestmark = [pytest.mark.slow, pytest.mark.real_data]


@pytest.mark.parametrize("flatness", ["none", "sam"])
def test_resnet20_frn_learns_on_real_cifar10_subset(flatness, cifar10_archive, tmp_path):
    res = run_cfg([
        "dataset=cifar10", f"dataset.root={cifar10_archive}", f"dataset.cache_dir={tmp_path / 'cache'}",
        "dataset.train_subset=5000", "dataset.test_subset=1000", "dataset.augment=none",
        "model=resnet20_frn", "method=map", f"flatness={flatness}", "flatness.rho=0.05" if flatness == "sam" else "seed=0",
        "trainer.epochs=2", "trainer.batch_size=32", "optimizer.lr=0.05", "trainer.eval_every=0",
    ], tmp_path / "run")
    m = res["metrics"]
    print(flatness, m)
    assert res["meta"]["budget"]["train_size"] == 5000 and res["meta"]["budget"]["test_size"] == 1000
    assert m["accuracy"] >= 0.20, m  # chance is 0.10
    assert m["nll"] < 2.30, m        # below the uniform predictor's log 10 = 2.303
