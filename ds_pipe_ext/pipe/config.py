"""The plugin's settings: the ``"pipeline"`` section of ds.json, validated.

DeepSpeed copies unknown keys of its ``"pipeline"`` section through untouched,
so the plugin's settings live beside DeepSpeed's own there::

    "pipeline": {
      "stages": 2,
      "partition_method": "profiled",
      "profile": {"warmup": 2, "repeats": 5, "cache_dir": ".ds_pipe_ext_cache"},
      "memory_cap_gib": null,
      "activation_checkpoint_interval": 0,
      "analytic": {"device": "cpu", "dtype": "fp32", "calibrate": false},  # for partition_method "analytic"
      "instrument": {"enabled": false, "run_dir": "runs/latest", "every": 0},
      "refine_from": null                               # a run directory to learn stage costs from
    }
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..costs.types import ProfileSettings  # torch-free: config parsing stays light

# DeepSpeed's own keys in the same section: accepted and left to DeepSpeed.
DEEPSPEED_PIPELINE_KEYS = {"stages", "partition", "seed_layers", "activation_checkpoint_interval",
                           "pipe_partitioned", "grad_partitioned", "use_reentrant"}


class ConfigError(ValueError):
    """A malformed ``pipeline`` section; the message names the key and the fix."""


@dataclass(frozen=True)
class InstrumentSettings:
    """``"pipeline": {"instrument": {"enabled": true, "run_dir": "runs/x", "every": 0}}`` (off by default)."""

    enabled: bool = False
    run_dir: str = "runs/latest"
    every: int = 0  # also gather a summary on rank 0 every N steps (0: only at the end)

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError("pipeline.instrument.enabled must be true or false")
        if not isinstance(self.run_dir, str) or not self.run_dir:
            raise ConfigError("pipeline.instrument.run_dir must be a directory path")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ConfigError("pipeline.instrument.every must be an integer >= 0")


@dataclass(frozen=True)
class PipelineSettings:
    stages: int = 1
    partition_method: str = "parameters"
    profile: ProfileSettings = field(default_factory=ProfileSettings)
    memory_cap_gib: float | None = None
    activation_checkpoint_interval: int = 0
    link_bandwidth_gbps: float | None = None  # GB/s between stages; None: ignore p2p in the partition
    analytic: dict = field(default_factory=lambda: {"device": "cpu", "dtype": "fp32"})  # for "analytic"
    instrument: InstrumentSettings = field(default_factory=InstrumentSettings)
    refine_from: str | None = None  # a run directory: correct layer costs with its measured stage times

    @classmethod
    def from_ds_config(cls, ds_config: dict) -> "PipelineSettings":
        if not isinstance(ds_config, dict):
            raise ConfigError(f"the DeepSpeed config must be a JSON object, got {type(ds_config).__name__}")
        section = ds_config.get("pipeline", {})
        if not isinstance(section, dict):
            raise ConfigError(f'"pipeline" in ds.json must be an object, got {section!r}')
        ours = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - ours - DEEPSPEED_PIPELINE_KEYS)
        if unknown:
            raise ConfigError(
                f'unknown key(s) {unknown} in the "pipeline" section of ds.json; valid keys are '
                f"{sorted(ours | DEEPSPEED_PIPELINE_KEYS)}"
            )
        kw = {k: v for k, v in section.items() if k in ours}
        prof = kw.get("profile", {})
        if not isinstance(prof, dict):
            raise ConfigError(f'"pipeline.profile" must be an object, got {prof!r}')
        prof_fields = {f.name for f in fields(ProfileSettings)}
        bad = sorted(set(prof) - prof_fields)
        if bad:
            raise ConfigError(f'unknown key(s) {bad} in "pipeline.profile"; valid keys are {sorted(prof_fields)}')
        inst = kw.get("instrument", {})
        inst_fields = {f.name for f in fields(InstrumentSettings)}
        if not isinstance(inst, dict) or set(inst) - inst_fields:
            raise ConfigError(f'"pipeline.instrument" must be an object with keys among {sorted(inst_fields)}')
        try:
            kw["profile"] = ProfileSettings(**prof)
            kw["instrument"] = InstrumentSettings(**inst)
            return cls(**kw)
        except ValueError as e:
            raise ConfigError(f'ds.json "pipeline": {e}') from None

    def __post_init__(self) -> None:
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 1:
            raise ConfigError(f"pipeline.stages = {self.stages!r}; use a positive integer")
        if not isinstance(self.partition_method, str) or not self.partition_method:
            raise ConfigError(f"pipeline.partition_method = {self.partition_method!r}; use a method name such as 'profiled'")
        if self.memory_cap_gib is not None and (
            isinstance(self.memory_cap_gib, bool) or not isinstance(self.memory_cap_gib, (int, float)) or self.memory_cap_gib <= 0
        ):
            raise ConfigError(f"pipeline.memory_cap_gib = {self.memory_cap_gib!r}; use a positive number or null")
        if not isinstance(self.activation_checkpoint_interval, int) or self.activation_checkpoint_interval < 0:
            raise ConfigError("pipeline.activation_checkpoint_interval must be an integer >= 0")
        if not isinstance(self.analytic, dict) or set(self.analytic) - {"device", "dtype", "calibrate"}:
            raise ConfigError('pipeline.analytic must be an object with keys among "device", "dtype", "calibrate"')
        if self.refine_from is not None and not isinstance(self.refine_from, str):
            raise ConfigError("pipeline.refine_from must be a run directory (string) or null")
        if self.link_bandwidth_gbps is not None and not (
            isinstance(self.link_bandwidth_gbps, (int, float)) and self.link_bandwidth_gbps > 0
        ):
            raise ConfigError("pipeline.link_bandwidth_gbps must be a positive number (GB/s) or null")
