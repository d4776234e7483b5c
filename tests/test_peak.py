"""The step's live-tensor peak from allocation events (instrument.peak), worked by hand."""

import pytest
import torch

from ds_pipe_ext.instrument.peak import Alloc, Marker, StepTrace, step_peak

# a step that begins at t=10 holding 1,000 bytes: parameters (400 at 0x100), optimizer states (200 at
# 0x200), and 400 other bytes, 50 of which (0x300) a warm-up step made at t=1 and this step frees
START = dict(start_ns=10, start_bytes=1000, start_held={0x100: (400, "param_bytes"), 0x200: (200, "optimizer_bytes")})
MARKERS = [Marker(10, "step"), Marker(11, "forward 0"), Marker(13, None, ((0x400, "activation_bytes"),)),
           Marker(16, "backward 0"), Marker(19, None, ((0x600, "grad_bytes"),)), Marker(21, "optimizer_step")]


def events(optimizer_temporary: int):
    return [Alloc(1, 0x300, 50),
            Alloc(12, 0x400, 300), Alloc(14, 0x500, 100), Alloc(15, 0x500, -100),  # saved; a temporary
            Alloc(17, 0x600, 400), Alloc(18, 0x300, -50), Alloc(18, 0x999, -10),  # the gradient; frees
            Alloc(20, 0x400, -300),  # the backward frees the saved tensor
            Alloc(22, 0x700, optimizer_temporary), Alloc(23, 0x700, -optimizer_temporary)]


def test_the_peak_in_the_backward_holds_the_gradient_and_the_saved_activations():
    # 1,000 -> 1,300 (saved) -> 1,400 -> 1,300 -> 1,700 (gradient): the peak, before 0x300 is freed
    peak = step_peak(events(250), MARKERS, **START)
    assert peak.peak_bytes == 1700 and peak.phase == "backward 0"
    assert peak.by_kind == {"param_bytes": 400, "grad_bytes": 400, "optimizer_bytes": 200, "buffer_bytes": 0, "gathered_bytes": 0,
                            "activation_bytes": 300, "temporary": 0, "other": 400}
    # 0x999 was made before the trace and is no held tensor: left out of the count, and reported
    assert peak.unmatched_free_bytes == 10


def test_a_free_the_trace_did_not_see_is_dated_by_the_first_phase_where_python_lets_go():
    # a 500-byte reduction buffer made in the forward (t=14, at 0x800) is freed on another thread: the
    # trace never sees the free.  The backward's marker (t=16) finds Python no longer reaching it, so it
    # was freed by then, and the backward (1,700 as above) does not hold it; the peak is the forward's,
    # at t=14: 1,000 + 300 (saved) + 100 (temporary) + 500
    unseen = events(250) + [Alloc(14, 0x800, 500)]
    looked = [Marker(m.t_ns, m.phase, m.sightings, frozenset({0x100, 0x200, 0x400}) if m.phase == "backward 0" else None)
              for m in MARKERS]
    peak = step_peak(unseen, looked, **START)
    assert peak.peak_bytes == 1900 and peak.phase == "forward 0"
    assert peak.unseen_free_bytes == 500
    # the saved tensor at 0x400 is not reached either at t=16 (autograd holds it): its free, seen at t=20, stands
    assert peak.by_kind["activation_bytes"] == 300
    # with no marker that looked, a later allocation at its address dates the free (t=19): the backward
    # then holds it, 1,700 + 500 = 2,200 at t=17
    reused = unseen + [Alloc(19, 0x800, 20), Alloc(19, 0x800, -20)]
    peak = step_peak(reused, MARKERS, **START)
    assert peak.unseen_free_bytes == 500 and peak.peak_bytes == 2200


