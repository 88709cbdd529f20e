"""One job of an eval row (docs/reproduce.md): evaluate.py's routine on one finished training run, run as a member
of a Hydra multirun, so an eval row uses the same launchers as a training row -- SLURM / joblib / submitit-local
through ``reproduce.py run ROW --launcher ...`` -- instead of evaluating every run in turn on the calling machine.

    python -m flatbnn.reproduce.eval_job --multirun 'hydra.searchpath=[file://OUT/.hydra_cells]' +cell=A,B \\
        hydra.sweep.dir=OUT 'hydra.sweep.subdir=${reproduce.cell}/seed${seed}' [hydra/launcher=slurm]

(launch.launch_eval writes the cell configs and this command.) A job writes ``<source>/eval/<name>/results.json``
(evaluate.py's place, beside the trained run) and copies it into its own directory, the eval row's run dir. A failing
member writes ``failed.txt`` there with a one-line reason and the sweep goes on; the process exits 1 at the end.
"""

from __future__ import annotations

from flatbnn.cli import exit_on_stop_signals  # noqa: I001 (flatbnn.cli imports nothing heavy)
if __name__ == "__main__":  # a stop anywhere (the imports, an evaluation: nothing to checkpoint): one line, 75 / 130
    exit_on_stop_signals("(an evaluation is not checkpointed: a rerun of the row evaluates what is not done)")

import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from flatbnn import resources  # noqa: E402
from flatbnn.cli import exit_if_members_failed, install_hydra_error_handler, one_line_error  # noqa: E402

FAILED_JOBS: list[tuple[str, str]] = []


@hydra.main(version_base="1.3", config_path=str(resources.CONFIGS_DIR), config_name="eval_job")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from flatbnn.engine.checkpoint import write_bytes
    from flatbnn.evaluate import evaluate_run

    dest = Path(HydraConfig.get().runtime.output_dir)
    source, name = Path(cfg.source), str(cfg.eval_name)
    try:
        # unresolved: an override is passed on as the user wrote it (evaluate.py parses it), not interpolated here
        overrides = [str(o) for o in OmegaConf.to_container(cfg.overrides, resolve=False)]
        evaluate_run(source, overrides, name)
        write_bytes(dest / "results.json", (source / "eval" / name / "results.json").read_bytes())
    except Exception as e:  # one member fails alone: its dir says why, the sweep goes on
        line = one_line_error(e) or f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "failed.txt").write_text(traceback.format_exc() + "\n" + line + "\n")
        print(f"flatbnn: error in {dest}: {line}", file=sys.stderr)
        FAILED_JOBS.append((str(dest), line))


if __name__ == "__main__":
    install_hydra_error_handler()
    main()
    exit_if_members_failed(FAILED_JOBS, "evaluation(s)")
