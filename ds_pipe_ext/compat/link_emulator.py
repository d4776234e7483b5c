"""A slower network on one machine: every pipeline p2p transfer takes latency + bytes / bandwidth more.

DeepSpeed's pipeline engine moves activations and gradients between stages with
``deepspeed.runtime.pipe.p2p.send`` / ``recv`` (module functions it looks up at each
call).  Both are rendezvous operations under gloo and NCCL: a send returns once the
receiver has taken the tensor (measured: a gloo send of 4 KB waits the full second its
receiver sleeps).  A link of latency L and bandwidth W delays that rendezvous by
L + bytes / W on both sides, so both wrappers sleep that long after the real call.
``simulate.events`` models exactly this (``comm="rendezvous"``).

Only the engine's p2p calls are slowed: DualPipeV's batched ``P2POp`` transfers and the
collectives (loss broadcast, gradient reduction) are not.  Off unless ds.json's
``"pipeline": {"link_emulation": {...}}`` asks for it; ``restore()`` undoes it.
"""

from __future__ import annotations

import time

_ORIGINAL: dict = {}


def _payload(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def emulate_links(latency_s: float, bandwidth: float | None) -> None:
    """Slow every later ``p2p.send``/``recv`` of this process by ``latency_s + bytes / bandwidth``."""
    from deepspeed.runtime.pipe import p2p

    if latency_s < 0 or (bandwidth is not None and bandwidth <= 0):
        raise ValueError(f"link emulation needs latency >= 0 and bandwidth > 0, got {latency_s} s, {bandwidth} B/s")
    restore()
    _ORIGINAL.update(send=p2p.send, recv=p2p.recv)

    def delayed(op):
        def call(tensor, stage, async_op=False):
            out = op(tensor, stage, async_op=async_op)
            time.sleep(latency_s + (_payload(tensor) / bandwidth if bandwidth else 0.0))
            return out

        call.__wrapped__ = op
        return call

    p2p.send, p2p.recv = delayed(_ORIGINAL["send"]), delayed(_ORIGINAL["recv"])


def restore() -> None:
    """DeepSpeed's own p2p functions again."""
    if _ORIGINAL:
        from deepspeed.runtime.pipe import p2p

        p2p.send, p2p.recv = _ORIGINAL.pop("send"), _ORIGINAL.pop("recv")
