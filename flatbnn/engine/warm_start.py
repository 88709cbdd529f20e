"""Warm start (``trainer.init_from``): the model weights of another run or a plain state dict, loaded into
the freshly built model before the method sets up (:func:`flatbnn.engine.build.build`)."""

from __future__ import annotations

from pathlib import Path

import torch

from flatbnn.engine.checkpoint import CheckpointError


class InitWeights:
    """``trainer.init_from``: the MODEL WEIGHTS (only) of another run, to train on from them.

    Accepts a run directory (its ``checkpoints/last.pt``), a flatbnn checkpoint (the method's
    ``state_dict()["model"]``: the current weights of MAP, SGLD, the SWAG family, ... -- the optimiser,
    schedule, step and posterior state are not taken) or a plain ``torch.save(state_dict)`` file, the
    state dict at its top level or under ``trainer.init_key`` (dotted for nested keys, e.g.
    ``state_dict`` or ``method.model``). DDP / compile prefixes (``module.``, ``_orig_mod.``) are
    dropped. Loading is strict: a mismatch is one line naming the first missing / unexpected keys."""

    def __init__(self, path: Path, key: str | None, state: dict, source: str):
        self.path, self.key, self.state, self.source = path, key, state, source
        self.loaded_into: str | None = None

    @classmethod
    def load(cls, spec, key: str | None = None) -> "InitWeights":
        path = Path(str(spec)).expanduser()
        if path.is_dir():
            if not (path / "checkpoints" / "last.pt").exists():
                raise FileNotFoundError(f"trainer.init_from={spec}: a directory without checkpoints/last.pt")
            path = path / "checkpoints" / "last.pt"
        if not path.exists():
            raise FileNotFoundError(f"trainer.init_from={spec}: no such checkpoint file or run directory")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise CheckpointError(f"trainer.init_from={path} is unreadable ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
        ours = isinstance(obj, dict) and "format" in obj and isinstance(obj.get("method"), dict)
        key = None if key in (None, "") else str(key)
        if key is not None:
            state = _dig(obj, key)
            if state is None:
                top = ", ".join(map(str, list(obj)[:8])) if isinstance(obj, dict) else type(obj).__name__
                raise ValueError(f"trainer.init_key={key}: no such key in {path} (top-level keys: {top})")
        elif ours:
            state, key = obj["method"]["model"], "method.model"
        else:
            state = obj
        if not _is_state_dict(state):
            top = ", ".join(map(str, list(state)[:8])) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"trainer.init_from={path}{f' [{key}]' if key else ''} is not a state dict of "
                             f"tensors (has: {top}); name the entry holding the weights with trainer.init_key=...")
        state = dict(state)
        for prefix in ("module.", "_orig_mod."):
            if state and all(k.startswith(prefix) for k in state):
                state = {k[len(prefix):]: v for k, v in state.items()}
        source = (f"flatbnn checkpoint (epoch {obj.get('epoch')}, global step {obj.get('global_step')})"
                  if ours else "state dict")
        return cls(path, key, state, source)

    def mismatch(self, module: torch.nn.Module) -> list[str]:
        """What keeps ``module`` from loading these weights strictly (empty: it fits)."""
        target = module.state_dict()
        missing = [k for k in target if k not in self.state]
        unexpected = [k for k in self.state if k not in target]
        shapes = [f"{k} {list(self.state[k].shape)} vs model {list(target[k].shape)}" for k in target
                  if k in self.state and hasattr(target[k], "shape") and hasattr(self.state[k], "shape")
                  and tuple(self.state[k].shape) != tuple(target[k].shape)]
        out = []
        for what, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", shapes)):
            if keys:
                more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
                out.append(f"{what}: {', '.join(keys[:3])}{more}")
        return out

    def load_into(self, module: torch.nn.Module, *, try_only: bool = False,
                  also_tried: torch.nn.Module | None = None) -> bool:
        problems = self.mismatch(module)
        if problems:
            if try_only:
                return False
            if also_tried is not None:  # report against whichever form of the model it is closer to
                other = self.mismatch(also_tried)
                problems = min(problems, other, key=lambda p: sum(len(x) for x in p))
            raise ValueError(f"trainer.init_from={self.path}{f' [{self.key}]' if self.key else ''} does not fit "
                             f"the model: {'; '.join(problems)} (same model.* settings as the run it comes from?)")
        module.load_state_dict(self.state, strict=True)
        self.loaded_into = "backbone" if try_only else "prepared model"
        return True


def _dig(obj, key: str):
    """``obj[key]``, or a nested ``obj[a][b]`` for ``key = "a.b"`` (state-dict keys contain dots too)."""
    if not isinstance(obj, dict):
        return None
    if key in obj:
        return obj[key]
    for i, ch in enumerate(key):
        if ch == "." and key[:i] in obj:
            found = _dig(obj[key[:i]], key[i + 1:])
            if found is not None:
                return found
    return None


def _is_state_dict(obj) -> bool:
    return (isinstance(obj, dict) and len(obj) > 0 and all(isinstance(k, str) for k in obj)
            and any(torch.is_tensor(v) for v in obj.values()))


def init_record(tc, init: InitWeights | None, resume_ckpt: Path | None) -> dict | None:
    """results.json ``meta.init_from``: where the starting weights came from (None: a fresh init)."""
    if tc.get("init_from") in (None, ""):
        return None
    if init is None:  # resumed: the weights come from the run's own checkpoint
        return {"path": str(tc.init_from), "key": tc.get("init_key"), "resumed_from": str(resume_ckpt)}
    return {"path": str(init.path), "key": init.key, "source": init.source, "loaded_into": init.loaded_into}
