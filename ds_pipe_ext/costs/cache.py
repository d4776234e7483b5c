"""On-disk caches: profiled layer costs, keyed by everything that changes them; a measurement made once when
several processes ask for it at the same time (``measured_once``)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from filelock import FileLock

from .types import LayerCost

log = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT = "ds_pipe_ext.profile/1"


def library_versions() -> dict[str, str]:
    import torch

    versions = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    except ImportError:  # pragma: no cover - deepspeed is a hard dependency in practice
        pass
    from .._version import __version__

    versions["ds_pipe_ext"] = __version__
    return versions


def measured_once(path: Path | None, measure: Callable[[], T], *, parse: Callable[[object], T],
                  dump: Callable[[T], object]) -> T:
    """The measurement cached at PATH as JSON (``parse`` of it; a file ``parse`` rejects with ValueError,
    KeyError or TypeError is measured again), else ``measure()``, written there as ``dump`` of it.  Under
    PATH.lock: processes that ask at once (the ranks of a launch, test workers) measure it once and read it
    after, and no measurement runs beside another one that would slow it.  ``path`` None: measured, uncached."""
    if path is None:
        return measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        if path.is_file():
            try:
                return parse(json.loads(path.read_text()))
            except (ValueError, KeyError, TypeError):
                pass  # corrupt: measure again
        value = measure()
        path.write_text(json.dumps(dump(value)))
        return value


def cache_key(fields: dict) -> str:
    """Stable hash of the key fields (JSON with sorted keys)."""
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class ProfileCache:
    def __init__(self, cache_dir: str | os.PathLike):
        self.dir = Path(cache_dir)

    def path(self, key: str) -> Path:
        return self.dir / f"profile-{key}.json"

    def load(self, key: str, expected_layers: int) -> list[LayerCost] | None:
        """Cached costs, or None if absent.  A corrupt file is reported and ignored (re-profiled)."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format') if isinstance(data, dict) else None!r}, expected {FORMAT!r}")
            layers = [LayerCost.from_dict(d) for d in data["layers"]]
            if len(layers) != expected_layers:
                raise ValueError(f"it holds {len(layers)} layers, the model has {expected_layers}")
            return layers
        except (ValueError, KeyError, TypeError) as e:
            log.warning("profile cache %s is corrupt (%s); re-profiling and overwriting it", path, e)
            return None

    def save(self, key: str, key_fields: dict, costs: list[LayerCost]) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        payload = {"format": FORMAT, "key": key_fields, "layers": [c.to_dict() for c in costs]}
        tmp.write_text(json.dumps(payload, indent=1, default=str))
        tmp.replace(path)  # atomic: a reader never sees half a file
        return path
