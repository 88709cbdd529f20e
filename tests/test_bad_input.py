"""Bad input is one line on stderr and exit status 2, found before any training (issue 15).

Every case runs ``train.py`` as a user would; the run is the tiny digits x MLP config, and each refusal
comes before the data are loaded, so a case costs one interpreter start and a config composition.
"""

from __future__ import annotations

import errno
import gzip
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = ["dataset=digits", "model=mlp", "trainer.epochs=1", "trainer.progress=false",
        "trainer.reliability_diagram=false"]


def _train(run_dir: Path, *overrides: str, env: dict | None = None, user: int | None = None):
    cmd = [sys.executable, str(REPO / "train.py"), *TINY, f"hydra.run.dir={run_dir}", *overrides]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    full_env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE")}
    full_env.update(env or {})
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=full_env)


def _one_line(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("flatbnn: error: ")
    return lines[0]


CASES = [
    # (overrides, words the line must contain)
    (["trainer.epochs=-1"], ["trainer.epochs=-1", ">= 0"]),
    (["trainer.epochs=1.5"], ["trainer.epochs=1.5", "whole number"]),
    (["+trainer.foo=1"], ["trainer.foo", "no such key"]),
    (["+trainer.epochz=1"], ["trainer.epochz", "did you mean epochs"]),
    (["trainer.epochs=abc"], ["trainer.epochs='abc'", "number"]),
    (["optimizer.lr=fast"], ["optimizer.lr='fast'", "number"]),
    (["optimizer.lr=-0.1"], ["optimizer.lr=-0.1", "> 0"]),
    (["method=sgvb", "method.num_samples=0"], ["method.num_samples=0", ">= 1"]),
    (["metrics.ece_edges=middle"], ["metrics.ece_edges='middle'", "right, left, both, strict"]),
    (["metrics.auroc=thresholds", "metrics.misclass_score=entropy"], ["metrics.auroc=thresholds", "max_prob"]),
    # Hydra's own errors
    (["trainer.epochz=1"], ["unknown key trainer.epochz", "did you mean trainer.epochs"]),
    (["modell=mlp"], ["unknown key or config group modell", "model"]),
    (["model=mlpp"], ["model=mlpp", "no such option in config group model", "did you mean mlp"]),
    (["method=swagg"], ["method=swagg", "swag"]),
    (["trainer.epochs=["], ["bad override"]),
]


# one config check and one Hydra error stay in the fast set; the rest (about 10 s each: a subprocess) are slow
FAST = (["trainer.epochs=-1"], ["model=mlpp"])


@pytest.mark.parametrize("overrides,words", [
    pytest.param(o, w, id=" ".join(o), marks=() if o in FAST else pytest.mark.slow) for o, w in CASES])
def test_bad_config_is_one_line_exit_2_and_writes_nothing(tmp_path, overrides, words):
    run_dir = tmp_path / "run"
    line = _one_line(_train(run_dir, *overrides))
    for w in words:
        assert w in line, line
    # refused before training: no checkpoint, no metrics, no results
    assert not (run_dir / "results.json").exists()
    assert not (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "checkpoints" / "last.pt").exists()


@pytest.mark.slow
def test_full_error_keeps_hydras_traceback(tmp_path):
    proc = _train(tmp_path / "run", "trainer.epochz=1", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ConfigCompositionException" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: trainer.device=cuda is valid here")
def test_cuda_without_gpu(tmp_path):
    line = _one_line(_train(tmp_path / "run", "trainer.device=cuda"))
    assert "trainer.device=cuda" in line and "no CUDA GPU" in line


def test_run_dir_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    line = _one_line(_train(tmp_path / "afile" / "run"))
    assert str(tmp_path / "afile" / "run") in line and "Not a directory" in line


def _as_unprivileged():
    """A uid for which chmod counts: this one, or nobody via setpriv when the tests run as root."""
    if os.geteuid() != 0:
        return None
    if shutil.which("setpriv") is None:
        pytest.skip("running as root (chmod does not stop root) and no setpriv to drop privileges")
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                            "import hydra, flatbnn"], capture_output=True, text=True, cwd=REPO)
    if probe.returncode != 0:  # e.g. a venv inside a 0700 mktemp dir (.ci/run opens its venv dir for this test)
        pytest.skip(f"uid 65534 cannot run this interpreter: {probe.stderr.strip().splitlines()[-1:]}")
    return 65534


@pytest.mark.parametrize("where", ["run_dir", "checkpoints"])
def test_read_only_run_dir_or_checkpoints(tmp_path, where):
    user = _as_unprivileged()
    base = tmp_path / "base"
    base.mkdir()
    os.chmod(tmp_path, 0o755)
    if where == "run_dir":
        os.chmod(base, 0o555)  # the run dir cannot be created in it
        run_dir = base / "run"
    else:
        os.chmod(base, 0o777)
        run_dir = base / "run"
        (run_dir / "checkpoints").mkdir(parents=True)
        os.chmod(run_dir, 0o777)
        os.chmod(run_dir / "checkpoints", 0o555)
    if user is None and os.access(base if where == "run_dir" else run_dir / "checkpoints", os.W_OK):
        pytest.skip("this user can write despite the mode bits")
    try:
        line = _one_line(_train(run_dir, env={"HOME": str(tmp_path)}, user=user))
    finally:
        os.chmod(base, 0o755)
        if (run_dir / "checkpoints").exists():
            os.chmod(run_dir / "checkpoints", 0o755)
    assert "cannot write" in line and "Permission denied" in line and "hydra.run.dir" in line
    assert not (run_dir / "results.json").exists()


