"""Re-evaluate a FINISHED run with the one evaluation routine, without retraining (``evaluate.py`` in a checkout,
``flatbnn-eval`` once installed).

    python evaluate.py run=outputs/2026-01-01/12-00-00-000000 method.num_samples=8
    python evaluate.py run=RUN metrics.ece_bins=20 eval.name=ece20
    python evaluate.py run=RUN dataset.shift_root=/data/CIFAR-10-C trainer.device=cpu
    python evaluate.py run=MAP_RUN method=laplace method.hessian_structure=diag   (a Laplace on a MAP / SAM run)

Loads the run's resolved config (``RUN/.hydra/config.yaml``), applies the overrides -- evaluation-side
keys only (the predict and runtime roles declared in ``flatbnn/keyroles.py``: the predictive-only keys the run's
method class declares, such as ``method.num_samples`` / SWAG's ``method.scale``, ``metrics.*``, the test / OOD / shifted test sets, data
paths, eval batch size, device); a key that shapes the trained weights (``optimizer.lr``, ``model.*``,
``seed``, ``trainer.epochs``, ...) is refused -- rebuilds data, model and method with train.py's builder
(``flatbnn.engine.build.build``), restores the method from ``RUN/checkpoints/last.pt`` (which must be the
final one) and writes ``RUN/eval/<name>/results.json``: train.py's structure plus ``meta.evaluated_from``
(run, checkpoint, overrides). ``method=<option>`` evaluates the weights with a post-hoc method trained exactly as
the run was (``method=laplace`` on a MAP run of any optimiser and flatness: ``Method.trains_like``). ``<name>`` is
``eval.name=...``, else a short hash of the overrides (``default`` without any). The run's own results.json is never touched. With no overrides the metrics
equal the run's.
Errors are one line, exit status 2.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path

from flatbnn import keyroles
from flatbnn.cli import EXIT_CONFIG, one_line_error


def eval_keys(method=None) -> tuple[str, ...]:
    """Keys that change only how the trained weights are evaluated: the predict and runtime roles of
    flatbnn/keyroles.py, with the prediction keys of the run's ``method`` class (a ``_target_``; None: those every
    shipped method agrees on). A key below one of these counts too (``metrics.ece_bins``, ``dataset.ood_roots.svhn``)."""
    return keyroles.declared("evaluable", method=method)


class EvalError(ValueError):
    """A usage error: one line, exit status 2."""


def command() -> str:
    """How the user started this, as its messages and ``--help`` name it: ``flatbnn-eval`` (the installed entry
    point; ``flatbnn-eval.exe`` on Windows), else ``evaluate.py`` (a checkout's script, ``python -m``)."""
    return "flatbnn-eval" if Path(sys.argv[0]).name.startswith("flatbnn-eval") else "evaluate.py"


def _usage() -> str:
    return f"{'' if command() == 'flatbnn-eval' else 'python '}{command()} run=<run dir> [key=value ...]"


def is_eval_key(key: str, method=None) -> bool:
    return keyroles.evaluable(key, method)


def split_args(argv: list[str]) -> tuple[Path, str | None, list[str]]:
    run, name, rest = None, None, []
    for arg in argv:
        if arg.startswith("run="):
            run = arg[len("run="):]
        elif arg.startswith("eval.name="):
            name = arg[len("eval.name="):]
        elif arg.startswith("-"):
            raise EvalError(f"unknown option {arg}: {command()} takes run=<run dir> [key=value ...] (see --help)")
        else:
            rest.append(arg)
    if not run:
        raise EvalError(f"name the finished run to evaluate: {_usage()}")
    if name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,99}", name):
        raise EvalError(f"eval.name={name!r}: use letters, digits and . _ = + - (it names a directory under eval/)")
    return Path(run).expanduser().absolute(), name, rest


