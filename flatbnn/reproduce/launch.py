"""Launch a paper row: every cell x seed as ONE Hydra multirun of train.py.

Each (cell, seed) becomes a small generated config ``cell/<cell>__s<seed>.yaml`` (``# @package _global_``: the
cell's group choices as ``override /group: option`` defaults, its values below), placed on Hydra's search path;
the row is then ``train.py --multirun +cell=<a>,<b>,...``: a Hydra launcher (basic, joblib, submitit/SLURM) sees
one sweep, i.e. one job array on a cluster. Runs land in ``<out>/<cell>/seed<k>/``; a (cell, seed) whose
results.json already exists is skipped, and an interrupted one resumes from its checkpoint, so rerunning the
same command after a preemption finishes the row.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from flatbnn import resources
from flatbnn.engine.checkpoint import write_json, write_text
from flatbnn.reproduce.spec import REPO, Cell, Row, SpecError, load_json, load_yaml, rows_reading

CONFIGS = resources.CONFIGS_DIR
OUTPUT_ROOT = Path(os.environ.get("FLATBNN_REPRODUCE_DIR", REPO / "outputs" / "reproduce"))

# what the smoke scale adds to every cell (after the row's own smoke overrides): one step on a few fake images
SMOKE_TRAINER = {"epochs": 1, "limit_train_batches": 1, "batch_size": 2, "eval_batch_size": 2,
                 "num_workers": 0, "progress": False, "reliability_diagram": False}
SMOKE_SUBSETS = {"train_subset": 2, "test_subset": 2, "ood_subset": 2}  # images: the paper nets are big on a CPU
# method keys that would keep a 1-epoch run from producing a posterior (collection / burn-in / sample counts)
SMOKE_METHOD = {"num_samples": 2, "num_members": 2, "swa_start": 0, "burn_in": 0, "max_samples": 2,
                "start": 0, "warmup_epochs": 0, "max_rank": 2,
                "temperature": 1.0e-4}  # SGLD: noise sqrt(2 lr T / N) with N = 2 images would blow the net up
# the deep CIFAR backbones at their family's smallest depth (same builder, same keys, one block per stage): a smoke
# step of PyramidNet-272 or WRN-28-10 costs a minute on 2 CPU cores and checks nothing the shallow one does not
SMOKE_MODEL = {"wrn": {"depth": 10, "widen_factor": 1}, "pyramidnet": {"depth": 11}, "resnext_cifar": {"depth": 11},
               "resnet_cifar": {"depth": 8}, "preresnet": {"depth": 11},
               # ResNet-18 -> 10 (one block per stage), VGG-19 -> 11: 2-5 s a smoke job each on the CI machine's
               # 2 cores (flatbnn_t3's 12 ResNet-18 SGVB cells, fsam_t1's 8 VGG-19-BN) for nothing the shallow one misses
               "resnet": {"depth": 10}, "vgg": {"depth": 11}}
SMOKE_COUNTS = {"num_samples", "num_members", "max_samples", "max_rank", "temperature"}
# ImageNet nets whose global pooling takes any input size: their smoke step at 64 px (dataset.image_size: the
# 224-px pipeline, then resized). At 224 px the 12 cells of flatbnn_t4 took 9 of the smoke stage's 19 minutes on
# 2 CPU cores, and the resolution checks nothing the config composition, the step and the evaluation do not
SMOKE_IMAGE_SIZE = {"resnet152": 64, "densenet161": 64}
# ... and at one block per stage (model.stage_blocks: the same torchvision class and widths; 10.1M / 0.53M parameters
# instead of 60.2M / 28.7M for 1000 classes): the 12 cells of flatbnn_t4 were still the smoke stage's longest row (238 s)
SMOKE_STAGE_BLOCKS = {"resnet152": [1, 1, 1, 1], "densenet161": [1, 1, 1, 1], "densenet_cifar": [1, 1, 1, 1]}

# DataLoader workers at paper scale (trainer.num_workers defaults to 0: right for tests and CPU runs, a GPU
# bottleneck where every item is decoded or heavily augmented on the CPU). Per process; a cell's or the command
# line's own trainer.num_workers wins.
PAPER_WORKERS_DECODED = 8       # JPEG / PNG decoded per item: ImageNet, TinyImageNet, the fine-grained sets
PAPER_WORKERS_HEAVY = 8         # tensor-backed, but AutoAugment + Cutout (~0.5 ms / item) or a resize to 224 px
PAPER_WORKERS_CROP_FLIP = 4     # tensor-backed crop + flip (~0.1 ms / item)
DECODED_DATASETS = ("imagenet", "tinyimagenet", "flowers102", "stanford_cars")


def paper_num_workers(dataset) -> int:
    """trainer.num_workers of a paper-scale cell for its composed ``dataset`` config: 0 when the train set lives
    on the device (dataset.loader=device) or needs no per-item work, else by the per-item CPU cost."""
    if dataset.get("loader", "cpu") == "device":
        return 0
    if dataset.get("name") in DECODED_DATASETS:
        return PAPER_WORKERS_DECODED
    augment = dataset.get("augment") or "none"
    if augment == "autoaugment_cutout" or dataset.get("image_size"):
        return PAPER_WORKERS_HEAVY
    return PAPER_WORKERS_CROP_FLIP if augment != "none" else 0


def paper_overrides(cfg, given: list[str]) -> list[str]:
    """What the paper scale adds to a composed cell, unless the cell or the command line sets it: loader workers
    (:func:`paper_num_workers`), and the global SAM ascent. Under DDP the SAM family's ascent otherwise runs per
    process (no_sync), i.e. a job on k GPUs would be m-sharpness with m = k x flatness.m, which no paper's table
    used; flatness.sync_ascent=true all-reduces the ascent gradient, so the row's flatness.m is the effective m on
    any number of processes (identical on one; results.json meta.flatness.effective_m records it)."""
    out = []
    if not any(o.startswith("trainer.num_workers=") for o in given):
        workers = paper_num_workers(cfg.dataset)
        out += [f"trainer.num_workers={workers}"] if workers else []
    if "sync_ascent" in cfg.flatness and not any(o.startswith("flatness.sync_ascent=") for o in given):
        out.append("flatness.sync_ascent=true")
    return out


def run_overrides(cell: Cell, scale: str, extra: list[str] | tuple = ()) -> list[str]:
    """The overrides a (non-smoke) job of ``cell`` runs with, before the command line's ``extra``: the spec's,
    plus :func:`paper_overrides` at paper scale. Staleness and reuse compare runs against these."""
    return list(cell.overrides) + (list(_paper_additions(tuple(cell.overrides), tuple(extra))) if scale == "paper"
                                   else [])


@functools.lru_cache(maxsize=512)
def _paper_additions(overrides: tuple[str, ...], extra: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(paper_overrides(compose_cell(list(overrides + extra)), list(overrides + extra)))


def cell_config_name(cell_id: str, seed: int) -> str:
    return f"{cell_id.replace('/', '__')}__s{seed}"


def run_dir(out: Path, cell_id: str, seed: int) -> Path:
    return Path(out) / cell_id / f"seed{seed}"


def _groups() -> set[str]:
    return {p.name for p in CONFIGS.iterdir() if p.is_dir()}


def overrides_to_config(overrides: list[str]) -> dict:
    """Hydra override strings -> a ``# @package _global_`` config: group choices become ``override /g: v``
    defaults, everything else nested values. Later overrides win, as on a command line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups = _groups()
    defaults: dict[str, str] = {}
    values: dict = {}
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_delete() or o.is_sweep_override():
            raise SpecError(f"override {o.input_line!r}: deletions and sweeps are not allowed in a row spec")
        key = o.key_or_group
        if key.startswith("hydra"):
            raise SpecError(f"override {o.input_line!r}: hydra.* keys belong on the command line, not in a cell")
        if key in groups and o.package is None:
            defaults[key] = o.value()
            continue
        node = values
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = o.value()
    cfg = {"defaults": [{f"override /{g}": v} for g, v in defaults.items()] + ["_self_"]}
    cfg.update(values)
    return cfg


