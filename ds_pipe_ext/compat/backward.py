"""One backward pass for a stage that hands the next stage several tensors.

DeepSpeed 0.19's ``PipelineEngine._exec_backward_pass`` backpropagates a tuple of outputs one tensor at a time
(``out.backward(grad, retain_graph=...)`` per tensor), so a stage whose outputs share their graph runs its whole
backward once per output: a Mixture-of-Experts stage hands on (hidden states, router loss), and the router loss
depends on every block's hidden states, so its backward ran twice (stage 0 of a dropless MoE model at 2 x 4:
157 ms a micro-batch against 95 ms profiled; docs/results/2026-11-27-profiled-generalization.md).  The profiler, and any single
``torch.autograd.backward(outputs, grads)``, runs it once.

``install_one_pass_backward`` wraps the class map's backward instruction: for such a stage it hands DeepSpeed one
scalar, sum_i <output_i, grad_i>, whose gradient with respect to each output is that output's gradient exactly,
so DeepSpeed's own method runs one pass with every gradient it would have accumulated.  Everything else (the last
stage, one output, partitioned activations or gradients) goes to DeepSpeed unchanged.
"""

from __future__ import annotations

import functools

import torch

_MARK = "_ds_pipe_ext_one_pass"


def one_pass_backward(exec_backward):
    """``exec_backward`` (DeepSpeed's ``_exec_backward_pass``) running a tuple of outputs as one pass."""

    @functools.wraps(exec_backward)
    def run(engine, buffer_id):
        outputs = engine.pipe_buffers["outputs"][buffer_id]
        if (engine.is_last_stage() or not isinstance(outputs, tuple) or engine.is_pipe_partitioned
                or engine.is_grad_partitioned):
            return exec_backward(engine, buffer_id)
        floats = [t for t in outputs if t.is_floating_point()]
        grads = engine.grad_layer
        if len(floats) < 2 or len(grads) != len(floats):
            return exec_backward(engine, buffer_id)
        pairs = [(out, grad) for out, grad in zip(floats, grads) if out.requires_grad]
        if len(pairs) < 2:
            return exec_backward(engine, buffer_id)
        joined = sum((out * grad).sum() for out, grad in pairs)
        engine.pipe_buffers["outputs"][buffer_id] = joined
        engine.grad_layer = torch.ones_like(joined)
        try:
            return exec_backward(engine, buffer_id)
        finally:
            engine.grad_layer = grads

    setattr(run, _MARK, True)
    return run


def install_one_pass_backward() -> None:
    """Wrap ``PipelineEngine._INSTRUCTION_MAP[BackwardPass]`` (the class map every engine reads), once."""
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    current = PipelineEngine._INSTRUCTION_MAP[schedule.BackwardPass]
    if not getattr(current, _MARK, False):
        PipelineEngine._INSTRUCTION_MAP[schedule.BackwardPass] = one_pass_backward(current)
