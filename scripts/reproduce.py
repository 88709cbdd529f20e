#!/usr/bin/env python
"""Reproduce the papers' rows (the code and its --help: flatbnn/reproduce/cli.py; installed: ``flatbnn-reproduce``).

    python scripts/reproduce.py list | check | run ROW --scale cpu | compare ROW | status | all --scale smoke
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbnn.reproduce.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