def is_hydra_override(o: str) -> bool:
    """``hydra.launcher.n_jobs=1``, ``hydra/launcher=slurm``: they configure the sweep, not a job's config."""
    return o.lstrip("+~").startswith(("hydra.", "hydra/"))


def compose_cell(overrides: list[str]):
    """The config train.py would run for these overrides (command-line semantics: unknown keys are errors).
    ``hydra.*`` overrides among a row's command-line extras go to the multirun only (compose() rejects them)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = [o for o in overrides if not is_hydra_override(o)]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def check_extra(cells: list[Cell], extra: list[str]) -> None:
    """The command line's overrides (``run <row> -- key=value ...``) compose with the row's first cell and pass the
    schema's types and ranges (engine/validate.check_values: ``optimizer.lr=fast``, ``trainer.epochs=-1``), checked
    once before anything is written or launched: a bad key or value is refused up front (SpecError: one line,
    exit 2) instead of failing every job of the sweep."""
    if not cells or not extra:
        return
    from flatbnn.cli import hydra_error_line
    from flatbnn.engine.validate import ConfigError, check_values
    bad = [o for o in extra if not is_hydra_override(o)]
    try:
        cfg = compose_cell(list(cells[0].overrides) + list(extra))
    except Exception as e:  # noqa: BLE001 -- any composition error: the line Hydra's would be at train.py
        line = hydra_error_line(e) or " ".join(str(e).split())[:300]
        raise SpecError(f"the overrides after -- ({' '.join(bad)}) do not compose with cell {cells[0].id}: {line}"
                        ) from None
    try:
        check_values(cfg)
    except ConfigError as e:  # the line train.py would print in every job
        raise SpecError(f"the overrides after -- ({' '.join(bad)}) give cell {cells[0].id} a bad value: {e}") from None


def smoke_overrides(cfg, fake_roots: dict[str, Path]) -> list[str]:
    """The smoke scale's additions for one composed cell: a few steps, fake data in the real layout."""
    ov = [f"trainer.{k}={v}" for k, v in SMOKE_TRAINER.items()]
    shrink = SMOKE_MODEL.get(cfg.model.get("name"), {})
    ov += [f"model.{k}={v}" for k, v in shrink.items() if k in cfg.model and int(cfg.model[k]) > v]
    size = SMOKE_IMAGE_SIZE.get(cfg.model.get("name"))
    shape = list(cfg.dataset.get("input_shape") or [])
    if size and "image_size" in cfg.dataset and len(shape) == 3 and int(shape[1]) > size:
        ov += [f"dataset.image_size={size}", f"dataset.input_shape=[{shape[0]},{size},{size}]"]
    blocks = SMOKE_STAGE_BLOCKS.get(cfg.model.get("name"))
    if blocks and "stage_blocks" in cfg.model and cfg.model.stage_blocks is None and not cfg.model.get("pretrained_path"):
        ov.append(f"model.stage_blocks=[{','.join(map(str, blocks))}]")
    if cfg.model.get("name") == "preresnet" and int(cfg.model.depth) >= 44:
        if cfg.model.get("block") == "auto":
            ov.append("model.block=bottleneck")  # what "auto" picks at the real depth
        if cfg.model.get("depth_rule") == "swag_dropout":  # n = (depth - 2) // 6 whatever the block
            ov[ov.index("model.depth=11")] = "model.depth=8"
    # only lower a count (MAP insists on one sample; a method predicting with the mean keeps 0/1)
    ov += [f"method.{k}={v}" for k, v in SMOKE_METHOD.items() if k in cfg.method and not (
        isinstance(cfg.method[k], (int, float)) and k in SMOKE_COUNTS and cfg.method[k] <= v)]
    # m-sharpness splits need a batch divisible by m: two chunks of one image
    ov += [f"{g}.m={min(int(cfg[g].m), 2)}" for g in ("method", "flatness") if cfg[g].get("m") is not None]
    if "warmup_epochs" in (cfg.get("scheduler") or {}):
        ov.append("scheduler.warmup_epochs=0")
    name = cfg.dataset.name
    if name in fake_roots:
        ov.append(f"dataset.root={fake_roots[name]}")
        if name == "imagenet":  # the fake ImageNet tree has a few classes; the head follows dataset.num_classes
            from flatbnn.data.fake import IN_CLASSES
            ov.append(f"dataset.num_classes={IN_CLASSES}")
        if cfg.dataset.get("shift_root"):
            ov.append(f"dataset.shift_root={fake_roots['cifar10_c']}")
        for ood in cfg.dataset.get("ood") or []:
            if ood in fake_roots and "ood_roots" in cfg.dataset:
                ov.append(f"dataset.ood_roots.{ood}={fake_roots[ood]}")
        ov += [f"dataset.{k}={v}" for k, v in SMOKE_SUBSETS.items() if k in cfg.dataset]
        if cfg.dataset.get("val_split"):
            ov.append("dataset.val_split=1")  # a held-out set of the 2 smoke images
    return ov


