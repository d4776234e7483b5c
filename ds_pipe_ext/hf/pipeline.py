"""The public face of ``ds_pipe_ext.hf``: a Hugging Face causal LM's pipeline layers and their cost model."""

from __future__ import annotations

from pathlib import Path

from .layers import HFDecoderLayerPipe, HFEmbeddingPipe, HFFinalNormPipe, HFHeadPipe, tied_lm_head
from .mtp import HFMTPPipe, check_mtp
from .source import HFSource


def as_source(model, *, attn_implementation: str | None = None) -> HFSource:
    """An ``HFSource`` for a directory, a model instance, or itself."""
    if isinstance(model, HFSource):
        return model
    if isinstance(model, (str, Path)):
        return HFSource(model, attn_implementation=attn_implementation)
    return HFSource(model=model, attn_implementation=attn_implementation)


def pipeline_layers(model, *, attn_implementation: str | None = None, mtp: bool = False) -> list:
    """DeepSpeed layer specs of a Hugging Face causal LM, in pipeline order.

    Untied: [embedding, L decoder layers, final norm + LM head]          (L + 2 layers)
    Tied:   [embedding, L decoder layers, final norm, tied LM head]      (L + 3 layers)
    ``mtp``: DeepSeek-V3's D multi-token-prediction layers read from the checkpoint before the head (L + D + 2;
    the loss is then ``hf.mtp_causal_lm_loss(D)``: ``hf.mtp``).
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    source = as_source(model, attn_implementation=attn_implementation)
    blocks = [LayerSpec(HFDecoderLayerPipe, source, i) for i in range(source.num_layers)]
    if mtp:
        depth = check_mtp(source)
        return [LayerSpec(HFEmbeddingPipe, source, depth), *blocks,
                *(LayerSpec(HFMTPPipe, source, k, depth) for k in range(1, depth + 1)), LayerSpec(HFHeadPipe, source)]
    if not source.tied:
        return [LayerSpec(HFEmbeddingPipe, source), *blocks, LayerSpec(HFHeadPipe, source)]
    weight = "embed_tokens.weight"
    return [TiedLayerSpec("embed", HFEmbeddingPipe, source, tied_weight_attr=weight), *blocks,
            LayerSpec(HFFinalNormPipe, source),
            TiedLayerSpec("embed", HFEmbeddingPipe, source, forward_fn=tied_lm_head, tied_weight_attr=weight)]


def cost_model(model, *, attn_implementation: str | None = None):
    """The analytic cost model of ``pipeline_layers(model)``: its family's description (``ds_pipe_ext.models``)."""
    from ..models import family_of

    config = as_source(model, attn_implementation=attn_implementation).family_config()
    return family_of(config).cost_model(config)
