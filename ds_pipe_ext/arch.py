"""What a model is, apart from how it is built: the description the analytic costs are derived from.

megatron-core's ``ModuleSpec`` says which modules make up a layer apart from how they are built;
this says what a decoder-only transformer computes, so that a family-free op library
(``costs.layer_ops.layer_ops`` over ``costs.analytic``) can cost any model a family describes:

    embedding  a vocabulary lookup (``vocab`` rows: padded) and its positions: learned | rotary | none
    blocks     one ``Block`` per layer (they may differ: width-pruned models, hybrids), each a norm and
               attention and an MLP, or one of them alone, or a Mamba-2 mixer alone (``Mamba2``: a
               hybrid's ``M`` layers; Nemotron-H's pattern ``M-M*-ME``); attention (heads, key/value
               heads, their width where it is not hidden / heads,
               q/k/v biases, per-head q/k norms, a sliding window, the kernel:
               eager softmax(QK^T)V or a fused one that saves no s x s probabilities) and an MLP (gelu:
               two matrices; swiglu: gate and up projections, SiLU, down projection), or routed
               ``Experts`` of that MLP (Mixture-of-Experts)
    head       the final norm, the vocabulary projection (tied to the embedding or not), the loss

The pipeline's layers are the embedding, each block, and the head, in that order.  A family in
``models/`` writes its description from its config; the core reads only this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary", "none")
MLPS = ("gelu", "swiglu", "relu2")  # relu2: squared ReLU between two matrices (Nemotron-H's MLP layers)
# "auto": the one that runs on the device costed, fused on a GPU and eager on a CPU (``attention_kernel``)
ATTENTION_KERNELS = ("eager", "fused", "auto")
ROUTERS = ("softmax", "sigmoid")


def runs_on_gpu(device: str | None) -> bool:
    """Whether ``device`` (a spec name) is a GPU's: "cpu" is the CPU, None is unknown and costed as written out,
    as the analytic model always did; any other name is a GPU's."""
    return device not in (None, "cpu")


def attention_kernel(kernel: str, device: str | None) -> str:
    """The kernel a description's attention runs on ``device`` (a spec name: "cpu" is the CPU, any other a
    GPU; None: unknown, which costs "auto" as written out, as the analytic model always did)."""
    if kernel != "auto":
        return kernel
    return "fused" if runs_on_gpu(device) else "eager"


def attention_backend(kernel: str, device: str | None, *, dtype: str = "bf16", head_dim: int = 64,
                      gqa: bool = False, masked: bool = False, sinks: bool = False) -> str:
    """The kernel an attention core runs: "eager" (written out) or, for SDPA, the backend torch selects on
    ``device`` ("cpu" for a CPU's).  The model code and the cost model both ask here.

    On a GPU, torch 2.11 tries cuDNN, then flash, then memory-efficient, then math, each where it can:
    flash and cuDNN take 16-bit inputs without an explicit mask, head dims to 256 (cuDNN: 128); cuDNN's
    path takes no ``enable_gqa`` (flash does); memory-efficient takes fp32 and a mask but no
    ``enable_gqa``, so a grouped-query core with a dense mask would fall to math, which writes the s x s scores
    out (gpt2-medium's bf16 block ran cuDNN on an H200: the layer peak trace).  A masked core here is a sliding
    window, which on a GPU runs as "flex": flex_attention's block mask, the blocks outside the window skipped
    (``models.llama``); a CPU keeps SDPA with the dense mask.

    Attention with ``sinks`` runs a kernel that returns its log-sum-exp (``models.sinks``): a CPU's flash kernel
    ("cpu"), or on a GPU FlashAttention-2 with its window native ("flash"), which takes 16-bit inputs and head
    dims to 256; otherwise written out."""
    kind = attention_kernel(kernel, device)
    if kind == "eager":
        return "eager"
    if not runs_on_gpu(device):
        return "cpu"
    if sinks:
        return "flash" if dtype in ("bf16", "fp16") and head_dim <= 256 else "eager"
    if masked:
        return "flex"
    sixteen_bit = dtype in ("bf16", "fp16")
    if sixteen_bit and not masked and not gqa and head_dim <= 128:
        return "cudnn"
    if sixteen_bit and not masked and head_dim <= 256:
        return "flash"
    return "math" if gqa else "efficient"


class DescriptionError(ValueError):
    """A description the analytic model cannot cost; the message names the field."""


