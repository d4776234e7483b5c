"""Checkpoints that run no code, and that resume on another data-parallel size or pipeline split.

Three launches share every layout kind (tests/checkpoint_moves_worker.py): 4 ranks save each; 2 ranks (the node
that is left) resume each and compare every parameter, fp32 master and Adam moment with what was saved, to the
element, then save again; 4 ranks resume those.  Crafted files are refused before anything loads.
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
    "bf16-pipeline": ({**PIPE, "bf16": {"enabled": True}}, "parts:0,3,6", "parts:0,2,6"),
    "zero1-pipeline": ({**PIPE, "zero_optimization": {"stage": 1}}, "parts:0,3,6", "parts:0,4,6"),
    "moe-pipeline": ({**PIPE, "train": {**TRAIN, "model": "moe-tiny"}}, "parts:0,3,6", "parts:0,2,6"),
}
WRAPPERS = {"zero1": "DeepSpeedZeroOptimizer", "zero3": "DeepSpeedZeroOptimizer_Stage3",
            "bf16-pipeline": "BF16_Optimizer"}


def cases(tmp_path, split: int) -> list[str]:
    out = []
    for name, (fields, *splits) in KINDS.items():
        ds = write_config(tmp_path / f"{name}.json", **fields, pipeline=None if splits[0] is None else
                          {"stages": 2, "partition_method": splits[split]})
        out += ["--case", f"{name}={ds}"]
    return out


def run_phase(tmp_path, ranks: int, phase: str, case_args: list[str], root) -> dict:
    out = tmp_path / f"{phase}-{ranks}"
    out.mkdir()
    proc, _ = launch(ranks, None, "--phase", phase, "--root", str(root), *case_args, out_dir=out, cwd=tmp_path,
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


def test_every_kind_saves_safely_and_resumes_on_half_the_ranks_and_back(tmp_path):
    root = tmp_path / "ckpt"
    saved, _ = run_phase(tmp_path, 4, "save", cases(tmp_path, 0), root)
    allowed = {f"{m}.{c}" for m, c in DEEPSPEED_GLOBALS}
    for name, rec in saved.items():
        assert all(len(rec["losses"]) == 2 and x == x for x in rec["losses"]), name
        kinds = {g for found in rec["globals"].values() for g in found}
        assert kinds <= allowed, (name, kinds - allowed)  # no file of any kind needs an unsafe global
    for name, wrapper in WRAPPERS.items():
        assert saved[name]["wrapper"] == wrapper
    assert "deepspeed.utils.tensor_fragment.fragment_address" in {
        g for found in saved["bf16-pipeline"]["globals"].values() for g in found}
    assert any("expert" in f for f in saved["moe-pipeline"]["globals"])  # DeepSpeed's expert files were there

    # the node that is left: 2 ranks, half the data-parallel size, pipelines under another split
    moved, stdout = run_phase(tmp_path, 2, "move", cases(tmp_path, 1), root)
    for name, (_, saved_split, split) in KINDS.items():
        rec = moved[name]
        print(f"moved {name}: {rec['checked']} tensors checked on dp {rec['dp']}, parts {rec['parts']}, "
              f"{rec['wrapper']}, {len(rec['differ'])} differ")
        assert rec["differ"] == [] and rec["checked"] > 0, name
        assert rec["start_step"] == 2 and rec["dp"] == (1 if saved_split else 2), name
        if split:
            assert "parts:" + ",".join(map(str, rec["parts"])) == split, name
    assert stdout.count("weights, fp32 masters and Adam moments set from its full states") == len(KINDS)
    assert "resumed on pp 2 x tp 1 x dp 1, zero 1, split [0, 4, 6] by partition_method 'parts:0,4,6'" in stdout

    # and back onto 4 ranks (the saved split): 2 -> 4
    for name in KINDS:
        shutil.move(root / f"{name}-moved", root / f"{name}-back")
    back, _ = run_phase(tmp_path, 4, "move", [a.replace("=", "-back=", 1) if a != "--case" else a
                                               for a in cases(tmp_path, 0)], root)
    for name in KINDS:
        assert back[f"{name}-back"]["differ"] == [] and back[f"{name}-back"]["dp"] == (
            2 if KINDS[name][1] else 4), name

    # a crafted file as each kind of file in turn (its checkpoint's manifest updated), resumed by the 2 ranks:
    # refused by name before anything loads, and nothing created
    kinds = {"zero1": "zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero1-back": "mp_rank_00_model_states.pt",
             "zero2": "rng_rank001.pt", "zero2-back": "layer_003-tp_00-full_states.pt",
             "zero3": "zero_pp_rank_0_mp_rank_00_model_states.pt",
             "bf16-pipeline": "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
             "zero1-pipeline": "layer_01-model_states.pt",
             "moe-pipeline": "layer_1_expert_2_mp_rank_01_model_states.pt",
             "moe-pipeline-back": "expp_rank_0_mp_rank_01_optim_states.pt"}
    cases(tmp_path, 1)  # the ds.json files of the 2-rank layouts
    crafted = []
    for name, file in kinds.items():
        ckpt = root / name / "global_step2"
        assert (ckpt / file).is_file(), sorted(p.name for p in ckpt.iterdir())
        craft(ckpt, file, tmp_path / f"marker-{name}")
        crafted += ["--case", f"{name}={tmp_path / (name.removesuffix('-back') + '.json')}"]
    refused, _ = run_phase(tmp_path, 2, "crafted", crafted, root)
    for name, file in kinds.items():
        error = refused[name]["error"]
        assert error and f"{file} needs io.open" in error and "--trust-checkpoint" in error, error
        assert not (tmp_path / f"marker-{name}").exists()
    assert len(kinds) == 9
