#!/usr/bin/env python
"""`python scripts/ensemble.py ...` in a checkout: flatbnn/tools/ensemble.py (its --help; installed: python -m flatbnn.tools.ensemble)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's flatbnn, installed or not
from flatbnn.tools.ensemble import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
