import pytest

from ds_pipe_ext.models import load_model
from ds_pipe_ext.models.config import ModelConfigError, available_models
from ds_pipe_ext.models.gpt_config import GPTConfig, load_model_config
from ds_pipe_ext.pipe.config import ConfigError, PipelineSettings


def test_all_shipped_model_configs_load():
    names = available_models()
    for required in ["tiny", "gpt2-small", "gpt2-medium", "gpt3-small", "gpt3-1.3b", "gpt3-175b", "bench-cpu",
                     "llama3-8b", "llama3-70b", "llama3.1-405b", "mistral-7b", "qwen2.5-7b", "llama-tiny",
                     "bench-cpu-llama"]:
        assert required in names
    for n in names:
        cfg = load_model(n)  # each by its family
        # heads divide hidden, unless each head's width is given (kv_channels: Qwen3's, gpt-oss's wider heads)
        assert cfg.name == n and (cfg.hidden % cfg.heads == 0 or getattr(cfg, "kv_channels", 0))
    bench = load_model_config("bench-cpu")
    assert (bench.vocab_size, bench.hidden, bench.layers, bench.seq_len) == (50257, 512, 12, 256)
    assert bench.num_pipeline_layers == 14


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"hidden": 100, "heads": 3}, "not divisible by heads"),
        ({"layers": 0}, "layers = 0"),
        ({"vocab_size": "big"}, "vocab_size"),
        ({"dropout": 1.5}, "dropout"),
        ({"hiden": 64}, "unknown field"),
    ],
)
def test_bad_model_config_names_the_field(fields, match):
    base = dict(vocab_size=64, hidden=32, layers=2, heads=4, seq_len=8)
    with pytest.raises(ModelConfigError, match=match):
        GPTConfig.from_dict({**base, **fields}, name="bad")


def test_missing_field_and_bad_toml(tmp_path):
    with pytest.raises(ModelConfigError, match="missing field"):
        GPTConfig.from_dict({"vocab_size": 10}, name="x")
    p = tmp_path / "broken.toml"
    p.write_text("hidden = = 3")
    with pytest.raises(ModelConfigError, match="not valid TOML"):
        load_model_config(p)
    with pytest.raises(ModelConfigError, match="unknown model 'nope'"):
        load_model_config("nope")


def test_pipeline_section_parses_and_validates():
    s = PipelineSettings.from_ds_config(
        {"pipeline": {"stages": 2, "partition_method": "profiled", "profile": {"repeats": 3}, "memory_cap_gib": 4}}
    )
    assert (s.stages, s.partition_method, s.profile.repeats, s.memory_cap_gib) == (2, "profiled", 3, 4)
    # DeepSpeed's own keys in the same section are accepted
    PipelineSettings.from_ds_config({"pipeline": {"stages": 2, "pipe_partitioned": True}})
    s = PipelineSettings.from_ds_config({"pipeline": {"schedule": "gpipe", "link_emulation": {"latency_ms": 5}}})
    assert (s.schedule, s.link_emulation.latency_ms, s.link_emulation.bandwidth_gbs) == ("gpipe", 5.0, None)
    for bad, match in [
        ({"pipeline": {"stages": 0}}, "stages"),
        ({"pipeline": {"stagse": 2}}, "unknown key"),
        ({"pipeline": {"profile": {"repeat": 3}}}, "pipeline.profile"),
        ({"pipeline": {"profile": {"repeats": 0}}}, "repeats"),
        ({"pipeline": {"memory_cap_gib": -1}}, "memory_cap_gib"),
        ({"pipeline": []}, "must be an object"),
        # DeepSpeed's engine runs 1F1B and GPipe; zero-bubble and interleaved are simulated only
        ({"pipeline": {"schedule": "zb-h1"}}, "pipeline.schedule"),
        ({"pipeline": {"link_emulation": {"bandwidth_gbs": 0}}}, "bandwidth_gbs"),
        ({"pipeline": {"link_emulation": {"latency": 1}}}, "unknown key"),
        ({"pipeline": {"schedule": "dualpipev", "link_emulation": {"latency_ms": 1}}}, "batch_isend_irecv"),
    ]:
        with pytest.raises(ConfigError, match=match):
            PipelineSettings.from_ds_config(bad)


def test_a_ds_json_without_a_partition_method_means_parameters_at_every_point_that_reads_it():
    """One record resolves partition_method, with DeepSpeed's default: train.py's recompute check, the settings
    and PipelineModule (whose partition callback reads what its __init__ resolved) all see "parameters"."""
    from torch import nn

    from ds_pipe_ext import PipelineModule
    from ds_pipe_ext.partition import PartitionError
    from ds_pipe_ext.partition.methods import lookup
    from ds_pipe_ext.train.config import build_run_config

    section = {"stages": 2, "memory_cap_gib": 1.0}
    needs_costs = 'recompute = "auto" is decided with the split from layer costs'
    with pytest.raises(ConfigError, match=needs_costs):
        build_run_config({"pipeline": section, "train": {"model": "tiny", "recompute": "auto"}})
    settings = PipelineSettings.from_ds_config({"pipeline": section})
    assert settings.partition_method == "parameters" and settings.method == lookup("parameters")
    with pytest.raises(PartitionError, match=needs_costs):
        PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], settings=settings, recompute="auto")
    # with the method given, the same check passes everywhere it is read
    build_run_config({"pipeline": {**section, "partition_method": "profiled"},
                      "train": {"model": "tiny", "recompute": "auto"}})
    with pytest.raises(ConfigError, match="unknown partition_method 'balanced'"):
        PipelineSettings.from_ds_config({"pipeline": {"partition_method": "balanced"}})
