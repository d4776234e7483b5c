"""Model families, each registered here (``registry``): the core and the commands never import a model.

The GPT (``gpt.py``, its config in ``config.py``, its analytic cost model in ``gpt_costs.py``, its
megatron-core tensor parallelism in ``parallel/tensor_parallel.py``) is the family ``gpt``.  Each
callable imports its module when first called: loading a config needs no torch.
"""

from .config import GPTConfig, load_model_config
from .registry import ModelFamily, family_of, get_family, load_model, register_family


def _gpt_layer_specs(cfg, impl=None, *, selective_recompute: bool = False):
    from .gpt import LOCAL, gpt_layer_specs

    return gpt_layer_specs(cfg, impl or LOCAL, selective_recompute=selective_recompute)


def _gpt_loss_fn(impl=None):
    from .gpt import LOCAL, loss_fn_for

    return loss_fn_for(impl or LOCAL)


def _gpt_sequential(specs, loss_fn, *, base_seed: int, recompute: bool):
    from .gpt import SequentialGPT

    return SequentialGPT(specs, loss_fn, base_seed=base_seed, recompute=recompute)


def _gpt_tensor_parallel(tp: int, sp: bool = False):
    from .gpt import LOCAL

    if tp == 1:
        return LOCAL
    from ..parallel.tensor_parallel import megatron_layer_impl

    return megatron_layer_impl(tp=tp, sequence_parallel=sp)


def _gpt_cost_model(cfg, impl=None):
    from .gpt import LOCAL
    from .gpt_costs import gpt_cost_model

    return gpt_cost_model(cfg, impl or LOCAL)


def _gpt_profile(cfg, micro_batch: int, settings, key_fields: dict | None = None):
    from .gpt_costs import profile_gpt_layers

    return profile_gpt_layers(cfg, micro_batch, settings, key_fields)


def _gpt_calibrate(cfg, request, device, **kwargs):
    from .gpt_costs import profile_and_calibrate

    return profile_and_calibrate(cfg, request, device, **kwargs)


GPT = register_family(ModelFamily(
    name="gpt", config_type=GPTConfig, load_config=load_model_config, layer_specs=_gpt_layer_specs,
    loss_fn=_gpt_loss_fn, sequential=_gpt_sequential, tensor_parallel=_gpt_tensor_parallel,
    cost_model=_gpt_cost_model, profile=_gpt_profile, calibrate=_gpt_calibrate))

__all__ = ["GPT", "GPTConfig", "ModelFamily", "family_of", "get_family", "load_model", "register_family"]
