"""Profiled layer costs: build each layer alone, run a real micro-batch through it.

Side effects stay here (devices, timers, RNG, files); the partitioner only sees
the resulting ``LayerCost`` list.

* Each spec is built on its own and fed the real activation its predecessor
  produced, so shapes and dtypes are the ones the pipeline will run.
* On CPU forward and backward are timed separately after warm-up (perf_counter); the median of
  the repeats is kept.  Each backward accumulates into the gradients the one before left, as a step's
  micro-batches after its first run it.  On GPU a layer is timed as a loop of calls (``costs.gpu_timing``:
  triton's do_bench, else torch's blocked_autorange): one call between events moves from run to run.
* ``recompute_s`` is measured too: the layer's forward + backward under the checkpoint
  function the engine uses, minus the plain ones (the replay and the checkpoint's own work).
* Saved-activation bytes come from ``torch.autograd.graph.saved_tensors_hooks``:
  the unique storages autograd keeps for backward, parameters excluded.  On GPU
  the allocator peak during forward + backward is recorded too (``peak_bytes``).
* The profiler leaves no trace: it builds its own copies of the layers inside
  ``torch.random.fork_rng`` so the real model's initialisation is unchanged.
* Layers with identical specs and inputs (the transformer blocks) are measured
  once and share the result, which also gives the partitioner exact ties; a layer whose
  time follows its own weights (``layers.measured_alone``: a dropless MoE block) is measured
  each time, built from the seed the run builds it from (``layer_seeds``).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence

import torch

from ..adamw import torch_adamw
from .cache import ProfileCache, cache_key, library_versions
from .gpu_timing import Timer, cuda_timer, forward_backward_s
from .layers import build_for_profiling, describe_layer, layer_names, measured_alone, tied_key
from .probes import RegionTimer, detach_input, saved_activation_bytes, storage_key, tensors_of
from .types import LayerCost, ProfileSettings

log = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _shapes(x) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(t.shape), str(t.dtype)) for t in tensors_of(x)]


def _to_device(x, device: torch.device, dtype: torch.dtype | None = None):
    """A micro-batch as the engine feeds it: a tensor or a (nested) tuple of tensors; with ``dtype``, its
    floating-point tensors in the stage's precision (token ids stay integers)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype) if dtype is not None and x.is_floating_point() else x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to_device(t, device, dtype) for t in x)
    return x


