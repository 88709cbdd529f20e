# flatbnn -- one-command setup, demo, tests.
#   make demo    sets up .venv (first time) and runs SGD vs SAM on the embedded digits set (< 3 min, CPU)
#   make test    runs the test suite (the README's and CI's test command)
#   make regen   rewrites every generated block (README option table, import drawing, STATUS.md, ...) from its sources
VENV   ?= .venv
PY     ?= $(VENV)/bin/python
# torch 2.14.1 / torchvision 0.29.1 are what the dev and CI machines hold on disk; any torch >= 2.11 works (pyproject.toml's floor).
TORCH  ?= torch==2.14.1 torchvision==0.29.1
DEMO_DIR ?= outputs/demo

.PHONY: setup demo test test-fast bench bench-smoke clean-outputs

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(TORCH)
	$(VENV)/bin/pip install -q -e ".[test,demo,wandb,timm,cluster]"
	touch $@

demo: setup
	rm -rf $(DEMO_DIR)
	$(PY) train.py --multirun dataset=digits model=mlp method=map flatness=none,sam seed=0,1 \
		trainer.progress=false hydra.sweep.dir=$(DEMO_DIR)
	$(PY) scripts/aggregate.py $(DEMO_DIR)

# min(cores, 4) pytest-xdist workers (each holds ~1-2 GB); worksteal: the test durations are very uneven
# (0.01 s to ~5 min). One test, serially: $(PY) -m pytest tests/test_x.py
PYTEST_PAR ?= -n auto --maxprocesses 4 --dist worksteal
test: setup
	$(PY) -m pytest -q --durations=15 $(PYTEST_PAR)

test-fast: setup
	$(PY) -m pytest -q $(PYTEST_PAR) -m "not slow"

# images/s of method x flatness side by side (interleaved rounds; each pair also through trainer.cuda_graph: <pair>:graphed) -> results/bench/<device>-<date>.json + .md;
#   make bench BENCH_ARGS="--precision bf16 --channels-last --model wrn28x10 --reference"   (on a GPU)
#   make bench-smoke     tiny model, 2 steps: the pipeline in seconds (writes to outputs/bench-smoke)
BENCH_ARGS ?=
bench: setup
	$(PY) scripts/benchmark.py --graphed $(BENCH_ARGS)

bench-smoke: setup
	$(PY) scripts/benchmark.py --smoke --reference --out outputs/bench-smoke $(BENCH_ARGS)

clean-outputs:
	rm -rf outputs multirun

# ---------------------------------------------------------------------------- reproductions
# Fisher-SAM rho x eta sweep (FSAM Fig. 5 style) through --multirun + scripts/sweep_heatmap.py.
# Default: the digits set on CPU (the path end to end, not the paper's CIFAR numbers);
# SCALE=cifar: CIFAR-10 (5k subset) ResNet-20-FRN, 3 epochs -- point dataset.root at the data.
SWEEP_DIR ?= outputs/fsam_sweep
SWEEP_RHO ?= 0.01,0.05,0.1,0.5
SWEEP_ETA ?= 0,1,100,10000
ifeq ($(SCALE),cifar)
SWEEP_ARGS ?= dataset=cifar10 model=resnet20_frn dataset.train_subset=5000 dataset.test_subset=1000 trainer.epochs=3
else
SWEEP_ARGS ?= dataset=digits model=mlp trainer.epochs=10
endif

# the heatmaps go to outputs/ (a fresh clone's run must not rewrite the committed ones): SWEEP_FIGURES=results/fsam_sweep
SWEEP_FIGURES ?= outputs/fsam_sweep
.PHONY: reproduce-fsam-sweep
reproduce-fsam-sweep: setup
	rm -rf $(SWEEP_DIR)
	$(PY) train.py --multirun $(SWEEP_ARGS) method=map flatness=fsam flatness.rho=$(SWEEP_RHO) \
		flatness.eta=$(SWEEP_ETA) trainer.progress=false trainer.reliability_diagram=false hydra.sweep.dir=$(SWEEP_DIR)
	$(PY) scripts/sweep_heatmap.py $(SWEEP_DIR) --x flatness.rho --y flatness.eta --metric accuracy \
		--out $(SWEEP_FIGURES)/accuracy.png
	$(PY) scripts/sweep_heatmap.py $(SWEEP_DIR) --x flatness.rho --y flatness.eta --metric nll \
		--out $(SWEEP_FIGURES)/nll.png

