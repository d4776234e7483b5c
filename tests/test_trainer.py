"""train.py as a team would run it: rank-0 safety, every layout, the user's data, checkpoints that lose nothing.

Real multi-process launches of train.py, few but each checking several things; their ranks forked from the test's
process (conftest's ``forked_ranks``: DeepSpeed's launcher's argv and rank environment, without each rank's start-up).
"""

import json
import math

import pytest
import torch

from ds_pipe_ext.models.gpt_config import load_model_config
from ds_pipe_ext.models.gpt import SequentialGPT, gpt_layer_specs
from ds_pipe_ext.runner import ROOT, launch, write_config
from test_tensor_parallel import serial_reference

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("forked_ranks")]


def step_losses(stdout: str) -> dict[int, float]:
    """Rank 0's per-step JSON lines: {step: loss} (the loss in full precision)."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith('{"step"'):
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]
    return out


def test_builtin_method_with_instrumentation_under_pp2_tp2_finishes(tmp_path):
    """Rank 0's prediction profile runs with its TP peers (it used to wait for them forever)."""
    run = tmp_path / "run"
    proc, ranks = launch(4, ROOT / "launch_scripts" / "ds_pp2_tp2_sp.json", "--partition-method", "uniform",
                         "--instrument", str(run), "--steps", "2", out_dir=tmp_path, cwd=tmp_path, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ranks[0]["parts"] == [0, 3, 6] and len(ranks) == 4
    summary = json.loads((run / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == [0, 1]
    assert len(json.loads((run / "predicted.json").read_text())["layer_costs"]) == 6


def test_refine_from_a_missing_run_fails_on_every_rank(tmp_path):
    proc, _ = launch(2, ROOT / "launch_scripts" / "ds_pipeline.json", "--partition-method", "uniform",
                     "--refine-from", str(tmp_path / "nope"), "--steps", "1", out_dir=tmp_path, cwd=tmp_path,
                     timeout=180)
    assert proc.returncode != 0
    message = f"pipeline.refine_from = '{tmp_path / 'nope'}' failed on rank 0: RunDirError: {tmp_path / 'nope'}/predicted.json is missing"
    assert proc.stderr.count(message) == 2, proc.stderr[-3000:]


def test_tensor_parallel_without_a_pipeline_and_selective_recompute(tmp_path):
    """TP 2 x DP 1, no PipelineModule, selective recompute on: the first loss of one process without
    recompute (recompute changes what is kept, not the math; see also test_run_config.py)."""
    cfg = load_model_config("tiny")
    torch.save(SequentialGPT(gpt_layer_specs(cfg), base_seed=99).state_dict(), tmp_path / "init.pt")
    want = serial_reference(cfg, tmp_path / "init.pt", 1)[0][0]
    ds = write_config(tmp_path / "ds.json", pipeline=None, tensor_parallel={"size": 2},
                      train={"model": "tiny", "steps": 2, "seed": 1234, "recompute": "selective"})
    proc, ranks = launch(2, ds, "--init-from", str(tmp_path / "init.pt"), out_dir=tmp_path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = ranks[0]
    assert (got["mode"], got["tensor_parallel"], got["recompute"]) == ("data-parallel zero=0", 2, "selective")
    assert got["losses"] == ranks[1]["losses"]  # both TP ranks see the whole loss
    assert got["losses"][0] == pytest.approx(want, abs=1e-5)


def test_trains_on_a_megatron_indexed_dataset_with_a_hugging_face_config(tmp_path):
    from test_run_config import build_indexed

    hf = {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 16, "resid_pdrop": 0.0}
    (tmp_path / "gpt2-mini").mkdir()
    (tmp_path / "gpt2-mini" / "config.json").write_text(json.dumps(hf))
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 128, (int(n),), generator=gen).tolist() for n in torch.randint(5, 60, (40,), generator=gen)]
    build_indexed(str(tmp_path / "corpus"), docs)
    ds = write_config(tmp_path / "ds.json", train={"model": "tiny", "steps": 2, "seed": 1, "data": str(tmp_path / "corpus")})
    proc, ranks = launch(2, ds, "--model", str(tmp_path / "gpt2-mini" / "config.json"), out_dir=tmp_path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ranks[0]["model"] == "gpt2-mini" and ranks[0]["data"] == str(tmp_path / "corpus")
    assert ranks[0]["parts"][-1] == 5 and all(math.isfinite(x) for x in ranks[0]["losses"])


def test_a_rank_dying_mid_save_loses_nothing_and_resume_is_bit_identical(tmp_path):
    """PP 2 x TP 2 + SP: save every 2 steps; rank 1 dies during the step-4 save, after one of its files.
    ``latest`` still names step 2; resuming from it under another partition repeats steps 3-4 bit for bit."""
    ds = write_config(tmp_path / "ds.json", base="ds_pp2_tp2_sp.json",
                      train={"model": "tiny", "steps": 4, "seed": 1234, "save_interval": 2, "keep_last": 1})
    ckpt = tmp_path / "ckpt"
    crashed, _ = launch(4, ds, "--partition-method", "parts:0,2,6", "--save", str(ckpt), out_dir=tmp_path,
                        cwd=tmp_path, env={"DS_PIPE_EXT_FAULT_SAVE": "1:1:4"})
    assert crashed.returncode != 0
    assert "rank exits during the save after 1 of its files" in crashed.stdout
    whole = step_losses(crashed.stdout)
    assert sorted(whole) == [1, 2, 3, 4]  # it trained all four steps, then died saving
    assert (ckpt / "latest").read_text() == "global_step2"
    assert (ckpt / "global_step2" / "manifest.json").is_file()
    assert not (ckpt / "global_step4" / "manifest.json").exists()  # written in part, never committed
    out = tmp_path / "resumed"
    out.mkdir()
    proc, ranks = launch(4, ds, "--partition-method", "parts:0,4,6", "--load", str(ckpt), "--steps", "2",
                         out_dir=out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ranks[0]["parts"] == [0, 4, 6] and ranks[0]["start_step"] == 2
    assert ranks[0]["losses"] == [whole[3], whole[4]]  # bit-identical in fp32


@pytest.mark.parametrize("layout", ["zero2_data_parallel", "zero1_pipeline"])
def test_zero_checkpoints_resume_from_the_last_complete_one(tmp_path, layout):
    """DeepSpeed's own checkpoint files (ZeRO-partitioned optimizer state), committed by our manifest:
    rank 1 dies right after DeepSpeed's files of the step-3 save; the resume repeats step 3 bit for bit."""
    train = {"model": "tiny", "steps": 3, "seed": 1234, "save_interval": 1, "keep_last": 2}
    if layout == "zero2_data_parallel":
        ds = write_config(tmp_path / "ds.json", base="ds_zero3.json", zero_optimization={"stage": 2}, train=train)
        extra = []
    else:
        ds = write_config(tmp_path / "ds.json", zero_optimization={"stage": 1}, train=train)
        extra = ["--partition-method", "parts:0,3,6"]
    ckpt = tmp_path / "ckpt"
    crashed, _ = launch(2, ds, *extra, "--save", str(ckpt), out_dir=tmp_path, cwd=tmp_path,
                        env={"DS_PIPE_EXT_FAULT_SAVE": "1:0:3"})
    assert crashed.returncode != 0, crashed.stderr[-3000:]
    whole = step_losses(crashed.stdout)
    assert (ckpt / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in ckpt.glob("global_step*")) == ["global_step1", "global_step2", "global_step3"]
    out = tmp_path / "resumed"
    out.mkdir()
    proc, ranks = launch(2, ds, *extra, "--load", str(ckpt), "--steps", "1", out_dir=out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ranks[0]["start_step"] == 2
    assert ranks[0]["losses"] == [whole[3]]


def test_a_cuda_out_of_memory_error_is_an_oom_result_with_its_time(tmp_path):
    """train.py's handler, without a GPU: the error raised where a CUDA allocation fails ends the rank at once
    with exit status 3, a message naming the fixes, and the record an ``oom`` row reads (with the error's time)."""
    import subprocess
    import sys
    import time

    script = ("import runpy, sys, torch\n"
              "import ds_pipe_ext.train.build as b\n"
              "def build(cfg): raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
              "b.build = build\n"
              f"sys.argv = ['train.py', '--deepspeed_config', 'ds.json', '--metrics-out', {str(tmp_path / 'm.json')!r}]\n"
              "runpy.run_path('train.py', run_name='__main__')\n")
    before = time.time()
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "error: out of memory on rank 0: CUDA out of memory. Tried to allocate 2.00 GiB - lower " in proc.stderr
    record = json.loads((tmp_path / "m.json").read_text())
    assert record["status"] == "oom" and record["oom"]["measure"] == "CUDA out-of-memory error"
    assert before < record["oom"]["at_unix"] < time.time()
    assert json.loads((tmp_path / "m.rank0.json").read_text())["rank"] == 0
