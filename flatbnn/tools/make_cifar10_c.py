#!/usr/bin/env python
"""Generate a CIFAR-10-C-format folder from a CIFAR-10 test set: the fallback where the official release
(https://zenodo.org/record/2535967) is absent -- prefer the release for any number compared with a paper.

    python scripts/make_cifar10_c.py --root /path/to/cifar10_jpeg.tar.gz --out /data/CIFAR-10-C-gen \\
        [--subset 1000] [--corruptions gaussian_noise,fog,...|all] [--seed 0] [--cache-dir DIR]

Reads the test set with flatbnn's cifar10 loader (any of its layouts: torchvision pickles, image
folders, .tar.gz; ``--subset N`` = its fixed class-balanced subset of N images, in flatbnn's
canonical order) and writes, like the official release (Hendrycks & Dietterich 2019),

    <out>/<corruption>.npy   uint8 [5 * N, 32, 32, 3]: severity 1 rows 0..N-1, severity 2 rows N..2N-1, ...
    <out>/labels.npy         uint8 [5 * N]: the N test labels repeated 5 times
    <out>/GENERATED_BY.json  this script, seed, N, corruptions: a run reading the folder warns and records
                             meta.shift_data.source = generated in its results.json

which ``dataset=cifar10_c dataset.root=<out>`` or ``dataset=cifar10 dataset.shift_root=<out>``
read back (choose ``corruptions`` among those generated).

Corruptions are flatbnn's own implementations (:mod:`flatbnn.data.corruptions`, numpy / scipy /
PIL) with the published CIFAR-10-C severity parameters. Implemented: gaussian_noise, shot_noise,
impulse_noise (noise); defocus_blur, glass_blur, motion_blur, zoom_blur (blur); snow, fog,
brightness (weather); contrast, elastic_transform, pixelate, jpeg_compression (digital).
NOT implemented: frost (needs the frost photographs of the official code).
Differences from the official release:

* motion_blur (and the snow layer's blur): an own one-sided Gaussian line kernel in the manner
  of ImageMagick's MotionBlurImage, not Wand/ImageMagick itself;
* fog: a value-noise plasma fractal (octaves of interpolated lattice noise) instead of the
  diamond-square fractal, with the same per-octave amplitude decay;
* defocus/glass/elastic use scipy instead of OpenCV / scikit-image (same kernels and borders);
* jpeg_compression depends on the installed PIL/libjpeg;
* random draws differ from the official files (the same in distribution), and the five
  severities of a corruption share their random draws (common random numbers).

Outputs are deterministic in (--seed, corruption, severity). Never write them into the
repository (refused).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from flatbnn import resources  # noqa: E402
from flatbnn.atomic_io import save_npy, write_json  # noqa: E402
from flatbnn.data.cifar import load_cifar10_arrays  # noqa: E402
from flatbnn.data.cifar10_c import GENERATED_MARKER, GROUPS  # noqa: E402
from flatbnn.data.corruptions import corrupt, implemented  # noqa: E402

ROOT = resources.CHECKOUT  # None: an installed package, no repository to keep data out of


def parse_corruptions(text: str) -> list[str]:
    if text in ("", "all"):
        return implemented()
    out = []
    for item in text.split(","):
        item = item.strip()
        for c in GROUPS.get(item, (item,)):
            if c not in implemented():
                raise SystemExit(f"corruption {c!r} is not implemented; available: {', '.join(implemented())}")
            if c not in out:
                out.append(c)
    return out


def generate(root, out, subset=None, corruptions=None, seed=0, cache_dir=None, verbose=True) -> dict:
    """Write ``<out>/<corruption>.npy`` and ``<out>/labels.npy``; returns a summary dict."""
    out = Path(out).expanduser().resolve()
    if ROOT is not None and (ROOT / ".git").exists() and (out == ROOT or ROOT in out.parents):
        raise SystemExit(f"refusing to write generated data inside the repository ({out}); choose --out elsewhere")
    names = list(corruptions or implemented())
    data, _, layout = load_cifar10_arrays(root, None, subset, False, cache_dir, key="--root", splits=("test",))
    x, y = data["test"]
    out.mkdir(parents=True, exist_ok=True)
    # first: a folder holding any generated array is marked as generated, even if this script is killed midway
    write_json(out / GENERATED_MARKER, {"generator": "scripts/make_cifar10_c.py", "seed": seed, "test_images": int(len(y)),
                                        "corruptions": names, "clean_layout": layout})
    save_npy(out / "labels.npy", np.tile(y.astype(np.uint8), 5))
    timings = {}
    for name in names:
        t0 = time.perf_counter()
        arr = np.concatenate([corrupt(x, name, s, seed=seed) for s in range(1, 6)])
        save_npy(out / f"{name}.npy", arr)
        timings[name] = time.perf_counter() - t0
        if verbose:
            print(f"{name:18s} {arr.shape} {timings[name]:6.1f}s", flush=True)
    return {"out": str(out), "n": int(len(y)), "layout": layout, "corruptions": names, "seconds": timings}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="CIFAR-10 root (any flatbnn cifar10 layout, or the .tar.gz)")
    p.add_argument("--out", required=True, help="output folder (outside the repository)")
    p.add_argument("--subset", type=int, default=None, help="class-balanced test subset of N images (default: all)")
    p.add_argument("--corruptions", default="all", help="comma-separated names or groups, or 'all' (implemented ones)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None, help="decoded-archive cache (default $FLATBNN_CACHE or ~/.cache/flatbnn)")
    args = p.parse_args(argv)
    summary = generate(args.root, args.out, args.subset, parse_corruptions(args.corruptions), args.seed, args.cache_dir)
    print(f"wrote {len(summary['corruptions'])} corruptions x 5 severities x {summary['n']} images to {summary['out']}")


if __name__ == "__main__":
    main()
