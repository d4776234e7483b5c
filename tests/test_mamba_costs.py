"""The Mamba-2 mixer's analytic costs against what runs: the bytes autograd saves (the profiler's count, fp32 on
this CPU), its weights, and its FLOPs by hand."""

import pytest
import torch

from ds_pipe_ext.costs import analytic as A
from ds_pipe_ext.costs.mamba_ops import mamba2_mixer
from ds_pipe_ext.costs.probes import elementwise_traffic, saved_activation_bytes
from ds_pipe_ext.models.mamba2 import Mamba2Mixer, Mamba2Shape

SHAPES = [  # (hidden, heads, head_dim, state, groups, chunk, kernel, b, s)
    (64, 8, 16, 16, 2, 16, 4, 2, 64),
    (48, 6, 8, 32, 1, 8, 4, 1, 37),  # a sequence that is no multiple of the chunk
    (32, 4, 16, 8, 4, 32, 3, 3, 20),  # a chunk longer than the sequence
]


@pytest.mark.parametrize("hidden, heads, head_dim, state, groups, chunk, kernel, b, s", SHAPES)
def test_the_mixers_saved_bytes_and_weights_are_counted(hidden, heads, head_dim, state, groups, chunk, kernel, b, s):
    shape = Mamba2Shape(hidden=hidden, heads=heads, head_dim=head_dim, state=state, groups=groups, chunk=chunk,
                        conv_kernel=kernel)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(shape)
    x = torch.randn(b, s, hidden, requires_grad=True)
    saved, _ = saved_activation_bytes(lambda: mixer(x), list(mixer.parameters()))
    shp = A.Shape(b=b, s=s, h=hidden, a=1, f=1, V=1, e=4)
    ops = mamba2_mixer(shp, heads=heads, head_dim=head_dim, state=state, groups=groups, conv_kernel=kernel,
                       chunk=chunk, torch_code=True)  # the conv and the scan as they run here
    analytic = sum(op.activation_bytes for op in ops)
    assert analytic == pytest.approx(saved, rel=0.03)
    assert abs(analytic - saved) <= 2 * heads * 4  # all but A = -exp(A_log), which two ops keep
    params = sum(p.numel() for p in mixer.parameters())
    assert sum(sum(op.weights) for op in ops) == params  # the dt op holds dt_bias, A_log and D


def test_the_scans_flops_by_hand():
    shp = A.Shape(b=2, s=64, h=64, a=1, f=1, V=1, e=4)
    scan = next(op for op in mamba2_mixer(shp, heads=8, head_dim=16, state=16, groups=2, conv_kernel=4, chunk=16)
                if op.name == "mamba_ssd_scan")
    chunks, b, Q, H, P, N, G = 4, 2, 16, 8, 16, 16, 2
    per_chunk = 2 * Q * Q * G * N + Q * Q * H + 2 * Q * Q * H * P + 4 * Q * H * P * N
    assert scan.fwd_flops == chunks * b * per_chunk + 2 * chunks * b * H * P * N
    assert scan.bwd_flops == 3 * scan.fwd_flops  # recomputed, then twice the forward


def test_tensor_parallelism_must_divide_the_groups_in_the_costs_too():
    shp = A.Shape(b=1, s=8, h=32, a=8, f=8, V=1, e=2, t=4)
    with pytest.raises(ValueError, match=r"tensor parallelism 4 does not divide n_groups \(2\)"):
        mamba2_mixer(shp, heads=8, head_dim=4, state=4, groups=2, conv_kernel=4, chunk=8)
    two = mamba2_mixer(A.Shape(b=1, s=8, h=32, a=8, f=8, V=1, e=2, t=2), heads=8, head_dim=4, state=4, groups=2,
                       conv_kernel=4, chunk=8)
    one = mamba2_mixer(A.Shape(b=1, s=8, h=32, a=1, f=1, V=1, e=2), heads=8, head_dim=4, state=4, groups=2,
                       conv_kernel=4, chunk=8)
    assert sum(op.fwd_flops for op in two) < sum(op.fwd_flops for op in one)
    assert two[0].weights[0] * 2 == one[0].weights[0]  # in_proj: half the output features a rank


def hybrid(pattern: str = "M-M*-ME", **mamba):
    """A Nemotron-H-like description: each letter one block of its kind."""
    from ds_pipe_ext.arch import MLP, Attention, Block, Experts, Mamba2, ModelDescription

    m = Mamba2(**{"heads": 8, "head_dim": 16, "state": 16, "groups": 2, "chunk": 16, **mamba})
    kinds = {"M": Block(None, None, mamba=m), "*": Block(Attention(heads=4, kv_heads=2, kernel="fused"), None),
             "-": Block(None, MLP(256, "relu2")), "E": Block(None, MLP(64, "swiglu"), Experts(count=4, top_k=2))}
    return ModelDescription("hybrid", hidden=64, vocab=1024, seq_len=64, blocks=[kinds[c] for c in pattern],
                            positions="none", norm="rmsnorm", tied_head=False, linear_bias=False)