def _positive(where: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DescriptionError(f"{where}: {name} = {value!r}; a positive integer is required")


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through a ``q_rank`` bottleneck (0: one h ->
    heads x (nope_dim + rope_dim) projection), keys and values expanded per head from a ``kv_rank`` latent, and
    one ``rope_dim`` rotary key shared by every head; a head's query and key are nope_dim + rope_dim wide, its
    value ``v_dim``.  The down projections (to q_rank and kv_rank + rope_dim) are whole on every TP rank, as
    megatron-core's MLASelfAttention builds them; the up projections and the out projection split the heads."""

    kv_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    q_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("kv_rank", "nope_dim", "rope_dim", "v_dim"):
            _positive("mla", name, getattr(self, name))
        if self.q_rank:
            _positive("mla", "q_rank", self.q_rank)

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim


@dataclass(frozen=True)
class Attention:
    heads: int
    kv_heads: int | None = None  # grouped-query attention: key/value heads shared by heads / kv_heads queries
    qkv_bias: bool | None = None  # None: as the model's linears (ModelDescription.linear_bias)
    window: int | None = None  # sliding window: each query attends to at most this many positions
    # eager: softmax(QK^T)V written out (saves the s x s probabilities); fused: one kernel (flash or
    # torch's SDPA) that saves its output and log-sum-exp and recomputes the probabilities backward
    kernel: str = "eager"
    # a head's width where it is not hidden / heads (Qwen3: 128 for hidden 2,048 and 32 heads;
    # Megatron's --kv-channels); None: hidden / heads
    head_dim: int | None = None
    qk_norm: bool = False  # an RMSNorm over each query and key head before rotary (Qwen3, --qk-layernorm)
    mla: MLA | None = None  # multi-head latent attention (DeepSeek-V3): its ranks and head widths
    # a learned logit per head beside each query's keys (gpt-oss): the softmax's mass the sink takes is
    # dropped; fused, a kernel's output is rescaled by its log-sum-exp (models.sinks)
    sinks: bool = False
    out_bias: bool = False  # the out projection's bias where the model's linears carry none (gpt-oss)

    def __post_init__(self) -> None:
        _positive("attention", "heads", self.heads)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        _positive("attention", "kv_heads", self.kv_heads)
        if self.heads % self.kv_heads:
            raise DescriptionError(f"attention: kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.window is not None:
            _positive("attention", "window", self.window)
        if self.kernel not in ATTENTION_KERNELS:
            raise DescriptionError(f"attention: kernel = {self.kernel!r}; use one of {', '.join(ATTENTION_KERNELS)}")
        if self.head_dim is not None:
            _positive("attention", "head_dim", self.head_dim)


@dataclass(frozen=True)
class MLP:
    ffn: int
    kind: str = "gelu"

    def __post_init__(self) -> None:
        _positive("mlp", "ffn", self.ffn)
        if self.kind not in MLPS:
            raise DescriptionError(f"mlp: kind = {self.kind!r}; use one of {', '.join(MLPS)}")


@dataclass(frozen=True)
class Experts:
    """A block's MLP as routed experts (Mixture-of-Experts): a linear router sends each token to ``top_k``
    of ``count`` experts, each an ``MLP`` of the block's kind and width; ``shared_ffn`` wide always-on
    shared experts beside them (DeepSeekMoE's two, fused as one MLP; Qwen-MoE's one, whose output
    ``shared_gate``, a sigmoid of a linear, scales).  ``capacity_factor`` 0: dropless (every routed token
    is processed); else each expert processes at most capacity_factor x top_k x tokens / count of them."""

    count: int
    top_k: int
    shared_ffn: int = 0
    shared_gate: bool = False
    capacity_factor: float = 0.0
    # the router's scores: "softmax" (Mixtral, Qwen-MoE, DeepSpeed's TopKGate); "sigmoid" (DeepSeek-V3): a
    # sigmoid per expert plus a bias that steers the choice only, the top-k taken within the ``topk_groups``
    # best of ``groups`` groups of experts (each group scored by its two best experts)
    router: str = "softmax"
    groups: int = 1
    topk_groups: int = 1
    bias: bool = False  # the experts' linears carry biases (gpt-oss)
    router_bias: bool = False  # the router's linear carries one (gpt-oss)
    swiglu_limit: float = 0.0  # gpt-oss's clamped SwiGLU (its gate and up clamped at the limit); 0: the plain one

    def __post_init__(self) -> None:
        _positive("experts", "count", self.count)
        _positive("experts", "top_k", self.top_k)
        if self.top_k > self.count:
            raise DescriptionError(f"experts: top_k ({self.top_k}) exceeds the experts ({self.count}); each token "
                                   f"goes to top_k distinct experts")
        if isinstance(self.shared_ffn, bool) or not isinstance(self.shared_ffn, int) or self.shared_ffn < 0:
            raise DescriptionError(f"experts: shared_ffn = {self.shared_ffn!r}; 0 (none) or a positive width")
        if self.shared_gate and not self.shared_ffn:
            raise DescriptionError("experts: shared_gate needs shared experts (shared_ffn > 0)")
        if not isinstance(self.capacity_factor, (int, float)) or isinstance(self.capacity_factor, bool) \
                or self.capacity_factor < 0:
            raise DescriptionError(f"experts: capacity_factor = {self.capacity_factor!r}; 0 (dropless) or > 0")
        if self.router not in ROUTERS:
            raise DescriptionError(f"experts: router = {self.router!r}; use one of {', '.join(ROUTERS)}")
        if not isinstance(self.swiglu_limit, (int, float)) or isinstance(self.swiglu_limit, bool) \
                or self.swiglu_limit < 0:
            raise DescriptionError(f"experts: swiglu_limit = {self.swiglu_limit!r}; 0 (the plain SwiGLU) or > 0")
        for name in ("groups", "topk_groups"):
            _positive("experts", name, getattr(self, name))
        if self.count % self.groups:
            raise DescriptionError(f"experts: n_group ({self.groups}) must divide the experts ({self.count})")
        if self.topk_groups > self.groups:
            raise DescriptionError(f"experts: topk_group ({self.topk_groups}) exceeds n_group ({self.groups})")

    def capacity_slots(self, tokens: int) -> int:
        """``capacity_slots`` of these experts."""
        return capacity_slots(tokens, self.count, self.top_k, self.capacity_factor)


def capacity_slots(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """The slots DeepSpeed's capacity gives each expert for ``tokens`` routed tokens (``sharded_moe._capacity``:
    ceil(tokens / experts x capacity_factor x top_k)); 0 for a dropless layer (its slots follow the loads)."""
    if not capacity_factor:
        return 0
    return math.ceil(tokens / experts * capacity_factor * top_k)


@dataclass(frozen=True)
class Mamba2:
    """A Mamba-2 mixer (``models.mamba2``): ``heads`` of ``head_dim`` channels, a ``state``-wide SSM state per
    head, B and C shared by the heads of each of ``groups``, a causal conv of ``conv_kernel`` taps, the scan
    in chunks of ``chunk`` tokens."""

    heads: int
    head_dim: int
    state: int
    groups: int = 1
    conv_kernel: int = 4
    chunk: int = 128

    def __post_init__(self) -> None:
        for name in ("heads", "head_dim", "state", "groups", "conv_kernel", "chunk"):
            _positive("mamba", name, getattr(self, name))
        if self.heads % self.groups:
            raise DescriptionError(f"mamba: n_groups ({self.groups}) must divide heads ({self.heads})")


BLOCK_KINDS = ("transformer", "attention", "mlp", "moe", "mamba", "mtp")


@dataclass(frozen=True)
class Block:
    """One layer behind its norm(s) and residual(s): attention then an MLP (a transformer block), or one
    of attention, an MLP (routed ``experts`` of it: MoE) or a Mamba-2 mixer alone (a hybrid's layers)."""

    attention: Attention | None
    mlp: MLP | None  # with ``experts``: one expert's kind and width
    experts: Experts | None = None  # None: a dense block
    mamba: Mamba2 | None = None
    # a multi-token-prediction layer (DeepSeek-V3; megatron-core's MultiTokenPredictionLayer): the embedding of
    # the token after next and the hidden state, each RMS-normed, concatenated and projected 2h -> h, then this
    # block's attention and MLP, then the shared final norm, output head and loss; the pipeline's last block
    mtp: bool = False

    def __post_init__(self) -> None:
        if self.mtp and (self.attention is None or self.mlp is None):
            raise DescriptionError("block: a multi-token-prediction layer holds a transformer block (attention and an MLP)")
        if self.mamba is not None and (self.attention is not None or self.mlp is not None):
            raise DescriptionError("block: a Mamba-2 block holds the mixer alone (no attention, no MLP)")
        if self.mamba is None and self.attention is None and self.mlp is None:
            raise DescriptionError("block: describe attention, an MLP or a Mamba-2 mixer")
        if self.experts is not None and self.mlp is None:
            raise DescriptionError("block: experts need the MLP they are routed copies of (mlp=)")

    @property
    def kind(self) -> str:
        if self.mtp:
            return "mtp"
        if self.mamba is not None:
            return "mamba"
        if self.attention is not None and self.mlp is not None:
            return "transformer"
        if self.attention is not None:
            return "attention"
        return "moe" if self.experts is not None else "mlp"


@dataclass(frozen=True)
class ModelDescription:
    name: str
    hidden: int
    vocab: int  # rows of the embedding and the head (the padded vocabulary)
    seq_len: int
    blocks: tuple[Block, ...]
    positions: str = "learned"
    norm: str = "layernorm"
    tied_head: bool = True
    dropout: bool = False  # dropout layers present (they save masks)
    linear_bias: bool = True  # GPT's linears carry biases; Llama's carry none
    loss_chunk_tokens: int = 0  # the head + loss in token chunks (models.linear_cross_entropy); 0: plain

    def __post_init__(self) -> None:
        for name in ("hidden", "vocab", "seq_len"):
            _positive(f"model {self.name!r}", name, getattr(self, name))
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if not self.blocks:
            raise DescriptionError(f"model {self.name!r}: no blocks; describe at least one")
        if self.positions not in POSITIONS:
            raise DescriptionError(f"model {self.name!r}: positions = {self.positions!r}; use one of {POSITIONS}")
        if self.norm not in NORMS:
            raise DescriptionError(f"model {self.name!r}: norm = {self.norm!r}; use one of {NORMS}")
        mtp = [i for i, block in enumerate(self.blocks) if block.mtp]
        if mtp and mtp != list(range(len(self.blocks) - len(mtp), len(self.blocks))):
            raise DescriptionError(f"model {self.name!r}: multi-token-prediction layers come after every other "
                                   f"block (found at {mtp} of {len(self.blocks)})")
        for i, block in enumerate(self.blocks):
            if block.attention is None:
                continue
            if block.attention.head_dim is None and self.hidden % block.attention.heads:
                raise DescriptionError(f"model {self.name!r}: block {i}: heads ({block.attention.heads}) do not "
                                       f"divide hidden ({self.hidden})")

    # what every layout rule reads (``layout.Layout.check``): the widths tensor parallelism splits
    @property
    def heads(self) -> int:
        """The first attention block's (a model without attention: the first Mamba-2 mixer's heads)."""
        first = next((b.attention for b in self.blocks if b.attention is not None), None)
        if first is not None:
            return first.heads
        mixer = next((b.mamba for b in self.blocks if b.mamba is not None), None)
        return mixer.heads if mixer is not None else 1  # MLP blocks alone: no heads to split

    @property
    def kv_heads(self) -> int:
        return min((b.attention.kv_heads for b in self.blocks if b.attention is not None), default=self.heads)

    @property
    def ffn(self) -> int:
        first = next((b.mlp for b in self.blocks if b.mlp is not None), None)
        return first.ffn if first is not None else self.hidden

    @property
    def mamba_groups(self) -> int:
        """n_groups of the Mamba-2 blocks (tensor parallelism must divide it); 0 without any."""
        return min((b.mamba.groups for b in self.blocks if b.mamba is not None), default=0)

    @property
    def padded_vocab(self) -> int:
        return self.vocab

    @property
    def experts(self) -> int:
        """Routed experts per Mixture-of-Experts block (the most of any block); 0 for a dense model."""
        return max((b.experts.count for b in self.blocks if b.experts is not None), default=0)

    @property
    def layers(self) -> int:
        return len(self.blocks)

    @property
    def mtp_layers(self) -> int:
        """The multi-token-prediction layers among the blocks (the last ones): Megatron's ``m``."""
        return sum(b.mtp for b in self.blocks)

    @property
    def num_pipeline_layers(self) -> int:
        """Embedding, the blocks, the head."""
        return len(self.blocks) + 2

    @property
    def uniform(self) -> bool:
        """Every block alike: one block's costs serve them all."""
        return all(b == self.blocks[0] for b in self.blocks)


def as_description(model) -> ModelDescription:
    """``model`` itself if it is a description, else what its ``describe()`` returns (a family's config)."""
    if isinstance(model, ModelDescription):
        return model
    describe = getattr(model, "describe", None)
    if callable(describe):
        return describe()
    raise DescriptionError(f"{type(model).__name__} is not a model description: pass an arch.ModelDescription "
                           f"or a model config with a describe() method (a family in ds_pipe_ext/models/)")
