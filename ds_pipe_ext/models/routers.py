"""The routers of the moe family's blocks, each a gate DeepSpeed's MoE layer (``deepspeed.moe``) runs:

    softmax  DeepSpeed's own ``TopKGate``: softmax scores, the top k (Mixtral, Qwen-MoE, DeepSeekMoE); with
             ``router_bias`` the router's linear has a bias (gpt-oss: the softmax over the top k logits, which
             DeepSpeed's renormalised top-k of the softmax over all is, exactly)
    sigmoid  DeepSeek-V3's: a sigmoid score per expert; the choice made on score + a bias (the
             ``e_score_correction_bias`` that steers the load without a loss), among the experts of the
             ``topk_groups`` best of ``groups`` groups (a group scored by its two best experts); the weights
             are the chosen experts' scores, renormalised, times ``routed_scaling_factor``

Why a gate of DeepSpeed's layer and not a layer of our own: the capacity slots, the dispatch, the EP all-to-all,
the combine, the expert groups and the checkpoint names stay DeepSpeed's one code path, which ``costs/moe_ops.py``
prices and the EP and checkpoint tests already hold.  ``SigmoidGroupGate`` chooses the experts and hands
DeepSpeed's ``topkgating`` the log of the chosen experts' scores (every other expert -inf): the softmax DeepSpeed
takes of them is the renormalised scores, exactly and with their gradient (softmax(log s) = s / sum(s)), and its
capacity, dispatch and load-balancing loss run unchanged on them.  The routed scaling factor multiplies the
routed experts' output (the combine is linear in the weights).

The bias is a buffer, as in Hugging Face's model: nothing here updates it (DeepSeek-V3's update, a step of
+-gamma per expert against its load after each optimizer step, is a training-loop rule outside the layer).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F


def sigmoid_group_topk(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, groups: int,
                       topk_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids (T, k), the sigmoid scores (T, E)) of fp32 router logits (T, E), as DeepSeek-V3 chooses:
    the top ``top_k`` of score + ``bias`` within the ``topk_groups`` groups whose two best experts score most."""
    scores = logits.sigmoid()
    with torch.no_grad():  # the choice takes no gradient: nothing of it is kept for the backward
        return _choose(scores + bias, top_k, groups, topk_groups), scores


def _choose(choice: torch.Tensor, top_k: int, groups: int, topk_groups: int) -> torch.Tensor:
    tokens, experts = choice.shape
    group_scores = choice.view(tokens, groups, experts // groups).topk(2, dim=-1).values.sum(-1)
    best_groups = group_scores.topk(topk_groups, dim=-1, sorted=False).indices
    in_best = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    in_best = in_best.unsqueeze(-1).expand(tokens, groups, experts // groups).reshape(tokens, experts)
    return choice.masked_fill(~in_best, float("-inf")).topk(top_k, dim=-1, sorted=False).indices


def chosen_log_scores(scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Logits whose softmax is the chosen experts' renormalised scores and 0 elsewhere: log(score) at the chosen
    experts, -inf at the others (what ``SigmoidGroupGate`` hands DeepSpeed's top-k gating)."""
    logits = torch.full_like(scores, float("-inf"))
    return logits.scatter(1, chosen, scores.gather(1, chosen).log())


@lru_cache(maxsize=1)
def _gate_class():
    """Our gates' base: a DeepSpeed ``TopKGate`` whose ``route`` (of the subclass) picks the logits handed to
    DeepSpeed's ``topkgating`` (DeepSpeed imported only here: a config loads without it)."""
    from deepspeed.moe.sharded_moe import TopKGate, topkgating

    class RoutedGate(TopKGate):
        what = "this router"

        def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
            raise NotImplementedError

        def forward(self, input: torch.Tensor, used_token: torch.Tensor = None, sparse_routes: bool = False,
                    use_tutel: bool = False):
            if use_tutel:
                raise ValueError(f"{self.what} runs DeepSpeed's own dispatch; turn tutel off")
            _, logits = self.route(input)
            capacity = self.capacity_factor if self.training else self.eval_capacity_factor
            return topkgating(logits, self.k, capacity, self.min_capacity, self.drop_tokens, self.ep_group,
                              sparse_routes=sparse_routes)

    return RoutedGate


def make_sigmoid_gate(model_dim: int, num_experts: int, *, k: int, groups: int, topk_groups: int, **gate_kwargs):
    """A ``SigmoidGroupGate``: DeepSeek-V3's router as a gate of DeepSpeed's MoE layer (the module's docstring)."""

    class SigmoidGroupGate(_gate_class()):
        what = "the sigmoid router"

        def __init__(self) -> None:
            super().__init__(model_dim, num_experts, k, **gate_kwargs)
            self.groups, self.topk_groups = groups, topk_groups
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

        def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """(chosen expert ids, the logits DeepSpeed's top-k gating is handed) of tokens (T, h)."""
            logits = F.linear(tokens.float(), self.wg.weight.float())
            chosen, scores = sigmoid_group_topk(logits, self.e_score_correction_bias, top_k=self.k,
                                                groups=self.groups, topk_groups=self.topk_groups)
            return chosen, chosen_log_scores(scores, chosen)

    return SigmoidGroupGate()


def make_biased_gate(model_dim: int, num_experts: int, *, k: int, **gate_kwargs):
    """DeepSpeed's softmax top-k gate with a bias on its router's linear (gpt-oss's router)."""

    class BiasedSoftmaxGate(_gate_class()):
        what = "the biased router"

        def __init__(self) -> None:
            super().__init__(model_dim, num_experts, k, **gate_kwargs)
            self.wg = torch.nn.Linear(model_dim, num_experts, bias=True)

        def route(self, tokens: torch.Tensor) -> tuple[None, torch.Tensor]:
            return None, F.linear(tokens.float(), self.wg.weight.float(), self.wg.bias.float())

    return BiasedSoftmaxGate()
