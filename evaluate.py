#!/usr/bin/env python
"""Re-evaluate a FINISHED run without retraining (the code and its --help: flatbnn/evaluate.py; installed:
``flatbnn-eval``).

    python evaluate.py run=outputs/2026-01-01/12-00-00-000000 method.num_samples=8
"""

import sys

from flatbnn.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
