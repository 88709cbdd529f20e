"""CIFAR-10-C (Hendrycks & Dietterich, ICLR 2019): the CIFAR-10 test set under 15 corruptions x 5 severities.

Official layout: ``<root>/<corruption>.npy`` uint8 ``[50000, 32, 32, 3]`` = severities 1..5, each
the 10,000 test images in the order of CIFAR-10's ``test_batch``, stacked in severity order
(rows ``(s - 1) * 10000 ... s * 10000 - 1`` are severity ``s``), plus ``<root>/labels.npy``
``[50000]`` (the test labels repeated 5 times). ``root`` may also be the folder holding
``CIFAR-10-C/``. Folders written by ``scripts/make_cifar10_c.py`` -- the fallback where the official
release is absent, with our own corruption code -- have the same layout with ``5 * N`` rows for an
``N``-image test set and a marker file (:data:`GENERATED_MARKER`): reading one warns once, and results.json
says which was read (``meta.shift_data.source``: ``official`` / ``generated``).

Each severity block is put in flatbnn's canonical order (by class, then by position), the same
order every CIFAR-10 layout gives the clean test set, and ``test_subset`` picks the same fixed
class-balanced subset. So index ``i`` of every corrupted set is the corruption of index ``i`` of
the clean test set (for the official files and for generated ones). Normalisation = clean
CIFAR-10 test (same mean/std). The arrays are memory-mapped, never loaded whole.

Two ways to use it for shift evaluation:

* ``dataset=cifar10 dataset.shift_root=/path/to/CIFAR-10-C``: ``DataBundle.shift`` gets one test
  set per ``"<corruption>/<severity>"`` next to the clean test set;
* ``dataset=cifar10_c``: its own data set whose ``train`` is CIFAR-10 train (``clean_root``) and
  whose ``test`` is the concatenation of the selected corrupted sets (their mean), with the
  same per-key sets in ``DataBundle.shift``.

Corruption groups follow flat_seeking_bnn Table 5 (:data:`GROUPS`).
"""

from __future__ import annotations

import json
import os
from bisect import bisect_right
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from flatbnn.data.registry import as_list
from flatbnn.data.arrays import canonical_subset
from flatbnn.runlog import warn

GROUPS: dict[str, tuple[str, ...]] = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
    "blur": ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur"),
    "weather": ("snow", "frost", "fog", "brightness"),
    "digital": ("contrast", "elastic_transform", "pixelate", "jpeg_compression"),
}
CORRUPTIONS: tuple[str, ...] = tuple(c for g in GROUPS.values() for c in g)
GROUP_OF: dict[str, str] = {c: g for g, cs in GROUPS.items() for c in cs}
#: the four extra corruptions of the official release (not in the 15-corruption benchmark)
EXTRA_CORRUPTIONS = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
SEVERITIES = (1, 2, 3, 4, 5)
FOLDER = "CIFAR-10-C"
RELEASE = "https://zenodo.org/record/2535967"
SOURCE = f"{RELEASE} (CIFAR-10-C.tar), or generate one with scripts/make_cifar10_c.py (the fallback: our own corruptions)"
#: scripts/make_cifar10_c.py writes this next to the arrays: a folder holding it is a generated set
GENERATED_MARKER = "GENERATED_BY.json"


def locate(root: Any) -> Path | None:
    root = Path(os.path.expanduser(str(root)))
    for cand in (root, root / FOLDER):
        if (cand / "labels.npy").is_file():
            return cand
    return None


def shift_data_source(folder: Path) -> dict[str, Any]:
    """``{"source": "official"}``, or ``{"source": "generated", ...}`` with the generator's record (seed, test set
    size, corruptions) for a folder scripts/make_cifar10_c.py wrote. A folder without the marker is taken for the
    official release (a folder generated before the marker existed: add it, or regenerate)."""
    marker = folder / GENERATED_MARKER
    if not marker.is_file():
        return {"source": "official"}
    try:
        record = json.loads(marker.read_text())
    except ValueError:
        record = {}
    return {**(record if isinstance(record, dict) else {}), "source": "generated"}


