"""`MoEConfig`: Mixture-of-Experts models on the Llama family's blocks (Mixtral, Qwen-MoE, DeepSeekMoE shapes),
from `model_configs/*.toml` (``family = "moe"``) or a Hugging Face ``config.json`` (``model_type`` mixtral,
qwen2_moe, qwen3_moe, deepseek).

Each block's MLP is ``experts`` SwiGLU experts of ``expert_ffn_hidden`` of which a router picks ``top_k`` per
token, optionally beside always-on shared experts (``shared_ffn_hidden`` wide in all; Qwen-MoE gates
theirs), and the first ``dense_layers`` blocks keep a dense ``ffn_hidden`` MLP (DeepSeekMoE: 1).  The
router's load-balancing loss is weighted by ``aux_loss_coef``.  ``capacity_factor`` 0 is dropless (what
the published models train with); > 0 caps each expert at capacity_factor x top_k x tokens / experts.

Refused by name: multi-head latent attention (DeepSeek-V2/V3), a routed layer pattern other than "every
block after the dense ones" (Qwen-MoE's decoder_sparse_step / mlp_only_layers); and, as for the Llama
family, what ``LlamaConfig`` refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from ..arch import MLA, MLP, Attention, Block, Experts, ModelDescription
from .config import ModelConfigError, check_positive_ints, check_router_groups, config_from_dict, load_family_config
from .llama_config import LlamaConfig, attention_of, from_hf_llama

ROUTERS = ("softmax", "sigmoid")  # models/routers.py


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    experts: int = 8  # routed experts per MoE block (E)
    top_k: int = 2  # experts each token is routed to (k)
    expert_ffn_hidden: int = 0  # one routed expert's SwiGLU width; 0: ffn_hidden
    shared_ffn_hidden: int = 0  # the always-on shared experts' width in all (fused as one MLP); 0: none
    shared_gate: bool = False  # Qwen-MoE: the shared experts' output scaled by sigmoid(linear(x))
    dense_layers: int = 0  # the first blocks keep a dense ffn_hidden MLP
    capacity_factor: float = 0.0  # 0: dropless; else an expert takes capacity_factor x k x tokens / E
    aux_loss_coef: float = 0.01  # the router's load-balancing loss in the training loss
    norm_topk_prob: bool = True  # the k gate weights renormalised to sum to 1 (Mixtral yes, Qwen1.5-MoE no)
    # "softmax" (DeepSpeed's TopKGate) or "sigmoid" (DeepSeek-V3's: group-limited, a bias steering the choice;
    # models/routers.py), with its n_group, topk_group and the routed experts' output scale
    router: str = "softmax"
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False  # the router's linear has a bias (gpt-oss)
    # multi-head latent attention (DeepSeek-V2/V3; models/mla.py) where kv_lora_rank > 0: the query's bottleneck
    # (0: one projection), the key/value latent, a head's query/key widths without and with rotary, its value's
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # gpt-oss: a learned sink logit per head (models/sinks.py), and which layers attend in the sliding window:
    # one letter a layer, "W" windowed (sliding_window wide) or "F" full; "" every layer as sliding_window says
    attention_sinks: bool = False
    window_pattern: str = ""
    # the sinks' core: "fused" (a fused kernel's output rescaled by its log-sum-exp) or "eager" (written out, as
    # transformers runs gpt-oss; it keeps the s x (s + 1) probabilities)
    sink_attention: str = "fused"
    # gpt-oss's experts: biases on their linears, and the clamped SwiGLU (gate clamped above, up both ways at
    # swiglu_limit; out = (up + 1) x gate x sigmoid(1.702 gate)); 0: the plain SwiGLU
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    # multi-token prediction (DeepSeek-V3's num_nextn_predict_layers; megatron-core's MTP; models/mtp.py): layers
    # after the last block, each a pipeline layer of its own
    mtp_layers: int = 0
    mtp_loss_scale: float = 0.1  # the MTP losses' weight in all (megatron's --mtp-loss-scaling-factor)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_chunk_tokens:
            raise ModelConfigError(f"model config {self.name!r}: loss_chunk_tokens = {self.loss_chunk_tokens} is not "
                                   f"built for Mixture-of-Experts models (their loss adds the router's); use 0")
        where = f"model config {self.name!r}"
        check_positive_ints(self, ("experts", "top_k"), where)
        if self.top_k > self.experts:
            raise ModelConfigError(f"{where}: top_k ({self.top_k}) exceeds experts ({self.experts}); each token "
                                   f"goes to top_k distinct experts: lower top_k or add experts")
        for f in ("expert_ffn_hidden", "shared_ffn_hidden", "dense_layers"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ModelConfigError(f"{where}: {f} = {v!r}; it must be 0 or a positive integer")
        if self.dense_layers >= self.layers:
            raise ModelConfigError(f"{where}: dense_layers ({self.dense_layers}) leaves no MoE block of "
                                   f"{self.layers}; an all-dense model is the llama family")
        if self.shared_gate and not self.shared_ffn_hidden:
            raise ModelConfigError(f"{where}: shared_gate needs shared experts (shared_ffn_hidden > 0)")
        cf = self.capacity_factor
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf < 0:
            raise ModelConfigError(f"{where}: capacity_factor = {cf!r}; 0 (dropless) or a positive factor")
        coef = self.aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
            raise ModelConfigError(f"{where}: aux_loss_coef = {coef!r}; 0 or a positive weight")
        if not isinstance(self.norm_topk_prob, bool):
            raise ModelConfigError(f"{where}: norm_topk_prob must be true or false")
        if self.router not in ROUTERS:
            raise ModelConfigError(f"{where}: router = {self.router!r}; use one of {list(ROUTERS)}")
        check_router_groups(self, where, sigmoid=self.router == "sigmoid")
        self._check_mla(where)
        self._check_gpt_oss(where)
        scale = self.routed_scaling_factor
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ModelConfigError(f"{where}: routed_scaling_factor = {scale!r}; a positive factor")

    def _check_mla(self, where: str) -> None:
        fields = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for f in fields:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ModelConfigError(f"{where}: {f} = {v!r}; it must be 0 or a positive integer")
        if not self.kv_lora_rank:
            if any(getattr(self, f) for f in fields):
                raise ModelConfigError(f"{where}: multi-head latent attention needs kv_lora_rank > 0 (the other "
                                       f"MLA fields are set)")
            return
        missing = [f for f in fields[2:] if not getattr(self, f)]
        if missing:
            raise ModelConfigError(f"{where}: multi-head latent attention needs {missing} > 0")
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError(f"{where}: qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for rotary")
        if self.kv_heads != self.heads:
            raise ModelConfigError(f"{where}: multi-head latent attention expands a key and value per head; set "
                                   f"kv_heads = heads ({self.heads})")

    def _check_gpt_oss(self, where: str) -> None:
        for f in ("attention_sinks", "expert_bias", "router_bias"):
            if not isinstance(getattr(self, f), bool):
                raise ModelConfigError(f"{where}: {f} must be true or false")
        if self.sink_attention not in ("fused", "eager"):
            raise ModelConfigError(f"{where}: sink_attention = {self.sink_attention!r}; use \"fused\" (a fused "
                                   f"kernel, its output rescaled) or \"eager\" (written out)")
        pattern = self.window_pattern
        if not isinstance(pattern, str) or set(pattern) - set("WF"):
            raise ModelConfigError(f"{where}: window_pattern = {pattern!r}; one letter a layer, W (the sliding "
                                   f"window) or F (full attention)")
        if pattern and len(pattern) != self.layers:
            raise ModelConfigError(f"{where}: window_pattern has {len(pattern)} letters for {self.layers} layers; "
                                   f"give one a layer")
        if "W" in pattern and not self.sliding_window:
            raise ModelConfigError(f"{where}: window_pattern has windowed layers (W) but sliding_window is 0; set "
                                   f"the window's width")
        if pattern and not self.attention_sinks:
            raise ModelConfigError(f"{where}: a window_pattern is built for attention with sinks (gpt-oss); set "
                                   f"attention_sinks = true, or give every layer the window (sliding_window alone)")
        if self.router_bias and self.router != "softmax":
            raise ModelConfigError(f"{where}: router_bias is built for the softmax router (gpt-oss's)")
        if (self.attention_sinks or pattern) and self.mla:
            raise ModelConfigError(f"{where}: sinks and window patterns are gpt-oss's attention, not MLA's")
        m = self.mtp_layers
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ModelConfigError(f"{where}: mtp_layers = {m!r}; 0 or a positive number of layers")
        if m and (pattern or self.loss_chunk_tokens):
            raise ModelConfigError(f"{where}: multi-token prediction is built for DeepSeek-V3's shape: without a "
                                   f"window_pattern or a chunked loss")
        scale = self.mtp_loss_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
            raise ModelConfigError(f"{where}: mtp_loss_scale = {scale!r}; 0 or a positive weight")
        limit = self.swiglu_limit
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit < 0:
            raise ModelConfigError(f"{where}: swiglu_limit = {limit!r}; 0 (the plain SwiGLU) or a positive limit")

    @property
    def window(self) -> int | None:
        """Every layer's window, where there is no per-layer pattern (``layer_window`` otherwise)."""
        return None if self.window_pattern else super().window

    @property
    def num_pipeline_layers(self) -> int:
        """Embedding, the blocks, the multi-token-prediction layers, final norm + LM head."""
        return self.layers + self.mtp_layers + 2

    def layer_window(self, i: int) -> int | None:
        """Layer ``i``'s attention window (None: full causal attention)."""
        if not self.window_pattern:
            return self.window
        w = self.sliding_window
        return w if self.window_pattern[i] == "W" and w < self.seq_len else None

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def expert_ffn(self) -> int:
        return self.expert_ffn_hidden or self.ffn_hidden

    def is_moe_block(self, i: int) -> bool:
        return i >= self.dense_layers

    def describe(self) -> ModelDescription:
        """The Llama family's description with each block after the dense ones routed to experts."""
        return _describe_moe(self)

    @classmethod
    def from_dict(cls, data: dict, *, name: str = "<dict>") -> "MoEConfig":
        return config_from_dict(cls, data, name=name)


