#!/usr/bin/env python
"""`python scripts/analyze.py ...` in a checkout: flatbnn/tools/analyze.py (its --help; installed: python -m flatbnn.tools.analyze)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's flatbnn, installed or not
from flatbnn.tools.analyze import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
