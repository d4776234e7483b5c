"""What a Mixture-of-Experts model's routers did each step: tokens per expert per layer, the tokens dropped
beyond capacity, and the load-balancing loss.

``ExpertLoadMeter`` hooks the routed blocks of a stage (``models.moe.MoEBlock``: each keeps its last
forward's ``tokens_per_expert`` and ``dropped_tokens``) and sums them over a step's micro-batches.  Each
micro-batch's busiest expert against the mean is kept too (``expert_imbalance``, the mean of it over a
step's micro-batches and layers): dropless routing pads every local expert to the busiest one's load, so
this is the factor the analytic experts' time takes (``EstimateRequest.expert_imbalance``).  A
forward without gradients is not counted: under DeepSpeed's reentrant checkpointing the first forward
runs without them and the replay with them, so each micro-batch counts once.  Layers are named by their
index in the pipeline (DeepSpeed registers a stage's layers under their global index).
"""

from __future__ import annotations

import torch


class ExpertLoadMeter:
    def __init__(self, module: torch.nn.Module):
        self.blocks = {name.split(".")[-1]: m for name, m in module.named_modules()
                       if getattr(m, "routed", False) and hasattr(m, "tokens_per_expert")}
        self.counts: dict[str, torch.Tensor] = {}
        self.dropped = 0
        self.routed = 0
        self.imbalances: list[float] = []
        self.handles = [m.register_forward_hook(self._seen(name)) for name, m in self.blocks.items()]

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def _seen(self, name: str):
        def hook(block, inputs, output) -> None:
            if not torch.is_grad_enabled() or block.tokens_per_expert is None:
                return
            counts = block.tokens_per_expert.detach().to("cpu", torch.long)
            self.counts[name] = counts + self.counts[name] if name in self.counts else counts
            self.dropped += int(block.dropped_tokens)
            self.routed += int(counts.sum())
            if int(counts.sum()):
                self.imbalances.append(int(counts.max()) * len(counts) / int(counts.sum()))
        return hook

    def read(self) -> dict:
        """This step's loads, then start the next step from zero."""
        out = {"expert_load": {name: c.tolist() for name, c in sorted(self.counts.items(), key=lambda kv: int(kv[0]))},
               "dropped_token_fraction": self.dropped / self.routed if self.routed else 0.0,
               "expert_imbalance": sum(self.imbalances) / len(self.imbalances) if self.imbalances else 1.0}
        self.counts, self.dropped, self.routed, self.imbalances = {}, 0, 0, []
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