@lru_cache(maxsize=64)
def _describe_moe(cfg: MoEConfig) -> ModelDescription:
    experts = Experts(cfg.experts, cfg.top_k, shared_ffn=cfg.shared_ffn_hidden, shared_gate=cfg.shared_gate,
                      capacity_factor=float(cfg.capacity_factor), router=cfg.router, groups=cfg.router_groups,
                      topk_groups=cfg.router_topk_groups, bias=cfg.expert_bias, router_bias=cfg.router_bias,
                      swiglu_limit=float(cfg.swiglu_limit))
    blocks = []
    for i in range(cfg.layers):
        attention = _attention_at(cfg, i)
        blocks.append(Block(attention, MLP(cfg.expert_ffn, "swiglu"), experts) if cfg.is_moe_block(i)
                      else Block(attention, MLP(cfg.ffn_hidden, "swiglu")))
    for i in range(cfg.mtp_layers):  # after the last block, each a MoE block of its own (DeepSeek-V3's layer 61)
        blocks.append(replace(blocks[-1], mtp=True))
    return ModelDescription(name=cfg.name, hidden=cfg.hidden, vocab=cfg.padded_vocab, seq_len=cfg.seq_len,
                            blocks=tuple(blocks), positions="rotary", norm="rmsnorm", tied_head=cfg.tie_embeddings,
                            dropout=False, linear_bias=False)