def _plain(value):
    from omegaconf import DictConfig, ListConfig, OmegaConf
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def apply_overrides(cfg, args: list[str]) -> list[str]:
    """Apply ``key=value`` overrides (Hydra's grammar) to ``cfg`` in place; returns those that change
    evaluation settings. Unknown keys and training-side changes raise :class:`EvalError`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException
    from omegaconf import DictConfig, OmegaConf

    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except HydraException as e:
        raise EvalError(" ".join(str(e).split())) from None
    applied = []
    switch = [o for o in overrides if o.key_or_group == "method"]
    if switch:  # method=<option>: a post-hoc method on the run's trained weights (method=laplace on a MAP run)
        applied.append(switch_method(cfg, switch[-1]))
        overrides = [o for o in overrides if o.key_or_group != "method"]
    # method.* keys are the run's method class's (flatbnn/keyroles.py): one key may be a prediction key of one
    # method and a training key of another (method.prior_precision)
    method = OmegaConf.select(cfg, "method._target_", default=None)
    if method is not None and any(o.key_or_group.startswith(keyroles.METHOD) for o in overrides):
        try:
            method = keyroles.method_class(method)
        except Exception as e:  # the run's class is gone (renamed, uninstalled): it could not be rebuilt either
            raise EvalError(f"method._target_={method}: the run's method class cannot be imported "
                            f"({' '.join(str(e).split())[:200]})") from None
    for o in overrides:
        key = o.key_or_group
        if o.package:
            raise EvalError(f"{o.input_line}: package overrides (@) are not evaluation settings")
        if o.is_sweep_override():
            raise EvalError(f"{o.input_line}: one value per key ({command()} is no sweep; loop in the shell)")
        if o.type == OverrideType.DEL:
            raise EvalError(f"{o.input_line}: deleting keys is not an evaluation setting")
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        exists = isinstance(parent, DictConfig) and leaf in parent
        if not exists and (o.type == OverrideType.CHANGE or not key.startswith("dataset.")):
            # adding is for data-set keys a run from an older config lacks (e.g. +dataset.shift_root=...)
            raise EvalError(f"unknown key {key}: not in the run's config ({'a new data-set key needs +' + key + '=...' if key.startswith('dataset.') else 'check the spelling'})")
        value = o.value()
        if exists:
            try:
                current = _plain(OmegaConf.select(cfg, key))
            except Exception:  # an unresolvable interpolation: treat as different
                current = object()
            if current == value:
                continue  # no change: accepted for any key (e.g. a full command line pasted back)
        if not is_eval_key(key, method):
            role = keyroles.role_of(key, method)
            whose = f" of {method.__name__}" if key.startswith(keyroles.METHOD) and isinstance(method, type) else ""
            raise EvalError(f"{key}: refusing a change ({role.name} key{whose}: {role.meaning}); {command()} "
                            f"re-evaluates a run's trained weights -- train a new run for {o.input_line}; "
                            f"evaluation-side keys (flatbnn/keyroles.py): {', '.join(eval_keys(method))}")
        OmegaConf.update(cfg, key, value, merge=True, force_add=o.type != OverrideType.CHANGE)
        applied.append(o.input_line)
    return applied


def switch_method(cfg, override) -> str:
    """``method=<option>``: evaluate the run's trained weights with another method whose training is the run's
    (its class's ``trains_like``: ``method=laplace`` on a ``method=map`` run, with any optimiser and flatness --
    SGD, Adam, SAM, FSAM). ``cfg.method`` becomes that option's config (its keys as shipped; ``method.<key>=``
    overrides after it are that class's). Anything else is refused in one line."""
    from omegaconf import OmegaConf

    from flatbnn.resources import group_options

    option = override.value()
    options = group_options("method")
    node = options.get(option) if isinstance(option, str) else None
    if not isinstance(node, dict) or not node.get("_target_"):
        raise EvalError(f"{override.input_line}: not a method option with a class of its own (configs/method/)")
    try:
        new, run = keyroles.method_class(node["_target_"]), keyroles.method_class(cfg.method._target_)
    except Exception as e:  # noqa: BLE001 -- a class that cannot be imported: one line
        raise EvalError(f"{override.input_line}: {' '.join(str(e).split())[:200]}") from None
    if new is not run and new.trains_like is not run:
        raise EvalError(f"{override.input_line}: {command()} can switch a run only to a method trained exactly as "
                        f"it was ({new.__name__} trains like {getattr(new.trains_like, '__name__', 'no other method')}"
                        f", the run is {run.__name__}); train a new run with {override.input_line}")
    if new is not run:
        cfg.method = OmegaConf.create(node)
    return override.input_line


def eval_name(applied: list[str]) -> str:
    if not applied:
        return "default"
    return hashlib.sha1("\n".join(sorted(applied)).encode()).hexdigest()[:8]


def _run_info(run: Path, cfg) -> tuple[str, list]:
    """(model name, training overrides) as train.py recorded them."""
    from omegaconf import OmegaConf

    model, overrides = None, None
    res = run / "results.json"
    if res.exists():
        try:
            meta = json.loads(res.read_text())["meta"]
            model, overrides = meta.get("model"), meta.get("overrides")
        except (OSError, ValueError, KeyError):
            pass
    if model is None and (run / ".hydra" / "hydra.yaml").exists():
        try:
            model = OmegaConf.load(run / ".hydra" / "hydra.yaml").hydra.runtime.choices.get("model")
        except Exception:
            model = None
    if overrides is None and (run / ".hydra" / "overrides.yaml").exists():
        overrides = list(OmegaConf.load(run / ".hydra" / "overrides.yaml"))
    return model or cfg.model.get("name", "unknown"), overrides or []


def _init_from(run: Path, cfg) -> dict | None:
    """The trained run's ``meta.init_from`` (its results.json, else its config)."""
    try:
        return json.loads((run / "results.json").read_text())["meta"]["init_from"]
    except (OSError, ValueError, KeyError):
        init = cfg.trainer.get("init_from")
        return None if init in (None, "") else {"path": str(init), "key": cfg.trainer.get("init_key")}


