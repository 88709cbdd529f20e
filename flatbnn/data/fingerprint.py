"""What data a run trained and was evaluated on: a cheap fingerprint per split, kept in every checkpoint and in
results.json (``meta.data``), so a resume whose data differ is refused instead of continuing on other images
(engine/run_dir.py) and a run says what it read.

Per split (``train``, ``val``, ``test``, ``ood/<name>``, ``shift/<corruption>/<severity>``), from the data set the
run uses -- after subsets, the held-out split and label noise, so the subset indices are part of it:

* in-memory arrays (digits, MNIST, CIFAR, SVHN, ...: decoded from idx files, archives or image folders, whose decoded
  cache is itself keyed by the files' sizes and mtimes): a SHA-256 of the pixels, the labels and the normalisation
  (~0.3 s for CIFAR-10's 50,000 images);
* image files read on access (ImageNet, TinyImageNet, the fine-grained sets): a SHA-256 of the listing (files and
  labels) and one of each file's size and mtime -- of every :data:`STAT_LIMIT`-th file beyond that many (ImageNet's
  1.28M ``stat`` calls would take minutes on a network file system; the fingerprint says ``stat_every``);
* memory-mapped ``.npy`` rows (CIFAR-10-C): the file's size and mtime and a SHA-256 of the rows and labels.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import torch

STAT_LIMIT = 100_000  # files stat'ed per split; above it every (n // STAT_LIMIT + 1)-th
FORMAT = 1


def _update(h, value) -> None:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().numpy()
    if isinstance(value, np.ndarray):
        value = np.ascontiguousarray(value)
        h.update(f"{value.dtype.str}{value.shape}".encode())
        h.update(memoryview(value).cast("B"))
    else:
        h.update(repr(value).encode())


def _digest(*values) -> str:
    h = hashlib.sha256()
    for v in values:
        _update(h, v)
    return h.hexdigest()


def _base(ds):
    """The data set under augmentation wrappers (they change no image on disk nor any label)."""
    while hasattr(ds, "base"):
        ds = ds.base
    return ds


def split_fingerprint(ds) -> dict[str, Any]:
    """The fingerprint of one split (see the module docstring); ``{"n", "kind"}`` at least."""
    ds = _base(ds)
    n = len(ds)
    if hasattr(ds, "files") and hasattr(ds, "root"):  # image files decoded on access
        files = [f.decode("utf-8") if isinstance(f, bytes) else str(f) for f in ds.files]
        every = 1 if len(files) <= STAT_LIMIT else len(files) // STAT_LIMIT + 1
        h = hashlib.sha256()
        for f in files[::every]:
            try:
                st = os.stat(os.path.join(ds.root, f))
                h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}\n".encode())
            except OSError:
                h.update(f"{f}:missing\n".encode())
        out = {"n": n, "kind": "files", "root": str(ds.root), "listing": _digest("\n".join(files), ds.targets),
               "stats": h.hexdigest()}
        return {**out, "stat_every": every} if every > 1 else out
    if hasattr(ds, "rows") and hasattr(ds, "path"):  # rows of a memory-mapped .npy
        try:
            st = os.stat(ds.path)
            stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        except OSError:
            stamp = {"size": None}
        return {"n": n, "kind": "npy", "file": str(ds.path), **stamp,
                "rows": _digest(ds.rows, ds.targets, getattr(ds, "mean", None), getattr(ds, "std", None))}
    images = getattr(ds, "images", None)
    if isinstance(images, (torch.Tensor, np.ndarray)):
        return {"n": n, "kind": "arrays", "sha256": _digest(images, getattr(ds, "targets", None),
                                                            getattr(ds, "mean", None), getattr(ds, "std", None),
                                                            getattr(ds, "scale", None))}
    return {"n": n, "kind": type(ds).__name__}


def fingerprint(bundle) -> dict[str, Any]:
    """``{"format", "splits": {split: fingerprint}}`` of a :class:`~flatbnn.data.registry.DataBundle`."""
    splits = {"train": bundle.train, "test": bundle.test}
    if bundle.val is not None and len(bundle.val) > 0:
        splits["val"] = bundle.val
    splits.update({f"ood/{k}": v for k, v in (bundle.ood or {}).items()})
    splits.update({f"shift/{k}": v for k, v in (getattr(bundle, "shift", None) or {}).items()})
    return {"format": FORMAT, "splits": {k: split_fingerprint(v) for k, v in splits.items()}}


def _what(old: dict, new: dict) -> str:
    if old.get("n") != new.get("n"):
        return f"{old.get('n')} -> {new.get('n')} examples"
    if old.get("kind") != new.get("kind"):
        return f"read as {old.get('kind')}, now {new.get('kind')}"
    for key, say in (("sha256", "the images, labels or normalisation"), ("listing", "the file list or labels"),
                     ("stats", "file sizes / mtimes"), ("file", "the file"), ("size", "the file's size"),
                     ("mtime_ns", "the file's mtime"), ("rows", "the rows or labels"), ("root", "the folder")):
        if old.get(key) != new.get(key):
            a, b = old.get(key), new.get(key)
            short = (lambda v: str(v)[:12]) if key in ("sha256", "listing", "stats", "rows") else str
            return f"{say} changed ({short(a)} -> {short(b)}, {new.get('n')} examples)"
    return "changed"


def differences(old: dict | None, new: dict | None) -> list[str]:
    """One phrase per split whose fingerprint differs (``train: the images, labels or normalisation changed
    (1a2b... -> 3c4d..., 256 examples)``); a split only one side has is named too. ``[]``: the same data."""
    a, b = (old or {}).get("splits") or {}, (new or {}).get("splits") or {}
    out = []
    for split in list(a) + [s for s in b if s not in a]:
        if split not in b:
            out.append(f"{split}: no longer read")
        elif split not in a:
            out.append(f"{split}: not read before")
        elif a[split] != b[split]:
            out.append(f"{split}: {_what(a[split], b[split])}")
    return out


__all__ = ["FORMAT", "STAT_LIMIT", "differences", "fingerprint", "split_fingerprint"]
