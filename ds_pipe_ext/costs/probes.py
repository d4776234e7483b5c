"""What one call of a layer takes and holds, measured: the region timer the profiler times with, the bytes
autograd saves (``saved_tensors_hooks``), and the most a call holds at once on a CPU (torch.profiler's allocation
events).  ``costs.profiler`` runs layers through these; tests and benches probe single calls with them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


class RegionTimer:
    """Wall time of a region: CUDA events on GPU (no host sync inside), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._end.record()
        else:
            self.seconds = time.perf_counter() - self._t0

    def elapsed(self) -> float:
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self.seconds


def tensors_of(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in tensors_of(item)]
    return []


def detach_input(x):
    """A leaf copy of an activation: float tensors require grad, as a stage input does.

    A view into a larger storage (Megatron's sequence-parallel scatter returns a
    slice of the full tensor) is compacted first, so that the next layer's saved
    input is counted at its own size, as when it arrives over p2p.
    """
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.untyped_storage().nbytes() > x.numel() * x.element_size():
            x = x.clone()
        return x.requires_grad_(True) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(detach_input(t) for t in x)
    return x


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


def saved_activation_bytes(run: Callable[[], object], params: Sequence[torch.Tensor]) -> tuple[int, object]:
    """Bytes of the unique non-parameter storages autograd saves while ``run()`` executes."""
    param_storages = {storage_key(p) for p in params}
    seen: set[tuple[int, int]] = set()

    held: list[torch.Tensor] = []

    def pack(t: torch.Tensor):
        key = storage_key(t)
        if key not in param_storages:
            seen.add(key)
        # The graph gets an index, not the tensor: this forward only counts and is never
        # backpropagated, and a graph holding an op's own output (output -> grad_fn -> saved output)
        # is a cycle through C++ the garbage collector cannot see (every profile leaked its layer).
        # ``held`` keeps the saved tensors alive until the forward ends, so a freed storage's
        # address is not reused under a new key and counted twice
        held.append(t)
        return len(held) - 1

    def unpack(_):
        raise RuntimeError("the activation-counting forward cannot be backpropagated")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = run()
    held.clear()
    return sum(nbytes for _, nbytes in seen), out


def allocation_events(prof, device_type: str) -> list:
    """A finished ``torch.profiler`` (``profile_memory``) run's allocation events on ``device_type``, in time
    order (a free before an allocation at one instant): (event, its fields: ``alloc_size`` negative for a free,
    ``ptr``, ``total_allocated``); each event's ``parent`` is the op that allocated."""
    from torch._C._profiler import _EventType

    found, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        tag, fields = event.typed
        if tag == _EventType.Allocation:
            if fields.device.type == device_type:
                found.append((event, fields))
            continue
        stack.extend(event.children)
    return sorted(found, key=lambda e: (e[0].start_time_ns, e[1].alloc_size))


def traced_peak_bytes(run: Callable[[], object]) -> int:
    """The most bytes ``run()`` holds at once on the CPU above what was alive before it, from torch.profiler's
    allocation events (``profile_memory``): what a GPU's allocator peak says of the same call.  ``run`` is
    called twice, the first untraced (lazy initialisation, caches)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        run()
    live = peak = 0
    for _, fields in allocation_events(prof, "cpu"):
        live += fields.alloc_size
        peak = max(peak, live)
    return peak


# ops that move no data: views, and allocations whose contents are not read
_NO_TRAFFIC = {"view", "_unsafe_view", "transpose", "unbind", "select", "slice", "expand", "unflatten", "as_strided",
               "t", "permute", "unsqueeze", "squeeze", "detach", "alias", "split", "split_with_sizes", "reshape",
               "_reshape_alias", "lift_fresh", "narrow", "empty", "empty_like", "empty_strided", "new_empty"}
_UNREAD_INPUTS = {"zeros", "ones", "full", "zeros_like", "ones_like", "new_zeros", "new_ones", "new_full"}
# the products and the kernels priced by FLOPs or measured apart (a fused attention, a convolution)
PRODUCT_OPS = {"mm", "bmm", "addmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward", "convolution", "convolution_backward",
               "mkldnn_convolution"}


def _distinct_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor's elements span once each (a broadcast dimension, stride 0, counted once)."""
    if not t.numel():
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n * t.element_size()


def eager_traffic(run: Callable[[], object]) -> dict[str, int]:
    """Bytes each aten op ``run()`` dispatches reads and writes, by op name: every input's and output's distinct
    elements (views free; a factory's input unread), as an eager CPU or GPU runs them one kernel an op.  What the
    analytic ops' ``fwd_bytes`` / ``bwd_bytes`` are checked against where they count an eager code's passes
    (``PRODUCT_OPS``: the products and kernels priced otherwise, kept apart under their own names)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    moved: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name not in _NO_TRAFFIC:
                ins = [] if name in _UNREAD_INPUTS else tree_flatten((args, kwargs))[0]
                tensors = [x for x in (*ins, *tree_flatten(out)[0]) if isinstance(x, torch.Tensor)]
                moved[name] = moved.get(name, 0) + sum(map(_distinct_bytes, tensors))
            return out

    with Count():
        run()
    return moved


def elementwise_traffic(run: Callable[[], object]) -> int:
    """``eager_traffic``'s bytes outside ``PRODUCT_OPS``: the elementwise passes, reductions and copies."""
    return sum(b for name, b in eager_traffic(run).items() if name not in PRODUCT_OPS)
