"""What each config key changes, declared once: the resume check, the aggregation and evaluate.py all read it here.

Three tools ask the same question of a dotted config key (``trainer.eval_batch_size``):

* a resume (``flatbnn.engine.run_dir.config_changes``): may the rerun change it without ``trainer.resume_overrides``?
* the aggregation (``flatbnn.reproduce.aggregate``, also the reproduction runner's stale and reused runs): do two
  runs that differ in it belong to different rows, or are they seeds of one experiment?
* ``evaluate.py``: may a re-evaluation of a finished run override it?

The answers follow from the key's :class:`Role` in :data:`KEY_ROLES`. A key takes the role of its longest declared
prefix (``method.num_samples`` before ``method``); a key under no declaration -- one a user adds with ``+key=...``
-- is a :data:`TRAIN` key, the safe default (refused on resume, its own row, not evaluable). Config groups whose
keys all shape the weights (``model``, ``optimizer``, ...) are declared once as a group; ``trainer`` and
``dataset`` mix roles, so each of their keys is declared (tests/test_keyroles.py checks that every key of the
configs is).

``method.*`` keys are the method class's: a key its class lists in ``predict_keys`` (flatbnn/methods/base.py) is a
:data:`PREDICT` key of that method, every other one a :data:`TRAIN` key. One key path may mean different things
to two methods, so ``role_of`` takes the run's method (``cfg.method._target_``): ``evaluate.py`` always passes it.
Without one, a ``method.*`` key is :data:`PREDICT` only where every shipped method class that takes it says so
(tests/test_keyroles.py fails on a key two classes give different roles).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    """What changing a key changes, as the three tools need it."""

    name: str
    resume_may_change: bool  # a resume may change it unasked (it changes nothing the checkpoint holds)
    splits_rows: bool        # runs that differ in it are different experiments (never averaged together)
    evaluable: bool          # evaluate.py may change it when it re-evaluates a finished run
    meaning: str             # one line, also in evaluate.py's refusal


TRAIN = Role("train", resume_may_change=False, splits_rows=True, evaluable=False,
             meaning="a change would alter the trained weights")
PREDICT = Role("predict", resume_may_change=False, splits_rows=True, evaluable=True,
               meaning="a change alters the evaluated numbers, not the trained weights")
RUNTIME = Role("runtime", resume_may_change=True, splits_rows=False, evaluable=True,
               meaning="a change alters neither the weights nor the numbers (up to float rounding): speed, "
                       "memory, where data are read, what is written or shown")
BOOKKEEPING = Role("bookkeeping", resume_may_change=True, splits_rows=False, evaluable=False,
                   meaning="how a run is resumed, logged and displayed; evaluate.py reads none of it")
ORIGIN = Role("origin", resume_may_change=True, splits_rows=True, evaluable=False,
              meaning="where the trained weights started (a warm start) or what a resume changed in them: a "
                      "resume keeps its checkpoint's, but runs differing in it are different experiments")
IDENTITY = Role("identity", resume_may_change=False, splits_rows=False, evaluable=False,
                meaning="which replicate (seed) or reproduction cell a run is: a change would alter the trained "
                        "weights or refile the run, yet runs differing only in it are the seeds of one row")

DEFAULT_ROLE = TRAIN

KEY_ROLES: dict[str, Role] = {
    # ---- top level
    "seed": IDENTITY,                        # the replicate index (aggregate also drops the keys copied from it)
    "reproduce": IDENTITY,                   # the reproduction runner's row / cell / scale labels
    "print_config": BOOKKEEPING,             # display only
    "logger": BOOKKEEPING,                   # console / wandb: where numbers are shown, not what they are
    "hydra": BOOKKEEPING,                    # run location, job names, sweep bookkeeping
    "metrics": PREDICT,                      # conventions of the one evaluation routine (ECE bins, AUROC, ...)
    "paper": TRAIN,                          # whose protocol: a protocol run is an experiment of its own
    # ---- groups whose keys shape the weights; the exceptions below them
    "model": TRAIN,
    "model.min_input_size": RUNTIME,         # a check of the data a network is meant for, not what it computes
    "optimizer": TRAIN,
    "scheduler": TRAIN,
    "flatness": TRAIN,
    "method": TRAIN,                         # below it: each method class's predict_keys (method_role)
    # ---- trainer: every key
    "trainer.epochs": TRAIN,
    "trainer.batch_size": TRAIN,
    "trainer.precision": TRAIN,
    "trainer.channels_last": TRAIN,          # another memory format, other kernels
    "trainer.compile": TRAIN,                # compiled kernels round differently
    "trainer.cuda_graph": TRAIN,
    "trainer.sync_bn": TRAIN,
    "trainer.deterministic": TRAIN,
    "trainer.grad_clip": TRAIN,
    "trainer.label_smoothing": TRAIN,
    "trainer.limit_train_batches": TRAIN,
    "trainer.eval_batch_size": RUNTIME,      # batching of evaluation (BN refresh reads the train loader)
    "trainer.eval_sample_chunk": RUNTIME,    # the same weight samples, evaluated several at a time
    "trainer.num_workers": RUNTIME,
    "trainer.device": RUNTIME,               # "auto" / "cuda" / "cpu": the hardware used is in results.json meta
    "trainer.progress": RUNTIME,
    "trainer.reliability_diagram": RUNTIME,  # a PNG beside results.json
    "trainer.eval_every": RUNTIME,           # how often metrics.jsonl gets a val line; results.json is the same
    "trainer.checkpoint_every": RUNTIME,
    "trainer.compile_cache": RUNTIME,        # where compiled kernels are kept between runs
    "trainer.dist_timeout_s": RUNTIME,       # how long a collective may stall before the run stops
    "trainer.resume": BOOKKEEPING,
    "trainer.resume_overrides": ORIGIN,      # a resumed run whose values changed is not a fresh run's seed
    "trainer.resume_data_changed": BOOKKEEPING,  # whether a resume may go on with other data (then in meta.resume_changes)
    "trainer.init_from": ORIGIN,             # weights to start from (a resumed run ignores it)
    "trainer.init_key": ORIGIN,
    "trainer.weights_required": RUNTIME,     # a check that the weights are given, not what they are
    # ---- dataset: every key
    "dataset._target_": TRAIN,
    "dataset.name": TRAIN,
    "dataset.train_subset": TRAIN,
    "dataset.train_split": TRAIN,
    "dataset.val_split": TRAIN,
    "dataset.augment": TRAIN,
    "dataset.normalize": TRAIN,              # MNIST / Fashion-MNIST: mean / std standardisation or [0, 1] pixels
    "dataset.seed": TRAIN,                   # augmentation stream; ${seed} by default (then aggregate drops it)
    "dataset.label_noise": TRAIN,
    "dataset.loader": TRAIN,                 # GPU augmentation: equal in distribution, not in values
    "dataset.image_size": TRAIN,
    "dataset.num_classes": TRAIN,
    "dataset.input_shape": TRAIN,
    # which test sets are evaluated: a run's numbers, not its weights
    "dataset.test_subset": PREDICT,
    "dataset.ood": PREDICT,
    "dataset.ood_subset": PREDICT,
    "dataset.corruptions": PREDICT,          # dataset=cifar10_c: its test sets (train is clean CIFAR-10)
    "dataset.severities": PREDICT,
    "dataset.shift_corruptions": PREDICT,
    "dataset.shift_severities": PREDICT,
    # where the data are read (the same files found elsewhere)
    "dataset.root": RUNTIME,
    "dataset.clean_root": RUNTIME,
    "dataset.ood_roots": RUNTIME,
    "dataset.shift_root": RUNTIME,
    "dataset.cache_dir": RUNTIME,
    "dataset.download": RUNTIME,
}


METHOD = "method."


def method_class(method):
    """The method class of ``method``: a class, or a ``_target_`` path as a run's config names it (imported by name,
    as Hydra instantiates it: this module stays below the methods)."""
    if isinstance(method, type):
        return method
    from hydra.utils import get_class

    return get_class(str(method))


def constructor_keys(cls) -> frozenset[str]:
    """The ``method.<key>`` names a method class takes: its constructor's arguments (the group's schema), with its
    bases' where it passes ``**kwargs`` on (HWA to SGVB)."""
    import inspect

    names: set[str] = set()
    for base in cls.__mro__:
        if "__init__" not in vars(base):
            continue
        params = inspect.signature(vars(base)["__init__"]).parameters.values()
        names |= {p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return frozenset(names)


@functools.cache
def shipped_method_classes() -> tuple[type, ...]:
    """Every class a shipped ``configs/method/`` option names (flatbnn/resources.py: own_targets)."""
    from flatbnn.resources import own_targets

    return tuple(dict.fromkeys(method_class(t) for t in own_targets("method").values()))


def role_collisions(classes) -> list[str]:
    """One line per ``method.<key>`` that two of ``classes`` give different roles: a prediction key of one (its
    ``predict_keys``) that another takes as a training key (a constructor argument it does not list)."""
    out = []
    for name in sorted({n for c in classes for n in c.predict_keys}):
        predict = [c.__name__ for c in classes if name in c.predict_keys]
        train = [c.__name__ for c in classes if name in constructor_keys(c) and name not in c.predict_keys]
        if train:
            out.append(f"{METHOD}{name}: a prediction key of {', '.join(predict)} but a training key of "
                       f"{', '.join(train)}")
    return out


def method_role(key: str, method=None) -> Role:
    """The role of ``method.<name>[...]``: :data:`PREDICT` if the method class lists ``<name>`` in its
    ``predict_keys``, else :data:`TRAIN`. Without a method: :data:`PREDICT` only if every shipped method class
    taking ``<name>`` lists it (a disputed key is a training key, the safe side)."""
    name = key[len(METHOD):].split(".")[0]
    if method is not None:
        return PREDICT if name in method_class(method).predict_keys else TRAIN
    takers = [c for c in shipped_method_classes() if name in constructor_keys(c) or name in c.predict_keys]
    return PREDICT if takers and all(name in c.predict_keys for c in takers) else TRAIN


def declaration(key: str) -> str | None:
    """The entry of :data:`KEY_ROLES` that decides ``key``: its longest declared prefix (None: the default)."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in KEY_ROLES:
            return prefix
    return None


def role_of(key: str, method=None) -> Role:
    """The role of a dotted config key (``trainer.eval_batch_size`` -> :data:`RUNTIME`); a ``method.*`` key's is
    its method class's (``method``: the run's class or ``_target_``; see :func:`method_role`)."""
    if key.startswith(METHOD):
        return method_role(key, method)
    entry = declaration(key)
    return KEY_ROLES[entry] if entry is not None else DEFAULT_ROLE


def _answer(key: str, attribute: str, method=None) -> bool:
    # a method key is PREDICT or TRAIN: where the two agree the classes need not be imported (the aggregation and
    # the resume check stay free of torch)
    if key.startswith(METHOD) and getattr(PREDICT, attribute) == getattr(TRAIN, attribute):
        return getattr(TRAIN, attribute)
    return getattr(role_of(key, method), attribute)


def resume_may_change(key: str) -> bool:
    return _answer(key, "resume_may_change")


def splits_rows(key: str) -> bool:
    return _answer(key, "splits_rows")


def evaluable(key: str, method=None) -> bool:
    return _answer(key, "evaluable", method)


def method_predict_keys(method=None) -> tuple[str, ...]:
    """``method.<key>`` for each key :func:`method_role` makes :data:`PREDICT` (of ``method``, or of every shipped
    method class where they agree)."""
    classes = (method_class(method),) if method is not None else shipped_method_classes()
    names = dict.fromkeys(n for c in classes for n in c.predict_keys)
    return tuple(METHOD + n for n in names if method_role(METHOD + n, method) is PREDICT)


def declared(attribute: str, value: bool = True, method=None) -> tuple[str, ...]:
    """The declared keys whose role has ``attribute == value``, with the method classes' prediction keys where
    :data:`PREDICT` has it (for messages and docs; ask the functions above for one key: a declared key below one of
    these may have another role). The method classes are imported only when their keys belong to the answer."""
    keys = tuple(k for k, role in KEY_ROLES.items() if getattr(role, attribute) == value)
    return keys + (method_predict_keys(method) if getattr(PREDICT, attribute) == value else ())


__all__ = ["BOOKKEEPING", "DEFAULT_ROLE", "IDENTITY", "KEY_ROLES", "ORIGIN", "PREDICT", "RUNTIME", "Role", "TRAIN",
           "constructor_keys", "declaration", "role_collisions", "declared", "evaluable", "method_class", "method_predict_keys",
           "method_role", "resume_may_change", "role_of", "shipped_method_classes", "splits_rows"]
