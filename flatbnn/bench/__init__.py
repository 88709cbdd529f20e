"""What a training step costs and whether a step path is right, below the reproduction runner that uses them:
the minimal loops of the reference implementations (``reference.py``, timed by ``scripts/benchmark.py --reference``),
the benchmark's rows read from configs/ (``variants.py``; the cost estimates read them), the GPU window's
self-check of the step paths (``selfcheck.py``; a campaign cell's step overrides) and CUDA MPS (``mps.py``).
Nothing here imports flatbnn.reproduce: the window that runs a self-check and then a campaign sits there."""
