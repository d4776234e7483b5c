"""Loading a checkpoint runs no code: every file is unpickled with ``weights_only=True``.

DeepSpeed 0.19 reads each of its checkpoint files (module and layer states, ZeRO's and the
bf16 optimizer's partitions, MoE experts) through ``engine.checkpoint_engine.load``, and its
``TorchCheckpointEngine.load`` passes ``weights_only=False``: a crafted file runs whatever its
pickle names.  The engine is an attribute DeepSpeed reads at each call, and DeepSpeed takes no
engine from its user, so ``guard(engine)`` replaces it before ``load_checkpoint`` with one that
delegates everything but ``load``: every file DeepSpeed opens, those we did not foresee included,
is unpickled with ``weights_only=True``.  A refusal raised inside DeepSpeed's load, though, is
raised on the one rank that read the file while the others wait in its collectives; so first
``check_files`` reads the pickle stream (no tensor data) of every file the manifest lists, on
rank 0, and every rank gets its verdict before any rank loads anything.  The guard then holds
against a file swapped between the check and the load.

Beyond tensors and containers, DeepSpeed's own files hold three globals, found by
``torch.serialization.get_unsafe_globals_in_checkpoint`` over a checkpoint of every kind
``train.py`` writes (tests/test_checkpoint_kinds.py): ZeRO's files the loss scaler,
the ZeRO stage enum and the bf16/ZeRO fragment addresses.  They are allowed by name, only
while a file loads; a file that needs any other global is refused, naming it.  ``trust=True``
(``train.py --trust-checkpoint``) loads a file the user vouches for as DeepSpeed would.

DeepSpeed's universal checkpoint loader (``checkpoint.load_universal``) calls ``torch.load``
itself, outside any engine: the run config refuses it (``train/config.py``).
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

# What DeepSpeed 0.19's own files need beyond tensors (module path, then the class).
DEEPSPEED_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)
TRUST_FLAG = "--trust-checkpoint"


class UnsafeCheckpointError(ValueError):
    """A checkpoint file whose loading would unpickle something other than tensors and DeepSpeed's records."""


def allowed_globals() -> list:
    import importlib

    return [getattr(importlib.import_module(module), name) for module, name in DEEPSPEED_GLOBALS]


def _qualified(g) -> str:
    return f"{g.__module__}.{g.__qualname__}"


def _disallowed_globals(path) -> list[str]:
    """The globals a torch zip file's pickle names beyond tensors, containers and DeepSpeed's records: read from
    the pickle stream alone, no tensor data and nothing run."""
    allowed = {_qualified(g) for g in allowed_globals()}
    return [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in allowed]


def check_files(paths) -> None:
    """Refuse the first file that needs an unsafe global, before any file is loaded."""
    for path in paths:
        if not zipfile.is_zipfile(path):  # torch's legacy format: loading it with weights_only is the check
            safe_load(path, map_location="cpu")
            continue
        unsafe = _disallowed_globals(path)
        if unsafe:
            raise UnsafeCheckpointError(_refusal(path, ", ".join(unsafe)))


def _refusal(path, what: str) -> str:
    return (f"{path} needs {what} to load: a checkpoint DeepSpeed or ds_pipe_ext writes holds tensors and "
            f"{len(DEEPSPEED_GLOBALS)} DeepSpeed records only, and unpickling anything else can run code, so it "
            f"was not loaded. If you trust this file, resume with {TRUST_FLAG}")


def safe_load(path, map_location=None, *, trust: bool = False, mmap: bool = False):
    """``torch.load`` that unpickles tensors, containers and DeepSpeed's records only."""
    if trust:
        return torch.load(path, map_location=map_location, weights_only=False)
    with torch.serialization.safe_globals(allowed_globals()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:
            # torch's legacy format has no pickle stream to read apart: torch's own message says what it met
            unsafe = _disallowed_globals(path) if zipfile.is_zipfile(path) else []
            what = ", ".join(unsafe) if unsafe else str(e).splitlines()[0]
            raise UnsafeCheckpointError(_refusal(path, what)) from None


class SafeCheckpointEngine:
    """DeepSpeed's checkpoint engine with its ``load`` replaced by ``safe_load``; saving is the engine's own."""

    def __init__(self, inner, *, trust: bool = False):
        self._inner, self.trust = inner, trust

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path, map_location=None):
        return safe_load(path, map_location=map_location, trust=self.trust)


def guard(engine, *, trust: bool = False) -> None:
    """Have every file ``engine`` loads from now on go through ``safe_load``."""
    current = engine.checkpoint_engine
    if isinstance(current, SafeCheckpointEngine):
        current.trust = trust
        return
    engine.checkpoint_engine = SafeCheckpointEngine(current, trust=trust)
