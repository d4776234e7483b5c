"""Cost of the instrumentation: off (the default) must cost nothing measurable.

Off installs nothing: the engine runs DeepSpeed's own instruction map.  Timing
separate launches against each other measures launch-to-launch noise (a few %),
so this bench compares inside one 2-rank launch of tiny: blocks of steps that
alternate never-instrumented (baseline), instrumented (on), and after removing the
instrumentation again (off), and compares the median step times of each kind.

    python bench/instrument_overhead.py [--smoke]

Last line: RESULT off_overhead_pct=X on_overhead_pct=Y   (target: |X| < 1)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "--smoke" in sys.argv or os.environ.get("OVERHEAD_SMOKE") == "1"  # one step a block, one round
BLOCK, ROUNDS = (1, 1) if SMOKE else (20, 5)


def worker() -> None:
    """Runs inside each rank (launched by deepspeed)."""
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    import train
    from ds_pipe_ext.instrument.hooks import instrument_engine, remove_instrumentation

    out = Path(os.environ["OVERHEAD_OUT"])

    def ab(engine, data):
        times = {"baseline": [], "on": [], "off": []}
        for _ in range(1 if SMOKE else 3):  # warm-up
            engine.train_batch(data_iter=data)
        for _ in range(ROUNDS):
            for kind in ("baseline", "on", "off"):
                if kind == "on":
                    recorder = instrument_engine(engine, lambda rec: None)
                for _ in range(BLOCK):
                    t0 = time.perf_counter()
                    engine.train_batch(data_iter=data)
                    times[kind].append(time.perf_counter() - t0)
                if kind == "on":
                    remove_instrumentation(engine, recorder)
        if dist.get_rank() == 0:
            out.write_text(json.dumps(times))

    train.main(["--deepspeed_config", str(ROOT / "launch_scripts" / "ds_pipeline.json"), "--steps", "0"], on_engine=ab)
    from ds_pipe_ext.train.trainer import exit_process

    exit_process(0)  # no interpreter teardown under gloo (see exit_process)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="ds_pipe_ext_overhead_"))
    sys.path.insert(0, str(ROOT))
    from ds_pipe_ext.runner import launch

    proc, _ = launch(2, None, "--worker", cwd=work, timeout=900, script="bench/instrument_overhead.py",
                     env={"OVERHEAD_OUT": str(work / "times.json"), "OVERHEAD_SMOKE": "1" if SMOKE else "0"})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    times = json.loads((work / "times.json").read_text())
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    for k in ("baseline", "off", "on"):
        print(f"{k:<8} median step {med[k]:.3f} ms over {len(times[k])} steps ({ROUNDS} interleaved blocks of {BLOCK})")
    off_pct = 100 * (med["off"] - med["baseline"]) / med["baseline"]
    on_pct = 100 * (med["on"] - med["baseline"]) / med["baseline"]
    print(f"RESULT off_overhead_pct={off_pct:.2f} on_overhead_pct={on_pct:.2f}")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
