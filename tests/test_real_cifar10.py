"""Real data: ResNet-20-FRN on a 5,000-image subset of the real CIFAR-10, 2 epochs on CPU.

ResNet-20-FRN starts slowly (per-example FRN normalisation + TLU; the bSAM code's network and
init): at this budget SGD reached 0.27-0.29 for every lr/batch we tried (0.01-0.1, batch 16-128),
the same net with BatchNorm 0.31. Adam (lr 2e-3, batch 16, no augmentation, cosine) is the
fastest start we measured: 0.356 plain, 0.363 with SAM at rho = 0.01 (the bSAM paper's radius for
ResNet-20). The runs are seeded and bit-reproducible on CPU, so the bar is the issue's 0.35.
"""

import pytest

from helpers import run_cfg

pytestmark = [pytest.mark.slow, pytest.mark.real_data]


@pytest.mark.parametrize("flatness", ["none", "sam"])
def test_resnet20_frn_learns_on_real_cifar10_subset(flatness, cifar10_archive, tmp_path):
    res = run_cfg([
        "dataset=cifar10", f"dataset.root={cifar10_archive}", f"dataset.cache_dir={tmp_path / 'cache'}",
        "dataset.train_subset=5000", "dataset.test_subset=1000", "dataset.augment=none",
        "model=resnet20_frn", "method=map", f"flatness={flatness}",
        "optimizer=adam", "optimizer.lr=0.002", "trainer.epochs=2", "trainer.batch_size=16",
        "trainer.eval_every=0", "seed=0",
    ] + (["flatness.rho=0.01"] if flatness == "sam" else []), tmp_path / "run")
    m = res["metrics"]
    print(flatness, {k: round(v, 4) for k, v in m.items() if isinstance(v, float)})
    assert res["meta"]["budget"]["train_size"] == 5000 and res["meta"]["budget"]["test_size"] == 1000
    assert m["accuracy"] >= 0.35, m  # chance is 0.10
    assert m["nll"] < 1.9, m         # the uniform predictor's NLL is log 10 = 2.303
