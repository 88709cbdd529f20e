"""CUDA MPS (several processes share the GPU's SMs): started for a campaign's or a self-check's side-by-side
processes when the daemon exists and none runs, stopped afterwards."""

from __future__ import annotations

import shutil
import subprocess


def start_mps() -> bool:
    """Start the CUDA MPS daemon when it exists and is not running; True if this call started it (stop it then)."""
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl is None or subprocess.run(["pgrep", "-x", "nvidia-cuda-mps"], capture_output=True).returncode == 0:
        return False
    return subprocess.run([ctl, "-d"], capture_output=True).returncode == 0


def stop_mps() -> None:
    subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", capture_output=True)
