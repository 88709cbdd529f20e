"""CIFAR-10 from any of three layouts under ``root``; CIFAR-100 from torchvision's pickles.

(a) torchvision: ``<root>/cifar-10-batches-py`` (pickled batches; ``download=True`` fetches it
    with ``torchvision.datasets.CIFAR10``).
(b) image folders: ``<root>/{train,test}/<class>/*.{png,jpg}`` or
    ``<root>/cifar10_jpeg/{train,test}/<class>/*``; classes sorted alphabetically = label order.
(c) a ``.tar.gz`` of (b) (``root`` is the archive, or a directory holding ``cifar10_jpeg.tar.gz``):
    read in one streaming pass; only the images of the requested subset are decoded, and
    the decoded uint8 arrays are cached as ``.npy`` under ``cache_dir`` (default
    ``$FLATBNN_CACHE`` or ``~/.cache/flatbnn``; never inside the repository).

Every layout yields its examples in one canonical order: by class, then by position within
the class (file order in the pickles, file name in folders/archives), so equal data gives
equal arrays, subsets and augmentations whatever the layout.

Subsets (``train_subset``/``test_subset``) are class-balanced with a fixed RNG (seed 0),
independent of the run seed; ``val_split`` holds out the last k of a fixed permutation of
the (subset) training set.

CIFAR-100 (``cifar100``): ``<root>/cifar-100-python/{train,test,meta}`` (torchvision's pickle
layout, fine labels; ``download=True`` fetches it with ``torchvision.datasets.CIFAR100``), in
the same canonical order (by fine class, then file position).

``build_cifar10(shift_root=...)`` also fills ``DataBundle.shift`` with CIFAR-10-C
(:mod:`flatbnn.data.cifar10_c`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import tarfile
import zlib
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from flatbnn import resources
from flatbnn.atomic_io import save_npy
from flatbnn.data.registry import DataBundle, DataOptions, make_bundle, register_dataset
from flatbnn.data.ood import register_test_loader
from flatbnn.data.arrays import SUBSET_SEED, Arrays, canonical_subset, check_arrays
from flatbnn.data.cifar10_c import SEVERITIES, ConcatWithTargets, load_shift_sets
from flatbnn.data.transforms import balanced_subset

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
NUM_CLASSES = 10
INPUT_SHAPE = (3, 32, 32)
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".bmp"}
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
TV_FOLDER = "cifar-10-batches-py"
TV_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
TV_TEST = ("test_batch",)
_CACHE_VERSION = 1
_SPLITS = ("train", "test")



# --------------------------------------------------------------------------- locating

def not_found_message(root: Any, key: str = "dataset.root") -> str:
    return (
        f"CIFAR-10 not found under '{root}': expected {root}/{TV_FOLDER} (torchvision layout), "
        f"{root}/{{train,test}}/<class>/ image folders, or a .tar.gz of those; "
        f"set {key}=/path/to/cifar10_jpeg.tar.gz (or a folder holding one of those), or "
        "dataset.download=true to fetch it from https://www.cs.toronto.edu/~kriz/cifar.html."
    )


def _is_archive(path: Path) -> bool:
    return path.name.lower().endswith(ARCHIVE_SUFFIXES)


def _has_splits(path: Path) -> bool:
    return all((path / s).is_dir() for s in _SPLITS)


def locate(root: Any) -> tuple[str, Path] | None:
    """``("torchvision" | "folder" | "archive", path)`` for the data under ``root``, or None."""
    root = Path(os.path.expanduser(str(root)))
    if root.is_file():
        return ("archive", root) if _is_archive(root) else None
    if not root.is_dir():
        return None
    if (root / TV_FOLDER).is_dir():
        return "torchvision", root / TV_FOLDER
    if root.name == TV_FOLDER and (root / TV_TEST[0]).is_file():
        return "torchvision", root
    for cand in (root, root / "cifar10_jpeg"):
        if _has_splits(cand):
            return "folder", cand
    preferred = [root / "cifar10_jpeg.tar.gz", root / "cifar10.tar.gz"]
    others = sorted(
        p for p in root.iterdir()
        if p.is_file() and _is_archive(p) and "cifar" in p.name.lower() and "10" in p.name
        and not p.name.startswith("cifar-10-python")  # torchvision's own download (pickles)
    )
    for cand in preferred + others:
        if cand.is_file():
            return "archive", cand
    return None


# --------------------------------------------------------------------------- cache

def default_cache_dir() -> Path:
    env = os.environ.get("FLATBNN_CACHE")
    return Path(os.path.expanduser(env)) if env else Path.home() / ".cache" / "flatbnn"


def resolve_cache_dir(cache_dir: Any) -> Path | None:
    """``False``/``""`` disable caching; ``None`` = default; refuses paths inside the repository."""
    if cache_dir is False or cache_dir == "":
        return None
    path = default_cache_dir() if cache_dir is None else Path(os.path.expanduser(str(cache_dir)))
    path = path.resolve()
    repo = resources.CHECKOUT  # None for an installed wheel: no repository to keep clean
    if repo is not None and (path == repo or repo in path.parents):
        raise ValueError(
            f"cache_dir {str(path)!r} is inside the repository {str(repo)!r}; decoded data must "
            "live outside it (set dataset.cache_dir or $FLATBNN_CACHE elsewhere)"
        )
    return path / "cifar10"


def _cache_files(cache: Path, key: dict[str, Any]) -> tuple[Path, Path]:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    stem = f"{key['split']}-{key['subset'] if key['subset'] is not None else 'all'}-{digest}"
    return cache / f"{stem}.images.npy", cache / f"{stem}.labels.npy"


def _cache_load(files: tuple[Path, Path]) -> Arrays | None:
    img_f, lbl_f = files
    if not (img_f.is_file() and lbl_f.is_file()):
        return None
    try:
        x, y = np.load(img_f), np.load(lbl_f)
    except (OSError, ValueError):  # truncated / foreign file: rebuild it
        return None
    if x.ndim != 4 or x.shape[1:] != (32, 32, 3) or len(x) != len(y):
        return None
    return x, y.astype(np.int64)


def _cache_save(files: tuple[Path, Path], arrays: Arrays) -> None:
    save_npy(files[0], arrays[0])
    save_npy(files[1], arrays[1])  # labels last: their presence marks a complete entry


# --------------------------------------------------------------------------- decoding

def decode_image(data: bytes, what: str = "image") -> np.ndarray:
    """Encoded image bytes -> uint8 ``[32, 32, 3]``."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
    if arr.shape != (32, 32, 3):
        raise ValueError(f"{what}: expected a 32x32 RGB image, got shape {arr.shape}")
    return arr


