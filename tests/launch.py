"""Run `deepspeed --num_gpus N train.py ...` for real and collect what each rank wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, **overrides) -> Path:
    cfg = json.loads((ROOT / "launch_scripts" / "ds_pipeline.json").read_text())
    for key, value in overrides.items():
        if value is None:
            cfg.pop(key, None)
        elif isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))
    return path


def launch(num_ranks: int, config: Path, *args: str, out_dir: Path, cwd: Path = ROOT, timeout: int = 240):
    """Returns (completed process, {rank: metrics})."""
    metrics = out_dir / "metrics.json"
    deepspeed = Path(sys.executable).with_name("deepspeed")
    cmd = [str(deepspeed), "--num_gpus", str(num_ranks), str(ROOT / "train.py"),
           "--deepspeed_config", str(config), "--metrics-out", str(metrics), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    ranks = {}
    for f in out_dir.glob("metrics.rank*.json"):
        d = json.loads(f.read_text())
        ranks[d["rank"]] = d
    return proc, ranks
