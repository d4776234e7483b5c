"""Run `deepspeed --num_gpus N train.py ...` for real and collect what each rank wrote.

Used by the multi-process tests and the benches; needs a source checkout (train.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: train.py, launch_scripts/


def write_config(path: Path, base: str = "ds_pipeline.json", **overrides) -> Path:
    """A copy of launch_scripts/BASE with top-level sections replaced or merged (None removes one)."""
    cfg = json.loads((ROOT / "launch_scripts" / base).read_text())
    for key, value in overrides.items():
        if value is None:
            cfg.pop(key, None)
        elif isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))
    return path


def free_port() -> int:
    """A free TCP port on loopback: launches never share DeepSpeed's default 29500 with another job."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(num_ranks: int, config: Path | None, *args: str, out_dir: Path, cwd: Path = ROOT, timeout: int = 240,
           threads_per_rank: int = 1, script: str = "train.py", env: dict | None = None):
    """Returns (completed process, {rank: metrics}).  Ranks run with OMP_NUM_THREADS=threads_per_rank.

    ``script`` (relative to the repository) must accept ``--metrics-out`` and write NAME.rankR.json files;
    ``config`` is passed as ``--deepspeed_config`` unless None.
    """
    metrics = out_dir / "metrics.json"
    deepspeed = Path(sys.executable).with_name("deepspeed")
    config_args = ["--deepspeed_config", str(config)] if config is not None else []
    cmd = [str(deepspeed), "--num_gpus", str(num_ranks), "--master_port", str(free_port()), str(ROOT / script),
           *config_args, "--metrics-out", str(metrics), *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank), "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    ranks = {}
    for f in out_dir.glob("metrics.rank*.json"):
        d = json.loads(f.read_text())
        ranks[d["rank"]] = d
    return proc, ranks