def write_cells(row: Row, cells: list[Cell], scale: str, out: Path, extra: list[str],
                fake_roots: dict[str, Path] | None = None) -> tuple[Path, list[tuple[Cell, int]]]:
    """Write the generated cell configs under ``out/.hydra_cells/cell/``; returns (search dir, jobs to run)."""
    search = out / ".hydra_cells"
    (search / "cell").mkdir(parents=True, exist_ok=True)
    jobs = []
    for cell in cells:
        overrides = list(cell.overrides)
        if scale == "smoke":
            overrides += smoke_overrides(compose_cell(overrides + list(extra)), fake_roots or {})
        else:
            overrides = run_overrides(cell, scale, extra)
        for seed in cell.seeds:
            init = [f"trainer.init_from={run_dir(out, cell.init_from, seed).resolve()}"] if cell.init_from else []
            cfg = overrides_to_config(overrides + init + [f"seed={seed}"])
            cfg["reproduce"] = {"row": row.row, "cell": cell.id, "scale": scale}
            _write_cell_config(search, cell_config_name(cell.id, seed), cfg,
                               f"{row.row} / {cell.id} / seed {seed} ({scale})")
            jobs.append((cell, seed))
    return search, jobs


def _write_cell_config(search: Path, name: str, cfg: dict, what: str) -> None:
    """``<search>/cell/<name>.yaml``: a generated ``# @package _global_`` config, selected by ``+cell=<name>``.
    Written atomically and only when its content changes: a sweep of the same row composing its cells at this
    moment (a second launcher, a requeued job) must never read a half-written or empty file."""
    path = search / "cell" / f"{name}.yaml"
    text = (f"# @package _global_\n# generated by flatbnn.reproduce.launch for {what}; do not edit\n"
            + yaml.safe_dump(cfg, sort_keys=False))
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    write_text(path, text)


def check_cell_choice(cfg, choice: str | None) -> None:
    """A job composed with ``+cell=<choice>`` must carry that cell's own keys (``reproduce.cell`` and the seed
    its name says): an empty or foreign cell file would otherwise train the default config and file it under
    the cell's name."""
    if choice in (None, ""):
        return
    cell = cfg.get("reproduce", {}).get("cell") if hasattr(cfg, "get") else None
    if cell is None or cell_config_name(str(cell), cfg.get("seed")) != str(choice):
        raise SpecError(f"+cell={choice}: the composed config is not that cell's (reproduce.cell={cell}, "
                        f"seed={cfg.get('seed')}): its generated file was empty or rewritten while this job "
                        f"composed it; rerun the row (the file is complete now)")


