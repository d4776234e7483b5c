"""Model families, each registered here (``registry``): the core and the commands never import a model.

    gpt     GPT-2/3 (``gpt.py``, its config in ``gpt_config.py``; what every family's config shares in ``config.py``)
    llama   Llama 2/3, Mistral, Qwen2 (``llama.py``, its config in ``llama_config.py``)
    moe     Mixture-of-Experts on Llama blocks: Mixtral, Qwen-MoE, DeepSeekMoE (``moe.py``, its config in
            ``moe_config.py``): DeepSpeed's MoE layer, costed at ep 1 (``costs/moe_ops.py``)
    hybrid  Mamba-2, attention and MLP layers in a pattern: Nemotron-H (``hybrid.py``, its config in
            ``hybrid_config.py``; the mixer in ``mamba2.py``, costed by ``costs/mamba_ops.py``)

Both build their layers from a ``layers.LayerImpl`` (megatron-core's tensor parallelism in
``tensor_parallel.py`` for either) and are costed from their description (``costs.py``).
Each callable imports its module when first called: loading a config needs no torch.
"""

from .gpt_config import GPTConfig, from_hf_gpt2, load_model_config
from .hybrid_config import HybridConfig, from_hf_nemotron_h, load_hybrid_config
from .llama_config import LlamaConfig, from_hf_llama, load_llama_config
from .moe_config import MoEConfig, from_hf_moe, load_moe_config
from .registry import ModelFamily, family_of, get_family, load_model, register_family


def _local(impl):
    from .layers import LOCAL

    return impl or LOCAL


def _tensor_parallel(tp: int, sp: bool = False):
    if tp == 1:
        return _local(None)
    from .tensor_parallel import megatron_layer_impl

    return megatron_layer_impl(tp=tp, sequence_parallel=sp)


def _loss_fn(cfg, impl=None):
    from .layers import loss_fn_for

    return loss_fn_for(_local(impl), cfg)


def _family(name: str, config_type: type, load_config, from_hf, specs_module: str, specs_name: str,
            sequential_name: str, loss_fn=_loss_fn, expert_parallel: bool = False, boundary_grads: int = 1):
    """A family whose layers come from ``specs_module.specs_name`` and are costed from their description."""

    def specs_fn(cfg, impl=None, *, selective_recompute: bool = False, **options):
        from importlib import import_module

        return getattr(import_module(specs_module, __name__), specs_name)(
            cfg, _local(impl), selective_recompute=selective_recompute, **options)

    def sequential(specs, loss_fn, *, base_seed: int, recompute: bool):
        from importlib import import_module

        return getattr(import_module(specs_module, __name__), sequential_name)(
            specs, loss_fn, base_seed=base_seed, recompute=recompute)

    def cost_model(cfg, impl=None):
        from .costs import described_cost_model

        return described_cost_model(cfg, _local(impl), specs_fn, loss_fn(cfg, impl))

    def profile(cfg, micro_batch: int, settings, key_fields: dict | None = None):
        from .costs import profile_family_layers

        return profile_family_layers(cfg, micro_batch, settings, key_fields, specs_fn=specs_fn, loss_fn=loss_fn(cfg))

    def calibrate(cfg, request, device, **kwargs):
        from .costs import profile_and_calibrate

        return profile_and_calibrate(cfg, request, device, specs_fn=specs_fn, loss_fn=loss_fn(cfg), **kwargs)

    return register_family(ModelFamily(
        name=name, config_type=config_type, load_config=load_config, layer_specs=specs_fn, loss_fn=loss_fn,
        sequential=sequential, tensor_parallel=_tensor_parallel, cost_model=cost_model,
        profile=profile, calibrate=calibrate, from_hf=from_hf, expert_parallel=expert_parallel,
        boundary_grads=boundary_grads))


def _moe_loss_fn(cfg, impl=None):
    from .moe import MoELoss

    main = MoELoss(cfg.aux_loss_coef, _loss_fn(cfg, impl))
    if not cfg.mtp_layers:
        return main
    from .mtp import MTPLoss

    return MTPLoss(main, cfg.mtp_layers, cfg.mtp_loss_scale, _loss_fn(cfg, impl))


GPT = _family("gpt", GPTConfig, load_model_config, from_hf_gpt2, ".gpt", "gpt_layer_specs", "SequentialGPT")
LLAMA = _family("llama", LlamaConfig, load_llama_config, from_hf_llama, ".llama", "llama_layer_specs",
                "SequentialLlama")
MOE = _family("moe", MoEConfig, load_moe_config, from_hf_moe, ".moe", "moe_layer_specs", "SequentialMoE",
              loss_fn=_moe_loss_fn, expert_parallel=True, boundary_grads=2)
HYBRID = _family("hybrid", HybridConfig, load_hybrid_config, from_hf_nemotron_h, ".hybrid", "hybrid_layer_specs",
                 "SequentialHybrid", expert_parallel=True)

__all__ = ["GPT", "HYBRID", "HybridConfig", "LLAMA", "MOE", "MoEConfig", "GPTConfig", "LlamaConfig", "ModelFamily", "family_of", "get_family", "load_model",
           "register_family"]
