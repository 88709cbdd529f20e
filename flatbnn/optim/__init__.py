"""Learning-rate schedules (per step). Optimisers themselves are torch.optim classes via Hydra."""
