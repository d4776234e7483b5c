"""instrument.per_layer: each layer's calls in a stage, timed by module hooks, without a launch."""

import time

import pytest
import torch
from torch import nn

from ds_pipe_ext.config_model import ConfigError
from ds_pipe_ext.instrument.hooks import _Clock
from ds_pipe_ext.instrument.layer_timing import LayerTimer, summarize_layer_times
from ds_pipe_ext.train.config import build_run_config


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepLayer(nn.Module):
    """A layer whose forward and backward take known times."""

    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return _Sleep.apply(x * self.scale, self.forward_s, self.backward_s)


def _stage():
    """DeepSpeed's view of a stage holding layers 3-5: submodules named by their global index."""
    stage = nn.Module()
    stage._local_start, stage._local_stop = 3, 6
    stage.add_module("3", nn.Embedding(10, 4))
    stage.add_module("4", SleepLayer(0.020, 0.030))
    stage.add_module("5", SleepLayer(0.005, 0.060))
    return stage


def _micro_batch(stage):
    tokens = torch.randint(0, 10, (2, 3))
    out = getattr(stage, "5")(getattr(stage, "4")(getattr(stage, "3")(tokens)))
    out.sum().backward()


def test_each_layer_is_timed_over_its_own_calls_and_an_embeddings_backward_is_left_out():
    stage = _stage()
    timer = LayerTimer(stage, _Clock(torch.device("cpu")))
    for _ in range(3):
        _micro_batch(stage)
    step = timer.take_step()
    assert sorted(step["layer_forward_ms"]) == ["3", "4", "5"]
    assert all(len(v) == 3 for v in step["layer_forward_ms"].values())
    # token ids need no gradient: the embedding's hooks fire together, so no backward is recorded for it
    assert sorted(step["layer_backward_ms"]) == ["4", "5"]
    f4, b4 = step["layer_forward_ms"]["4"], step["layer_backward_ms"]["4"]
    # each window holds its own layer's sleep and not its neighbour's (layer 5's 60 ms backward runs
    # first: a window opened at the step's start or at layer 5's output would read >= 90 ms)
    assert all(20 <= t < 60 for t in f4) and all(30 <= t < 60 for t in b4), (f4, b4)
    assert all(60 <= t < 90 for t in step["layer_backward_ms"]["5"])
    assert all(5 <= t < 20 for t in step["layer_forward_ms"]["5"])
    assert timer.take_step() == {"layer_forward_ms": {}, "layer_backward_ms": {}}  # the next step starts empty

    summary = summarize_layer_times([step, step])
    assert list(summary) == ["3", "4", "5"] and "backward_ms" not in summary["3"]
    assert summary["4"]["forward_ms"] == pytest.approx(sum(f4) / 3)

    timer.remove()
    _micro_batch(stage)
    assert timer.take_step() == {"layer_forward_ms": {}, "layer_backward_ms": {}}


def test_per_layer_timing_belongs_to_a_pipeline():
    with pytest.raises(ConfigError, match=r"instrument.per_layer times the layers of a pipeline stage"):
        build_run_config({"train_micro_batch_size_per_gpu": 1, "instrument": {"enabled": True, "per_layer": True}})
