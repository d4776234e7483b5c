"""The PipelineModule as a drop-in for any DeepSpeed model: layers of every form, tuple inputs."""

import json
import math

import pytest
import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from ds_pipe_ext.costs.layers import describe_layer, layer_name
from ds_pipe_ext.costs.profiler import ProfileSettings, profile_layers
from ds_pipe_ext.partition import PartitionError
from ds_pipe_ext.runner import launch

QUICK = ProfileSettings(warmup=0, repeats=1, cache_dir=None, progress=False)


def double(x):
    return 2 * x


class Pair(nn.Module):
    """Takes a (tensor, tensor) tuple, as a first layer fed a tuple micro-batch does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, inputs):
        a, b = inputs
        return self.lin(a) * b


def test_every_layer_form_has_a_name_and_a_stable_description():
    view = lambda x: x.view(-1)  # noqa: E731
    flat = lambda x: x.flatten(1)  # noqa: E731
    assert layer_name(LayerSpec(nn.Linear, 4, 4)) == "Linear"
    assert layer_name(TiedLayerSpec("e", nn.Embedding, 4, 4, forward_fn=double)) == "Embedding.double"
    assert layer_name(nn.GELU()) == "GELU"
    assert layer_name(view) == "lambda" and layer_name(double) == "double"
    # equal layers describe equally (measured once); different callables never collide
    assert describe_layer(nn.Linear(4, 4)) == describe_layer(nn.Linear(4, 4))
    assert describe_layer(nn.Linear(4, 4)) != describe_layer(nn.Linear(4, 5))
    frozen = nn.Linear(4, 4).requires_grad_(False)
    assert describe_layer(frozen) != describe_layer(nn.Linear(4, 4))
    assert describe_layer(view) != describe_layer(flat)
    assert "0x" not in describe_layer(view)  # no addresses: the cache key is stable across processes


def test_profiler_takes_instances_callables_and_a_tuple_input_and_leaves_them_untouched():
    torch.manual_seed(0)
    pair, lin = Pair(), nn.Linear(8, 4)
    layers = [pair, lambda x: x.relu(), double, LayerSpec(nn.Linear, 8, 8), lin]
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    inputs = (torch.randn(3, 8), torch.rand(3, 8))
    costs = profile_layers(layers, inputs, labels=torch.randint(0, 4, (3,)),
                           loss_fn=nn.functional.cross_entropy, settings=QUICK)
    assert [c.name for c in costs] == ["Pair", "lambda", "double", "Linear", "Linear"]
    # parameters: 8*8+8 floats each for Pair and the spec's Linear, 8*4+4 for the last
    assert [c.param_bytes for c in costs] == [288, 0, 0, 288, 144]
    assert costs[1].param_bytes == costs[1].optimizer_bytes == 0 and costs[1].forward_s < 0.01
    assert costs[0].output_bytes == 3 * 8 * 4 and costs[-1].output_bytes == 0  # the loss never crosses
    # the user's modules are not moved, trained or given gradients
    assert all(torch.equal(v, lin.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for m in (pair, lin) for p in m.parameters())


def test_profiled_without_a_profile_batch_or_analytic_without_a_cost_model_is_a_clear_error():
    from ds_pipe_ext import PipelineModule

    with pytest.raises(PartitionError, match=r"needs one micro-batch: pass profile_batch=\(inputs, labels\)"):
        PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=2, partition_method="profiled")
    with pytest.raises(PartitionError, match="pass cost_model="):
        PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=2, partition_method="analytic",
                       profile_batch=(torch.zeros(1, 2), torch.zeros(1)))
    with pytest.raises(PartitionError, match="3 pipeline stages but only 2 layers: use at most 2 stages"):
        PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=3, partition_method="uniform")
    with pytest.raises(PartitionError, match=r"profile_batch must be \(inputs, labels\)"):
        PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=2, partition_method="profiled",
                       profile_batch=torch.zeros(1, 2))


@pytest.mark.multiprocess
@pytest.mark.usefixtures("forked_ranks")
@pytest.mark.parametrize("model", ["plain", "tied"])
def test_any_model_trains_under_profiled_on_2_ranks_with_one_process_losses(tmp_path, model):
    """plain: nn.Module instances + lambdas; tied: TiedLayerSpec, an nn.Module, a (tokens, mask) tuple input."""
    proc, ranks = launch(2, None, "--model", model, "--steps", "2", out_dir=tmp_path, cwd=tmp_path,
                         script="examples/any_model.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(ranks) == [0, 1]
    parts = ranks[0]["parts"]
    n = 9 if model == "plain" else 6
    assert parts[0] == 0 and parts[-1] == n and len(parts) == 3
    assert all(r["parts"] == parts for r in ranks.values())  # the same stages on every rank
    for r in ranks.values():
        assert r["local_layers"] == parts[r["stage_id"]:r["stage_id"] + 2]
    assert proc.stdout.count("partition_method=profiled parts=") == 1  # decided once
    names = ranks[0]["layer_names"]
    if model == "plain":
        assert names == ["Linear", "GELU", "lambda", "Linear", "Tanh", "lambda", "Linear", "ReLU", "Linear"]
    else:
        assert names[0] == "TokenEmbedding" and names[-1] == "TokenEmbedding.tied_logits" and names[4] == "LayerNorm"
    first = ranks[0]["losses"][0]
    assert math.isfinite(first)
    assert first == pytest.approx(ranks[0]["reference_first_loss"], abs=1e-5)
    assert json.dumps(ranks[1]["losses"]) == json.dumps(ranks[0]["losses"])  # the engine's loss, broadcast
