#!/usr/bin/env python
"""`python scripts/idx_from_packages.py ...` in a checkout: flatbnn/tools/idx_from_packages.py (its --help; installed: python -m flatbnn.tools.idx_from_packages)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's flatbnn, installed or not
from flatbnn.tools.idx_from_packages import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
