"""Loading a checkpoint unpickles tensors and DeepSpeed's own records only; what a move onto another layout keeps.

In one process; tests/test_checkpoint_moves.py saves and resumes every layout kind in real launches."""

import json

import pytest
import torch

from ds_pipe_ext.config_model import ConfigError
from ds_pipe_ext.layout import Layout
from ds_pipe_ext.train import checkpoint, full_states
from ds_pipe_ext.train.config import build_run_config
from ds_pipe_ext.train.safe_load import SafeCheckpointEngine, UnsafeCheckpointError, check_files, safe_load


class Opens:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_file_is_refused_by_name_and_runs_nothing_unless_trusted(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    marker, evil, fine = tmp_path / "marker", tmp_path / "evil.pt", tmp_path / "fine.pt"
    torch.save({"optimizer": {"state": {}}, "loss_scaler": Opens(marker)}, evil)
    torch.save({"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.optimizer_states,
                "w": torch.ones(2)}, fine)  # what DeepSpeed's ZeRO files hold
    for load in (lambda: check_files([fine, evil]), lambda: safe_load(evil),
                 lambda: SafeCheckpointEngine(object()).load(str(evil))):  # as DeepSpeed calls its engine
        with pytest.raises(UnsafeCheckpointError, match=r"evil.pt needs io.open to load: .* resume with "
                                                        r"--trust-checkpoint"):
            load()
        assert not marker.exists()
    assert safe_load(fine)["zero_stage"] == ZeroStageEnum.optimizer_states
    safe_load(evil, trust=True)  # the user vouches for it: loaded as DeepSpeed would
    assert marker.exists()


def test_the_universal_checkpoint_loader_is_refused():
    with pytest.raises(ConfigError, match="checkpoint.load_universal = true: DeepSpeed's universal checkpoint "
                                          "loader unpickles"):
        build_run_config({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"load_universal": True}})


MANIFEST = {"layout": Layout(pp=2, dp=2, tp=2, zero=1).to_dict(), "parts": [0, 3, 6], "full_states": True}


@pytest.mark.parametrize("layout, match", [
    (Layout(pp=2, dp=1, tp=1, zero=1), r"written with tp = 2, this run has 1: each tensor-parallel rank's "
                                              r"full states hold its shard .* resume with tp = 2"),
    (Layout(pp=1, dp=2, tp=2, zero=1), r"written with pipelined = True, this run has False"),
    (Layout(pp=2, dp=2, zero=1, ep=2), r"written with ep = 1, this run has 2: each expert-parallel rank"),
])
def test_a_move_keeps_tp_ep_and_the_pipeline_and_names_what_differs(tmp_path, layout, match):
    manifest = MANIFEST if layout.ep == 1 else {**MANIFEST, "layout": Layout(pp=2, dp=2, zero=1).to_dict()}
    with pytest.raises(checkpoint.CheckpointError, match=match):
        checkpoint.check_move(manifest, layout, tmp_path)


def test_a_move_may_change_the_data_parallel_size_the_split_and_the_zero_stage(tmp_path):
    checkpoint.check_move(MANIFEST, Layout(pp=2, dp=1, tp=2, zero=0), tmp_path)
    checkpoint.check_move({**MANIFEST, "layout": Layout(dp=4, tp=2, zero=1).to_dict()}, Layout(dp=2, tp=2, zero=3),
                          tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="holds no full states .* resume with its layout, "
                                                         "pp 2 x tp 2 x dp 2, zero 1"):
        checkpoint.check_move({**MANIFEST, "full_states": False}, Layout(pp=2, dp=1, tp=2, zero=1), tmp_path)
    words = checkpoint._move_words({**MANIFEST, "layout": {**MANIFEST["layout"], "micro_batch": 2,
                                                           "micro_batches": 2}},
                                   Layout(pp=2, dp=1, tp=2, zero=1, micro_batch=2, micro_batches=4), [0, 2, 6],
                                   "profiled")
    assert words.startswith("written by pp 2 x tp 2 x dp 2, zero 1 (parts [0, 3, 6]), resumed on pp 2 x tp 2 x dp "
                            "1, zero 1, split [0, 2, 6] by partition_method 'profiled' for the ranks this run has")
    assert words.endswith("the global batch stays 8 samples")


class Engine:
    """What full_states reads of an engine without DeepSpeed wrappers (ZeRO-0 in fp32): the parameter is its
    own master, torch's AdamW keeps the moments."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.module = torch.nn.Module()
        self.module.layers = torch.nn.ModuleList([torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)])
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=0.1)
        self.global_steps, self.global_samples, self.skipped_steps = 0, 0, 0

    def step(self, x=None):
        x = torch.randn(4, 3) if x is None else x
        self.optimizer.zero_grad()
        self.module.layers[1](self.module.layers[0](x)).square().sum().backward()
        self.optimizer.step()
        self.global_steps += 1
        self.global_samples += 4


def test_full_states_round_trip_a_plain_adamw_and_refuse_another_model(tmp_path):
    a, b = Engine(0), Engine(1)
    for _ in range(3):
        a.step()
    full_states.save(a, tmp_path, pipelined=False, writer=True, tp_rank=0)
    assert json.loads((tmp_path / "full_states.json").read_text())["step"] == 3.0
    full_states.load(b, tmp_path, pipelined=False, tp_rank=0)
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.optimizer.state[p][k], b.optimizer.state[q][k])
    assert (b.global_steps, b.global_samples) == (3, 12)
    x = torch.randn(4, 3)
    a.step(x), b.step(x)  # the same next step
    assert all(torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters()))
    c = Engine(2)
    c.module.layers[1] = torch.nn.Linear(2, 5)
    c.optimizer = torch.optim.AdamW(c.module.parameters(), lr=0.1)
    with pytest.raises(full_states.FullStateError, match=r"layer_001-tp_00-full_states.pt: weight: saved \(2, 2\), "
                                                         r"this run's parameter is \(5, 2\)"):
        full_states.load(c, tmp_path, pipelined=False, tp_rank=0)