def _attention_at(cfg: MoEConfig, i: int) -> Attention:
    """Block ``i``'s attention as the description says it: MLA, sinks (windowed or not), or the Llama family's."""
    if cfg.mla:
        return Attention(cfg.heads, cfg.heads, kernel="fused", head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                         mla=MLA(cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                 q_rank=cfg.q_lora_rank))
    if cfg.attention_sinks:
        wide = cfg.head_dim * cfg.heads != cfg.hidden
        return Attention(cfg.heads, cfg.kv_heads, qkv_bias=cfg.qkv_bias, window=cfg.layer_window(i),
                         kernel=cfg.sink_attention,
                         head_dim=cfg.head_dim if wide else None, sinks=True, out_bias=cfg.qkv_bias)
    return attention_of(cfg)


# ---------------------------------------------------------------------------- Hugging Face config.json

HF_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek", "deepseek_v3", "gpt_oss")
REFUSED_MODEL_TYPES = {
    "deepseek_v2": "DeepSeek-V2's softmax group-limited router is not modelled (its MLA is: see deepseek_v3)",
}


def from_hf_moe(data: dict, *, name: str) -> MoEConfig:
    """A Hugging Face ``config.json`` of ``model_type`` mixtral, qwen2_moe, qwen3_moe or deepseek (DeepSeekMoE 16B)."""
    kind = data.get("model_type")
    where = f"model config {name!r} (model_type {kind!r})"
    if kind in REFUSED_MODEL_TYPES:
        raise ModelConfigError(f"{where}: {REFUSED_MODEL_TYPES[kind]}; supported MoE model types: "
                               f"{list(HF_MODEL_TYPES)}")
    if kind not in HF_MODEL_TYPES:
        raise ModelConfigError(f"{where}: not a Mixture-of-Experts model type; supported: {list(HF_MODEL_TYPES)}")
    if kind == "mixtral":
        moe = {"experts": data.get("num_local_experts"), "top_k": data.get("num_experts_per_tok"),
               "expert_ffn_hidden": 0, "norm_topk_prob": True}
        dense_like = {**data, "model_type": "mistral"}
    elif kind in ("qwen2_moe", "qwen3_moe"):
        if data.get("decoder_sparse_step", 1) != 1 or data.get("mlp_only_layers"):
            raise ModelConfigError(f"{where}: decoder_sparse_step / mlp_only_layers (dense blocks between MoE "
                                   f"ones) is not modelled: every block routes to experts")
        shared = data.get("shared_expert_intermediate_size") or 0
        moe = {"experts": data.get("num_experts"), "top_k": data.get("num_experts_per_tok"),
               "expert_ffn_hidden": data.get("moe_intermediate_size"), "shared_ffn_hidden": shared,
               "shared_gate": bool(shared), "norm_topk_prob": bool(data.get("norm_topk_prob", False))}
        dense_like = {**data, "model_type": kind.removesuffix("_moe")}  # Qwen3-MoE: Qwen3's attention
    elif kind == "deepseek_v3":
        moe, dense_like = _deepseek_v3(data, where)
    elif kind == "gpt_oss":
        moe, dense_like = _gpt_oss(data, where)
    else:  # deepseek: DeepSeekMoE 16B's remote-code config
        if data.get("moe_layer_freq", 1) != 1:
            raise ModelConfigError(f"{where}: moe_layer_freq {data['moe_layer_freq']} (dense blocks between "
                                   f"MoE ones) is not modelled")
        moe = {"experts": data.get("n_routed_experts"), "top_k": data.get("num_experts_per_tok"),
               "expert_ffn_hidden": data.get("moe_intermediate_size"),
               "shared_ffn_hidden": (data.get("n_shared_experts") or 0) * (data.get("moe_intermediate_size") or 0),
               "dense_layers": data.get("first_k_dense_replace", 0),
               "norm_topk_prob": bool(data.get("norm_topk_prob", False))}
        dense_like = {**data, "model_type": "llama"}
    missing = [k for k in ("experts", "top_k", "expert_ffn_hidden") if moe.get(k) is None]
    if missing:
        raise ModelConfigError(f"{where}: config.json lacks the expert fields for {missing}")
    if data.get("router_aux_loss_coef") is not None or data.get("aux_loss_alpha") is not None:
        moe["aux_loss_coef"] = float(data.get("router_aux_loss_coef", data.get("aux_loss_alpha")))
    base = from_hf_llama(dense_like, name=name)
    return MoEConfig.from_dict({**base.to_dict(), **moe, "rope_scaling": base.rope_scaling}, name=name)


