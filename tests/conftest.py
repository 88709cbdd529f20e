import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one thread per pytest-xdist worker (make test: min(cores, 4) workers): torch's default of one thread per
    # core in every worker oversubscribes the cores, and OpenMP threads spin while they wait
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def real_cifar10_path() -> Path | None:
    p = Path(os.environ.get("FLATBNN_CIFAR10", REPO.parent / "shared" / "data" / "cifar10_jpeg.tar.gz"))
    return p if p.exists() else None


@pytest.fixture
def cifar10_archive():
    p = real_cifar10_path()
    if p is None:
        if os.environ.get("FLATBNN_REQUIRE_REAL_DATA") == "1":
            pytest.fail("real CIFAR-10 archive required (FLATBNN_REQUIRE_REAL_DATA=1) but not found; set FLATBNN_CIFAR10")
        pytest.skip("real CIFAR-10 archive not found; set FLATBNN_CIFAR10=/path/to/cifar10_jpeg.tar.gz")
    return p


def pytest_collection_modifyitems(config, items):
    """The longest tests first (real data, then the other slow ones; stable within each group): under
    pytest-xdist (``make test``) they overlap with the many short tests instead of running alone at the end
    (measured: the two real-CIFAR-10 tests, ~5 min each, were a 7-minute tail of a 21-minute run)."""
    items.sort(key=lambda it: 0 if it.get_closest_marker("real_data") else 1 if it.get_closest_marker("slow") else 2)