def job_state(out: Path, cell_id: str, seed: int) -> tuple[str, str]:
    """(state, detail) of one (cell, seed): done | failed | running-or-interrupted | pending. A done job that
    is a link to another row's run (see ``reusable_runs``) says so in its detail."""
    d = run_dir(out, cell_id, seed)
    if (d / "results.json").exists():
        return "done", (f"reused: {os.readlink(d)}" if d.is_symlink() else "")
    if (d / "failed.txt").exists():
        return "failed", (d / "failed.txt").read_text().strip().splitlines()[-1][:300]
    if (d / "checkpoints" / "last.pt").exists():
        return "interrupted", "has a checkpoint; rerun to resume"
    return "pending", ""


def runs_root_of(out: Path, row: str, scale: str) -> Path | None:
    """The runs root ``out`` lies in when it is ``<root>/<row>/<scale>`` (``all --out ROOT``, a campaign's --out),
    where the other rows' runs of that scale sit beside it; None for any other ``out``."""
    out = Path(out)
    return out.parent.parent if (out.name, out.parent.name) == (scale, row) else None


def _finished_runs_elsewhere(out: Path, scale: str, row_name: str | None = None) -> dict[tuple, Path]:
    """{(seed, training-config key): run dir} of every finished, non-linked run of the OTHER training rows at
    ``scale`` (an eval row's dirs hold re-evaluations, not training runs): their live run dirs under OUTPUT_ROOT
    and under ``out``'s runs root (``out`` = ``<root>/<row>/<scale>``, e.g. campaign --out) first, then their
    committed records (archive.py) -- a fresh clone has no outputs/, but the records say which runs exist and hold
    all a comparison reads. A record that was itself a link is skipped (its source is indexed)."""
    from flatbnn.reproduce import archive
    from flatbnn.reproduce.aggregate import _canon, config_key
    from flatbnn.reproduce.spec import list_rows, load_row

    this_row = row_name or Path(out).resolve().parent.name  # its own records: the launcher retrains, see archive.py
    train_rows = {name for name in list_rows() if load_row(name).kind == "train"}
    index = {}

    def add(cfg_file: Path) -> None:
        run = cfg_file.parent
        if run.is_symlink() or not (run / "results.json").exists():
            return
        rec = run / "record.json"
        if rec.is_file() and load_json(rec).get("reused_from"):
            return
        cfg = load_yaml(cfg_file) or {}
        index.setdefault((_canon(cfg.get("seed")), _canon(config_key(cfg))), run)

    roots = [Path(OUTPUT_ROOT)]
    own_root = runs_root_of(Path(out).resolve(), this_row, scale)
    if own_root is not None and own_root != roots[0].resolve():
        roots.append(own_root)  # a runs root of its own (campaign --out): its other rows' runs too
    for d in sorted(d for root in roots for d in root.glob(f"*/{scale}")):
        if d.resolve() == Path(out).resolve() or d.parent.name not in train_rows:
            continue
        for cfg_file in sorted(d.rglob("config_resolved.yaml")):
            add(cfg_file)
    if scale in archive.SCALES:
        for d in sorted(Path(archive.ARCHIVE_ROOT).glob(f"*/{scale}/runs")):
            if d.parent.parent.name == this_row or d.parent.parent.name not in train_rows:
                continue
            for cfg_file in sorted(d.rglob("config_resolved.yaml")):
                add(cfg_file)
    return index


def reusable_runs(todo: list[tuple[Cell, int]], scale: str, out: Path,
                  extra: list[str], row_name: str | None = None) -> dict[tuple[str, int], Path]:
    """The jobs of ``todo`` that another row already ran at this scale: same seed and the same composed training
    config (aggregate.config_key: every key except run location, display, data paths and the reproduce labels).
    E.g. bSAM T3's bsam cell and T5's M = 8 cells are T1's; VSAM T4's sgd/sam/vsam/rsam are T3's. Such a job is
    linked, not retrained (~GPU-days at paper scale). Never at smoke scale (its point is to run every cell's config),
    and never over a run dir that exists (a partial run resumes instead)."""
    todo = [(c, s) for c, s in todo if not run_dir(out, c.id, s).exists() and not run_dir(out, c.id, s).is_symlink()
            and not c.init_from]  # a fine-tune starts from THIS row's run: never another row's (its source differs)
    if scale == "smoke" or not todo:
        return {}
    index = _finished_runs_elsewhere(out, scale, row_name)
    if not index:
        return {}
    found = {}
    composed = {}
    for cell, seed in todo:
        if cell.id not in composed:
            composed[cell.id] = compose_cell(run_overrides(cell, scale, extra) + list(extra))
        key = training_key(composed[cell.id], seed)
        if key in index:
            found[(cell.id, seed)] = index[key]
    return found


def _config_key_at_seed(cfg, seed: int) -> dict[str, str]:
    """aggregate.config_key of a composed cell config run with ``seed`` (the seed and what derives from it drop out)."""
    from omegaconf import OmegaConf

    from flatbnn.reproduce.aggregate import config_key

    cfg = cfg.copy()
    OmegaConf.update(cfg, "seed", seed, force_add=True)
    return config_key(OmegaConf.to_container(cfg, resolve=True))


@functools.lru_cache(maxsize=512)
def _spec_config_key(overrides: tuple[str, ...], seed: int) -> dict[str, str]:
    return _config_key_at_seed(compose_cell(list(overrides)), seed)


