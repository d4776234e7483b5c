"""Any Hugging Face causal LM as a DeepSpeed pipeline: the few lines a training script adds.

    from ds_pipe_ext import PipelineModule
    from ds_pipe_ext import hf

    layers = hf.pipeline_layers("path/to/save_pretrained_dir")       # GPT-2, Llama, Mistral, Qwen2
    model = PipelineModule(layers, num_stages=2, loss_fn=hf.causal_lm_loss, partition_method="profiled",
                           profile_batch=(input_ids, input_ids), micro_batches=4)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())

Batches are (input_ids, labels) with labels = input_ids (-100 where no loss is wanted): the loss shifts
them as transformers' causal-LM loss does.  Each rank builds only its stage's layers, from the meta
device and the safetensors files; a model instance is accepted too (small models: every rank then holds
the whole model).  ``partition_method="analytic"`` takes ``cost_model=hf.cost_model(path)``, the
family's description read from the model's config.  ``hf.save_pretrained(checkpoint_dir, path, out)``
turns a pipeline checkpoint back into a ``save_pretrained`` directory.

DeepSeek-V3's multi-token-prediction layers, which transformers' model ignores, are read from the checkpoint with
``pipeline_layers(path, mtp=True)`` and trained with ``loss_fn=hf.mtp_causal_lm_loss(depth)`` (``hf.mtp``).

HF models run PP x DP with ZeRO-0/1.  DeepSpeed's AutoTP inside the pipeline is out of scope (the
``llama`` family of ``ds_pipe_ext.models`` runs megatron-core TP/SP instead); padded batches and HF's
gradient checkpointing are refused.
"""

from __future__ import annotations

from .export import save_pretrained
from .layers import causal_lm_loss, hf_key_map
from .mtp import mtp_causal_lm_loss
from .pipeline import as_source, cost_model, pipeline_layers
from .source import ARCHITECTURES, HFPipelineError, HFSource

__all__ = ["ARCHITECTURES", "HFPipelineError", "HFSource", "as_source", "causal_lm_loss", "cost_model", "hf_key_map",
           "mtp_causal_lm_loss", "pipeline_layers", "save_pretrained"]