def not_found_message(root: Any, key: str, corruptions: Sequence[str] = ()) -> str:
    what = ", ".join(f"{c}.npy" for c in corruptions[:3]) + (", ..." if len(corruptions) > 3 else "")
    return (f"CIFAR-10-C not found under '{root}': expected {root}/labels.npy and {root}/<corruption>.npy "
            f"({what or 'one file per corruption'}; or the same inside {root}/{FOLDER}); get it from {SOURCE}; "
            f"set {key} to that folder")


def parse_corruptions(value: Any) -> list[str]:
    """``"all"`` / ``None`` -> the 15 standard corruptions; a group name -> its members; else a list
    of names (group names allowed inside the list)."""
    items = as_list(value)
    if not items or items == ["all"]:
        return list(CORRUPTIONS)
    out: list[str] = []
    for item in items:
        item = str(item)
        members = GROUPS.get(item, (item,))
        for c in members:
            if c not in CORRUPTIONS and c not in EXTRA_CORRUPTIONS:
                raise ValueError(f"unknown CIFAR-10-C corruption {c!r}; one of {list(CORRUPTIONS)} "
                                 f"(+ {list(EXTRA_CORRUPTIONS)}), a group {list(GROUPS)}, or 'all'")
            if c not in out:
                out.append(c)
    return out


def parse_severities(value: Any) -> list[int]:
    items = as_list(value) or list(SEVERITIES)
    out = sorted({int(s) for s in items})
    if any(s not in SEVERITIES for s in out):
        raise ValueError(f"CIFAR-10-C severities must be in 1..5, got {items}")
    return out


class NpyImageDataset(Dataset):
    """Rows ``rows`` of a uint8 ``[M, H, W, C]`` ``.npy`` file, memory-mapped (opened lazily per
    process, so it pickles cheaply to DataLoader workers), normalised like ``ArrayDataset``."""

    def __init__(self, path: str | os.PathLike, rows: np.ndarray, targets: Any, mean: Sequence[float],
                 std: Sequence[float], scale: float = 255.0) -> None:
        self.path = str(path)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.targets = torch.as_tensor(np.asarray(targets, dtype=np.int64))
        if len(self.rows) != len(self.targets):
            raise ValueError("rows and targets differ in length")
        self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
        self.scale = float(scale)
        self._mul = 1.0 / (self.scale * self.std)
        self._add = -self.mean / self.std
        self._array: np.ndarray | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_array"] = None
        return state

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.load(self.path, mmap_mode="r")
        return self._array

    @property
    def images(self) -> torch.Tensor:
        """All rows as a uint8 ``[N, H, W, C]`` tensor (reads them; for small sets and tests)."""
        return torch.from_numpy(np.ascontiguousarray(self.array[self.rows]))

    @property
    def item_shape(self) -> tuple[int, ...]:
        _, h, w, c = self.array.shape
        return (int(c), int(h), int(w))

    def __len__(self) -> int:
        return len(self.rows)

    def set_epoch(self, epoch: int) -> None:
        pass

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self._add, raw.to(torch.float32), self._mul)

    def raw(self, index: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.array[self.rows[int(index)]])).permute(2, 0, 1)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = int(index)
        return self.normalize(self.raw(index)), int(self.targets[index])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        idx = np.asarray([int(i) for i in indices], dtype=np.int64)
        rows = self.rows[idx]
        order = np.argsort(rows, kind="stable")  # sequential reads from the memory map
        raw = np.empty((len(rows), *self.array.shape[1:]), dtype=np.uint8)
        raw[order] = self.array[rows[order]]
        x = self.normalize(torch.from_numpy(raw).permute(0, 3, 1, 2))
        return list(zip(x.unbind(0), self.targets.numpy()[idx].tolist()))

    def __repr__(self) -> str:
        return f"NpyImageDataset({os.path.basename(self.path)!r}, n={len(self)})"


