"""The schedules DeepSpeed's pipeline engine runs: its 1F1B, GPipe, and both as the simulator sees them.

GPipe for DeepSpeed's engine: every forward first, then every backward.

DeepSpeed's ``PipelineEngine`` runs whatever ``PipeSchedule`` its ``_train_schedule()``
returns (1F1B's ``TrainSchedule`` by default).  ``GPipeSchedule`` yields the same
instructions in GPipe's order: stage s receives, computes and sends the forward of
micro-batch 0, 1, ..., m - 1, then the backward of 0, 1, ..., m - 1, then reduces the
gradients and steps.  It holds every micro-batch's activations (m buffers, where 1F1B
needs p - s), and its step equals 1F1B's to the last bit: the same micro-batches meet
the same weights, and the gradients are accumulated in the same order.

The compute order is ``simulate.schedules.build_schedule("gpipe", p, m)``'s.

``engine_schedule`` turns an engine schedule's instructions into the simulator's
``Schedule`` with its transfers where the engine places them (DeepSpeed's 1F1B sends a
forward's output only after the next step's gradient receive), so ``simulate.events``
times what the engine does, not an idealised order.
"""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds

from ..simulate.schedules import Schedule, Work
from ..simulate.step_model import register_engine_order


class GPipeSchedule(ds.PipeSchedule):
    def num_pipe_buffers(self) -> int:
        return max(2, self.micro_batches)

    def steps(self):
        first, last = self.stage_id == 0, self.stage_id == self.stages - 1
        for i in range(self.micro_batches):
            cmds = [] if first else [ds.RecvActivation(i)]
            if first or last:
                cmds.append(ds.LoadMicroBatch(i))
            cmds.append(ds.ForwardPass(i))
            if not last:
                cmds.append(ds.SendActivation(i))
            yield cmds
        for i in range(self.micro_batches):
            cmds = [] if last else [ds.RecvGrad(i)]
            cmds.append(ds.BackwardPass(i))
            if not first:
                cmds.append(ds.SendGrad(i))
            if i == self.micro_batches - 1:
                cmds += [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]
            yield cmds


TRAIN_SCHEDULES = {"1f1b": ds.TrainSchedule, "gpipe": GPipeSchedule}  # the schedules DeepSpeed's engine can run


def engine_schedule(name: str, num_stages: int, micro_batches: int) -> Schedule:
    """The instructions ``TRAIN_SCHEDULES[name]`` yields on every stage, as a ``Schedule`` with explicit
    transfers (one chunk per stage; buffers mapped back to micro-batches)."""
    if name not in TRAIN_SCHEDULES:
        raise ValueError(f"DeepSpeed's engine runs {sorted(TRAIN_SCHEDULES)}, not {name!r}")
    kinds = {ds.ForwardPass: "F", ds.BackwardPass: "B", ds.SendActivation: "SA", ds.RecvActivation: "RA",
             ds.SendGrad: "SG", ds.RecvGrad: "RG"}
    orders = []
    for s in range(num_stages):
        sched = TRAIN_SCHEDULES[name](micro_batches=micro_batches, stages=num_stages, stage_id=s)
        order, count = [], {k: 0 for k in kinds.values()}
        for step in sched.steps():
            for cmd in step:
                kind = kinds.get(type(cmd))
                if kind is None:
                    continue
                # each kind walks the micro-batches in order; a buffer is reused only after its backward
                i = count[kind]
                count[kind] += 1
                order.append(Work(kind, i, s))
        orders.append(tuple(order))
    return Schedule(f"{name} (DeepSpeed engine)", num_stages, micro_batches, tuple(range(num_stages)), tuple(orders))


register_engine_order("deepspeed", engine_schedule)  # the step model times DeepSpeed runs in its engine's order
