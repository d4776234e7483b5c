"""One recompute mode per pipeline layer (issue 36, point 1): what the drop-in builds and refuses, the
configuration's rules, and the costs each mode runs at.  The parity of a run under a mode per layer is
one more build in the PP 2 x TP 2 launch (tests/test_tensor_parallel.py)."""

import pytest
import torch
from deepspeed.pipe import LayerSpec
from torch import nn

from ds_pipe_ext.costs.stage import recompute_modes, with_layer_recompute
from ds_pipe_ext.costs.types import LayerCost
from ds_pipe_ext.models import family_of, load_model
from ds_pipe_ext.partition import PartitionError
from ds_pipe_ext.pipe.recompute import with_selective_recompute


def llama_specs():
    cfg = load_model("llama-tiny")
    return cfg, family_of(cfg).layer_specs(cfg)


def test_selective_layers_are_built_to_replay_their_attention_core():
    cfg, specs = llama_specs()
    modes = ["none", "selective", "full", "none", "selective", "none", "full"]
    rebuilt = with_selective_recompute(specs, modes, 0)
    flags = [[m.selective_recompute for m in spec.build().modules() if hasattr(m, "selective_recompute")]
             for spec in rebuilt[1:-1]]
    assert flags == [[True], [False], [False], [True], [False]]
    # the same parameter names whatever the choice: a checkpoint loads under another
    torch.manual_seed(0)
    a = rebuilt[1].build().state_dict()
    torch.manual_seed(0)
    b = specs[1].build().state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("modes, interval, match", [
    (["none"] * 6, 0, r"6 modes for 7 pipeline layers: give one per layer"),
    (["none", "partial"] + ["none"] * 5, 0, r"recompute mode\(s\) \['partial'\]: use none, selective, full"),
    (["none", "full"] + ["none"] * 5, 1, r"activation_checkpoint_interval = 1 both say .* keep one"),
    (["selective"] + ["none"] * 6, 0, r"layer\(s\) \[0\] have no selective recompute .* \"none\" or \"full\""),
])
def test_a_mode_per_layer_that_cannot_run_is_refused_by_name(modes, interval, match):
    _, specs = llama_specs()
    with pytest.raises(PartitionError, match=match):
        with_selective_recompute(specs, modes, interval)
    with pytest.raises(PartitionError, match="no selective recompute"):
        with_selective_recompute([nn.Linear(2, 2), LayerSpec(nn.Linear, 2, 2)], ["selective", "none"], 0)


def test_the_drop_in_refuses_before_building():
    from ds_pipe_ext import PipelineModule

    with pytest.raises(PartitionError, match=r"2 modes for 3 pipeline layers"):
        PipelineModule([nn.Linear(2, 2)] * 3, num_stages=2, partition_method="uniform", recompute=["none", "full"])


def test_each_mode_runs_at_its_own_costs():
    costs = [LayerCost("emb", 1.0, 1.0, recompute_s=1.0, activation_bytes=10, output_bytes=100),
             LayerCost("block", 2.0, 4.0, recompute_s=2.0, activation_bytes=1000, output_bytes=100,
                       selective_kept_bytes=600, selective_replay_s=0.5),
             LayerCost("head", 3.0, 6.0, recompute_s=3.0, activation_bytes=2000)]
    ran = with_layer_recompute(costs, ["none", "selective", "full"], selective_built=False)
    assert [(c.activation_bytes, c.backward_s) for c in ran] == [(10, 1.0), (600, 4.5), (100, 9.0)]
    # a profile of layers built as they run already holds the selective layer's costs
    assert with_layer_recompute(costs, ["none", "selective", "none"], selective_built=True)[1] == costs[1]
    modes = recompute_modes(costs)
    assert [[m.name for m in layer] for layer in modes] == [["none", "full"], ["none", "selective", "full"], ["none", "full"]]
    assert (modes[0][1].kept_bytes, modes[0][1].replay_bytes) == (0, 10)  # the token ids: nothing kept
    assert (modes[1][1].kept_bytes, modes[1][1].replay_bytes, modes[1][1].replay_time) == (600, 400, 0.5)
    assert (modes[2][1].kept_bytes, modes[2][1].replay_bytes, modes[2][1].replay_time) == (100, 1900, 3.0)


@pytest.mark.parametrize("extra, match", [
    ({"pipeline": {"stages": 2, "activation_checkpoint_interval": 1}}, "activation_checkpoint_interval"),
    ({"pipeline": {"stages": 2}, "activation_checkpointing": {"partition_activations": True}},
     "activation_checkpointing section"),
    ({}, "no \"pipeline\" section"),
])
def test_a_mode_per_layer_beside_another_checkpointing_setting_is_a_config_error(extra, match):
    from ds_pipe_ext.config_model import ConfigError
    from ds_pipe_ext.train.config import build_run_config

    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
          "train": {"model": "llama-tiny", "recompute": ["none", "full", "none", "none", "none", "none", "none"]},
          **extra}
    with pytest.raises(ConfigError, match=match):
        build_run_config(ds)