def _decode_many(blobs: Iterable[tuple[str, bytes]], n: int) -> np.ndarray:
    out = np.empty((n, 32, 32, 3), dtype=np.uint8)
    for i, (what, data) in enumerate(blobs):
        out[i] = decode_image(data, what)
    return out


def _index_listing(listing: dict[str, list[str]], where: str) -> tuple[list[str], list[tuple[str, str]], np.ndarray]:
    """``{class: [file, ...]}`` -> (classes, canonical (class, file) order, labels)."""
    classes = sorted(listing)
    entries = [(c, f) for c in classes for f in sorted(listing[c])]
    labels = np.array([classes.index(c) for c, _ in entries], dtype=np.int64)
    if len(classes) != NUM_CLASSES:
        raise ValueError(f"CIFAR-10 at {where}: expected {NUM_CLASSES} class folders, found {len(classes)}: {classes}")
    return classes, entries, labels


def _check_classes(per_split: dict[str, list[str]], where: str) -> list[str]:
    tr, te = per_split.get("train"), per_split.get("test")
    if tr is not None and te is not None and tr != te:
        raise ValueError(f"CIFAR-10 at {where}: train classes {tr} differ from test classes {te}")
    return tr if tr is not None else te


# --------------------------------------------------------------------------- (a) torchvision

def _unpickle(path: Path) -> dict:
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="latin1")
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}


