"""Cost of the instrumentation: off (the default) must cost nothing measurable.

Off installs nothing: the engine runs DeepSpeed's own instruction map.  This bench
times tiny on 2 ranks with no "instrument" key, with "instrument": {"enabled": false},
and with instrumentation on, alternating runs, and compares median step times.

    python bench/instrument_overhead.py

Last line: RESULT off_overhead_pct=X on_overhead_pct=Y   (target: |X| < 1)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.runner import launch, write_config  # noqa: E402

STEPS, ROUNDS = 60, 3


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="ds_pipe_ext_overhead_"))
    base = write_config(work / "base.json")
    off = write_config(work / "off.json", pipeline={"instrument": {"enabled": False}})
    results: dict[str, list[float]] = {"baseline": [], "off": [], "on": []}
    for r in range(ROUNDS):
        for name, cfg, extra in (("baseline", base, []), ("off", off, []),
                                 ("on", base, ["--instrument", str(work / f"run{r}")])):
            out = work / f"{name}{r}"
            out.mkdir()
            proc, ranks = launch(2, cfg, "--steps", str(STEPS), *extra, out_dir=out, cwd=work)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            results[name].append(1e3 * ranks[0]["step_s_median"])
            print(f"round {r} {name:<8} median step {results[name][-1]:.3f} ms", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    off_pct = 100 * (med["off"] - med["baseline"]) / med["baseline"]
    on_pct = 100 * (med["on"] - med["baseline"]) / med["baseline"]
    print(f"median of {ROUNDS} runs x {STEPS} steps: baseline {med['baseline']:.3f} ms, off {med['off']:.3f} ms, "
          f"on {med['on']:.3f} ms")
    print(f"RESULT off_overhead_pct={off_pct:.2f} on_overhead_pct={on_pct:.2f}")


if __name__ == "__main__":
    main()