def evaluate_run(run: Path, args: list[str], name: str | None = None) -> dict | None:
    """Re-evaluate the finished run ``run`` under the overrides ``args``; returns the results (rank 0)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from flatbnn.engine import distributed as D
    from flatbnn.engine.backprop import set_global_rng_state
    from flatbnn.engine.checkpoint import load_checkpoint, write_json
    from flatbnn.engine.build import build
    from flatbnn.engine.results import final_evaluate, results_meta, save_reliability_diagram

    t0 = time.perf_counter()
    config = run / ".hydra" / "config.yaml"
    ckpt_path = run / "checkpoints" / "last.pt"
    if not config.exists():
        raise EvalError(f"run={run}: no .hydra/config.yaml (not a train.py run directory)")
    if not ckpt_path.exists():
        raise EvalError(f"run={run}: no checkpoints/last.pt (was it trained with trainer.checkpoint_every=0?)")
    cfg = OmegaConf.load(config)
    applied = apply_overrides(cfg, args)
    name = name or eval_name(applied)
    out = run / "eval" / name

    state = load_checkpoint(ckpt_path)
    total = int(cfg.trainer.epochs) * int(getattr(instantiate(cfg.method), "epoch_multiplier", 1))
    if state["epoch"] != total or state.get("step_in_epoch", 0):
        raise EvalError(f"run={run} is unfinished: its checkpoint is at epoch {state['epoch']}"
                        f"{', step ' + str(state['step_in_epoch']) if state.get('step_in_epoch') else ''} of {total}; "
                        f"finish it first (rerun its train.py command: it resumes)")

    made = [d for d in (out.parent, out) if not d.exists()]  # what this evaluation creates
    try:
        b = build(cfg, run_dir=out, training=False)
        b.method.load_state_dict(state["method"])
        # the RNG streams as they stood after training, where train.py's final evaluation began
        rng = state["rng"][0]
        set_global_rng_state(rng["global"])
        if rng.get("generator") is not None:
            try:
                b.generator.set_state(rng["generator"])
            except (RuntimeError, TypeError):  # trained on another device type: its stream cannot be carried over
                pass
        metrics, predictive = final_evaluate(b)
        results = None
        if b.info.is_main:
            model_name, train_overrides = _run_info(run, cfg)
            meta = results_meta(b, steps=state["global_step"], train_seconds=state["elapsed"],
                                wall_seconds=time.perf_counter() - t0, overrides=train_overrides,
                                model_name=model_name, run_dir=run, world_size=state.get("world_size", 1))
            meta["init_from"] = _init_from(run, cfg)
            meta["evaluated_from"] = {"run_dir": str(run), "checkpoint": str(ckpt_path), "epoch": state["epoch"],
                                      "global_step": state["global_step"], "name": name, "overrides": applied,
                                      "out_dir": str(out)}
            results = {"metrics": metrics, "meta": meta}
            write_json(out / "results.json", results)
            if cfg.trainer.get("reliability_diagram", False):
                save_reliability_diagram(predictive["test"].exp(), b.test_targets, out / "reliability.png", b.eval_cfg)
            shown = {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float) and k != "eval_seconds"}
            predictive = b.method.closed_form or f"num_samples={metrics['num_samples']}"  # e.g. Laplace's probit
            print(f"{out / 'results.json'}: {predictive} {shown}")
        D.barrier(b.info)
        D.cleanup(b.info)
        return results
    except BaseException:  # stopped (or failed) before its results.json: no empty eval dir stays behind
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass
        raise


def main(argv: list[str] | None = None) -> int:
    from flatbnn.cli import exit_on_stop_signals

    # a stop signal (Ctrl-C, a job's time limit) is one line and 75 / 130; the write of results.json removes its temp
    # file on the way out (flatbnn/atomic_io.py) and evaluate_run an eval dir it made, so a rerun starts clean
    import signal
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
                                                        signal.SIGINT)}
    exit_on_stop_signals("while evaluating: nothing of this evaluation was kept; rerun the same command")
    try:
        return _main(argv)
    finally:  # called from Python (a test, a notebook): its own handlers again
        for sig, old in previous.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):  # not the main thread / a handler not set from Python
                pass


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        # the examples as this command is called (python evaluate.py / flatbnn-eval)
        print(__doc__.replace("python evaluate.py run=", _usage().split(" run=")[0] + " run="))
        return 0
    try:
        run, name, rest = split_args(argv)
        evaluate_run(run, rest, name)
    except Exception as e:  # known, actionable errors become one line; anything else keeps its traceback
        msg = one_line_error(e)
        if msg is None:
            raise
        print(f"flatbnn: error: {msg}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
