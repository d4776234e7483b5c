"""compat.backward: a stage handing on several tensors backpropagates once, with the gradients DeepSpeed's
one-pass-per-output loop gives (DeepSpeed 0.19's _exec_backward_pass ran the shared graph once per output)."""

from types import SimpleNamespace

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
