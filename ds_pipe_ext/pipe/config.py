"""The plugin's settings: the ``"pipeline"`` section of ds.json, validated like DeepSpeed's own config.

DeepSpeed copies unknown keys of its ``"pipeline"`` section through untouched,
so the plugin's settings live beside DeepSpeed's own there::

    "pipeline": {
      "stages": 2,                                      # DeepSpeed's (an integer, or "auto")
      "partition_method": "profiled",
      "profile": {"warmup": 2, "repeats": 5, "cache_dir": ".ds_pipe_ext_cache"},
      "memory_cap_gib": null,
      "activation_checkpoint_interval": 0,              # DeepSpeed's: full recompute every N layers
      "link_bandwidth_gbs": null,                       # GB/s between stages (adds p2p time to the split)
      "schedule": "1f1b",                               # or "gpipe" (every forward, then every backward), "dualpipev"
      "link_emulation": null,                           # {"latency_ms": 5, "bandwidth_gbs": 0.25}: a slower link
      "analytic": {"device": null, "dtype": null, "calibrate": false},  # for "analytic"; null: the run's
      "instrument": {"enabled": false, "run_dir": "runs/latest", "every": 0, "per_layer": false},
      "refine_from": null,                              # a run directory to learn stage costs from
      "step_model": null                                # a fitted step model (ds-pipe-ext step-model fit)
    }

Every key is typed and checked when ds.json is read, before any process group:
a string where a boolean belongs, an unknown key (the error lists the valid
ones) or a negative interval is a ``ConfigError`` naming the key.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ..config_model import ConfigError, ConfigModel, parse_section
from ..costs.types import ProfileSettings

__all__ = ["ConfigError", "LinkEmulation", "PipelineSettings", "InstrumentSettings", "AnalyticSettings", "ProfileSettings",
           "engine_dtype"]


class InstrumentSettings(ConfigModel):
    """``"pipeline": {"instrument": {"enabled": true, "run_dir": "runs/x", "every": 0, "per_layer": false}}``
    (off by default)."""

    enabled: bool = False
    run_dir: str = Field("runs/latest", min_length=1)
    every: int = Field(0, ge=0)  # also gather a summary on rank 0 every N steps (0: only at the end)
    # trace the live-tensor peak of this step (>= 2; the step before warms the trace) with torch.profiler's
    # allocation events, broken down by kind, into its step record ("peak"); 0: none.  Slows both steps
    peak_step: int = Field(0, ge=0)
    # time each layer of the stage by module hooks (instrument/layer_timing.py), for the report's per-layer
    # table against the profile; a few microseconds a call
    per_layer: bool = False

    @field_validator("peak_step")
    @classmethod
    def _after_a_warm_up(cls, v: int) -> int:
        if v == 1:
            raise ValueError("peak_step = 1: the traced step needs a step before it to warm the trace; use 2 or later")
        return v


class AnalyticSettings(ConfigModel):
    """``"pipeline": {"analytic": {...}}``: the device spec and precision the analytic costs assume;
    None: the run's own (``cuda``, measured on the GPU the run is on, or ``cpu``; the dtype the engine trains in)."""

    device: str | None = None  # a100 | a100-40gb | h100 | h200 | cuda | cpu (the last two measured here)
    dtype: Literal["fp32", "bf16", "fp16"] | None = None
    calibrate: bool = False  # fit the spec's efficiencies to a few layers profiled on this machine


class LinkEmulation(ConfigModel):
    """``"pipeline": {"link_emulation": {"latency_ms": 5, "bandwidth_gbs": 0.25}}``: every pipeline p2p
    transfer takes this much longer (``compat.link_emulator``), to measure a network this machine lacks."""

    latency_ms: float = Field(0.0, ge=0)
    bandwidth_gbs: float | None = Field(None, gt=0)  # GB/s; None: latency only