# ---------------------------------------------------------------------------- paper rows (docs/reproduce.md)
#   make reproduce-<row> SCALE=smoke|cpu|paper [ARGS="dataset.root=..."] [LAUNCHER=slurm|local|cpu_parallel|gpu_shared] [DRY=1]
#     LAUNCHER: a configs/hydra/launcher option (docs/cluster.md); DRY=1 prints the sweep command and a time estimate
#     per job (measured throughput where one matches, else assumed), runs nothing;
#     MISSING=1 skips the jobs the row's committed records hold (finish a row in a fresh clone / on another cluster)
#   make reproduce-all SCALE=smoke [JOBS=4]   (CI) every row (JOBS rows at a time), then results/STATUS.md
#   make compare-<row> SCALE=cpu              rerender the comparison from whatever runs exist, into
#     outputs/reproduce/comparison/<row>/ (RESULTS=results/reproduce: the committed one)
#   make status                               regenerate results/STATUS.md
SCALE    ?= smoke
ARGS     ?=
LAUNCHER ?=
DRY      ?=
MISSING  ?=
REPRO_FLAGS = --scale $(SCALE) $(if $(LAUNCHER),--launcher $(LAUNCHER)) $(if $(DRY),--dry-run) $(if $(MISSING),--missing)

.PHONY: reproduce-all status rows-check
reproduce-all: setup
	$(PY) scripts/reproduce.py all $(REPRO_FLAGS) $(if $(JOBS),--jobs $(JOBS)) -- $(ARGS)

reproduce-%: setup
	$(PY) scripts/reproduce.py run $* $(REPRO_FLAGS) -- $(ARGS)

compare-%: setup
	$(PY) scripts/reproduce.py compare $* --scale $(SCALE) $(if $(RESULTS),--results $(RESULTS))

status: setup
	$(PY) scripts/reproduce.py status

rows-check: setup
	$(PY) scripts/reproduce.py check

# estimated runs / PFLOP / GPU-hours per row at paper scale -> the table in docs/cluster.md (a few minutes, CPU);
# its last column: hours on the benchmarked GPU from measured throughput where one matches (else assumed, counted)
#   make cost-table COST_ARGS="--tflops 40"   (another assumed sustained rate)
COST_ARGS ?=
.PHONY: cost-table
cost-table: setup
	$(PY) scripts/estimate_cost.py --write-docs $(COST_ARGS)

# paper-scale cells, cheapest verdicts first, until the budget runs out; resumes on the next call (docs/cluster.md:
# "A campaign", and the standing rule for GPU time). Finished runs -> records + comparisons + results/STATUS.md.
#   make campaign MINUTES=11 [ROWS=bsam_t6,hwa_fig1] [GPUS=1] [PROCS=2] [DATA=mnist=/data/mnist_root,cifar10=...]
#   make campaign HOURS=8 GPUS=1 DRY=1      the queue with a time estimate per job (measured vs assumed), runs nothing
#   CAMPAIGN_ARGS="--restore in.tgz --archive-out $$OUT/campaign.tgz"   chain a job across short GPU commands
ROWS    ?=
HOURS   ?=
MINUTES ?=
GPUS    ?=
PROCS   ?=
DATA    ?=
CAMPAIGN_ARGS ?=
.PHONY: campaign
campaign: setup
	$(PY) scripts/campaign.py $(if $(ROWS),--rows $(ROWS)) $(if $(HOURS),--hours $(HOURS)) \
		$(if $(MINUTES),--minutes $(MINUTES)) $(if $(GPUS),--gpus $(GPUS)) $(if $(PROCS),--procs $(PROCS)) \
		$(if $(DATA),--data $(DATA)) $(if $(DRY),--dry-run) $(CAMPAIGN_ARGS) -- $(ARGS)

# 2-D toy reproductions through the runner (exact problems, CPU: vsam_fig1 seconds, fsam_toy ~11 min)
.PHONY: reproduce-fsam-toy reproduce-vsam-fig1
reproduce-fsam-toy: setup
	$(PY) scripts/reproduce.py run fsam_toy --scale paper

