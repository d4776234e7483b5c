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
    b, l, h, p = x.shape
    n = B.shape[-1]
    pad = (-l) % chunk
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    chunks = (l + pad) // chunk
    B, C = _per_head(B, h), _per_head(C, h)
    xs = (x * dt[..., None]).view(b, chunks, chunk, h, p)  # the input each step adds, dt_t * x_t
    B, C = B.view(b, chunks, chunk, h, n), C.view(b, chunks, chunk, h, n)
    log_decay = (dt * A).view(b, chunks, chunk, h).cumsum(dim=2)  # sum of log-decays from the chunk's start to t

    # inside each chunk: y_t = sum_{s <= t} exp(cum_t - cum_s) (C_t . B_s) dt_s x_s
    between = log_decay[:, :, :, None, :] - log_decay[:, :, None, :, :]  # (b, c, t, s, h)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    weights = torch.exp(between.masked_fill(~causal[:, :, None], float("-inf")))
    weights = weights * torch.einsum("bcthn,bcshn->bctsh", C, B)
    y = torch.einsum("bctsh,bcshp->bcthp", weights, xs)

    # each chunk's own contribution to the state at its end: sum_s exp(cum_last - cum_s) dt_s x_s B_s^T
    to_end = torch.exp(log_decay[:, :, -1:, :] - log_decay)  # (b, c, s, h)
    added = torch.einsum("bcsh,bcshp,bcshn->bchpn", to_end, xs, B)
    # across chunks: the state entering each chunk, carried from the one before, read by every step of it
    state = x.new_zeros(b, h, p, n) if state is None else state
    entering = []
    for c in range(chunks):
        entering.append(state)
        state = torch.exp(log_decay[:, c, -1])[..., None, None] * state + added[:, c]
    entering = torch.stack(entering, dim=1)  # (b, c, h, p, n)
    y = y + torch.einsum("bcthn,bchpn,bcth->bcthp", C, entering, torch.exp(log_decay))
    return y.reshape(b, chunks * chunk, h, p)[:, :l], state
