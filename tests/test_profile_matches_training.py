"""What makes a profile match the training run it predicts (issue 53): a stage handing on several tensors
backpropagates once (compat.backward), and each stage's optimizer step is profiled and run after its last backward."""

from types import SimpleNamespace

import pytest

import torch

from ds_pipe_ext.compat.backward import one_pass_backward


def deepspeed_loop(engine, buffer_id):
    """DeepSpeed 0.19's tuple branch of _exec_backward_pass: one backward call per floating-point output."""
    outputs = engine.pipe_buffers["outputs"][buffer_id]
    if isinstance(outputs, tuple):
        floats = [t for t in outputs if t.is_floating_point()]
        for i, (out, grad) in enumerate(zip(floats, engine.grad_layer)):
            out.backward(gradient=grad, retain_graph=i < len(floats) - 1)
    else:
        outputs.backward(gradient=engine.grad_layer)


def stage(last: bool = False):
    """A stage whose two outputs share their graph (hidden states and a loss computed from them, as a MoE
    stage's router loss is), and a counter of how often its shared part is backpropagated."""
    torch.manual_seed(0)
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    passes = []
    hidden = torch.tanh(x @ weight)
    hidden.register_hook(lambda g: passes.append(1))
    aux = (hidden.square().mean() * 0.1).reshape(1)
    out = hidden * 2
    engine = SimpleNamespace(pipe_buffers={"outputs": {0: (out, aux, torch.zeros(2, dtype=torch.long))}},
                             grad_layer=(torch.randn(4, 8), torch.randn(1)), is_last_stage=lambda: last,
                             is_pipe_partitioned=False, is_grad_partitioned=False)
    return engine, weight, passes


def test_one_pass_gives_deepspeed_gradients_with_one_backward():
    engine, weight, passes = stage()
    deepspeed_loop(engine, 0)
    expected, ds_passes = weight.grad.clone(), len(passes)
    engine, weight, passes = stage()
    one_pass_backward(deepspeed_loop)(engine, 0)
    assert ds_passes == 2 and len(passes) == 1
    torch.testing.assert_close(weight.grad, expected, rtol=1e-6, atol=1e-7)
    assert isinstance(engine.grad_layer, tuple) and len(engine.grad_layer) == 2  # handed back as received


def test_the_last_stage_and_single_outputs_go_to_deepspeed_unchanged():
    calls = []
    engine, _, _ = stage(last=True)
    one_pass_backward(lambda e, b: calls.append(e.pipe_buffers["outputs"][b]))(engine, 0)
    assert isinstance(calls[-1], tuple)
    engine, _, _ = stage()
    single = engine.pipe_buffers["outputs"][0][0]
    engine.pipe_buffers["outputs"][0] = single
    one_pass_backward(lambda e, b: calls.append(e.pipe_buffers["outputs"][b]))(engine, 0)
    assert calls[-1] is single


def test_the_plan_runs_each_stage_optimizer_step_after_its_last_backward():
    """Without a step model the plan's step is the layers through the schedule plus each stage's optimizer step
    after its last backward: under 1F1B stage 0 finishes last, so its step is the one added."""
    from ds_pipe_ext.costs.types import LayerCost
    from ds_pipe_ext.partition.report import build_plan

    def costs(opt0: float, opt1: float) -> list:
        return [LayerCost("a", 1.0, 2.0, optimizer_step_s=opt0), LayerCost("b", 1.0, 2.0, optimizer_step_s=opt1)]

    plain = build_plan("x", [0, 1, 2], costs(0.0, 0.0), micro_batches=4).predicted_step_ms
    assert plain == 1e3 * (4 * 3.0 + 3.0)  # (m + p - 1) x (f + b)
    assert build_plan("x", [0, 1, 2], costs(0.5, 0.1), micro_batches=4).predicted_step_ms == plain + 500.0
    assert build_plan("x", [0, 1, 2], costs(0.0, 4.0), micro_batches=4).predicted_step_ms == plain - 2000.0 + 4000.0


def test_the_profiler_times_the_optimizer_step_of_a_layer_with_parameters():
    from ds_pipe_ext.costs.profiler import profile_layers
    from ds_pipe_ext.costs.types import ProfileSettings

    costs = profile_layers([torch.nn.Linear(64, 64), torch.nn.Tanh()], torch.randn(8, 64),
                           settings=ProfileSettings(warmup=1, repeats=2, cache_dir=None, progress=False))
    assert costs[0].optimizer_step_s > 0 and costs[1].optimizer_step_s == 0


def test_the_step_search_minimises_the_step_with_each_stage_optimizer_step():
    """Without a step model `profiled` takes the split of the smallest predicted step, the optimizer steps its
    layers were profiled with included: exact against every split on small instances."""
    import itertools
    import random

    from ds_pipe_ext.costs.stage import stage_costs
    from ds_pipe_ext.costs.types import LayerCost
    from ds_pipe_ext.partition.step_search import partition_min_step
    from ds_pipe_ext.simulate.step_model import StepModel

    rng = random.Random(53)
    for _ in range(20):
        n, p, m = rng.randint(4, 7), rng.choice([2, 3]), rng.choice([2, 4])
        costs = [LayerCost(f"l{i}", rng.uniform(0.1, 1), rng.uniform(0.2, 2),
                           optimizer_step_s=rng.choice([0.0, rng.uniform(0, 3)])) for i in range(n)]

        def step(parts):
            stages = stage_costs(costs, parts, micro_batches=m)
            return StepModel().predict(stages, m, timeline=False, update_s=[s.optimizer_s for s in stages]).step_s

        best = min(step([0, *cut, n]) for cut in itertools.combinations(range(1, n), p - 1))
        found = partition_min_step(costs, p, micro_batches=m)
        assert found.gap == 0.0 and step(found.parts) == pytest.approx(best, rel=1e-12)


class GradientsSeen(torch.nn.Linear):
    """A layer that records its weight's gradient norm each time autograd accumulates into it."""

    norms: list = []

    def __init__(self):
        super().__init__(8, 8)
        self.weight.register_post_accumulate_grad_hook(lambda p: GradientsSeen.norms.append(p.grad.norm().item()))


def test_on_a_cpu_each_timed_backward_accumulates_into_the_gradients_already_there():
    """As m - 1 of a step's m micro-batches run it: a fresh gradient each repeat would time the allocator's page
    faults (bimodal for a 98 MiB embedding), not the backward training runs."""
    from deepspeed.pipe import LayerSpec

    from ds_pipe_ext.costs.profiler import profile_layers
    from ds_pipe_ext.costs.types import ProfileSettings

    GradientsSeen.norms = []
    profile_layers([LayerSpec(GradientsSeen)], torch.randn(4, 8),
                   settings=ProfileSettings(warmup=1, repeats=3, cache_dir=None, progress=False))
    first = GradientsSeen.norms[0]
    assert GradientsSeen.norms[:4] == pytest.approx([first, 2 * first, 3 * first, 4 * first], rel=1e-5)
    # the checkpointed loop (recompute_s) starts from fresh gradients and accumulates the same way
    assert GradientsSeen.norms[4:8] == pytest.approx(GradientsSeen.norms[:4], rel=1e-5)
