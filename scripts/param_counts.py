"""Print the parameter count of every model config under configs/model/ (10 classes).

    python scripts/param_counts.py [--markdown]

Image models are built for 3x32x32 inputs (CIFAR), the MLP for 1x28x28 (MNIST-like).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flatbnn.models import create_model  # noqa: E402

NUM_CLASSES = 10
INPUT_SHAPES = {"mlp": (1, 28, 28)}
DEFAULT_INPUT_SHAPE = (3, 32, 32)
# Filled in by Hydra from the dataset group; replaced here by the fixed values above.
DATASET_KEYS = ("_target_", "num_classes", "input_shape")


def count_rows(config_dir: Path = ROOT / "configs" / "model") -> list[tuple[str, int, tuple[int, ...]]]:
    rows = []
    for path in sorted(config_dir.glob("*.yaml")):
        kw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        for key in DATASET_KEYS:
            kw.pop(key, None)
        name = kw.pop("name")
        shape = INPUT_SHAPES.get(name, DEFAULT_INPUT_SHAPE)
        model = create_model(name, num_classes=NUM_CLASSES, input_shape=shape, **kw)
        rows.append((path.stem, sum(p.numel() for p in model.parameters()), shape))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()

    rows = [(cfg, f"{n:,}", "x".join(map(str, shape))) for cfg, n, shape in count_rows()]
    header = ("config", "parameters", "input")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|---|---:|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
        fmt = f"{{:<{widths[0]}}}  {{:>{widths[1]}}}  {{:<{widths[2]}}}"
        print(fmt.format(*header).rstrip())
        for row in rows:
            print(fmt.format(*row).rstrip())


if __name__ == "__main__":
    main()
