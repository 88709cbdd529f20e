#!/usr/bin/env python
"""flatbnn's one entry point (the code: flatbnn/train.py; installed: ``flatbnn-train``).

    python train.py dataset=cifar10 model=resnet20_frn method=map flatness=sam flatness.rho=0.05
    python train.py --multirun flatness=sam flatness.rho=0.01,0.05,0.1 seed=0,1,2
    torchrun --nproc_per_node=2 train.py trainer.batch_size=128 ...   (DDP; batch_size is global)
"""

from flatbnn.cli import exit_on_stop_signals

exit_on_stop_signals()  # before the slow imports: a stop signal during them is one line, 75 / 130

from flatbnn.train import cli  # noqa: E402

if __name__ == "__main__":
    cli()
