"""torchrun --nproc_per_node=2 on CPU (gloo) gives the same metrics as one process with the same global batch."""

import pytest

from helpers import results, train_cli


@pytest.mark.slow
def test_ddp_two_cpu_processes_match_single_process(tmp_path):
    # 1,400 train examples, global batch 56 -> 25 steps/epoch; each rank gets 28 per step, and the two
    # ranks' shards of a step are exactly the single process's batch (same sampler permutation).
    args = ["dataset=digits", "model=mlp", "method=map", "flatness=none", "dataset.train_subset=1400",
            "trainer.batch_size=56", "trainer.epochs=3", "trainer.device=cpu"]
    train_cli(args, tmp_path / "single")
    train_cli(args, tmp_path / "ddp", torchrun=2)
    single, ddp = results(tmp_path / "single"), results(tmp_path / "ddp")
    assert ddp["meta"]["budget"]["world_size"] == 2 and single["meta"]["budget"]["world_size"] == 1
    assert ddp["meta"]["budget"]["steps"] == single["meta"]["budget"]["steps"] == 75
    for k in ("accuracy", "nll", "ece", "brier", "auroc_misclassification"):
        # all-reduce sums gradients in another order: equal up to float32 round-off
        assert ddp["metrics"][k] == pytest.approx(single["metrics"][k], abs=2e-5), k
    assert ddp["metrics"]["accuracy"] == single["metrics"]["accuracy"]
    # only rank 0 wrote a run directory's files
    assert (tmp_path / "ddp" / "results.json").exists()


@pytest.mark.slow
def test_ddp_m_sharpness_accumulates_chunks_and_syncs_once(tmp_path):
    """rho=0 with m=2 chunks per worker is the plain batch gradient: the chunks' gradients accumulate
    locally (no_sync) and are all-reduced once -- a missed or doubled sync would change the run."""
    base = ["dataset=digits", "model=mlp", "method=map", "dataset.train_subset=1400",
            "trainer.batch_size=56", "trainer.epochs=2", "trainer.device=cpu"]
    train_cli(base + ["flatness=none"], tmp_path / "single")
    train_cli(base + ["flatness=sam", "flatness.rho=0", "flatness.m=2"], tmp_path / "ddp", torchrun=2)
    single, ddp = results(tmp_path / "single"), results(tmp_path / "ddp")
    assert ddp["meta"]["flatness"]["m"] == 2
    for k in ("accuracy", "nll", "ece", "brier"):
        assert ddp["metrics"][k] == pytest.approx(single["metrics"][k], abs=2e-5), k
