"""Megatron-core tensor (and sequence) parallelism for the GPT, applied as a ``LayerImpl``.

The model file stays the same; this function swaps its linears, vocabulary
embedding, norms and loss for megatron-core's parallel ones:

* QKV and the first MLP linear are column-parallel (output features split), the
  attention output projection and second MLP linear row-parallel (input split,
  output all-reduced; reduce-scattered along the sequence under SP).
* The vocabulary embedding is split by rows; the LM head is column-parallel over the
  vocabulary and the loss is ``vocab_parallel_cross_entropy``.
* Under SP, hidden states between blocks are the rank's sequence shard (dim 0 of
  (s, b, h)); LayerNorms and row-parallel biases see only that shard, so their
  gradients are summed over the TP group (what Megatron's
  ``allreduce_sequence_parallel_grads`` does) by a hook on each such parameter.
* apex's FusedLayerNorm is used when apex is importable and CUDA present; torch's otherwise.

Call after ``topology.initialize`` (megatron's groups must exist).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .layers import INIT_STD, LayerImpl, RMSNorm


def _init(weight: torch.Tensor) -> torch.Tensor:
    return nn.init.normal_(weight, mean=0.0, std=INIT_STD)


def _layer_norm_class():
    if torch.cuda.is_available():
        try:
            from apex.normalization import FusedLayerNorm  # optional accelerator

            return FusedLayerNorm
        except ImportError:
            pass
    return nn.LayerNorm


def _sum_grads_over_tp(param: nn.Parameter) -> None:
    """Each TP rank saw a different sequence shard (or its own heads): the true gradient is their sum."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    param.sequence_parallel = True  # Megatron's marker
    param.register_hook(hook)


class _SumGradOverTP(torch.autograd.Function):
    """Megatron's f operator (identity forward, the gradient all-reduced over TP backward) for a gradient of any
    layout: megatron-core's ``copy_to_tensor_model_parallel_region`` all-reduces ``grad.contiguous()`` and returns
    the gradient it was handed, so a non-contiguous gradient (a permuted view's) comes back unreduced."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def megatron_layer_impl(*, tp: int, sequence_parallel: bool = False) -> LayerImpl:
    from megatron.core import tensor_parallel as mtp
    from megatron.core.transformer import TransformerConfig

    # only the parallel settings of this config matter to the layers built here
    cfg = TransformerConfig(num_layers=1, hidden_size=8 * tp, num_attention_heads=tp, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                            perform_initialization=True, params_dtype=torch.float32)

    class Column(mtp.ColumnParallelLinear):
        def forward(self, x):  # megatron returns (output, bias); the bias is already added
            return super().forward(x)[0]

    class Row(mtp.RowParallelLinear):
        def forward(self, x):
            return super().forward(x)[0]

    def column_linear(in_features: int, out_features: int, *, bias: bool = True) -> nn.Module:
        return Column(in_features, out_features, config=cfg, init_method=_init, bias=bias, gather_output=False)

    def row_linear(in_features: int, out_features: int, *, bias: bool = True) -> nn.Module:
        layer = Row(in_features, out_features, config=cfg, init_method=_init, bias=bias, input_is_parallel=True,
                    skip_bias_add=False)
        if sequence_parallel and bias:
            _sum_grads_over_tp(layer.bias)
        return layer

    def embedding(num: int, dim: int) -> nn.Module:
        return mtp.VocabParallelEmbedding(num, dim, init_method=_init, config=cfg)

    def replicated_norm(norm: nn.Module) -> nn.Module:
        if sequence_parallel:
            for p in norm.parameters():
                _sum_grads_over_tp(p)
        return norm

    def layer_norm(dim: int, eps: float) -> nn.Module:
        return replicated_norm(_layer_norm_class()(dim, eps=eps))

    def rms_norm(dim: int, eps: float) -> nn.Module:
        return replicated_norm(RMSNorm(dim, eps=eps))

    def head_norm(dim: int, eps: float) -> nn.Module:
        norm = RMSNorm(dim, eps=eps)
        for p in norm.parameters():
            if tp > 1:  # with or without SP: each rank normalised its own heads
                _sum_grads_over_tp(p)
        return norm

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return mtp.vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous()).mean()

    def tied_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Column-parallel product with the embedding's vocabulary rows (gathers the sequence under SP)."""
        from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

        return linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, gradient_accumulation_fusion=False,
            allreduce_dgrad=tp > 1 and not sequence_parallel, sequence_parallel=sequence_parallel)

    def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state

        return _SumGradOverTP.apply(x, parallel_state.get_tensor_model_parallel_group())

    enter = mtp.scatter_to_sequence_parallel_region if sequence_parallel else (lambda x: x)
    return LayerImpl(name="megatron", column_linear=column_linear, row_linear=row_linear, embedding=embedding,
                     layer_norm=layer_norm, rms_norm=rms_norm, head_norm=head_norm, tp_size=tp, sequence_parallel=sequence_parallel,
                     enter_blocks=enter, loss=loss, tied_head=tied_head,
                     copy_to_tp=copy_to_tp)


def shard_like(full_state: dict[str, torch.Tensor], model: nn.Module, *, rank: int | None = None,
               size: int | None = None) -> dict[str, torch.Tensor]:
    """This rank's slice of a full (single-process) state dict, for a model built with TP layers.

    Parameters megatron marks ``tensor_model_parallel`` are split along their
    ``partition_dim`` into tp equal chunks; everything else is replicated.  A parameter whose output
    holds several projections side by side (``models.layers.mark_sections``: q, k, v; gate, up) gets
    its share of each section, concatenated.  ``rank`` / ``size``: this rank's place in the TP group, where
    it is not megatron's.
    """
    if rank is None or size is None:
        from megatron.core import parallel_state

        rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    params = dict(model.named_parameters())
    for name, tensor in model.state_dict().items():
        if name.endswith("_extra_state"):  # megatron's per-layer metadata (FP8 state), not a weight
            out[name] = tensor
            continue
        full = full_state[name]
        p = params.get(name)
        if p is not None and getattr(p, "tensor_model_parallel", False):
            sections = getattr(p, "shard_sections", None) or (full.shape[p.partition_dim],)
            full = torch.cat([part.chunk(size, dim=p.partition_dim)[rank]
                              for part in full.split(list(sections), dim=p.partition_dim)], dim=p.partition_dim)
        if full.shape != tensor.shape:
            raise ValueError(f"{name}: full {tuple(full_state[name].shape)} does not shard to {tuple(tensor.shape)}")
        out[name] = full.clone()
    return out