def test_a_large_optimizer_temporary_moves_the_peak_to_the_step():
    # after the backward: 1,700 - 50 - 300 = 1,350; the temporary of 450 makes 1,800
    peak = step_peak(events(450), MARKERS, **START)
    assert peak.peak_bytes == 1800 and peak.phase == "optimizer_step"
    assert peak.by_kind == {"param_bytes": 400, "grad_bytes": 400, "optimizer_bytes": 200, "buffer_bytes": 0, "gathered_bytes": 0,
                            "activation_bytes": 0, "temporary": 450, "other": 350}
    assert peak.temporary_by_phase == {"optimizer_step": 450}
    assert sum(peak.by_kind.values()) == peak.peak_bytes


def test_what_the_step_holds_at_its_peak_is_summed_by_the_op_that_made_it():
    ops = {0x400: "aten::addmm", 0x500: "aten::gelu", 0x600: "AddmmBackward0 > aten::mm"}
    named = [Alloc(e.t_ns, e.ptr, e.nbytes, ops.get(e.ptr, "") if e.nbytes > 0 else "") for e in events(250)]
    peak = step_peak(named + [Alloc(17, 0x610, 40, "AddmmBackward0 > aten::mm")], MARKERS, **START)
    # at the peak (t=17): the saved 300 bytes and both gradient blocks (0x610 unsighted: a temporary); the
    # gelu temporary is gone, 0x300 was made before the step
    assert peak.by_op == [(400, "grad_bytes", "AddmmBackward0 > aten::mm", 1), (300, "activation_bytes", "aten::addmm", 1),
                          (40, "temporary", "AddmmBackward0 > aten::mm", 1)]
    assert peak.to_dict()["by_op"][0] == [400, "grad_bytes", "AddmmBackward0 > aten::mm", 1]


def test_a_held_tensor_freed_in_the_step_leaves_its_kind():
    # the optimizer's 200 bytes at 0x200 (made before the trace) are freed at t=16, before the peak
    peak = step_peak(events(250) + [Alloc(16, 0x200, -200)], MARKERS, **START)
    assert peak.peak_bytes == 1500 - 0 and peak.by_kind["optimizer_bytes"] == 0  # 1,300 - 200 + 400
    assert sum(peak.by_kind.values()) == peak.peak_bytes


def test_the_trace_of_a_plain_training_step_on_cpu():
    """A 2-layer MLP with Adam: the peak over the measured step holds the parameters, the gradients and
    Adam's states in full, sighted where the step shows them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    x = torch.randn(64, 256)
    params = list(model.parameters())
    n = sum(p.numel() for p in params) * 4

    def step(trace):
        trace.phase("forward 0")
        loss = model(x).pow(2).mean()
        trace.phase("backward 0")
        loss.backward()
        trace.sight("grad_bytes", [p.grad for p in params])
        trace.phase("optimizer_step")
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # Adam's states exist before the trace, as they do in a steady run
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with StepTrace(torch.device("cpu")) as trace:
        step(trace)
        held = {"param_bytes": {(p.data_ptr(), p.untyped_storage().nbytes()): p.untyped_storage().nbytes()
                                for p in params},
                "optimizer_bytes": {(t.data_ptr(), t.untyped_storage().nbytes()): t.untyped_storage().nbytes()
                                    for s in opt.state.values() for t in s.values() if t.dim()}}
        trace.step_begins(held)
        step(trace)
    peak = trace.peak()
    assert peak.by_kind["param_bytes"] == n and peak.by_kind["optimizer_bytes"] == 2 * n
    assert peak.by_kind["grad_bytes"] == n  # every gradient alive at the step
    # each gradient named by the backward op that made it
    grads = [(nbytes, op) for nbytes, kind, op, _ in peak.by_op if kind == "grad_bytes"]
    assert sum(nbytes for nbytes, _ in grads) == n and all("Backward" in op for _, op in grads), peak.by_op
    assert peak.phase in ("backward 0", "optimizer_step")
    assert sum(peak.by_kind.values()) == peak.peak_bytes


def test_peak_without_a_step_start_is_a_clear_error():
    with StepTrace(torch.device("cpu")) as trace:
        trace.phase("forward 0")
    with pytest.raises(RuntimeError, match="step_begins"):
        trace.peak()