def stale_run(cell: Cell, seed: int, run: Path, scale: str | None = None) -> str | None:
    """How a finished run's training config differs from the one the spec composes NOW for (cell, seed) plus the
    run's own command-line extras (data paths, device, ...), e.g. ``model.depth: 32 -> 20`` after a spec changed
    the cell's network; None when they agree or the run saved no config. A key only one side has (a config
    default added or dropped since) does not count; keys that never change a run (their roles in flatbnn/keyroles.py:
    paths, progress bars, device, labels) neither. Such a run -- or its committed record -- must not stand in for the
    cell: the comparison lists it as stale and the launcher says how to rerun it."""
    from flatbnn.reproduce.aggregate import config_key

    cfg_file, res = Path(run) / "config_resolved.yaml", Path(run) / "results.json"
    if not cfg_file.is_file() or not res.is_file():
        return None
    meta = load_json(res).get("meta") or {}
    extra = tuple(o for o in meta.get("overrides") or [] if not o.startswith("+cell="))
    ran_cfg = load_yaml(cfg_file) or {}
    scale = scale or (ran_cfg.get("reproduce") or {}).get("scale")
    try:
        want = _spec_config_key(tuple(run_overrides(cell, scale, extra)) + extra, seed)
    except Exception as e:  # noqa: BLE001 -- any Hydra composition error says the same: not the spec's config
        return f"its overrides no longer compose with the spec's: {' '.join(str(e).split())[:200]}"
    ran = config_key(ran_cfg, seed)
    diff = sorted(k for k in ran.keys() & want.keys() if ran[k] != want[k]
                  and not (cell.init_from and k == "trainer.init_from"))  # where its declared source lies
    if not diff:
        return None
    return ", ".join(f"{k}: {ran[k]} -> {want[k]}" for k in diff[:3]) + (f" (+{len(diff) - 3} more)" if len(diff) > 3
                                                                        else "")


def stale_detail(row: Row, scale: str, cell_id: str, seed: int, why: str) -> str:
    return (f"trained with another config than the spec's ({why}); rerun: scripts/reproduce.py run {row.row} "
            f"--scale {scale} --cells '{cell_id}' --seeds {seed} --force")


def checks_staleness(row: Row, scale: str) -> bool:
    """Stale runs are looked for in trained rows at cpu / paper scale (a smoke run is always fresh, and adds the
    smoke scale's own overrides; an eval row's results are re-evaluations)."""
    return row.kind == "train" and scale in ("cpu", "paper")


def training_key(cfg, seed: int) -> tuple[str, str]:
    """(seed, config key) of a composed cell config: equal keys = the same training run."""
    from flatbnn.reproduce.aggregate import _canon

    return _canon(seed), _canon(_config_key_at_seed(cfg, seed))


def link_reused(out: Path, cell_id: str, seed: int, source: Path) -> Path:
    """``<out>/<cell>/seed<k>`` -> a relative link to ``source`` (the other row's finished run)."""
    dest = run_dir(out, cell_id, seed)
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(source.resolve(), dest.parent.resolve()), dest, target_is_directory=True)
    return dest


def run_sweep(cmd: list[str]) -> int:
    """Run a sweep (``train.py --multirun``) and wait for it. A stop signal to this process (``timeout``,
    ``kill``, CI cancellation, SLURM) is handed on to the sweep, whose running job checkpoints and exits 75;
    this process waits for it -- never leaves it running as an orphan -- and returns the sweep's exit code.
    Ctrl-C reaches the sweep by itself (the terminal signals the whole foreground process group): not
    forwarded, or the sweep would take it for a second Ctrl-C and stop without its checkpoint.
    A sweep stopped so that did not finish returns 75 (Ctrl-C: 130) whatever its own code -- it may have been
    between jobs, or importing, when the signal came -- so the caller never takes a stop for a failure (nor
    builds a comparison from the runs finished so far)."""
    import signal
    proc = subprocess.Popen(cmd, cwd=REPO)
    forwarded = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
    previous, stopped = {}, []

    def forward(signum, frame):
        stopped.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    def interrupted(signum, frame):  # the sweep got it from the terminal too
        stopped.append(signum)

    try:
        for sig in forwarded + (signal.SIGINT,):
            previous[sig] = signal.signal(sig, forward if sig in forwarded else interrupted)
    except ValueError:  # not the main thread: the caller's signals stay its own
        pass
    try:
        rc = proc.wait()
        if stopped and rc != 0:
            return 130 if signal.SIGINT in stopped else 75
        return rc
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def multirun_command(search: Path, names: list[str], out: Path, extra: list[str],
                     launcher: str | None = None, entry: tuple[str, ...] | None = None) -> list[str]:
    """``<entry> --multirun +cell=<names>`` into ``<out>/<cell>/seed<k>``; ``entry``: train.py's ``-m flatbnn.train``, or an eval row's
    ``-m flatbnn.reproduce.eval_job``."""
    cmd = [sys.executable, *(entry or ("-m", "flatbnn.train")), "--multirun",
           f"hydra.searchpath=[file://{search.resolve()}]",
           "+cell=" + ",".join(names),
           f"hydra.sweep.dir={out}",
           "hydra.sweep.subdir=${reproduce.cell}/seed${seed}"]
    if launcher:
        cmd.append(f"hydra/launcher={launcher}")
    return cmd + list(extra)