def measure_layer(
    spec,
    x,
    *,
    device: torch.device,
    dtype: torch.dtype,
    settings: ProfileSettings,
    loss_fn: Callable | None = None,
    labels=None,
    name: str = "",
    timer: Timer | None = None,
) -> tuple[LayerCost, object]:
    """Profile one layer on input ``x``; returns its cost and its (detached) output.

    ``spec`` is any pipeline layer (``LayerSpec``, ``nn.Module``, callable); a private copy is measured.
    ``timer``: time forward and forward + backward as loops of calls (``costs.gpu_timing``; what a GPU
    uses), else each call of the warm-up/repeat loop on its own.
    """
    module, call = build_for_profiling(spec, device)
    module.to(device=device, dtype=dtype)
    if settings.compile:  # as train.compile runs it; the warm-up compiles
        module.compile()
    params = list({id(p): p for p in module.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]

    handed_to_loss = []  # the bytes of what the layer hands the loss (its logits), measured once

    def forward(inp):
        out = call(inp)
        if loss_fn is None:
            return out
        if not handed_to_loss:  # not a chunked head's weight, which the layer holds anyway
            weights = {storage_key(p) for p in params}
            handed_to_loss.append(sum(t.numel() * t.element_size() for t in tensors_of(out)
                                      if storage_key(t) not in weights))
        return loss_fn(out, labels)

    grad_out = None
    fwd_times, bwd_times = [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        resting = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    for r in range(settings.warmup + settings.repeats):
        _start_repeat(trainable, device, r)
        inp = detach_input(x)
        with RegionTimer(device) as tf:
            out = forward(inp)
        outs = [t for t in tensors_of(out) if t.requires_grad]
        if grad_out is None:
            gen = torch.Generator(device="cpu").manual_seed(0)
            grad_out = [torch.randn(t.shape, generator=gen).to(device=device, dtype=t.dtype) if t.dim() else None for t in outs]
        with RegionTimer(device) as tb:
            if outs:
                torch.autograd.backward(outs, grad_out)
        if r >= settings.warmup:
            fwd_times.append(tf.elapsed())
            bwd_times.append(tb.elapsed())
        if cuda:  # the allocator's peak over this loop: one call's output held, not the previous one's beside it
            out = outs = None

    # the output's gradient arrives from the next stage, resting memory as the input is: not the layer's.
    # Read before the optimizer's step is timed: its states are the layer's optimizer bytes, not its peak
    # (a Llama-3-8B block's AdamW states, 832 MiB, had set the peak on an H200)
    grad_bytes = sum(g.numel() * g.element_size() for g in grad_out or () if g is not None)
    peak = torch.cuda.max_memory_allocated(device) - resting - grad_bytes if cuda else 0
    optimizer_s = _optimizer_step_s(trainable, device, settings)
    if timer is not None:
        def backward(out):
            torch.autograd.backward([t for t in tensors_of(out) if t.requires_grad], grad_out)

        fwd_s, bwd_s = forward_backward_s(lambda: forward(detach_input(x)), backward, timer)
        fwd_times, bwd_times = [fwd_s], [bwd_s]
    recompute = _checkpoint_overhead(call, loss_fn, labels, x, trainable, grad_out, device, settings,
                                     plain=statistics.median(fwd_times) + statistics.median(bwd_times), timer=timer)
    for p in trainable:
        p.grad = None
    act_bytes, out = saved_activation_bytes(lambda: forward(detach_input(x)), params)
    elem = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    tied = tied_key(spec)
    n_trainable = sum(p.numel() for p in trainable)
    fwd = statistics.median(fwd_times)
    cost = LayerCost(
        name=name,
        forward_s=fwd,
        backward_s=statistics.median(bwd_times),
        recompute_s=recompute,
        param_bytes=elem(params),
        grad_bytes=elem(trainable),
        optimizer_bytes=n_trainable * settings.optimizer_bytes_per_param,
        activation_bytes=act_bytes,
        output_bytes=sum(t.numel() * t.element_size() for t in tensors_of(out)),
        peak_bytes=max(int(peak), 0),
        loss_input_bytes=handed_to_loss[0] if handed_to_loss else 0,
        # DeepSpeed marks expert parameters allreduce=False (they reduce over their expert-data-parallel group)
        expert_param_bytes=elem(p for p in params if getattr(p, "allreduce", True) is False),
        optimizer_step_s=optimizer_s,
        # a tied spec's module is one per process: all of it is what a second layer of its key shares
        tied_key=tied, tied_param_bytes=elem(params) if tied else 0,
    )
    return cost, detach_input(out)


def _start_repeat(trainable: list, device: torch.device, repeat: int) -> None:
    """The gradients a timed repeat starts from.  On a CPU the backward runs into the gradients the previous
    repeat left, as m - 1 of a step's m micro-batches run it (and as the GPU's loops of calls do): a fresh
    gradient each repeat times glibc's page faults instead, bimodally - a 98 MiB embedding's backward read 3 ms
    in one profile and 33 ms in the next while training ran it at ~7 ms - and moved bench-cpu's split.  On a GPU
    each repeat starts from none: the loop reads the allocator's peak, the layer's with its gradients fresh."""
    if device.type == "cuda" or repeat == 0:
        for p in trainable:
            p.grad = None


def _optimizer_step_s(trainable: list, device: torch.device, settings: ProfileSettings) -> float:
    """One AdamW step over the layer's parameters, as train.py builds it (fused on a GPU, the per-tensor loop on
    a CPU), with the gradients the last backward left; the median after the warm-up (the first step allocates
    its states).  Learning rate 0: the copy's weights stay as built."""
    grads = [p for p in trainable if p.grad is not None]
    if not grads:
        return 0.0
    opt = torch_adamw(grads, lr=0.0, device_type=device.type)
    times = []
    for r in range(settings.warmup + settings.repeats):
        with RegionTimer(device) as t:
            opt.step()
        if r >= settings.warmup:
            times.append(t.elapsed())
    return statistics.median(times)


def _checkpoint_function():
    """What the engine checkpoints with: DeepSpeed's non-reentrant checkpoint (``pipe.module``), else torch's."""
    try:
        from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

        return non_reentrant_checkpoint
    except ImportError:  # pragma: no cover - DeepSpeed is a dependency
        return lambda fn, *args: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def _checkpoint_overhead(call, loss_fn, labels, x, trainable, grad_out, device, settings, *, plain: float,
                         timer: Timer | None = None) -> float:
    """What activation checkpointing adds to one forward + backward of the layer: the replayed forward
    and the checkpoint's own bookkeeping, measured as the layer runs under the engine's checkpoint
    function minus its plain forward + backward (at least one forward: the replay is never free)."""
    checkpoint = _checkpoint_function()
    times = []
    run = lambda *args: call(args[0] if len(args) == 1 else tuple(args))  # noqa: E731 - as the engine calls it
    if timer is not None:
        def checkpointed():
            inp = detach_input(x)
            out = checkpoint(run, *(inp if isinstance(inp, tuple) else (inp,)))
            out = loss_fn(out, labels) if loss_fn is not None else out
            torch.autograd.backward([t for t in tensors_of(out) if t.requires_grad], grad_out)

        both = timer(checkpointed)
        for p in trainable:
            p.grad = None
        return max(both - plain, 0.0)
    for r in range(settings.warmup + settings.repeats):
        _start_repeat(trainable, device, r)
        inp = detach_input(x)
        with RegionTimer(device) as tf:
            out = checkpoint(run, *(inp if isinstance(inp, tuple) else (inp,)))
            if loss_fn is not None:
                out = loss_fn(out, labels)
        outs = [t for t in tensors_of(out) if t.requires_grad]
        with RegionTimer(device) as tb:
            if outs:
                torch.autograd.backward(outs, grad_out)
        if r >= settings.warmup:
            times.append(tf.elapsed() + tb.elapsed())
    for p in trainable:
        p.grad = None
    return max(statistics.median(times) - plain, 0.0)


def profile_layers(
    specs: Sequence,
    inputs,
    *,
    labels=None,
    loss_fn: Callable | None = None,
    names: Sequence[str] | None = None,
    settings: ProfileSettings = ProfileSettings(),
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    key_fields: dict | None = None,
    timer: Timer | None = None,
    layer_seeds: Sequence[int] | None = None,
    seed_fn: Callable[[int], None] | None = None,
) -> list[LayerCost]:
    """Profile every layer in order on one micro-batch ``inputs`` (a tensor or a tuple of tensors).

    ``specs`` are pipeline layers of any kind DeepSpeed accepts (``LayerSpec``,
    ``TiedLayerSpec``, ``nn.Module``, callables); each is named after its class or
    function unless ``names`` are given.  The loss (``loss_fn(out, labels)``) is timed as part of the last layer, since
    it always runs on the last stage.  ``key_fields`` are added to the cache key:
    pass whatever else changes the costs (model config, TP/SP degree, ...).  ``timer``: how a call is
    timed (``costs.gpu_timing``); None: loops of calls on a GPU (``cuda_timer``), single calls on a CPU.
    ``layer_seeds``: the seed each layer is built from in the run (DeepSpeed's ``seed_layers``: base_seed + i,
    through ``seed_fn`` where given): each copy is then built as the stage builds it, so a layer whose time follows
    its weights (a dropless MoE block's router) is measured with the run's weights.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:  # the current device, by name: timers, peaks, RNG fork
        device = torch.device("cuda", torch.cuda.current_device())
    host = {}
    if device.type == "cpu":
        from ..compat.cpu_shims import steady_host_allocator, training_mmap_threshold

        # measured under the allocator train.py's ranks run with: glibc's own thresholds move with what
        # the process did before, and a buffer above them pays its page faults on every call
        steady_host_allocator()
        host = {"mmap_threshold": training_mmap_threshold()}
    else:
        timer = timer or cuda_timer()
        host = {"timing": "loops-v1"}  # a GPU profile's times are loops of calls (costs.gpu_timing)
    names = list(names) if names is not None else layer_names(specs)
    fields = {
        "specs": [describe_layer(s) for s in specs],
        "inputs": _shapes(inputs),
        "labels": None if labels is None else _shapes(labels),
        "loss_fn": getattr(loss_fn, "__qualname__", repr(loss_fn)),
        "dtype": str(dtype),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu:{torch.get_num_threads()}threads",
        **host,
        "versions": library_versions(),
        # recompute_s under the checkpoint function; the optimizer step; a CPU backward into existing gradients
        "measures": "recompute-v2 optimizer-v1 tied-v1 accumulate-v1",
        "settings": {"warmup": settings.warmup, "repeats": settings.repeats,
                     "optimizer_bytes_per_param": settings.optimizer_bytes_per_param,
                     **({"compile": True} if settings.compile else {})},
        **({"layer_seeds": list(layer_seeds)} if layer_seeds is not None else {}),
        **(key_fields or {}),
    }
    cache = ProfileCache(settings.cache_dir) if settings.cache_dir else None
    key = cache_key(fields)
    if cache is not None:
        cached = cache.load(key, len(specs))
        if cached is not None:
            log.info("profile cache hit: %s", cache.path(key))
            return cached

    costs: list[LayerCost] = []
    measured: dict[str, tuple[LayerCost, object]] = {}
    x = _to_device(inputs, device, dtype)
    lab = _to_device(labels, device)
    iterator = range(len(specs))
    if settings.progress:
        try:
            from tqdm import tqdm

            iterator = tqdm(iterator, desc="profiling layers", unit="layer")
        except ImportError:  # pragma: no cover
            pass
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in iterator:
            last = i == len(specs) - 1
            sig = f"{describe_layer(specs[i])}|{_shapes(x)}|last={last}"
            if measured_alone(specs[i]):
                sig += f"|layer {i}"
            if sig not in measured:
                if layer_seeds is not None:
                    (seed_fn or torch.manual_seed)(layer_seeds[i])
                measured[sig] = measure_layer(
                    specs[i], x, device=device, dtype=dtype, settings=settings,
                    loss_fn=loss_fn if last else None, labels=lab if last else None, name=names[i],
                    timer=timer,
                )
            cost, x = measured[sig]
            # with the loss attached, the last layer's output is a scalar that never crosses a boundary
            ends_in_loss = last and loss_fn is not None
            costs.append(LayerCost(**{**cost.to_dict(), "name": names[i], **({"output_bytes": 0} if ends_in_loss else {})}))
    if cache is not None:
        path = cache.save(key, fields, costs)
        log.info("profiled %d layers; cached at %s", len(costs), path)
    return costs
