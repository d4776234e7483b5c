"""DeepSeek-V3's multi-token-prediction layers from its Hugging Face checkpoint, as pipeline layers.

transformers' ``DeepseekV3ForCausalLM`` builds ``num_hidden_layers`` layers and ignores the MTP weights the
released checkpoints hold after them (``model.layers.61.*``: ``enorm``, ``hnorm``, ``eh_proj``, a decoder layer's
weights, ``shared_head.norm``; ``embed_tokens`` and ``shared_head.head`` are copies of the model's own table and
head).  ``pipeline_layers(..., mtp=True)`` reads them from the safetensors files and runs them as
``models.mtp`` does (megatron-core's procedure; its docstring says why this way):

    embedding ─► (h, e_1 .. e_D) ─► decoder layers pass the e_k along ─► MTP layer k: takes e_k, appends h_k
              ─► head: the final norm of h, then one product of the shared head over [h; h_1 .. h_D]

``mtp_causal_lm_loss(depth, scale)`` is the pipeline's loss then: transformers' causal-LM loss on the main logits
plus scale / D x each MTP layer's, layer k predicting the token k + 1 places after the next (labels are the
inputs, unshifted, -100 ignored).  The e_k and the h_k cross stage boundaries in (b, s, h) layout, as the
hidden states do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .source import HFPipelineError, HFSource, _stack_experts

# the MTP layer's own modules; everything else under its prefix is the decoder layer's, but for the copies of
# the model's table and head, which the pipeline does not duplicate
OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
COPIES = ("embed_tokens.", "shared_head.head.")


def mtp_depth(source: HFSource) -> int:
    """The MTP layers the config declares (DeepSeek-V3's ``num_nextn_predict_layers``), 0 for other models."""
    return int(getattr(source.config, "num_nextn_predict_layers", 0) or 0)


def check_mtp(source: HFSource) -> int:
    """The MTP depth of ``source``, refused by name where there is none or the checkpoint lacks its weights."""
    depth = mtp_depth(source)
    if source.config.model_type != "deepseek_v3" or depth < 1:
        raise HFPipelineError(f"mtp=True: model_type {source.config.model_type!r} declares no multi-token-prediction "
                              f"layers (DeepSeek-V3's num_nextn_predict_layers); build without mtp")
    if source.model is not None:
        raise HFPipelineError("mtp=True reads the MTP weights from the safetensors files: pass the save_pretrained "
                              "directory, not a model instance (transformers' model holds no MTP weights)")
    for k in range(depth):
        prefix = f"model.layers.{source.num_layers + k}."
        if not source.tensors(prefix + "eh_proj."):
            raise HFPipelineError(f"{source.directory}: no weights under {prefix} for MTP layer {k + 1}; the "
                                  f"checkpoint holds none (transformers' save_pretrained drops them): build without "
                                  f"mtp")
    return depth


class HFMTPPipe(nn.Module):
    """MTP layer ``k`` (1-based) of ``depth``: (h, e_k .. e_D, h_1 .. h_k-1) -> (h, e_k+1 .. e_D, h_1 .. h_k)."""

    tensor_parallel = False  # whole HF weights: PipelineModule refuses a model-parallel axis

    def __init__(self, source: HFSource, k: int, depth: int):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        from .layers import HFDecoderLayerPipe

        cfg, index = source.config, source.num_layers + k - 1
        self.k, self.depth = k, depth
        state = source.tensors(f"model.layers.{index}.")
        self.enorm = DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.final_norm = DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        with torch.no_grad():
            for module, key in ((self.enorm, "enorm."), (self.hnorm, "hnorm."), (self.eh_proj, "eh_proj."),
                                (self.final_norm, "shared_head.norm.")):
                module.load_state_dict({n.removeprefix(key): t for n, t in state.items() if n.startswith(key)})
        layer = DeepseekV3DecoderLayer(cfg, index)
        own = {n: t for n, t in state.items() if not n.startswith(OWN + COPIES)}
        own = _stack_experts(own, layer.state_dict())
        missing = sorted(set(layer.state_dict()) - set(own))
        if missing:
            raise HFPipelineError(f"{source.directory}: no weights for model.layers.{index}.{missing[0]} (MTP layer {k})")
        layer.load_state_dict(own, strict=True)
        self.decoder = HFDecoderLayerPipe(source, index, layer=layer)

    def forward(self, inputs: tuple) -> tuple:
        h, *rest = inputs
        embeddings, outputs = rest[: self.depth - self.k + 1], rest[self.depth - self.k + 1:]
        previous = outputs[-1] if outputs else h
        x = self.eh_proj(torch.cat((self.enorm(embeddings[0]), self.hnorm(previous)), dim=-1))
        return (h, *embeddings[1:], *outputs, self.final_norm(self.decoder(x)))


def mtp_causal_lm_loss(depth: int, scale: float = 0.1):
    """The pipeline's loss with ``depth`` MTP layers weighted ``scale`` in all (DeepSeek-V3 trained with 0.3, then
    0.1): logits (b, (1 + D) s, V), the main ones first."""

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        chunks = logits.chunk(1 + depth, dim=1)
        total = _causal(chunks[0], labels, 1)
        mtp = sum(_causal(chunk, labels, 1 + k) for k, chunk in enumerate(chunks[1:], start=1))
        return total + scale / depth * mtp

    return loss


def _causal(logits: torch.Tensor, labels: torch.Tensor, ahead: int) -> torch.Tensor:
    """Position i predicts labels[i + ahead]; the mean over the positions that have one (-100 ignored)."""
    return F.cross_entropy(logits[:, :-ahead].float().reshape(-1, logits.shape[-1]), labels[:, ahead:].reshape(-1),
                           ignore_index=-100)