def test_disk_full_is_one_line():
    """ENOSPC cannot be produced here without mounting a small file system (needs privileges); the
    message an ENOSPC OSError becomes is checked instead (the checkpoint writer turns its own into a
    CheckpointError, which keeps the previous checkpoint)."""
    from flatbnn.cli import one_line_error

    e = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/results.json")
    line = one_line_error(e)
    assert line is not None and "\n" not in line
    assert "/runs/x/results.json" in line and "No space left" in line and "free space" in line
    assert one_line_error(OSError(errno.EIO, "Input/output error")) is None  # not the user's to fix: traceback


def test_torch_compile_failure_is_one_line_that_says_how_to_run_eager(tmp_path, monkeypatch):
    """torch 2.11's Inductor on an H200 failed at the first compiled resnet20_frn step ("AssertionError: 32 v.s.
    6400", docs/cluster.md); that can't be reproduced on CPU, so a compiler backend that fails the same way stands
    in. The run's own error path must turn it into one line naming the switch that avoids it."""
    from flatbnn.cli import one_line_error
    from tests.helpers import run_cfg

    def failing_backend(gm, example_inputs):
        raise AssertionError("32 v.s. 6400")

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real_compile(model, backend=failing_backend))
    with pytest.raises(Exception) as info:
        run_cfg([*TINY, "trainer.compile=true"], tmp_path / "run")
    line = one_line_error(info.value)
    assert line is not None and "\n" not in line
    assert line.startswith("torch.compile failed") and "32 v.s. 6400" in line and "trainer.compile=false" in line
    assert not (tmp_path / "run" / "results.json").exists()
    assert one_line_error(AssertionError("32 v.s. 6400")) is None  # the same error outside the compiler: a bug


def test_validate_accepts_shipped_configs_and_mean_prediction():
    """Every trainer key any shipped config sets is known, and num_samples=0 stays valid where it
    means "predict with the mean" (bsam, vogn)."""
    from hydra import compose, initialize_config_dir

    from flatbnn.engine.validate import validate_config

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        for overrides in (["trainer=gpu_fast", "trainer.device=cpu"], ["method=bsam", "method.num_samples=0"],
                          ["method=vogn", "method.num_samples=0"], ["experiment=flat_bnn_cifar10"],
                          ["method=sam_adam"], ["metrics.auroc=thresholds"]):
            validate_config(compose(config_name="config", overrides=overrides))


def _tiny_archive(path: Path) -> None:
    """A .tar.gz in the image-folder layout whose members are incompressible (truncation hits data)."""
    rng = torch.Generator().manual_seed(0)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for split in ("train", "test"):
            for c in range(3):
                data = torch.randint(0, 256, (20000,), generator=rng, dtype=torch.uint8).numpy().tobytes()
                info = tarfile.TarInfo(f"cifar10/{split}/class{c}/img{c}.png")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    path.write_bytes(gzip.compress(buf.getvalue()))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_archive_names_file_and_key(tmp_path, damage, monkeypatch):
    from flatbnn.cli import one_line_error
    from flatbnn.data.cifar import load_cifar10_arrays

    monkeypatch.setenv("FLATBNN_CACHE", str(tmp_path / "cache"))
    good = tmp_path / "good.tar.gz"
    _tiny_archive(good)
    bad = tmp_path / "cifar10_bad.tar.gz"
    data = good.read_bytes()
    bad.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    with pytest.raises(ValueError) as info:
        load_cifar10_arrays(bad, 10, 10, key="dataset.root")
    line = one_line_error(info.value)
    assert line is not None and "\n" not in line
    assert f"dataset.root={bad}" in line and "corrupt or truncated" in line


def test_resuming_a_two_process_checkpoint_with_one_process_is_one_line(tmp_path):
    # a DDP run's checkpoint holds one RNG state per rank and its batches are per-rank shards: a resume with
    # another world size cannot continue the same run, so it is refused (one line, exit 2), not a traceback
    from flatbnn.cli import one_line_error
    from flatbnn.engine import distributed as D
    from flatbnn.engine.checkpoint import CheckpointError
    from flatbnn.engine.trainer import Trainer

    info = D.DistInfo(rank=0, world_size=1, local_rank=0)
    trainer = Trainer(epochs=1, run_dir=tmp_path, info=info, device=torch.device("cpu"))
    with pytest.raises(CheckpointError) as e:
        trainer.restore({"world_size": 2}, None, None, None, path=tmp_path / "last.pt")
    line = one_line_error(e.value)
    assert line is not None and "\n" not in line and "2 processes" in line and "trainer.resume=false" in line