def test_a_hybrid_description_is_costed_block_by_block():
    """Each letter's block is its norm, its one kind of layer and its residual: a Mamba-2 block is the mixer's ops,
    an MLP block the transformer block's second half, an attention block its first; the partition sees each."""
    from ds_pipe_ext.costs.estimate import shape_for, EstimateRequest
    from ds_pipe_ext.costs.layer_ops import layer_ops

    desc = hybrid()
    assert [b.kind for b in desc.blocks] == ["mamba", "mlp", "mamba", "attention", "mlp", "mamba", "moe"]
    shp = shape_for(desc, EstimateRequest(2, 64, dtype="fp32"), runs_on="cpu")
    layers = layer_ops(desc, shp, device="cpu")
    names = [[op.name for op in ops] for _, _, ops in layers[1:-1]]
    torch_scan = ["mamba_ssd_products", "mamba_ssd_exps", "mamba_ssd_passes"]  # a CPU's
    assert names[0] == ["norm", "mamba_in_proj", "mamba_conv1d", "mamba_conv_silu", "mamba_dt", *torch_scan,
                        "mamba_gated_norm", "mamba_out_proj", "residual"]
    assert names[1] == ["ln_2", "fc1", "relu2", "fc2", "mlp_dropout", "residual_2"]
    assert names[3][0] == "ln_1" and names[3][-1] == "residual_1" and "fc1" not in names[3]
    assert any(n.startswith("expert_") for n in names[6]) and "qkv" not in names[6]
    mixer = sum(op.activation_bytes for op in layers[1][2][1:-1])
    assert mixer == sum(op.activation_bytes for op in mamba2_mixer(shp, heads=8, head_dim=16, state=16, groups=2,
                                                                   conv_kernel=4, chunk=16, torch_code=True))


def test_tensor_parallelism_must_divide_a_hybrids_mamba_groups():
    from ds_pipe_ext.layout import Layout, LayoutError

    Layout(tp=2, dp=1).check(hybrid("M-M*-M"))  # (the MoE family refuses TP: no E layer here)
    with pytest.raises(LayoutError, match=r"tensor parallel degree 4 does not divide the Mamba-2 n_groups \(2\)"):
        Layout(tp=4, dp=1).check(hybrid("M-M-M"))


@pytest.mark.parametrize("b, s, heads, head_dim, groups, state, chunk", [
    (1, 256, 16, 64, 2, 64, 64), (2, 100, 8, 8, 1, 16, 16), (3, 96, 12, 8, 3, 24, 32)])
def test_the_torch_scans_passes_are_what_its_code_moves(b, s, heads, head_dim, groups, state, chunk):
    """``torch_scan_ops``' elementwise bytes against a dispatch-level count of ``ssd_scan`` forward and backward
    (the mixer's D skip, which the op also carries, added by hand): within 10%."""
    from ds_pipe_ext.costs.mamba_ops import torch_scan_ops
    from ds_pipe_ext.models.ssd import ssd_scan

    torch.manual_seed(0)
    x = torch.randn(b, s, heads, head_dim, requires_grad=True)
    dt = (torch.rand(b, s, heads) * 0.1 + 0.01).requires_grad_()
    A = (-torch.rand(heads) - 0.5).requires_grad_()
    B, C = (torch.randn(b, s, groups, state, requires_grad=True) for _ in range(2))
    with torch.no_grad():
        forward = elementwise_traffic(lambda: ssd_scan(x, dt, A, B, C, chunk))
    y = ssd_scan(x, dt, A, B, C, chunk)[0]
    grad = torch.ones_like(y)
    backward = elementwise_traffic(lambda: y.backward(grad))
    skip = 5 * b * s * heads * head_dim * 4
    elementwise = torch_scan_ops(_scan_shape(b, s), heads=heads, head_dim=head_dim, state=state, groups=groups,
                                 chunk=chunk, activation_bytes=0)[1:]  # the exps and the other passes
    assert sum(op.fwd_bytes for op in elementwise) == pytest.approx(forward + skip, rel=0.1)
    assert sum(op.bwd_bytes for op in elementwise) == pytest.approx(backward + 3 * skip, rel=0.1)


def _scan_shape(b: int, s: int) -> A.Shape:
    return A.Shape(b=b, s=s, h=64, a=1, f=1, V=1, e=4)


@pytest.mark.parametrize("b, s, channels, kernel, bias", [(1, 256, 1280, 4, True), (2, 100, 96, 4, True),
                                                         (3, 64, 40, 3, False)])
def test_the_torch_convs_passes_are_what_its_code_moves(b, s, channels, kernel, bias):
    """``torch_conv_op``'s bytes and saved bytes against a dispatch-level count of ``causal_depthwise_conv`` and
    the profiler's saved tensors: within 3%."""
    from ds_pipe_ext.costs.mamba_ops import torch_conv_op
    from ds_pipe_ext.models.mamba2 import causal_depthwise_conv

    x = torch.randn(b, s, channels, requires_grad=True)
    w = torch.randn(channels, 1, kernel, requires_grad=True)
    bb = torch.randn(channels, requires_grad=True) if bias else None
    params = [w] + ([bb] if bias else [])
    with torch.no_grad():
        forward = elementwise_traffic(lambda: causal_depthwise_conv(x, w, bb))
    y = causal_depthwise_conv(x, w, bb)
    grad = torch.ones_like(y)
    backward = elementwise_traffic(lambda: y.backward(grad))
    saved, _ = saved_activation_bytes(lambda: causal_depthwise_conv(x, w, bb), params)
    op = torch_conv_op(_scan_shape(b, s), channels=channels, kernel=kernel, bias=bias,
                       weights=tuple(p.numel() for p in params))
    assert op.fwd_bytes == pytest.approx(forward, rel=0.03)
    assert op.bwd_bytes == pytest.approx(backward, rel=0.03)
    assert op.activation_bytes == saved