def _deepseek_v3(data: dict, where: str) -> tuple[dict, dict]:
    """DeepSeek-V3 (Kimi K2): MLA, the sigmoid group-limited router, dense first blocks, one shared expert."""
    if data.get("scoring_func", "sigmoid") != "sigmoid" or data.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ModelConfigError(f"{where}: scoring_func {data.get('scoring_func')!r} / topk_method "
                               f"{data.get('topk_method')!r}: the sigmoid router with its bias (noaux_tc) is modelled")
    mla = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    missing = [k for k in mla if not data.get(k)]
    if missing:
        raise ModelConfigError(f"{where}: config.json lacks the multi-head latent attention fields {missing}")
    ffn = data.get("moe_intermediate_size")
    moe = {"experts": data.get("n_routed_experts"), "top_k": data.get("num_experts_per_tok"),
           "expert_ffn_hidden": ffn, "shared_ffn_hidden": (data.get("n_shared_experts") or 0) * (ffn or 0),
           "dense_layers": data.get("first_k_dense_replace", 0), "norm_topk_prob": bool(data.get("norm_topk_prob", True)),
           "router": "sigmoid", "router_groups": data.get("n_group") or 1, "router_topk_groups": data.get("topk_group") or 1,
           "routed_scaling_factor": float(data.get("routed_scaling_factor", 1.0)),
           # transformers' model adds no balance loss (DeepSeek-V3 steers the load with the router's bias)
           "aux_loss_coef": 0.0, "mtp_layers": int(data.get("num_nextn_predict_layers") or 0),
           "q_lora_rank": data.get("q_lora_rank") or 0, "kv_lora_rank": data.get("kv_lora_rank"),
           "qk_nope_head_dim": data.get("qk_nope_head_dim"), "qk_rope_head_dim": data.get("qk_rope_head_dim"),
           "v_head_dim": data.get("v_head_dim")}
    heads = data.get("num_attention_heads")
    # MLA's widths are its own fields; the Llama reader sees plain heads (kv = heads, the default width)
    dense_like = {k: v for k, v in data.items() if k not in ("head_dim", "attention_bias")}
    return moe, {**dense_like, "model_type": "llama", "num_key_value_heads": heads}


