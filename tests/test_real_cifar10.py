"""Real data: ResNet-20-FRN on a 5,000-image subset of the real CIFAR-10, 3 epochs on CPU.

ResNet-20-FRN starts slowly (per-example FRN normalisation + TLU; the bSAM code's network and
init): at 2 epochs SGD reached 0.27-0.29 for every lr/batch we tried (0.01-0.1, batch 16-128),
the same net with BatchNorm 0.31. Adam (lr 2e-3, batch 16, no augmentation, cosine) is the
fastest start we measured. The runs are seeded and bit-reproducible on one machine, but not across
CPUs (other BLAS kernels): at 2 epochs this machine gave 0.356 and the CI machine 0.347 for the same
seed, too close to the issue's bar of 0.35. At 3 epochs this machine gave 0.396 (0.389 on 2026-11-28) plain and 0.386 with
SAM at rho = 0.01 (the bSAM paper's radius for ResNet-20), so the bar has a margin of ~0.04.

Only the plain run is tested: what is real here is the data (archive, cache, subset) and the net learning from it.
The SAM run cost twice as much (497 s against 260 s on a loaded 2-core box, the longest test in CI) for a flatness
step the digits tests pin down exactly (tests/test_sam*.py, tests/test_low_rank_sam.py).
"""

import pytest

from helpers import run_cfg

pytestmark = [pytest.mark.slow, pytest.mark.real_data]


@pytest.mark.parametrize("flatness", ["none"])
def test_resnet20_frn_learns_on_real_cifar10_subset(flatness, cifar10_archive, tmp_path):
    res = run_cfg([
        "dataset=cifar10", f"dataset.root={cifar10_archive}", f"dataset.cache_dir={tmp_path / 'cache'}",
        "dataset.train_subset=5000", "dataset.test_subset=1000", "dataset.augment=none",
        "model=resnet20_frn", "method=map", f"flatness={flatness}",
        "optimizer=adam", "optimizer.lr=0.002", "trainer.epochs=3", "trainer.batch_size=16",
        "trainer.eval_every=0", "seed=0",
    ] + (["flatness.rho=0.01"] if flatness == "sam" else []), tmp_path / "run")
    m = res["metrics"]
    print(flatness, {k: round(v, 4) for k, v in m.items() if isinstance(v, float)})
    assert res["meta"]["budget"]["train_size"] == 5000 and res["meta"]["budget"]["test_size"] == 1000
    assert m["accuracy"] >= 0.35, m  # chance is 0.10
    assert m["nll"] < 1.9, m         # the uniform predictor's NLL is log 10 = 2.303