class ConcatWithTargets(Dataset):
    """Concatenation of data sets that exposes ``targets`` (for the evaluation routine)."""

    def __init__(self, datasets: Sequence[Dataset]) -> None:
        self.datasets = list(datasets)
        self.offsets = np.cumsum([0] + [len(d) for d in self.datasets]).tolist()
        self.targets = torch.cat([torch.as_tensor(d.targets) for d in self.datasets]) if self.datasets else \
            torch.zeros(0, dtype=torch.int64)

    def __len__(self) -> int:
        return self.offsets[-1]

    def set_epoch(self, epoch: int) -> None:
        pass

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = int(index)
        if index < 0:
            index += len(self)
        k = bisect_right(self.offsets, index) - 1
        return self.datasets[k][index - self.offsets[k]]


def _open_labels(folder: Path, key: str, num_classes: int) -> tuple[np.ndarray, int]:
    labels = np.load(folder / "labels.npy").astype(np.int64).reshape(-1)
    if len(labels) % 5:
        raise ValueError(f"{folder}/labels.npy has {len(labels)} rows, not 5 severities x N")
    n = len(labels) // 5
    base = labels[:n]
    if not all(np.array_equal(labels[s * n:(s + 1) * n], base) for s in range(1, 5)):
        raise ValueError(f"{folder}/labels.npy: the 5 severity blocks do not carry the same labels")
    if n and (base.min() < 0 or base.max() >= num_classes):
        raise ValueError(f"{folder}/labels.npy: labels outside [0, {num_classes})")
    return base, n


def load_shift_sets(
    root: Any,
    corruptions: Any = "all",
    severities: Any = SEVERITIES,
    test_subset: int | None = None,
    *,
    key: str = "dataset.root",
    num_classes: int,
    mean: Sequence[float],
    std: Sequence[float],
) -> tuple[dict[str, NpyImageDataset], dict[str, Any]]:
    """``({"<corruption>/<severity>": data set}, meta)`` for the selected corruptions/severities;
    ``meta`` has ``shift_groups`` (corruption -> group), ``shift_corruptions``, ``shift_severities``
    and ``shift_root``. ``num_classes`` / ``mean`` / ``std``: CIFAR-10's (data/cifar.py declares them)."""
    names = parse_corruptions(corruptions)
    sevs = parse_severities(severities)
    folder = locate(root)
    if folder is None:
        raise FileNotFoundError(not_found_message(root, key, names))
    labels, n = _open_labels(folder, key, num_classes)
    missing = [c for c in names if not (folder / f"{c}.npy").is_file()]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10-C at '{folder}' lacks {', '.join(f'{c}.npy' for c in missing)}; get the full set from "
            f"{SOURCE} (a generated folder has only the corruptions it was made with: choose them with "
            f"the corruptions key), and set {key} to it")
    # canonical order + fixed balanced subset, exactly as the clean test set (positions within a block)
    pos, y = canonical_subset(np.arange(n), labels, test_subset, num_classes)
    sets: dict[str, NpyImageDataset] = {}
    for c in names:
        path = folder / f"{c}.npy"
        arr = np.load(path, mmap_mode="r")
        if arr.shape != (5 * n, 32, 32, 3) or arr.dtype != np.uint8:
            raise ValueError(f"{path}: expected uint8 array of shape {(5 * n, 32, 32, 3)}, got {arr.dtype} {arr.shape}")
        for s in sevs:
            sets[f"{c}/{s}"] = NpyImageDataset(path, (s - 1) * n + pos, y, mean, std)
    source = shift_data_source(folder)
    if source["source"] == "generated":
        warn(f"{folder}: a CIFAR-10-C generated by scripts/make_cifar10_c.py, not the official release "
             f"({RELEASE}): not comparable with published numbers; results.json marks it (meta.shift_data.source)")
    meta = {"shift_root": str(folder), "shift_corruptions": tuple(names), "shift_severities": tuple(sevs),
            "shift_groups": {c: GROUP_OF.get(c, "extra") for c in names},
            "shift_data": source}
    return sets, meta