def _gpt_oss(data: dict, where: str) -> tuple[dict, dict]:
    """gpt-oss: attention with sinks, windowed and full layers alternating, biases in attention, the router and
    the experts, the clamped SwiGLU."""
    alpha = data.get("swiglu_alpha", 1.702)
    if alpha != 1.702:
        raise ModelConfigError(f"{where}: swiglu_alpha = {alpha}; the clamped SwiGLU is built with gpt-oss's 1.702")
    types = data.get("layer_types") or []
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ModelConfigError(f"{where}: layer_types {unknown}: sliding_attention and full_attention are modelled")
    moe = {"experts": data.get("num_local_experts"), "top_k": data.get("num_experts_per_tok"),
           "expert_ffn_hidden": data.get("intermediate_size"), "norm_topk_prob": True,
           "router_bias": True, "expert_bias": True, "swiglu_limit": float(data.get("swiglu_limit") or 0.0),
           "attention_sinks": True, "window_pattern": "".join("W" if t == "sliding_attention" else "F" for t in types),
           "sliding_window": int(data.get("sliding_window") or 0)}
    dense_like = {k: v for k, v in data.items() if k not in ("layer_types", "attention_bias")}
    # qwen2: the Llama reader's q/k/v biases (gpt-oss's o_proj bias follows them, models/sinks.py)
    return moe, {**dense_like, "model_type": "qwen2", "sliding_window": data.get("sliding_window") or 0}


def load_moe_config(name_or_path: str | Path, **overrides) -> MoEConfig:
    """An MoE config: a name in model_configs/ (``family = "moe"``), a .toml path, a Hugging Face config.json
    or a ``save_pretrained`` directory.  ``overrides`` replace fields (e.g. ``seq_len=4096``)."""
    return load_family_config(MoEConfig, from_hf_moe, name_or_path, overrides)
