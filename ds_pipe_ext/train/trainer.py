"""The training loop: one step function chosen once, timing, logging, checkpoints, a pure summary.

``Trainer.run`` only times steps, logs them (a progress bar on a terminal, JSON lines
otherwise), saves checkpoints on schedule and calls hooks; everything it reports is
computed by ``summarize``, a pure function, and written at the edge by ``write_metrics``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import NoReturn
from pathlib import Path

import torch
import torch.distributed as dist

from ..device import collective_device
from . import checkpoint
from .build import Built


def pipeline_step(built: Built) -> float:
    """One optimizer step of the pipeline engine: its schedule runs every micro-batch."""
    return float(built.engine.train_batch(data_iter=built.data))


def data_parallel_step(built: Built) -> float:
    """One optimizer step of a data-parallel engine: gradient accumulation over the micro-batches."""
    from deepspeed.accelerator import get_accelerator

    from ..instrument.data_parallel import NoRecorder

    engine, device = built.engine, get_accelerator().device_name(built.engine.local_rank)
    rec = built.recorder or NoRecorder()
    rec.begin_step()
    losses = []
    for _ in range(built.cfg.grad_accum):
        inputs, labels = next(built.data)
        with rec.phase("forward"):
            loss = engine(inputs.to(device), labels.to(device))
        with rec.phase("backward"):
            engine.backward(loss)
        with rec.phase("optimizer_step"), torch.profiler.record_function("ds_pipe_ext.optimizer_step"):
            engine.step()  # steps the optimizer at the last micro-batch only
        losses.append(loss.detach())
    mean = float(torch.stack(losses).mean())  # what the pipeline engine reports: the mean over micro-batches
    rec.end_step(mean)
    return mean


def rank_peak_bytes(built: Built) -> int:
    """What the memory cap is compared with: the allocator's peak on GPU; on CPU the tensors this rank
    held at its peak (model states at the optimizer step + saved activations, from the instrumentation),
    because a CPU process's resident set mostly measures libraries and allocator slack."""
    if built.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(built.device))
    last = built.sink.records[-1]
    return int(sum(last[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_peak_bytes")))


def over_memory_cap(cap_gib: float, mine: int, device: torch.device) -> dict | None:
    """Collective: every rank's peak; the heaviest rank's when it exceeds the cap, else None.
    ``device``: the process group's (``device.collective_device``)."""
    everyone = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    everyone[dist.get_rank()] = mine
    dist.all_reduce(everyone)  # a sum of one-hot rows: every rank's peak, on every rank
    rank = int(everyone.argmax())
    cap = cap_gib * 2**30
    if everyone[rank] <= cap:
        return None
    return {"rank": rank, "peak_bytes": int(everyone[rank]), "cap_bytes": int(cap)}


class Trainer:
    def __init__(self, built: Built):
        self.built = built
        self.step_fn: Callable[[Built], float] = pipeline_step if built.cfg.pipelined else data_parallel_step
        self.hooks: list[Callable[[int, float], None]] = []  # called after every step with (step, loss)
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.oom: dict | None = None  # set when a rank's peak passed train.memory_cap_gib

    def _logger(self, total: int):
        if self.built.rank != 0:
            return lambda step, loss, seconds: None
        mode = self.built.cfg.train.log
        rate = self.built.throughput
        mfu = lambda seconds: round(rate.mfu(seconds), 4) if rate.peak_flops else None  # noqa: E731
        if mode == "progress" or (mode == "auto" and sys.stdout.isatty()):
            from tqdm import tqdm

            bar = tqdm(total=total, desc="training", unit="step")
            return lambda step, loss, seconds: (bar.update(1), bar.set_postfix(loss=f"{loss:.4f}", mfu=mfu(seconds)))
        # the loss in full: resumed runs are compared with uninterrupted ones bit for bit
        return lambda step, loss, seconds: print(json.dumps({
            "step": step, "loss": loss, "step_s": round(seconds, 4),
            "samples_per_s": round(rate.samples_per_s(seconds), 3), "mfu": mfu(seconds)}), flush=True)

    def _save(self, step: int) -> None:
        cfg = self.built.cfg
        checkpoint.save(self.built.engine, cfg.options.save, step=step, layout=self.built.layout, parts=self.built.parts,
                        keep_last=cfg.train.keep_last, client_state={"data_position": step * cfg.grad_accum},
                        experts=self.built.expert_parallel, vocabulary=checkpoint.vocabulary_of(self.built.model_cfg))

    def _profiled_step(self, step: int) -> float:
        """One step under torch.profiler; rank 0 writes its summary (``instrument.step_profile``)."""
        from torch.profiler import ProfilerActivity, profile

        from ..instrument.step_profile import write_summary

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.built.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            loss = self.step_fn(self.built)
            if self.built.device.type == "cuda":
                torch.cuda.synchronize(self.built.device)
        if self.built.rank == 0:
            path = write_summary(prof, "step_profile.json", step=step, model=self.built.model_cfg.name,
                                 device=str(self.built.device))
            print(f"ds_pipe_ext: step {step} profiled: {path.resolve()}", flush=True)
        return loss

    def run(self) -> dict:
        cfg, first = self.built.cfg, self.built.start_step
        log, last = self._logger(cfg.train.steps), first + cfg.train.steps
        interval = cfg.train.save_interval
        for step in range(first + 1, last + 1):
            t0 = time.perf_counter()
            if step == cfg.train.profile_step:
                loss = self._profiled_step(step)
            else:
                loss = self.step_fn(self.built)
            self.step_times.append(time.perf_counter() - t0)
            self.losses.append(loss)
            if step == first + 1 and cfg.train.compile and self.built.rank == 0:
                print(f"ds_pipe_ext: step {step} compiled the layers: {self.step_times[-1]:.1f} s "
                      f"(left out of the step timings, as every first step is)", flush=True)
            log(step, loss, self.step_times[-1])
            for hook in self.hooks:
                hook(step, loss)
            if cfg.train.memory_cap_gib is not None:
                self.oom = over_memory_cap(cfg.train.memory_cap_gib, rank_peak_bytes(self.built),
                                           collective_device())
                if self.oom is not None:  # every rank got the same answer: all stop here, together
                    self.oom.update(after_step=step, measure=self.built.cap_measure, at_unix=time.time())
                    if self.built.rank == 0:
                        print(f"ds_pipe_ext: memory cap exceeded: rank {self.oom['rank']} peaked at "
                              f"{self.oom['peak_bytes'] / 2**30:.3f} GiB ({self.oom['measure']}) > "
                              f"train.memory_cap_gib = {cfg.train.memory_cap_gib} after step {step}; "
                              f"stopping all ranks", file=sys.stderr, flush=True)
                    break
            if cfg.options.save and ((interval and step % interval == 0) or step == last):
                self._save(step)
        if self.built.sink is not None:
            self.built.sink.gather()  # collective: rank 0 writes RUN_DIR/summary.json
            self.built.sink.close()
        summary = summarize(self.built, self.losses, self.step_times)
        return {**summary, **self.built.throughput.fields(summary["step_s_median"]), "status": "oom" if self.oom else "ok",
                "oom": self.oom, "memory_cap_gib": cfg.train.memory_cap_gib,
                "peak_measure": self.built.peak_measure, "cap_measure": self.built.cap_measure}


def summarize(built: Built, losses: list[float], step_times: list[float]) -> dict:
    """What the run measured (a pure function of the build and the loop's figures)."""
    from ..compat.engine import coordinates, local_layer_range
    from ..pipe.recompute import built_recompute

    cfg, layout = built.cfg, built.layout
    # step 1 pays for warm-up; a step whose allocations were traced (instrument.peak_step) for profiling
    traced = cfg.instrument.peak_step if cfg.instrument.enabled else 0
    # the recorders count this run's steps; a profiled step (train.profile_step) counts from the run's start
    profiled = cfg.train.profile_step - built.start_step
    timed = [t for n, t in enumerate(step_times, start=1) if n not in (traced, profiled)]
    timed = (timed[1:] if len(timed) > 1 else timed) or [float("nan")]
    global_batch = cfg.micro_batch * cfg.grad_accum * layout.dp
    pipelined = cfg.pipelined
    return {
        "mode": "pipeline" if pipelined else f"data-parallel zero={cfg.zero_stage}", "zero_stage": cfg.zero_stage,
        "micro_batch": cfg.micro_batch, "grad_accum": cfg.grad_accum, "pp": layout.pp, "tp": layout.tp, "dp": layout.dp,
        "model": built.model_cfg.name, "world_size": layout.world_size,
        "stages": layout.pp, "partition_method": cfg.pipeline.partition_method if pipelined else None,
        "parts": list(built.model.parts) if pipelined else None,
        "schedule": cfg.pipeline.schedule if pipelined else None,
        "link_emulation": (cfg.pipeline.link_emulation.model_dump() if pipelined and cfg.pipeline.link_emulation
                           else None),
        "stage_id": coordinates(built.model).stage if pipelined else 0,
        "local_layers": list(local_layer_range(built.model)) if pipelined else None,
        "start_step": built.start_step, "steps": len(losses), "losses": losses,
        "step_s_median": statistics.median(timed), "step_s_each": list(step_times),
        "samples_per_s": global_batch / statistics.median(timed),
        "global_batch": global_batch, "grad_norms": built.grad_norms,
        "tensor_parallel": layout.tp, "sequence_parallel": layout.sp, "recompute": cfg.train.recompute,
        # what this rank's layers recompute as built ({layer: "full" | "selective"})
        "recomputed_layers": ({str(i): m for i, m in built_recompute(built.model).items()} if pipelined else None),
        "data": cfg.train.data or "synthetic",
    }


def write_metrics(summary: dict, rank: int, metrics_out: str | None) -> None:
    """Every rank: what it built (tests check that all ranks agree); rank 0: the summary."""
    if metrics_out:
        out = Path(metrics_out)
        out.with_name(f"{out.stem}.rank{rank}.json").write_text(json.dumps({**summary, "rank": rank}, indent=2))
    if rank == 0:
        print("SUMMARY " + json.dumps(summary), flush=True)
        if metrics_out:
            Path(metrics_out).write_text(json.dumps(summary, indent=2))


def exit_process(code: int) -> NoReturn:
    """End a launched rank without the interpreter's teardown.  DeepSpeed keeps references to its
    gloo groups, so their C++ objects are destroyed during finalization, where a joinable worker
    thread aborts the process ("terminate called without an active exception", exit -6) after
    training succeeded: seen on 1 launch in ~100 (pytorch/pytorch#179291 describes the same
    finalization race).  Call after ``leave_together`` and after the results are written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_together() -> None:
    """A rank that exits while others still talk to it aborts them ("terminate called without an
    active exception" from gloo threads): wait for everyone, then tear the group down."""
    dist.barrier()
    dist.destroy_process_group()
