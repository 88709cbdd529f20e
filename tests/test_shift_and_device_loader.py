"""Engine wiring of data-set extras: CIFAR-10-C shift evaluation and the device-resident loader."""

import subprocess
import sys

import pytest

from helpers import REPO, run_cfg

pytestmark = [pytest.mark.slow, pytest.mark.real_data]


def _cifar(archive, tmp_path, n_train=200, n_test=100):
    return ["dataset=cifar10", f"dataset.root={archive}", f"dataset.cache_dir={tmp_path / 'cache'}",
            f"dataset.train_subset={n_train}", f"dataset.test_subset={n_test}", "model=resnet20_frn",
            "trainer.epochs=1", "trainer.batch_size=50", "trainer.eval_every=0"]


def test_shift_sets_are_evaluated_per_set_corruption_severity_group_and_mean(cifar10_archive, tmp_path):
    c_dir = tmp_path / "CIFAR-10-C"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_cifar10_c.py"), "--root", str(cifar10_archive),
                    "--out", str(c_dir), "--subset", "100", "--corruptions", "gaussian_noise,contrast",
                    "--cache-dir", str(tmp_path / "cache")], check=True, capture_output=True)
    res = run_cfg(_cifar(cifar10_archive, tmp_path) + [
        f"dataset.shift_root={c_dir}", "dataset.shift_corruptions=[gaussian_noise,contrast]",
        "dataset.shift_severities=[1,5]"], tmp_path / "run")
    assert res["meta"]["shift_data"]["source"] == "generated"  # our own corruptions, never taken for the release
    shift = res["metrics"]["shift"]
    assert set(shift["sets"]) == {"gaussian_noise/1", "gaussian_noise/5", "contrast/1", "contrast/5"}
    assert set(shift["per_group"]) == {"noise", "digital"}
    assert set(shift["per_severity"]) == {"1", "5"}
    accs = [m["accuracy"] for m in shift["sets"].values()]
    assert shift["mean"]["accuracy"] == pytest.approx(sum(accs) / 4)
    assert shift["per_corruption"]["contrast"]["nll"] == pytest.approx(
        (shift["sets"]["contrast/1"]["nll"] + shift["sets"]["contrast/5"]["nll"]) / 2)


def test_device_loader_without_augmentation_gives_the_cpu_path_result(cifar10_archive, tmp_path):
    base = _cifar(cifar10_archive, tmp_path) + ["dataset.augment=none"]
    cpu = run_cfg(base + ["dataset.loader=cpu"], tmp_path / "cpu")["metrics"]
    dev = run_cfg(base + ["dataset.loader=device"], tmp_path / "dev")["metrics"]
    # same indices, same order, bitwise-equal input values; the batch tensor's memory layout differs
    # (HWC storage permuted on the device), so convolutions may sum in another order: round-off only
    assert dev["accuracy"] == cpu["accuracy"]
    for k in ("nll", "brier"):
        assert dev[k] == pytest.approx(cpu[k], rel=1e-4), k
    assert dev["ece"] == pytest.approx(cpu["ece"], abs=1e-3)  # a bin-edge crossing moves ECE a little more
    aug = run_cfg(_cifar(cifar10_archive, tmp_path) + ["dataset.loader=device", "dataset.augment=crop_flip"],
                  tmp_path / "aug")["metrics"]
    assert aug["nll"] != cpu["nll"]  # augmentation drawn on the device path too
