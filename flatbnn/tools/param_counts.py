"""Print the parameter count of every model config under configs/model/.

    python scripts/param_counts.py                      # plain table
    python scripts/param_counts.py --markdown           # Markdown table on stdout
    python scripts/param_counts.py --markdown --update docs/models.md   # rewrite the table there

Each config is built (on the meta device: nothing is allocated or initialised) at the input shape and
class count its papers use, from flatbnn/models/reference.py: CIFAR models at 3x32x32 with 10 classes
(PyramidNet-272 with 100, as its published count), MNIST models at 1x28x28, ImageNet models at
3x224x224 with 1000 classes; plus the 100-class count where a paper runs the network on CIFAR-100,
and the published figure with its source.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
from omegaconf import OmegaConf

from flatbnn import resources
from flatbnn.models import create_model  # noqa: E402
from flatbnn.models.reference import CIFAR, MODEL_REFS, ModelRef, count_parameters  # noqa: E402

# Filled in by Hydra from the dataset group; replaced here by the reference values.
DATASET_KEYS = ("_target_", "num_classes", "input_shape")
START, END = "<!-- param-table:start -->", "<!-- param-table:end -->"
HEADER = ("config", "network", "parameters", "input", "classes", "CIFAR-100", "published (M)", "used in")


def config_kwargs(path: Path) -> tuple[str, dict]:
    kw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    for key in DATASET_KEYS:
        kw.pop(key, None)
    return kw.pop("name"), kw


def count(name: str, kw: dict, num_classes: int, shape: tuple[int, ...], basis: str = "all") -> int:
    with torch.device("meta"):
        model = create_model(name, num_classes=num_classes, input_shape=shape, **kw)
    return count_parameters(model, basis)


def count_rows(config_dir: Path = resources.CONFIGS_DIR / "model") -> list[dict]:
    rows = []
    for path in sorted(config_dir.glob("*.yaml")):
        name, kw = config_kwargs(path)
        ref = MODEL_REFS.get(path.stem, ModelRef(path.stem, "?", CIFAR, 10))
        row = {
            "config": path.stem,
            "network": ref.network,
            "parameters": count(name, kw, ref.num_classes, ref.input_shape),
            "input": "x".join(map(str, ref.input_shape)),
            "classes": ref.num_classes,
            "cifar100": count(name, kw, 100, ref.input_shape) if ref.cifar100 else None,
            "published": ref.published,
            "published_by": ref.published_by,
            "used_in": ref.used_in,
        }
        if ref.cifar100 and ref.num_classes == 100:
            row["cifar100"] = row["parameters"]
        rows.append(row)
    return rows


def _cells(row: dict) -> tuple[str, ...]:
    published = row["published"] or "–"
    if row["published_by"]:
        published += f" ({row['published_by']})"
    return (
        row["config"],
        row["network"],
        f"{row['parameters']:,}",
        row["input"],
        str(row["classes"]),
        f"{row['cifar100']:,}" if row["cifar100"] is not None else "",
        published,
        row["used_in"],
    )


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|---|---|---:|---|---:|---:|---|---|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def update_file(path: Path, table: str) -> None:
    text = path.read_text()
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no {START} ... {END} block to replace")
    path.write_text(pattern.sub(lambda _: f"{START}\n{table}\n{END}", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--update", type=Path, help="with --markdown: replace the table in this file")
    args = parser.parse_args()

    rows = count_rows()
    if args.markdown:
        table = markdown(rows)
        if args.update:
            update_file(args.update, table)
            print(f"updated {args.update}")
        else:
            print(table)
        return
    cells = [_cells(r)[:6] for r in rows]
    header = HEADER[:6]
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(6)]
    fmt = "  ".join(f"{{:{'>' if i in (2, 4, 5) else '<'}{w}}}" for i, w in enumerate(widths))
    print(fmt.format(*header).rstrip())
    for c in cells:
        print(fmt.format(*c).rstrip())


if __name__ == "__main__":
    main()