def _load_torchvision(folder: Path, download_root: Path | None) -> tuple[dict[str, Arrays], list[str]]:
    if download_root is not None:
        # Downloads (and md5-checks) the official archive, then loads it.
        import torchvision

        out = {}
        for split in _SPLITS:
            ds = torchvision.datasets.CIFAR10(str(download_root), train=split == "train", download=True)
            out[split] = (np.asarray(ds.data, dtype=np.uint8), np.asarray(ds.targets, dtype=np.int64))
        return out, list(ds.classes)
    # Same pickle format torchvision reads, without its md5 check (so partial/fake sets work).
    out = {}
    for split, names in (("train", TV_TRAIN), ("test", TV_TEST)):
        xs, ys = [], []
        for name in names:
            path = folder / name
            if not path.is_file():
                raise FileNotFoundError(f"CIFAR-10 torchvision layout incomplete: missing {path}; re-download with dataset.download=true")
            d = _unpickle(path)
            xs.append(np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(d["labels"] if "labels" in d else d["fine_labels"], dtype=np.int64))
        out[split] = (np.concatenate(xs).transpose(0, 2, 3, 1).copy(), np.concatenate(ys))
    meta = folder / "batches.meta"
    classes = list(_unpickle(meta)["label_names"]) if meta.is_file() else list(CLASSES)
    return out, classes


# --------------------------------------------------------------------------- (b) image folders

