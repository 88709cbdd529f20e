# flatbnn -- one-command setup, demo, tests.
#   make demo    sets up .venv (first time) and runs SGD vs SAM on the embedded digits set (< 3 min, CPU)
#   make test    runs the test suite (the README's and CI's test command)
VENV   ?= .venv
PY     ?= $(VENV)/bin/python
# torch 2.14.1 / torchvision 0.29.1 are what the dev and CI machines hold on disk; any torch >= 2.3 works.
TORCH  ?= torch==2.14.1 torchvision==0.29.1
DEMO_DIR ?= outputs/demo

.PHONY: setup demo test test-fast bench clean-outputs

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(TORCH)
	$(VENV)/bin/pip install -q -e ".[test,demo,wandb,timm]"
	touch $@

demo: setup
	rm -rf $(DEMO_DIR)
	$(PY) train.py --multirun dataset=digits model=mlp method=map flatness=none,sam seed=0,1 \
		trainer.progress=false hydra.sweep.dir=$(DEMO_DIR)
	$(PY) scripts/aggregate.py $(DEMO_DIR)

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) scripts/benchmark.py

clean-outputs:
	rm -rf outputs multirun