def _fake_roots(base: Path) -> dict[str, Path]:
    """The fake data sets of the smoke scale under ``base`` (written once)."""
    from flatbnn.data.fake import write_all

    if (base / "roots.json").exists():
        return {k: Path(v) for k, v in json.loads((base / "roots.json").read_text()).items()}
    roots = write_all(base)
    (base / "roots.json").write_text(json.dumps({k: str(v) for k, v in roots.items()}))
    return roots


def select_cells(cells: list[Cell], cells_glob: str | None, seeds: list[int] | None) -> list[Cell]:
    """The cells matching ``cells_glob`` with only the given ``seeds`` (``--cells`` / ``--seeds``; None = all).
    A seed the scale does not list is an error, not a silent no-op."""
    import dataclasses
    import fnmatch

    cells = [c for c in cells if cells_glob is None or fnmatch.fnmatchcase(c.id, cells_glob)]
    if seeds is None:
        return cells
    known = sorted({s for c in cells for s in c.seeds})
    if any(s not in known for s in seeds):
        raise SpecError(f"--seeds {','.join(map(str, seeds))}: this scale's seeds are {known}")
    return [dataclasses.replace(c, seeds=[s for s in c.seeds if s in seeds]) for c in cells]


def recorded_jobs(row: Row, scale: str, todo: list[tuple[Cell, int]],
                  records: Path | None = None) -> dict[tuple[str, int], Path]:
    """{(cell id, seed): record dir} of the jobs of ``todo`` that a committed record of THIS row already holds
    (``records``: the comparisons' root, default results/reproduce; archive.py) and that is still the spec's run
    -- a stale record (launch.stale_run) does not count. ``run --missing`` trains only the others: a row started
    on one machine and finished on another (a fresh clone has the records, not the run dirs)."""
    from flatbnn.reproduce.archive import archived

    stale_checked = checks_staleness(row, scale)
    found = {}
    for cell, seed in todo:
        rec = archived(records, row.row, scale, cell.id, seed)
        if rec is not None and not (stale_checked and stale_run(cell, seed, rec)):
            found[(cell.id, seed)] = rec
    return found