def _list_folder(split_dir: Path) -> dict[str, list[str]]:
    listing: dict[str, list[str]] = {}
    for cdir in sorted(p for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        listing[cdir.name] = [
            f.name for f in cdir.iterdir()
            if f.suffix.lower() in IMAGE_EXTS and not f.name.startswith(".") and f.is_file()
        ]
    return listing


def _load_folder(folder: Path, subsets: dict[str, int | None], cache: Path | None) -> tuple[dict[str, Arrays], list[str]]:
    out, classes_per = {}, {}
    for split, n in subsets.items():
        split_dir = folder / split
        classes, entries, labels = _index_listing(_list_folder(split_dir), str(split_dir))
        classes_per[split] = classes
        sel = balanced_subset(labels, n, seed=SUBSET_SEED, num_classes=NUM_CLASSES)
        files = [split_dir / entries[i][0] / entries[i][1] for i in sel]
        cache_files = None
        if cache is not None:
            stats = hashlib.sha256()
            for (c, f), p in zip((entries[i] for i in sel), files):
                st = p.stat()
                stats.update(f"{c}/{f}:{st.st_size}:{st.st_mtime_ns}\n".encode())
            listing_digest = hashlib.sha256("\n".join(f"{c}/{f}" for c, f in entries).encode()).hexdigest()
            key = {"v": _CACHE_VERSION, "kind": "folder", "path": str(folder.resolve()), "split": split,
                   "subset": n, "seed": SUBSET_SEED, "listing": listing_digest, "stats": stats.hexdigest()}
            cache_files = _cache_files(cache, key)
            hit = _cache_load(cache_files)
            if hit is not None:
                out[split] = hit
                continue
        x = _decode_many(((str(p), p.read_bytes()) for p in files), len(files))
        out[split] = (x, labels[sel])
        if cache_files is not None:
            _cache_save(cache_files, out[split])
    return out, _check_classes(classes_per, str(folder))


# --------------------------------------------------------------------------- (c) archives

def _iter_tar(path: Path) -> Iterable[tuple[str, bytes]]:
    """``(name, data)`` of the regular files of a ``.tar`` / ``.tar.gz``, in one streaming pass.

    :mod:`tarfile` rather than a hand-written header parser. Measured back to back on the real 60k-image
    ``cifar10_jpeg.tar.gz`` (shared 2-core machine, CPU seconds): the first decode of the whole set
    (scan + JPEG decode + cache write) 7.0-8.3 s with it, 6.6-7.5 s with the former parser; the scan
    alone 1.9-2.1 s vs 0.5-0.8 s, so a 5k/1k subset's first load 3.0 s vs 1.1-1.4 s. Paid once per
    archive and subset: the ``.npy`` cache serves every later load. The decoded arrays are
    byte-identical (tests/test_data.py pins their hash); ``mode="r:*"`` was no faster.
    """
    with tarfile.open(path, mode="r|*") as tf:
        for member in tf:
            if member.isfile():
                f = tf.extractfile(member)
                if f is not None:
                    yield member.name, f.read()


def _scan_archive(path: Path, splits: set[str]) -> dict[str, dict[str, dict[str, bytes]]]:
    """One streaming pass: ``{split: {class: {file: encoded bytes}}}`` (nothing decoded)."""

    def collect(members: Iterable[tuple[str, bytes]]) -> dict[str, dict[str, dict[str, bytes]]]:
        found: dict[str, dict[str, dict[str, bytes]]] = {s: {} for s in splits}
        for name, data in members:
            parts = [p for p in name.split("/") if p not in ("", ".")]
            if len(parts) < 3:
                continue
            split, cls, fname = parts[-3:]
            if split not in splits or fname.startswith(".") or cls.startswith("."):
                continue
            if os.path.splitext(fname)[1].lower() not in IMAGE_EXTS:
                continue
            found[split].setdefault(cls, {})[fname] = data
        return found

    return collect(_iter_tar(path))


def _load_archive(path: Path, subsets: dict[str, int | None], cache: Path | None) -> tuple[dict[str, Arrays], list[str] | None]:
    st = path.stat()
    ident = {"v": _CACHE_VERSION, "kind": "archive", "path": str(path.resolve()), "size": st.st_size,
             "mtime_ns": st.st_mtime_ns, "seed": SUBSET_SEED}
    out: dict[str, Arrays] = {}
    cache_files: dict[str, tuple[Path, Path]] = {}
    if cache is not None:
        for split, n in subsets.items():
            cache_files[split] = _cache_files(cache, dict(ident, split=split, subset=n))
            hit = _cache_load(cache_files[split])
            if hit is not None:
                out[split] = hit
    missing = [s for s in subsets if s not in out]
    if not missing:
        return out, None
    found = _scan_archive(path, set(missing))
    classes_per = {}
    for split in missing:
        if not found[split]:
            raise FileNotFoundError(
                f"no {split}/<class>/<image> members in archive '{path}'; expected an archive of "
                "{train,test}/<class>/*.png|jpg folders (e.g. cifar10_jpeg.tar.gz); point dataset.root at one"
            )
        listing = {c: list(files) for c, files in found[split].items()}
        classes, entries, labels = _index_listing(listing, f"{path}:{split}")
        classes_per[split] = classes
        sel = balanced_subset(labels, subsets[split], seed=SUBSET_SEED, num_classes=NUM_CLASSES)
        blobs = ((f"{path}:{split}/{entries[i][0]}/{entries[i][1]}", found[split][entries[i][0]][entries[i][1]]) for i in sel)
        out[split] = (_decode_many(blobs, len(sel)), labels[sel])
        found[split] = {}  # free the encoded bytes early
        if split in cache_files:
            _cache_save(cache_files[split], out[split])
    return out, _check_classes(classes_per, str(path))



class CorruptArchive(ValueError):
    """A data-set archive that cannot be read to its end: one line naming the file and its config key."""


def _is_gzip_error(e: OSError) -> bool:
    import gzip
    # gzip.BadGzipFile is an OSError; "Not a gzipped file" / CRC errors come from there too
    return isinstance(e, gzip.BadGzipFile) or "gzip" in str(e).lower() or "crc" in str(e).lower()


# --------------------------------------------------------------------------- builder

def load_cifar10_arrays(
    root: Any,
    train_subset: int | None = None,
    test_subset: int | None = None,
    download: bool = False,
    cache_dir: Any = None,
    key: str = "dataset.root",
    splits: Iterable[str] = _SPLITS,
) -> tuple[dict[str, Arrays], list[str], str]:
    """``({"train": (x, y), "test": (x, y)}, classes, layout)`` with subsets already applied
    (only the ``splits`` asked for; ``key`` names the config key of ``root`` in error messages)."""
    subsets = {s: n for s, n in (("train", train_subset), ("test", test_subset)) if s in tuple(splits)}
    loc = locate(root)
    if loc is None and download:
        root_path = Path(os.path.expanduser(str(root)))
        if _is_archive(root_path):
            raise FileNotFoundError(f"CIFAR-10 archive '{root}' does not exist; dataset.download=true needs {key} to be a directory")
        data, classes = _load_torchvision(root_path / TV_FOLDER, download_root=root_path)
        layout = "torchvision"
    elif loc is None:
        raise FileNotFoundError(not_found_message(root, key))
    else:
        layout, path = loc
        if layout == "torchvision":
            data, classes = _load_torchvision(path, download_root=None)
        elif layout == "folder":
            data, classes = _load_folder(path, subsets, resolve_cache_dir(cache_dir))
        else:
            try:
                data, classes = _load_archive(path, subsets, resolve_cache_dir(cache_dir))
            except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
                if isinstance(e, FileNotFoundError) or (isinstance(e, OSError) and not _is_gzip_error(e)):
                    raise
                raise CorruptArchive(
                    f"{key}={root}: archive '{path}' is corrupt or truncated ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:120]}; {path.stat().st_size:,} bytes); copy or download it "
                    f"again, or point {key} at an intact one") from None
    if layout == "torchvision":
        for split, n in subsets.items():
            data[split] = canonical_subset(*data[split], n, NUM_CLASSES)
    data = {s: data[s] for s in subsets}
    return data, list(classes) if classes else list(CLASSES), layout


@register_test_loader("cifar10")
def cifar10_test_arrays(root: Any, *, subset: int | None = None, download: bool = False, cache_dir: Any = None,
                        key: str = "dataset.root") -> Arrays:
    data, _, _ = load_cifar10_arrays(root, None, subset, download, cache_dir, key=key, splits=("test",))
    return data["test"]


@register_dataset("cifar10", augment="crop_flip", num_classes=NUM_CLASSES, input_shape=INPUT_SHAPE)
def build_cifar10(
    opts: DataOptions,
    shift_root: Any = None,
    shift_corruptions: Any = "all",
    shift_severities: Any = (1, 2, 3, 4, 5),
) -> DataBundle:
    """CIFAR-10; with ``shift_root`` also ``bundle.shift`` = CIFAR-10-C (``"<corruption>/<severity>"``)."""
    data, classes, layout = load_cifar10_arrays(opts.root, opts.train_subset, opts.test_subset, opts.download,
                                                opts.cache_dir)
    check_arrays("cifar10", data, (32, 32, 3), NUM_CLASSES)
    meta = {"classes": tuple(classes), "layout": layout, "root": str(opts.root)}
    shift = {}
    if shift_root not in (None, ""):
        shift, shift_meta = load_shift_sets(shift_root, shift_corruptions, shift_severities, opts.test_subset,
                                            key="dataset.shift_root", num_classes=NUM_CLASSES, mean=MEAN, std=STD)
        meta.update(shift_meta)
    return make_bundle(opts, data["train"], data["test"], num_classes=NUM_CLASSES, mean=MEAN, std=STD,
                       scale=255.0, meta=meta, shift=shift)


# CIFAR-10-C (data/cifar10_c.py loads the corrupted sets) as its own data set, trained on clean CIFAR-10
@register_dataset("cifar10_c", augment="crop_flip", num_classes=NUM_CLASSES, input_shape=INPUT_SHAPE)
def build_cifar10_c(
    opts: DataOptions,
    clean_root: Any = "data",
    corruptions: Any = "all",
    severities: Any = SEVERITIES,
) -> DataBundle:
    """Train on clean CIFAR-10 (``clean_root``, any cifar10 layout), test on CIFAR-10-C (``opts.root``).

    ``download=True`` only fetches the clean CIFAR-10 (CIFAR-10-C is not downloaded: see
    :data:`SOURCE`). ``test`` = all selected corrupted sets concatenated (corruption-major, then
    severity); ``shift`` = the same sets keyed ``"<corruption>/<severity>"``. OOD sets default to
    ``clean_root``, not to the CIFAR-10-C folder (which holds no other data set).
    """
    root = opts.root
    shift, shift_meta = load_shift_sets(root, corruptions, severities, opts.test_subset, key="dataset.root",
                                         num_classes=NUM_CLASSES, mean=MEAN, std=STD)
    data, classes, layout = load_cifar10_arrays(clean_root, opts.train_subset, None, opts.download, opts.cache_dir,
                                                key="dataset.clean_root", splits=("train",))
    check_arrays("cifar10_c", data, (32, 32, 3), NUM_CLASSES)
    test = ConcatWithTargets(list(shift.values()))
    bundle = make_bundle(
        dataclasses.replace(opts, root=clean_root), data["train"],
        (np.zeros((0, 32, 32, 3), np.uint8), np.zeros(0, np.int64)),
        num_classes=NUM_CLASSES, mean=MEAN, std=STD, scale=255.0, shift=shift,
        meta=dict(shift_meta, classes=tuple(classes), layout=layout, root=str(root), clean_root=str(clean_root),
                  test_keys=tuple(shift)))
    bundle.test = test
    return bundle


# --------------------------------------------------------------------------- CIFAR-100

C100_FOLDER = "cifar-100-python"
C100_NUM_CLASSES = 100
C100_MEAN = (0.5071, 0.4865, 0.4409)
C100_STD = (0.2673, 0.2564, 0.2762)


def c100_not_found_message(root: Any, key: str = "dataset.root") -> str:
    return (
        f"CIFAR-100 not found under '{root}': expected {root}/{C100_FOLDER}/{{train,test,meta}} "
        f"(torchvision's pickle layout); set {key} to the folder holding {C100_FOLDER}, or "
        "dataset.download=true to fetch it from https://www.cs.toronto.edu/~kriz/cifar.html."
    )


def locate_cifar100(root: Any) -> Path | None:
    root = Path(os.path.expanduser(str(root)))
    for cand in (root / C100_FOLDER, root):
        if (cand / "test").is_file() and (cand / "train").is_file():
            return cand
    return None


def load_cifar100_arrays(
    root: Any,
    train_subset: int | None = None,
    test_subset: int | None = None,
    download: bool = False,
    key: str = "dataset.root",
    splits: Iterable[str] = _SPLITS,
) -> tuple[dict[str, Arrays], list[str]]:
    """``({"train": (x, y), "test": (x, y)}, fine class names)`` in canonical order, subsets applied."""
    folder = locate_cifar100(root)
    if folder is None and download:
        import torchvision

        for split in _SPLITS:  # downloads and md5-checks the official archive
            torchvision.datasets.CIFAR100(os.path.expanduser(str(root)), train=split == "train", download=True)
        folder = locate_cifar100(root)
    if folder is None:
        raise FileNotFoundError(c100_not_found_message(root, key))
    subsets = {s: n for s, n in (("train", train_subset), ("test", test_subset)) if s in tuple(splits)}
    out = {}
    for split, n in subsets.items():
        d = _unpickle(folder / split)
        x = np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        y = np.asarray(d["fine_labels"], dtype=np.int64)
        out[split] = canonical_subset(x, y, n, C100_NUM_CLASSES)
    meta = folder / "meta"
    classes = list(_unpickle(meta)["fine_label_names"]) if meta.is_file() else [str(i) for i in range(C100_NUM_CLASSES)]
    return out, classes


@register_test_loader("cifar100")
def cifar100_test_arrays(root: Any, *, subset: int | None = None, download: bool = False, cache_dir: Any = None,
                         key: str = "dataset.root") -> Arrays:
    return load_cifar100_arrays(root, None, subset, download, key=key, splits=("test",))[0]["test"]


@register_dataset("cifar100", augment="crop_flip", num_classes=C100_NUM_CLASSES, input_shape=INPUT_SHAPE)
def build_cifar100(opts: DataOptions) -> DataBundle:
    """CIFAR-100 (fine labels); ``cache_dir`` is only used by OOD sets that need it (CIFAR-10 archives)."""
    data, classes = load_cifar100_arrays(opts.root, opts.train_subset, opts.test_subset, opts.download)
    check_arrays("cifar100", data, (32, 32, 3), C100_NUM_CLASSES)
    return make_bundle(opts, data["train"], data["test"], num_classes=C100_NUM_CLASSES, mean=C100_MEAN,
                       std=C100_STD, scale=255.0,
                       meta={"classes": tuple(classes), "layout": "torchvision", "root": str(opts.root)})
