"""What the analytic model counts of a layer's elementwise memory traffic, against what its eager code moves.

For every distinct block of each model (fp32, b 1, s 256, one process, no launch): the bytes its ops outside the
products read and write at dispatch (``costs.probes.elementwise_traffic``: every aten op's distinct input and
output elements, views free), forward (no grad) and backward (autograd's, after a forward with grad), against the
sum of ``fwd_bytes`` / ``bwd_bytes`` of the analytic layer's "vector" ops on the cpu spec's shape.  A ratio far
above 1 is traffic the roofline does not see: on a CPU it prices every vector op's bytes at the measured copy
bandwidth, so uncounted passes read as a layer priced fast (docs/results/2026-11-29-todays-models.md).

    python bench/eager_passes.py [--models bench-cpu,bench-cpu-hybrid] [--micro-batch 1] [--seq 256]
    python bench/eager_passes.py --smoke     (the tiny models of each family at s 32: a check that it runs)

Last line: RESULT eager_passes_worst_ratio=X (counted / analytic, forward or backward, the worst layer).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ds_pipe_ext.costs.estimate import EstimateRequest, shape_for  # noqa: E402
from ds_pipe_ext.costs.layer_ops import layer_ops  # noqa: E402
from ds_pipe_ext.costs.hardware import DeviceSpec  # noqa: E402
from ds_pipe_ext.costs.probes import detach_input, elementwise_traffic, tensors_of  # noqa: E402
from ds_pipe_ext.models import family_of, load_model  # noqa: E402
from ds_pipe_ext.partition.report import render_table  # noqa: E402

MODELS = ("bench-cpu", "bench-cpu-llama", "bench-cpu-deepseek", "bench-cpu-gptoss", "bench-cpu-hybrid")
# only its name and its kernels' choices matter here (what runs on a CPU), not its rates
CPU = DeviceSpec("cpu", {"fp32": 1e11}, {"fp32": 1e10}, 2e10, 2e10, 2e10, 2.0**34, gpus_per_node=1)


def block_traffic(layer, x) -> tuple[int, int]:
    """(forward, backward) elementwise bytes of one call of ``layer`` on ``x``."""
    with torch.no_grad():
        forward = elementwise_traffic(lambda: layer(x))
    out = tensors_of(layer(detach_input(x)))
    total = sum(t.float().sum() for t in out if t.requires_grad)
    return forward, elementwise_traffic(lambda: total.backward())


def model_rows(name: str, b: int, seq: int) -> list[list]:
    cfg = replace(load_model(name), seq_len=seq)
    family = family_of(cfg)
    specs = family.layer_specs(cfg)
    ops = layer_ops(cfg, shape_for(cfg, EstimateRequest(b, seq, dtype="fp32"), CPU), device="cpu")
    tokens = torch.randint(0, cfg.vocab_size, (b, seq), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    rows, seen, x = [], set(), tokens
    for i, spec in enumerate(specs[:-1]):  # the head's loss is priced apart
        layer = spec.build() if hasattr(spec, "build") else spec
        if 0 < i and id(ops[i][2]) not in seen:  # alike blocks share one op list: one row each
            seen.add(id(ops[i][2]))
            counted = block_traffic(layer, x)
            vector = [op for op in ops[i][2] if op.kind == "vector"]
            priced = (sum(op.fwd_bytes for op in vector), sum(op.bwd_bytes for op in vector))
            rows.append([name, str(i), type(layer).__name__,
                         *(f"{v / 2**20:.1f}" for pair in zip(priced, counted) for v in pair),
                         *(f"{c / p:.2f}" if p else "-" for p, c in zip(priced, counted))])
        with torch.no_grad():
            x = layer(x)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="tiny models at s 32")
    args = ap.parse_args()
    if args.smoke:
        args.models, args.seq = "tiny,llama-tiny,moe-tiny,hybrid-tiny", 32
    rows = [row for name in args.models.split(",") for row in model_rows(name, args.micro_batch, args.seq)]
    print(f"elementwise traffic per block, MiB (fp32, b {args.micro_batch}, s {args.seq}): the analytic vector ops' "
          f"bytes against an eager run's, counted at dispatch")
    print("\n".join(render_table(["model", "layer", "block", "fwd priced", "fwd counted", "bwd priced", "bwd counted",
                                  "fwd ratio", "bwd ratio"], rows)))
    worst = max(float(r) for row in rows for r in row[-2:] if r != "-")
    print(f"RESULT eager_passes_worst_ratio={worst:.2f}")


if __name__ == "__main__":
    main()