def launch(row: Row, scale: str, *, out: Path | None = None, extra: list[str] = (), launcher: str | None = None,
           force: bool = False, dry_run: bool = False, cells_glob: str | None = None,
           fake_data: Path | None = None, seeds: list[int] | None = None, missing: bool = False,
           records: Path | None = None) -> dict:
    """Run every unfinished (cell, seed) of ``row`` at ``scale``; returns a summary dict (also written as
    ``<out>/launch.json``). ``missing``: skip the jobs a committed record under ``records`` holds, too."""
    if missing and force:
        raise SpecError("--missing and --force contradict each other: --missing skips recorded jobs, --force reruns")
    out = Path(out or OUTPUT_ROOT / row.row / scale)
    cells = select_cells(row.cells_for(scale), cells_glob, seeds)
    runnable = [c for c in cells if not c.blocked]
    blocked = {c.id: c.blocked for c in cells if c.blocked}
    check_extra(runnable, list(extra))
    fake_roots = _fake_roots(Path(fake_data or out / ".fake_data")) if scale == "smoke" and runnable else None
    search, jobs = write_cells(row, runnable, scale, out, list(extra), fake_roots)
    # seed-major order: a row cut short still has every cell at its first seeds (the direction checks need pairs)
    jobs.sort(key=lambda cs: (cs[0].seeds.index(cs[1]), [c.id for c in runnable].index(cs[0].id)))
    todo = [(c, s) for c, s in jobs if force or job_state(out, c.id, s)[0] != "done"]
    on_record = recorded_jobs(row, scale, todo, records) if missing else {}
    todo = [(c, s) for c, s in todo if (c.id, s) not in on_record]
    reuse = {} if force else reusable_runs(todo, scale, out, list(extra), row.row)
    for (cid, seed), src in reuse.items():
        print(f"  {cid}/seed{seed}: reusing {src} (same seed and training config)", file=sys.stderr)
        if not dry_run:
            link_reused(out, cid, seed, src)
    todo = [(c, s) for c, s in todo if (c.id, s) not in reuse]
    held = {} if dry_run else _held_elsewhere(out, todo)  # another launcher or campaign trains them now
    for (cid, seed), who in held.items():
        print(f"  {cid}/seed{seed}: left to {who}, which trains it now", file=sys.stderr)
    todo = [(c, s) for c, s in todo if (c.id, s) not in held]
    for c, s in todo:  # a failure marker from an earlier attempt must not outlive a new one
        if force and run_dir(out, c.id, s).is_symlink():  # a reused run: rerun into our own dir, not the source's
            run_dir(out, c.id, s).unlink()
        (run_dir(out, c.id, s) / "failed.txt").unlink(missing_ok=True)
    print(f"reproduce {row.row} ({scale}): {len(jobs)} jobs, "
          f"{len(jobs) - len(todo) - len(reuse) - len(on_record) - len(held)} already done, "
          + (f"{len(on_record)} on record (--missing), " if missing else "")
          + f"{len(reuse)} reused from other rows, " + (f"{len(held)} left to other processes, " if held else "")
          + f"{len(todo)} to run, {len(blocked)} cells blocked", file=sys.stderr)
    if not force and checks_staleness(row, scale):
        stale = [(f"{c.id}/seed{s}", why) for c, s in jobs if (c, s) not in todo and (c.id, s) not in reuse
                 and (why := stale_run(c, s, run_dir(out, c.id, s)))]
        if stale:  # finished, so not retrained -- but not the spec's run either
            print(f"  {len(stale)} finished runs were trained with another config than the spec's now, e.g. "
                  f"{stale[0][0]} ({stale[0][1]}): the comparison leaves them out; rerun them with --force "
                  f"(--cells / --seeds to pick them)", file=sys.stderr)
    from flatbnn.reproduce.archive import archived, archived_detail
    recorded = [f"{c.id}/seed{s}" for c, s in todo if archived(records, row.row, scale, c.id, s)]
    if recorded and missing:  # what recorded_jobs left in: stale records
        print(f"  {len(recorded)} of them have committed records trained with another config than the spec's now, "
              f"e.g. {recorded[0]}: retrained", file=sys.stderr)
    elif recorded:  # training them again is allowed (it reproduces them), but may not be what was meant
        print(f"  {len(recorded)} of them have committed records (results/reproduce/{row.row}/{scale}/runs/, read by "
              f"the comparison), e.g. {recorded[0]}: pass --missing to train only the others", file=sys.stderr)
    rc = 0
    # one multirun (a job array) per stage: the cells that fine-tune another cell's run (spec: scales.<scale>.
    # init_from) after the others
    commands, checkpointed = [], []
    for stage in ([(c, s) for c, s in todo if not c.init_from], [(c, s) for c, s in todo if c.init_from]):
        if stage and stage[0][0].init_from:
            stage, rc = _with_finished_sources(stage, out, row, scale, dry_run, rc)
        if not stage:
            continue
        cmd = multirun_command(search, [cell_config_name(c.id, s) for c, s in stage], out, list(extra), launcher)
        commands.append(cmd)
        print("  " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
        if not dry_run:
            if force:
                cmd.append("trainer.resume=false")
            started = time.time()
            rc = run_sweep(cmd) or rc
            if rc in (75, 130):  # stopped: the rerun resumes; dependents wait for their sources
                checkpointed = [f"{c.id}/seed{s}" for c, s in stage if _checkpointed_since(out, c.id, s, started)]
                break
    states = {f"{c.id}/seed{s}": (("done", archived_detail(on_record[c.id, s])) if (c.id, s) in on_record
                                  else job_state_now(out, c.id, s)) for c, s in jobs}
    if scale == "smoke" and not dry_run and not rows_reading(row.row, scale):
        drop_finished_checkpoints(out, jobs)
    summary = {"row": row.row, "scale": scale, "out": str(out), "returncode": rc,
               "command": commands[0] if commands else [], "commands": commands,
               "jobs": {k: {"state": st, "detail": d} for k, (st, d) in states.items()},
               "blocked": blocked, "checkpointed": checkpointed}  # stopped: the jobs that wrote a checkpoint then
    if not dry_run:
        write_json(out / "launch.json", summary)
    return summary


def _checkpointed_since(out: Path, cell_id: str, seed: int, t: float) -> bool:
    """Did (cell, seed) write a checkpoint since ``t`` and not finish (a stopped sweep's running job)?"""
    d = run_dir(out, cell_id, seed)
    try:
        return not (d / "results.json").exists() and (d / "checkpoints" / "last.pt").stat().st_mtime >= t
    except OSError:
        return False


def _held_elsewhere(out: Path, jobs) -> dict[tuple[str, int], str]:
    """{(cell id, seed): 'pid N on host H (since T)'} of the jobs whose run-dir lock a live process holds now."""
    from flatbnn.engine.lock import live_holder

    return {(c.id, s): who for c, s in jobs if (who := live_holder(run_dir(out, c.id, s)))}


def job_state_now(out: Path, cell_id: str, seed: int) -> tuple[str, str]:
    """``job_state``, except that an unfinished job a live process trains now (a launcher or a campaign on the same
    --out) is ``running``, ``left to pid N ...``: not failed, not interrupted, not this launcher's to finish (and a
    comparison made meanwhile says so)."""
    state = job_state(out, cell_id, seed)
    if state[0] == "done":
        return state
    who = _held_elsewhere(out, [(Cell(cell_id, [], [seed]), seed)]).get((cell_id, seed))
    return ("running", f"left to {who}, which trains it now") if who else state


def _with_finished_sources(stage: list, out: Path, row: Row, scale: str, dry_run: bool, rc: int) -> tuple[list, int]:
    """The jobs of ``stage`` whose source run (``Cell.init_from``, same seed) has finished; each other one gets a
    failed.txt naming its source (a dry run only says it), and the returned code is 1."""
    ready = []
    for c, s in stage:
        src = run_dir(out, c.init_from, s)
        if (src / "results.json").exists() or dry_run:
            ready.append((c, s))
            continue
        rc = rc or 1
        why = (f"source run {src} ({c.init_from}, which this cell fine-tunes) is not finished: run "
               f"`scripts/reproduce.py run {row.row} --scale {scale} --cells '{c.init_from}'` first")
        print(f"  {c.id}/seed{s}: {why}", file=sys.stderr)
        run_dir(out, c.id, s).mkdir(parents=True, exist_ok=True)
        (run_dir(out, c.id, s) / "failed.txt").write_text(why + "\n")
    return ready, rc


def drop_finished_checkpoints(out: Path, jobs: list) -> int:
    """Smoke scale, rows nothing else reads: delete the checkpoints of finished jobs (results.json stays; a
    smoke step of an ImageNet ResNet-152 SWAG cell writes 1.4 GB, a whole smoke pass ~16 GB). Interrupted
    jobs keep theirs to resume. Returns the bytes freed."""
    import shutil

    freed = 0
    for c, s in jobs:
        d = run_dir(out, c.id, s)
        if (d / "results.json").exists() and (d / "checkpoints").is_dir():
            freed += sum(f.stat().st_size for f in (d / "checkpoints").rglob("*") if f.is_file())
            shutil.rmtree(d / "checkpoints")
    return freed


def source_cell(row: Row, cell_id: str) -> str:
    """The trained row's cell an eval row's cell re-evaluates (``eval_from.cell`` formats over our axes)."""
    template = row.eval_from.get("cell")
    return template.format(**dict(zip(row.axes, cell_id.split("/")))) if template else cell_id


def launch_eval(row: Row, scale: str, *, out: Path | None = None, extra: list[str] = (), launcher: str | None = None,
                force: bool = False, dry_run: bool = False, cells_glob: str | None = None,
                seeds: list[int] | None = None, missing: bool = False, records: Path | None = None) -> dict:
    """An eval row: re-evaluate the finished runs of ``eval_from.row`` (same scale) with evaluate.py's routine (no
    retraining), e.g. FlatBNN Table 5 = Table 2's SWAG runs on CIFAR-10-C; results land in ``<out>/<cell>/seed<k>``.
    Like a training row, every (cell, seed) is one member of ONE Hydra multirun (``flatbnn.reproduce.eval_job``), so
    ``launcher`` (slurm, cpu_parallel, ...) sends the evaluations where the GPUs are. ``missing``: as ``launch``."""
    from flatbnn.reproduce.archive import archived_detail

    if missing and force:
        raise SpecError("--missing and --force contradict each other: --missing skips recorded jobs, --force reruns")
    out = Path(out or OUTPUT_ROOT / row.row / scale)
    src_out = Path(row.eval_from.get("out") or OUTPUT_ROOT / row.eval_from["row"] / scale)
    cells = select_cells(row.cells_for(scale), cells_glob, seeds)
    blocked = {c.id: c.blocked for c in cells if c.blocked}
    rc = 0
    hydra_extra = [o for o in extra if is_hydra_override(o)]     # the sweep's (launcher settings)
    eval_extra = [o for o in extra if not is_hydra_override(o)]  # every evaluation's (data roots, device)
    if scale == "smoke":  # the trained smoke runs saw fake CIFAR-10; evaluate them on its fake CIFAR-10-C
        roots = _fake_roots(out / ".fake_data")
        from flatbnn.data.fake import C10C_CORRUPTIONS
        eval_extra += [f"dataset.root={roots['cifar10']}", f"dataset.shift_root={roots['cifar10_c']}",
                       f"dataset.shift_corruptions=[{','.join(C10C_CORRUPTIONS)}]"]
    search = out / ".hydra_cells"
    names = []
    on_record = recorded_jobs(row, scale, [(c, s) for c in cells if not c.blocked for s in c.seeds
                                           if not (run_dir(out, c.id, s) / "results.json").exists()],
                              records) if missing else {}
    for cell in (c for c in cells if not c.blocked):
        for seed in cell.seeds:
            dest = run_dir(out, cell.id, seed)
            if not force and (dest / "results.json").exists() or (cell.id, seed) in on_record:
                continue
            src = run_dir(src_out, source_cell(row, cell.id), seed)
            if not (src / "results.json").exists():
                rc = 1
                if dry_run:  # a dry run writes nothing: say it
                    print(f"  {cell.id}/seed{seed}: source run {src} is not finished", file=sys.stderr)
                    continue
                dest.mkdir(parents=True, exist_ok=True)
                (dest / "failed.txt").write_text(f"source run {src} is not finished: run "
                                                 f"`scripts/reproduce.py run {row.eval_from['row']} --scale {scale}` first\n")
                continue
            names.append(cell_config_name(cell.id, seed))
            if dry_run:
                continue
            job = {"source": str(src.resolve()), "eval_name": row.row, "overrides": list(cell.overrides) + eval_extra,
                   "seed": seed, "reproduce": {"row": row.row, "cell": cell.id, "scale": scale}}
            _write_cell_config(search, names[-1], job, f"{row.row} / {cell.id} / seed {seed} ({scale}), one eval job")
            (dest / "failed.txt").unlink(missing_ok=True)
    cmd = multirun_command(search, names, out, hydra_extra, launcher, entry=("-m", "flatbnn.reproduce.eval_job"))
    if names:
        print("  " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
        if not dry_run:
            rc = run_sweep(cmd) or rc
    jobs = {f"{c.id}/seed{s}": dict(zip(("state", "detail"), ("done", archived_detail(on_record[c.id, s]))
                                        if (c.id, s) in on_record else job_state(out, c.id, s)))
            for c in cells if not c.blocked for s in c.seeds}
    summary = {"row": row.row, "scale": scale, "out": str(out), "returncode": rc, "command": cmd if names else [],
               "jobs": jobs, "blocked": blocked}
    if not dry_run:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "launch.json", summary)
    return summary
