"""A Hugging Face causal LM's parts as pipeline layers: only hidden states (b, s, h) cross a stage boundary.

    input_ids ─► HFEmbeddingPipe ─► HFDecoderLayerPipe × L ─► HFHeadPipe (final norm + LM head) ─► causal_lm_loss

Each decoder layer rebuilds what the model's own forward hands it: positions 0..s-1, (cos, sin) from the
model's rotary module, and the mask the model builds for that layer's attention type (causal, or a sliding
window: Mistral, Qwen2's sliding layers).  Without the mask an eager-attention layer would attend to the
future; with SDPA the mask builder returns None and the kernel runs causally.

``hf_key_map`` is the one place that says which checkpoint names a pipeline layer's weights come from and
go back to (``export.save_pretrained``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .source import HFPipelineError, HFSource


def _no_padding(inputs) -> torch.Tensor:
    """input_ids, or (input_ids, attention_mask) of an unpadded batch."""
    if isinstance(inputs, (tuple, list)):
        if len(inputs) != 2:
            raise HFPipelineError(f"the pipeline's first layer takes input_ids or (input_ids, attention_mask); "
                                  f"got {len(inputs)} tensors")
        input_ids, mask = inputs
        if mask is not None and not bool((mask != 0).all()):
            raise HFPipelineError("a padded batch (an attention_mask with zeros) cannot cross pipeline stages, "
                                  "which pass hidden states only: pack the sequences to full length (no padding), "
                                  "and mark positions to skip in the labels with -100")
        return input_ids
    return inputs


class HFEmbeddingPipe(nn.Module):
    """input_ids (b, s) -> hidden states (b, s, h): the token embedding (+ learned positions and dropout: GPT-2)."""

    tensor_parallel = False  # whole HF weights: PipelineModule refuses a model-parallel axis
    def __init__(self, source: HFSource, mtp: int = 0):
        super().__init__()
        arch = source.arch
        self.embed_tokens = source.part(arch.embed)
        self.positions = source.part(arch.positions) if arch.positions else None
        self.dropout = source.part(arch.dropout) if arch.dropout else None
        self.mtp = mtp  # DeepSeek-V3's MTP layers: the shifted ids' embeddings travel with the hidden states (hf.mtp)

    def forward(self, inputs):
        input_ids = _no_padding(inputs)
        x = self.embed_tokens(input_ids)
        if self.positions is not None:
            x = x + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device))[None]
        x = self.dropout(x) if self.dropout is not None else x
        if not self.mtp:
            return x
        from ..models.mtp import shifted_ids

        return (x, *(self.embed_tokens(shifted_ids(input_ids, k)) for k in range(1, self.mtp + 1)))


ATTENTION_TYPES = ("full_attention", "sliding_attention")


def attention_type(source: HFSource, index: int) -> str:
    """What layer ``index`` attends to: "full_attention" or "sliding_attention", as the model decides it; a
    hybrid model's other layers are of their own type (Nemotron-H's "linear_attention": Mamba-2, "mlp", "moe")."""
    cfg = source.config
    types = getattr(cfg, "layer_types", None)
    if types:
        return types[index]
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return "sliding_attention"
    return "full_attention"


class HFDecoderLayerPipe(nn.Module):
    """Decoder layer ``index``: hidden states in, hidden states out."""

    tensor_parallel = False  # whole HF weights: PipelineModule refuses a model-parallel axis
    def __init__(self, source: HFSource, index: int, layer: nn.Module | None = None):
        super().__init__()
        self.layer = layer if layer is not None else source.part(f"{source.arch.layers}.{index}")
        self.rotary = source.rotary()
        self.config = source.config
        kind = attention_type(source, index)
        self.sliding, self.attends = kind == "sliding_attention", kind in ATTENTION_TYPES

    def forward(self, hidden):
        if isinstance(hidden, tuple):  # MTP's travelling embeddings pass through (hf.mtp)
            return (self.forward(hidden[0]), *hidden[1:])
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        b, s = hidden.shape[:2]
        position_ids = torch.arange(s, device=hidden.device)[None].expand(b, -1)
        make_mask = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        # a Mamba-2 layer reads a padding mask, not an attention one (none: the batch is unpadded)
        mask = make_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                         position_ids=position_ids) if self.attends else None
        kwargs = {"attention_mask": mask, "position_ids": position_ids}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden, position_ids)
        out = self.layer(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class HFFinalNormPipe(nn.Module):

    tensor_parallel = False  # whole HF weights: PipelineModule refuses a model-parallel axis
    def __init__(self, source: HFSource):
        super().__init__()
        self.norm = source.part(source.arch.norm)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


class HFHeadPipe(nn.Module):
    """Final norm + LM head: (b, s, h) -> logits (b, s, V)."""

    tensor_parallel = False  # whole HF weights: PipelineModule refuses a model-parallel axis
    def __init__(self, source: HFSource):
        super().__init__()
        self.norm = source.part(source.arch.norm)
        self.lm_head = source.part(source.arch.head)

    def forward(self, hidden) -> torch.Tensor:
        if isinstance(hidden, tuple):  # the MTP layers' outputs (normed there) after the main states, one product
            return self.lm_head(torch.cat((self.norm(hidden[0]), *hidden[1:]), dim=1))
        return self.lm_head(self.norm(hidden))


def tied_lm_head(embedding: HFEmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head that reuses the input embedding matrix (``TiedLayerSpec`` forward_fn)."""
    return F.linear(hidden, embedding.embed_tokens.weight)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss: position i predicts label i + 1 (the labels are the inputs, unshifted);
    -100 is ignored; the mean over the rest, in fp32."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


def hf_key_map(source: HFSource, index: int, num_layers: int) -> dict[str, str]:
    """Pipeline layer ``index``'s state-dict prefixes -> the checkpoint's (``num_layers``: pipeline layers)."""
    arch, blocks = source.arch, source.num_layers
    if index == 0:
        return {"embed_tokens.": arch.embed + ".",
                **({"positions.": arch.positions + "."} if arch.positions else {})}
    if index <= blocks:
        return {"layer.": f"{arch.layers}.{index - 1}."}
    if source.tied:  # [embedding, blocks, final norm, tied head]: the head's weight is the embedding's
        return {"norm.": arch.norm + "."} if index == blocks + 1 else {}
    return {"norm.": arch.norm + ".", "lm_head.": arch.head + "."}
