"""The engine: one training loop, checkpoints, DDP, loggers. Nothing method-specific."""
