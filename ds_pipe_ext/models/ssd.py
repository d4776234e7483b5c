"""Mamba-2's state-space dual (SSD) scan, chunked, in plain torch (Dao and Gu, 2024, section 6).

Per head, with a scalar decay a_t = exp(dt_t * A) (A < 0) and a state S of (head_dim, d_state):

    S_t = a_t * S_{t-1} + dt_t * x_t B_t^T,        y_t = S_t C_t

``ssd_scan`` computes it a chunk of Q steps at a time: inside a chunk, quadratically, as attention with the
causal decay mask exp(sum of log-decays between s and t); across chunks, by carrying the state from one chunk's
end to the next chunk's start (a loop over L / Q chunks).  Heads share B and C within a group, as Mamba-2's
``ngroups`` do.  ``ssd_recurrence`` is the step-by-step definition, for tests.  Both run on any device.

Inside a chunk the scan holds (b, chunks, Q, Q, heads) decay weights: with Q = 128 and 128 heads, 8 MiB a chunk
a sequence in fp32.  On a GPU ``mamba_ssm``'s fused kernels keep them on chip (``mamba2.cuda_kernels``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# exp of an argument below log(float32's smallest normal) returns a subnormal or zero and leaves the CPU's vector
# path: 45x slower than in range (torch 2.13 on an AMD EPYC here), 5x for -inf.  Decay weights of steps far apart
# fall there, so exp's argument is clamped at this; what that drops is below 1.2e-38.
SMALLEST_LOG = -87.0


class _Decay(torch.autograd.Function):
    """exp of a log-decay clamped to [SMALLEST_LOG, 0], with exp's own gradient (grad x result), not the clamp's
    (whose backward is 4-5 passes more over the chunk's decay weights).  Below the clamp that gradient is
    1e-38 where the true one is smaller; above it (positive arguments: only above the chunk's diagonal) the
    gradient arriving is zero, the scores there being masked."""

    @staticmethod
    def forward(ctx, log_decay):
        out = torch.exp(log_decay.clamp(SMALLEST_LOG, 0.0))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.saved_tensors[0]


_decay = _Decay.apply


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, l, groups, n) -> (b, l, heads, n): each head reads its group's B or C."""
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def ssd_recurrence(x, dt, A, B, C, state=None):
    """The definition, one step at a time: x (b, l, h, p), dt (b, l, h) > 0, A (h) < 0, B and C (b, l, g, n);
    returns y (b, l, h, p) and the last state (b, h, p, n)."""
    b, l, h, p = x.shape
    B, C = _per_head(B, h), _per_head(C, h)
    if state is None:
        state = x.new_zeros(b, h, p, B.shape[-1])
    ys = []
    for t in range(l):
        decay = torch.exp(dt[:, t] * A)  # (b, h)
        state = decay[..., None, None] * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(ys, dim=1), state


def ssd_scan(x, dt, A, B, C, chunk: int, state=None):
    """``ssd_recurrence``'s result, a chunk of ``chunk`` steps at a time; any length (the last chunk is padded
    with steps of dt = 0, which neither decay the state nor add to it)."""
    if torch.is_grad_enabled() and state is None and any(t.requires_grad for t in (x, dt, A, B, C)):
        return _RecomputedScan.apply(x, dt, A, B, C, chunk), None
    return _scan(x, dt, A, B, C, chunk, state)


class _RecomputedScan(torch.autograd.Function):
    """The scan keeping its inputs only (x, dt, A, B, C), its intermediates recomputed in the backward, as
    ``mamba_ssm``'s fused scan does: per token it keeps (heads x head_dim + 2 groups x state + heads) values
    (most of them views of the conv's output) where the written-out scan kept several times its chunk's
    (chunk x chunk x heads) decay weights."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk):
        ctx.chunk = chunk
        ctx.save_for_backward(x, dt, A, B, C)
        with torch.no_grad():
            return _scan(x, dt, A, B, C, chunk)[0]

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            y = _scan(*inputs, ctx.chunk)[0]
            wanted = [t for t in inputs if t.requires_grad]
            got = iter(torch.autograd.grad(y, wanted, grad))
        return (*(next(got) if t.requires_grad else None for t in inputs), None)


def _scan(x, dt, A, B, C, chunk: int, state=None):
    """The chunked scan, laid out for batched products without copies: the heads of a group sit side by side in x's
    last two dims, so a group's (chunk, heads x head_dim) block is a strided matrix that ``bmm`` reads in place, and
    B and C (one per group) enter their products once a group, not once a head.  The loop over groups is short
    (``n_groups`` / TP: 1 to 8); unbind, whose backward is one stack, where indexing's would zero a whole buffer
    per slice."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    per_group = h // g
    pad = (-l) % chunk
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    chunks, q = (l + pad) // chunk, chunk
    bc = b * chunks
    xs = (x * dt[..., None]).reshape(bc, q, h, p)  # the input each step adds, dt_t * x_t
    Bs, Cs = B.reshape(bc, q, g, n).unbind(2), C.reshape(bc, q, g, n).unbind(2)
    log_decay = (dt * A).view(bc, q, h).transpose(1, 2).cumsum(dim=2)  # (bc, h, t): log-decay from the chunk's start
    last = log_decay[:, :, -1:]

    # inside each chunk: y_t = sum_{s <= t} exp(cum_t - cum_s) (C_t . B_s) dt_s x_s.  Above the diagonal
    # cum_t - cum_s >= 0, clamped to 0 (exp 1, never inf), and the scores are masked: a group's, not each head's
    # decay weights (masked with -inf they would be exp's slow path)
    upper = torch.ones(q, q, dtype=torch.bool, device=x.device).triu(1)
    between = log_decay[:, :, :, None] - log_decay[:, :, None, :]  # (bc, h, t, s)
    decay = _decay(between).unflatten(1, (g, per_group))  # (bc, g, heads of a group, t, s)
    # each chunk's own contribution to the state at its end: sum_s exp(cum_last - cum_s) dt_s x_s B_s^T
    to_end = _decay(last - log_decay).transpose(1, 2)  # (bc, s, h)
    xs_to_end = (xs * to_end[..., None]).reshape(bc, q, g, per_group * p)
    heads_first = xs.transpose(1, 2).unflatten(1, (g, per_group))  # (bc, g, heads of a group, s, p): a view
    inside, added = [], []
    for Cg, Bg, decay_g, xs_g, end_g in zip(Cs, Bs, decay.unbind(1), heads_first.unbind(1), xs_to_end.unbind(2)):
        scores = (Cg @ Bg.transpose(1, 2)).masked_fill(upper, 0.0)  # (bc, t, s): C_t . B_s, s <= t
        inside.append((decay_g * scores[:, None]) @ xs_g)  # (bc, heads of a group, t, p)
        added.append(end_g.transpose(1, 2) @ Bg)  # (bc, heads of a group x p, n)
    added = torch.stack(added, dim=1).view(b, chunks, h, p, n)

    # across chunks: the state entering each chunk, carried from the one before, read by every step of it
    state = x.new_zeros(b, h, p, n) if state is None else state
    carry = _decay(last).view(b, chunks, h, 1, 1)
    entering = []
    for carry_c, added_c in zip(carry.unbind(1), added.unbind(1)):
        entering.append(state)
        state = carry_c * state + added_c
    entering = torch.stack(entering, dim=1).view(bc, g, per_group * p, n)
    from_before = torch.stack([Cg @ e.transpose(1, 2) for Cg, e in zip(Cs, entering.unbind(1))], dim=2)
    y = (from_before.view(bc, q, h, p) * _decay(log_decay).transpose(1, 2)[..., None]
         + torch.cat(inside, dim=1).transpose(1, 2))
    return y.reshape(b, chunks * q, h, p)[:, :l], state
