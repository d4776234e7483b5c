"""The peak rule in the form a partitioner's memory cap can use for any split (``PipelinePeakRule``).

``costs.peak.step_peak`` walks one rank's step for one split.  A partitioner asks about every split, so it
needs the peak as sums over a stage's layers plus a reserve that depends only on the stage's position;
this module gives that form, built from the same ZeRO rules (``costs.zero``) and settings
(``costs.peak.ZeroSettings``), and tests/test_peak_rule.py holds the two equal on a last stage of alike
blocks.  Pure arithmetic on ``LayerCost`` lists: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from .peak import ZeroSettings
from .zero import layer_states_by_rule, layer_tensors


@dataclass(frozen=True)
class PipelinePeakRule:
    """The peak rule in the form a partitioner's memory cap can use for any split: a stage's peak is at
    most the sum of its layers' states as held during a backward (``layer_states``), its in-flight
    micro-batches' saved activations, and a reserve that depends only on the stage's position
    (``stage_reserves``): ZeRO-1's reduction bucket (two in the gradient reduction), the pipe buffers of received inputs and sent outputs
    (the last stage's hold the loss's input, ``LayerCost.loss_input_bytes``), and the largest temporaries
    of any layer the stage can hold (``LayerCost.peak_bytes`` over its saved activations and its output).  Equal to
    ``step_peak`` for the last stage of alike blocks; above it where the peak falls in a first backward
    (gradients not yet all made) or the largest temporaries are not the stage's last layer's."""

    zero: ZeroSettings = ZeroSettings()
    dp: int = 1
    element_bytes: int = 4
    fused_adam: bool = False  # the optimizer step makes no temporaries
    ep: int = 1  # expert parallelism: the experts' states partition over tp x dp / ep ranks
    tp: int = 1

    def _states(self, costs: list) -> list:
        """Per layer, its states at the step by ZeRO's rule; under BF16_Optimizer ZeRO-1's master weights and
        moments on 1/dp beside its whole 16-bit gradients (``bf16_optimizer_states``, the accumulation buffer
        apart)."""
        e = self.element_bytes
        if not self.zero.bf16_optimizer:
            return layer_states_by_rule(costs, stage=self.zero.stage, dp=self.dp, element_bytes=e, ep=self.ep,
                                        tp=self.tp)
        return [replace(r, grad_bytes=r.param_bytes if c.grad_bytes > 0 else 0)
                for c, r in zip(costs, layer_states_by_rule(costs, stage=1, dp=self.dp, element_bytes=e, ep=self.ep,
                                                                      tp=self.tp))]

    def step_bytes(self, costs: list) -> list[float]:
        """Per layer, what its stage holds for it at the optimizer step: the states as at the step (ZeRO's
        rule), 16-bit ZeRO-0's flat accumulation buffer, and Adam's two fp32 temporaries (of the flat
        partition, its share per layer; of the layer's largest tensor where torch steps each parameter,
        fp32 ZeRO-0: a bound, the stage's largest being at most the sum)."""
        e, z, a = self.element_bytes, self.zero.stage, self.zero.bf16_accum_bytes
        out = []
        for c, ruled in zip(costs, self._states(costs)):
            params = c.param_bytes / e
            trainable = c.grad_bytes > 0
            flat = e * params if e < 4 and z == 0 and trainable else 0.0
            if a and trainable:  # the accumulation buffer, and its partition cast to fp32 where it is bf16
                flat = a * params + (4.0 * params / self.dp if a < 4 else 0.0)
            if self.fused_adam or not trainable:
                adam = 0.0
            elif z == 0 and e == 4:
                adam = 8.0 * max(layer_tensors(c, e), default=0)
            elif a:  # the flat fp32 partition
                adam = 8.0 * params / self.dp
            else:  # the flat fp32 partitions: the dense one over dp, the experts' over tp x dp / ep
                experts = c.expert_param_bytes / e
                adam = (8.0 * ((params - experts) / self.dp + experts * self.ep / (self.tp * self.dp)) if z
                        else 8.0 * params)
            out.append(float(ruled.static_bytes) + flat + adam)
        return out

    def layer_states(self, costs: list) -> list:
        """``LayerCost`` records whose states are what a stage holds during its backward: parameters and
        optimizer states by ZeRO's rule, every gradient in the parameters' dtype (ZeRO-0 and -1 keep them
        to the step), and 16-bit ZeRO-0's flat accumulation buffer beside them."""
        e, a = self.element_bytes, self.zero.bf16_accum_bytes
        # 16-bit ZeRO-0: the gradients and the flat accumulation buffer (BF16_Optimizer's in grad_accum_dtype)
        per_grad = e + a if a else e * (2 if e < 4 and self.zero.stage == 0 else 1)
        out = []
        for c, ruled in zip(costs, self._states(costs)):
            out.append(_with_grads(ruled, round(per_grad * c.param_bytes / e) if c.grad_bytes > 0 else 0))
        return out

    def stage_reserves(self, costs: list, num_stages: int, *, micro_batches: int) -> list[float]:
        """Per stage, the bytes it holds beside its layers' states and saved activations at its peak, for
        any split of ``costs`` into ``num_stages`` (stage s holds layers among [s, n - (p - s)])."""
        n, p = len(costs), num_stages
        bucket = float(self.element_bytes * self.zero.reduce_bucket_size) if self.zero.stage == 1 else 0.0
        # a layer's temporaries in a stage's walk: its peak (a profile's: above its input, with its output held)
        # less its saved activations, its output, and with its input back, which it saves
        inputs = [0.0] + [float(c.output_bytes) for c in costs[:-1]]
        transient = [max(0.0, float(c.peak_bytes - c.activation_bytes - c.output_bytes + i))
                     for c, i in zip(costs, inputs)]
        out = []
        for s in range(p):
            lo, hi = s, n - (p - s)  # the layers stage s can hold
            buffers = max(2, min(p - s, micro_batches))  # DeepSpeed's TrainSchedule.num_pipe_buffers
            received = max((float(costs[i - 1].output_bytes) for i in range(max(lo, 1), hi + 1)), default=0.0) if s else 0.0
            sent = (float(costs[-1].loss_input_bytes) if s == p - 1
                    else max(float(costs[i].output_bytes) for i in range(lo, hi + 1)))
            # ZeRO-1's bucket beside the backward's temporaries, or two buckets in the pipeline's gradient
            # reduction (``step_peak``'s reduce_grads; no activations are held then)
            out.append(buffers * (received + sent) + max(bucket + max(transient[lo:hi + 1]), 2 * bucket))
        return out


@lru_cache(maxsize=4096)  # alike blocks are equal records
def _with_grads(c, grad_bytes: int):
    return replace(c, grad_bytes=grad_bytes)
