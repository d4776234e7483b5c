"""The shapes of bench/profiled_generalization.py, fixed before its first measurement (2026-11-27 03:02 UTC) and
never used to fit anything.  Each varies what moves a split away from the project's own benches (bench-cpu,
bench-cpu-llama, bench-cpu-moe): vocabulary width and tying, blocks that are not alike, depth, a Mixture-of-Experts
block, a Llama block, the micro-batch count, and the optimizer (DeepSpeed's, named in ds.json, or the script's).

``optimizer``: "ds:Adam" / "ds:AdamW" put ``{"type": ...}`` in ds.json for DeepSpeed to build; "script" passes the
script's own ``torch.optim.AdamW`` to ``deepspeed.initialize``, as a user's script does.  ``via_train_py``: the shape
is also built once per launch through train.py's path (``ds_pipe_ext.train.build``), beside the drop-in's builds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    name: str
    model: str  # model_configs/NAME.toml
    micro_batch: int
    micro_batches: int
    optimizer: str  # "ds:Adam", "ds:AdamW" or "script"
    via_train_py: bool = False
    why: str = ""


SHAPES = [
    Shape("wide-alt", "gen-wide-alt", 2, 4, "ds:Adam", via_train_py=True,
          why="wide untied vocabulary (65,536 x 256, twice), MLPs alternating 8 h / 2 h"),
    Shape("tied-deep", "gen-tied-deep", 1, 8, "script",
          why="tied vocabulary (32,768), 16 alike blocks, 8 micro-batches"),
    Shape("llama", "gen-llama", 2, 4, "ds:AdamW",
          why="Llama blocks (GQA 6/2, SwiGLU), narrow untied vocabulary (8,192)"),
    Shape("moe", "gen-moe", 2, 4, "script",
          why="2 dense blocks then 6 MoE blocks (4 experts, top-2, dropless)"),
    Shape("long-seq", "gen-long-seq", 1, 4, "ds:Adam",
          why="sequence 1,024 at hidden 256: attention-bound blocks, small vocabulary (4,096)"),
    Shape("taper", "gen-taper", 2, 2, "ds:AdamW",
          why="GPT-2 vocabulary at hidden 320, MLPs widening 2 h -> 8 h towards the head, 2 micro-batches"),
]

# bench/profiled_generalization.py --smoke: the whole path (a script's optimizer, train.py's build) on tiny; no score
SMOKE_SHAPE = Shape("smoke", "tiny", 2, 2, "script", via_train_py=True, why="tiny: a check that the bench runs")

BY_NAME = {s.name: s for s in (*SHAPES, SMOKE_SHAPE)}

# per build: 2 steps untimed, the median of the other 3 (bench/profiled_generalization.py says why); the worker's
# defaults and the bench's
STEPS, WARMUP_STEPS = 5, 2