reproduce-vsam-fig1: setup
	$(PY) scripts/reproduce.py run vsam_fig1 --scale paper

# bSAM paper toys (App. F.1 logistic regression with exact posterior, F.2 two moons), CPU < 2 min each
.PHONY: reproduce-bsam-logreg reproduce-bsam-twomoons
reproduce-bsam-logreg: setup
	$(PY) scripts/reproduce.py run bsam_logreg --scale paper

reproduce-bsam-twomoons: setup
	$(PY) scripts/reproduce.py run bsam_twomoons --scale paper

# the README's table of config groups, regenerated from configs/ (tests/test_readme_options.py fails when stale)
.PHONY: readme-options
readme-options: setup
	$(PY) scripts/readme_options.py

# every generated block, rewritten from its sources (a new config option, method or module changes some of them;
# each has a test that fails while it is stale): README's option table, the import drawing in docs/ARCHITECTURE.md,
# docs/models.md's parameter table, results/STATUS.md, docs/cluster.md's cost table (that one takes a few minutes)
.PHONY: regen
regen: setup
	$(PY) scripts/readme_options.py
	$(PY) scripts/import_graph.py --write
	$(PY) scripts/param_counts.py --markdown --update docs/models.md
	$(PY) scripts/reproduce.py claims --rejudge
	$(PY) scripts/reproduce.py status
	$(PY) scripts/estimate_cost.py --write-docs

# ---------------------------------------------------------------------------- a lent GPU window (docs/cluster.md)
#   make gpu-window PRINT=1 [MINUTES=9.5] [ROWS=...]   build .device/ (wheels, data, COMMIT, resume.tgz) and print
#        [SELFCHECK=results/bench/<...>-selfcheck-<commit>.json]   the device call: its carry list and command line;
#                                                      SELFCHECK: an earlier window's verdicts (same step code)
#        [EAGER=1] [PROCS=4]                           EAGER: no self-check, every job eager (small nets, where
#                                                      start-up rules: window 6); PROCS: jobs at once, not measured
#   make gpu-window DRY=1                              the whole chain on this CPU at tiny sizes, into $(WINDOW_OUT)
#   make gpu-restore FROM=<files_at>                   merge the window's output into results/ (dry: FROM/restored/)
CIFAR10    ?= ../shared/data/cifar10_jpeg.tar.gz
MNIST_ROOT ?= $(if $(FLATBNN_DATA_ROOT),$(FLATBNN_DATA_ROOT),data)
WHEELS     ?= ../shared/wheels
WINDOW_DATA ?= cifar10,mnist,fashion_mnist
WINDOW_OUT ?= outputs/gpu-window-dry
FROM       ?= $(WINDOW_OUT)
.PHONY: gpu-window gpu-window-prepare gpu-restore
gpu-window-prepare: setup
	$(PY) -m flatbnn.reproduce.window_host prepare --minutes $(or $(MINUTES),9.5) $(if $(ROWS),--rows $(ROWS)) \
		--cifar10 $(CIFAR10) --mnist-root $(MNIST_ROOT) --wheels $(WHEELS) --data $(WINDOW_DATA) --print \
		$(if $(SELFCHECK),--selfcheck-from $(SELFCHECK)) $(if $(PROCS),--procs $(PROCS)) $(if $(EAGER),--eager)

ifeq ($(DRY),1)
gpu-window: setup
	rm -rf $(WINDOW_OUT)
	$(PY) -m flatbnn.reproduce.window --dry-run --minutes $(or $(MINUTES),2.5) --out $(WINDOW_OUT) $(if $(ROWS),--rows $(ROWS))
else ifeq ($(PRINT),1)
gpu-window: gpu-window-prepare
else
gpu-window:
	python3 -m flatbnn.reproduce.window --minutes $(or $(MINUTES),9.5) --data-dir .device --out $(OUT) $(if $(ROWS),--rows $(ROWS)) \
		$(if $(PROCS),--procs $(PROCS)) $(if $(EAGER),--eager)
endif

gpu-restore: setup
	$(PY) -m flatbnn.reproduce.window_host restore $(FROM)
