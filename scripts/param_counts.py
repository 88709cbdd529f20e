#!/usr/bin/env python
"""`python scripts/param_counts.py ...` in a checkout: flatbnn/tools/param_counts.py (its --help; installed: python -m flatbnn.tools.param_counts)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's flatbnn, installed or not
from flatbnn.tools.param_counts import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
