"""Frozen layers: what freezing does to a layer's costs, and where the partition goes."""

from dataclasses import replace

import pytest
import torch
from deepspeed.runtime import utils as ds_utils

from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
from ds_pipe_ext.costs.frozen import freeze_costs
from ds_pipe_ext.costs.hardware import get_device
from ds_pipe_ext.costs.profiler import profile_layers
from ds_pipe_ext.costs.types import ProfileSettings
from ds_pipe_ext.models.gpt_config import load_model_config
from ds_pipe_ext.models.gpt import gpt_layer_specs, lm_loss
from ds_pipe_ext.partition.methods import decide_offline
from ds_pipe_ext.pipe.freeze import FrozenLayerSpec, freeze_layers, frozen_flags, parse_layer_set

FIRST_HALF = list(range(1, 7))  # bench-cpu's layers: 0 the embedding, 1-12 the blocks, 13 the head


def _bench_cpu_costs():
    # costed as it runs on the CPU (attention written out), by the roofline on A100 peaks (no GPU kernels)
    cfg = load_model_config("bench-cpu")
    return cfg, analytic_layer_costs(cfg, EstimateRequest(micro_batch=2, seq=256, dtype="fp32"),
                                     replace(get_device("a100"), gpu=None), runs_on="cpu")


def test_a_frozen_layer_loses_its_weight_gradient_and_states():
    _, costs = _bench_cpu_costs()
    flags = [i in FIRST_HALF for i in range(len(costs))]
    frozen = freeze_costs(costs, flags, measured=False)
    block, cold = costs[1], frozen[1]
    assert cold.name == "Block(frozen)" and frozen[7].name == "Block"
    assert cold.grad_bytes == 0 and cold.optimizer_bytes == 0 and cold.param_bytes == block.param_bytes
    assert cold.backward_s == pytest.approx(block.backward_s - block.weight_grad_s)
    assert cold.forward_s == block.forward_s and cold.activation_bytes == block.activation_bytes
    assert frozen[7:] == [c for c in costs[7:]]  # the trainable layers are untouched


def test_nothing_before_the_first_trainable_layer_runs_a_backward():
    _, costs = _bench_cpu_costs()
    flags = [i <= 3 for i in range(len(costs))]  # the embedding and blocks 1-3: a frozen prefix
    frozen = freeze_costs(costs, flags, measured=False)
    for c in frozen[:4]:
        assert c.backward_s == 0 and c.recompute_s == 0 and c.activation_bytes == 0
    assert frozen[4] == costs[4]


def test_freezing_the_first_half_moves_the_split_later():
    """Frozen blocks are cheaper (no weight gradient), so the balanced split puts more of them on stage 0
    ([0,11,14] -> [0,12,14] here).  DeepSpeed's `parameters` counts trainable parameters only, so the
    frozen blocks weigh nothing and it moves later too ([0,7,14] -> [0,10,14]), but the head's compute
    is still invisible to it: it stays short of the balanced split."""
    cfg, costs = _bench_cpu_costs()
    flags = [i in FIRST_HALF for i in range(len(costs))]
    before = decide_offline("profiled", costs, 2, micro_batches=4)
    after = decide_offline("profiled", freeze_costs(costs, flags, measured=False), 2, micro_batches=4)
    assert before == [0, 11, 14] and after == [0, 12, 14]

    def parameters(specs):  # DeepSpeed's own rule, on the specs as its PipelineModule builds them
        counts = [sum(p.numel() for p in s.build().parameters() if p.requires_grad) for s in specs]
        return [int(b) for b in ds_utils.partition_balanced(counts, 2)]

    specs = gpt_layer_specs(cfg)
    assert parameters(specs) == [0, 7, 14]
    frozen_split = parameters(freeze_layers(specs, FIRST_HALF))
    assert frozen_split == [0, 10, 14]


def test_frozen_specs_build_frozen_and_profile_without_weight_gradients(tmp_path):
    cfg = load_model_config("tiny")
    specs = gpt_layer_specs(cfg)
    frozen = freeze_layers(specs, [1])
    assert isinstance(frozen[1], FrozenLayerSpec) and not isinstance(specs[1], FrozenLayerSpec)
    assert repr(frozen[1]) == "frozen " + repr(specs[1])  # a different profile cache key
    assert not any(p.requires_grad for p in frozen[1].build().parameters())
    assert all(p.requires_grad for p in frozen[2].build().parameters())
    assert frozen_flags(frozen) == [False, True] + [False] * (len(specs) - 2)

    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    settings = ProfileSettings(warmup=1, repeats=3, cache_dir=None, progress=False)
    costs = profile_layers(frozen, tokens[:, :-1], labels=tokens[:, 1:], loss_fn=lm_loss, settings=settings)
    assert costs[1].grad_bytes == 0 and costs[1].optimizer_bytes == 0 and costs[1].param_bytes == costs[2].param_bytes
    assert costs[2].grad_bytes > 0  # measured apart: the frozen block is not deduplicated with the others


def test_frozen_layer_errors():
    assert parse_layer_set("1-3,5", 8) == [1, 2, 3, 5] and parse_layer_set(None, 8) == []
    with pytest.raises(ValueError, match="outside the pipeline's layers 0-7"):
        parse_layer_set("6-9", 8)
    with pytest.raises(ValueError, match="not an index or a range"):
        parse_layer_set("blocks", 8)
    with pytest.raises(ValueError, match="runs backwards"):
        parse_layer_set("5-2", 8)
    tied = gpt_layer_specs(load_model_config("gpt2-small"))  # tied embeddings
    with pytest.raises(ValueError, match="freezing it would freeze its partner"):
        freeze_layers(tied, [0])
