#!/usr/bin/env python
"""`python scripts/make_cifar10_c.py ...` in a checkout: flatbnn/tools/make_cifar10_c.py (its --help; installed: python -m flatbnn.tools.make_cifar10_c)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's flatbnn, installed or not
from flatbnn.tools.make_cifar10_c import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