class PipelineSettings(ConfigModel):
    # DeepSpeed's own keys: accepted here, used by DeepSpeed
    stages: int | Literal["auto"] = 1
    partition: Any = None
    seed_layers: bool | None = None
    pipe_partitioned: bool | None = None
    grad_partitioned: bool | None = None
    use_reentrant: bool | None = None
    activation_checkpoint_interval: int = Field(0, ge=0)
    # ours.  DeepSpeed's default, so that the drop-in stays one; train.py's own configs say "profiled".  Resolved
    # here once (``method``): the recompute check, PipelineModule and its partition callback read this record
    partition_method: str = Field("parameters", min_length=1)
    profile: ProfileSettings = ProfileSettings()
    memory_cap_gib: float | None = Field(None, gt=0)
    link_bandwidth_gbs: float | None = Field(None, gt=0)  # GB/s between stages; None: ignore p2p in the partition
    analytic: AnalyticSettings = AnalyticSettings()
    instrument: InstrumentSettings = InstrumentSettings()
    refine_from: str | None = None  # a run directory: correct layer costs with its measured stage times
    # a JSON file from `ds-pipe-ext step-model fit`: profiled and analytic then minimise the step it
    # predicts (engine costs per instruction, optimizer step, shared cores); None: layer costs alone
    step_model: str | None = None
    # the order DeepSpeed's engine runs: its 1F1B TrainSchedule, GPipe (holds every micro-batch), or
    # its DualPipeV engine (2 chunks a rank; our methods then balance each rank's pair); the
    # partitioner's memory cap counts the micro-batches the chosen one holds
    schedule: Literal["1f1b", "gpipe", "dualpipev"] = "1f1b"
    link_emulation: LinkEmulation | None = None  # off: the machine's own links

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data):
        # link_bandwidth_gbps always meant gigaBYTES per second: accepted, with a note
        if isinstance(data, dict) and "link_bandwidth_gbps" in data:
            if "link_bandwidth_gbs" in data:
                raise ValueError("give link_bandwidth_gbs only (link_bandwidth_gbps is its old name)")
            warnings.warn("pipeline.link_bandwidth_gbps is deprecated: it is GB/s, now spelled link_bandwidth_gbs",
                          FutureWarning, stacklevel=2)
            data = {**data, "link_bandwidth_gbs": data["link_bandwidth_gbps"]}
            del data["link_bandwidth_gbps"]
        return data

    @field_validator("partition_method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        from ..partition import PartitionError
        from ..partition.methods import lookup

        try:
            lookup(method)
        except PartitionError as e:
            raise ValueError(str(e)) from None
        return method

    @property
    def method(self) -> tuple:
        """The partition method's spec and its argument (``partition.methods.lookup``)."""
        from ..partition.methods import lookup

        return lookup(self.partition_method)

    @model_validator(mode="after")
    def _stages(self):
        if isinstance(self.stages, int) and self.stages < 1:
            raise ValueError(f"stages = {self.stages}: use a positive integer or \"auto\"")
        return self

    @model_validator(mode="after")
    def _emulation_reaches_the_schedule(self):
        if self.schedule == "dualpipev" and self.link_emulation is not None:
            raise ValueError("link_emulation slows DeepSpeed's p2p send/recv, which DualPipeV does not use (it "
                             "batches its transfers through batch_isend_irecv): drop one of the two")
        return self

    @property
    def link_bandwidth(self) -> float | None:
        """Bytes per second, or None."""
        return self.link_bandwidth_gbs * 1e9 if self.link_bandwidth_gbs else None

    @classmethod
    def from_ds_config(cls, ds_config: dict) -> "PipelineSettings":
        if not isinstance(ds_config, dict):
            raise ConfigError(f"the DeepSpeed config must be a JSON object, got {type(ds_config).__name__}")
        return parse_section(cls, ds_config.get("pipeline", {}), "pipeline")


def engine_dtype(ds_config: dict) -> str:
    """The precision DeepSpeed trains in, from ds.json: its ``bf16`` or ``fp16`` section, else fp32."""
    for name in ("bf16", "fp16"):
        section = ds_config.get(name) or {}
        if section.get("enabled", False) is True:
            return name
    return "fp32"
