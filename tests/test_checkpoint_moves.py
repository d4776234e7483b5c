"""Checkpoints that run no code, and that resume on another data-parallel size or pipeline split.

Three launches share every layout kind (tests/checkpoint_moves_worker.py): 4 ranks save each; 2 ranks (the node
that is left) resume each and compare every parameter, fp32 master and Adam moment with what was saved, to the
element, then save again; 4 ranks resume those, and are refused copies with a crafted file of each kind.
"""

import json
import shutil

import pytest
import torch

from ds_pipe_ext.runner import launch, write_config
from ds_pipe_ext.train.safe_load import DEEPSPEED_GLOBALS

pytestmark = pytest.mark.multiprocess

TRAIN = {"model": "tiny", "steps": 2, "seed": 1234}
DP = dict(base="ds_zero3.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, train=TRAIN)
PIPE = dict(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, train=TRAIN)
# name: (ds.json fields, the split saved on 4 ranks, the split resumed on 2)
KINDS = {
    "zero1": ({**DP, "zero_optimization": {"stage": 1}}, None, None),
    "zero2": ({**DP, "zero_optimization": {"stage": 2}}, None, None),
    "zero3": ({**DP, "zero_optimization": {"stage": 3}}, None, None),
    "fp16-zero1": ({**DP, "zero_optimization": {"stage": 1}, "fp16": {"enabled": True, "initial_scale_power": 8,
                                                                      "loss_scale_window": 1}}, None, None),
    "bf16-zero0": ({**DP, "zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}, None, None),
    "bf16-pipeline": ({**PIPE, "bf16": {"enabled": True}}, "parts:0,3,6", "parts:0,2,6"),
    "zero1-pipeline": ({**PIPE, "zero_optimization": {"stage": 1}}, "parts:0,3,6", "parts:0,4,6"),
    "moe-pipeline": ({**PIPE, "train": {**TRAIN, "model": "moe-tiny"}}, "parts:0,3,6", "parts:0,2,6"),
    "moe-ep2-zero2": ({**DP, "zero_optimization": {"stage": 2}, "moe": {"ep_size": 2},
                       "train": {**TRAIN, "model": "moe-tiny"}}, None, None),
}
WRAPPERS = {"zero1": "DeepSpeedZeroOptimizer", "zero3": "DeepSpeedZeroOptimizer_Stage3",
            "bf16-zero0": "FP16_UnfusedOptimizer", "bf16-pipeline": "BF16_Optimizer", "moe-pipeline": "AdamW"}


def configs(tmp_path, split: int) -> dict:
    """{kind: its ds.json}, the pipelines' split the saved one (0) or the one the 2 ranks resume with (1)."""
    out = {}
    for name, (fields, *splits) in KINDS.items():
        out[name] = write_config(tmp_path / f"{name}-{split}.json", **fields, pipeline=None if splits[0] is None
                                 else {"stages": 2, "partition_method": splits[split]})
    return out


def run_launch(tmp_path, ranks: int, cases: list[tuple[str, str, object]], root) -> tuple[dict, str]:
    """One launch running each (phase, checkpoint name, ds.json) in turn; rank 0's results and the output."""
    out = tmp_path / f"launch-{len(list(tmp_path.glob('launch-*')))}"
    out.mkdir()
    args = [a for phase, name, ds in cases for a in ("--case", f"{phase}:{name}={ds}")]
    proc, _ = launch(ranks, None, "--root", str(root), *args, out_dir=out, cwd=tmp_path,
                     script="tests/checkpoint_moves_worker.py", timeout=400)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads((out / "metrics.json").read_text()), proc.stdout


class Opens:
    """A pickle whose loading would create MARKER: unpickling it calls open (io.open)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def craft(ckpt, name: str, marker) -> None:
    """Replace ckpt/NAME with the crafted pickle, the manifest updated to its size (a careful attacker)."""
    torch.save({"module": Opens(marker)}, ckpt / name)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = (ckpt / name).stat().st_size
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


# a crafted file as each kind of checkpoint file, in a copy of the checkpoint of the kind that writes it
CRAFTED = {"zero1": "zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero2": "mp_rank_00_model_states.pt",
           "zero3": "zero_pp_rank_0_mp_rank_00_model_states.pt", "moe-ep2-zero2": "rng_rank001.pt",
           "bf16-pipeline": "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
           "zero1-pipeline": "layer_01-model_states.pt",
           "moe-pipeline": "layer_1_expert_2_mp_rank_01_model_states.pt"}
CRAFTED_OURS = {"zero1-pipeline": "layer_004-tp_00-full_states.pt",
                "moe-ep2-zero2": "layer_002-tp_00-ep_01-full_states.pt",
                "moe-pipeline": "expp_rank_0_mp_rank_01_optim_states.pt"}


def test_every_kind_saves_safely_and_resumes_on_half_the_ranks_and_back(tmp_path, forked_ranks):
    # ranks forked from this process (conftest's forked_ranks): the checks are the files and states
    root, saved_cfg, moved_cfg = tmp_path / "ckpt", configs(tmp_path, 0), configs(tmp_path, 1)
    saved, _ = run_launch(tmp_path, 4, [("save", name, saved_cfg[name]) for name in KINDS], root)
    allowed = {f"{m}.{c}" for m, c in DEEPSPEED_GLOBALS}
    for name, rec in saved.items():
        assert len(rec["losses"]) == 2 and all(x == x for x in rec["losses"]), name
        kinds = {g for found in rec["globals"].values() for g in found}
        print(f"globals {name} ({rec['wrapper']}, {len(rec['globals'])} files): {sorted(kinds)}")
        assert kinds <= allowed, (name, kinds - allowed)  # no file of any kind needs an unsafe global
    for name, wrapper in WRAPPERS.items():
        assert saved[name]["wrapper"] == wrapper
    assert "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler" in {
        g for found in saved["fp16-zero1"]["globals"].values() for g in found}  # fp16's dynamic loss scaling
    assert saved["fp16-zero1"]["loss_scale"] > 2.0 ** 8  # raised from 2^8 by steps without overflow: moved below
    assert "deepspeed.utils.tensor_fragment.fragment_address" in {
        g for found in saved["bf16-pipeline"]["globals"].values() for g in found}
    assert any("expert" in f for f in saved["moe-pipeline"]["globals"])  # DeepSpeed's expert files were there

    # the node that is left: 2 ranks, half the data-parallel size, pipelines under another split
    moved, stdout = run_launch(tmp_path, 2, [("move", name, moved_cfg[name]) for name in KINDS], root)
    for name, (_, saved_split, split) in KINDS.items():
        rec = moved[name]
        print(f"moved {name}: {rec['checked']} tensors checked on dp {rec['dp']}, parts {rec['parts']}, "
              f"{rec['wrapper']}, {len(rec['differ'])} differ")
        assert rec["differ"] == [] and rec["checked"] > 0, name
        assert rec["start_step"] == 2 and rec["dp"] == (1 if saved_split else 2), name
        assert rec["loss_scale"] == saved[name]["loss_scale"], name
        if split:
            assert "parts:" + ",".join(map(str, rec["parts"])) == split, name
    assert stdout.count("weights, fp32 masters and Adam moments set from its full states") == len(KINDS)
    assert "resumed on pp 2 x tp 1 x dp 1, zero 1, split [0, 4, 6] by partition_method 'parts:0,4,6'" in stdout

    # crafted files, each refused by name before any model is built, and nothing created
    crafted = []
    for kinds, suffix in ((CRAFTED, "-crafted"), (CRAFTED_OURS, "-ours")):
        for name, file in kinds.items():
            copy = root / f"{name}{suffix}"
            shutil.copytree(root / name, copy)
            assert (copy / "global_step2" / file).is_file(), sorted(p.name for p in (copy / "global_step2").iterdir())
            craft(copy / "global_step2", file, tmp_path / f"marker-{copy.name}")
            crafted.append(("crafted", copy.name, saved_cfg[name]))
    # and back onto 4 ranks (the saved split): 2 -> 4, in the same launch as the crafted files
    back, _ = run_launch(tmp_path, 4, [("move", f"{name}-moved", saved_cfg[name]) for name in KINDS] + crafted, root)
    for name in KINDS:
        rec = back[f"{name}-moved"]
        assert rec["differ"] == [] and rec["checked"] > 0 and rec["dp"] == (2 if KINDS[name][1] else 4), name
    for (_, copy, _), file in zip(crafted, [*CRAFTED.values(), *CRAFTED_OURS.values()]):
        error = back[copy]["error"]
        assert error and f"{file} needs io.open" in error and "--trust-checkpoint" in error, error
        assert not (tmp_path / f"marker-{copy}").exists()
    assert len(crafted) == 10
