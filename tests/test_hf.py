"""Hugging Face causal LMs as DeepSpeed pipelines (``ds_pipe_ext.hf``): the pipeline's loss equals the model's
own ``labels=`` loss, layers see the masks and positions the model would give them, a stage reads only its
own tensors, a checkpoint goes back to a save_pretrained directory, and what cannot run is refused by name.
Nothing is downloaded: every model is a small one built and saved here."""

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (AutoModelForCausalLM, DeepseekV3Config, GPT2Config, GptOssConfig, LlamaConfig,  # noqa: E402
                          MistralConfig, NemotronHConfig, Qwen2Config, Qwen3Config)

from ds_pipe_ext import hf  # noqa: E402
from ds_pipe_ext.costs.hardware import get_device  # noqa: E402
from ds_pipe_ext.hf.source import HFPipelineError  # noqa: E402
from ds_pipe_ext.pipe.sequential import SequentialLayers  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=6),  # a window shorter than the batch's 16 tokens
    "qwen2-tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),  # heads of 16 on hidden 32; q/k norms
    "gpt2": lambda: GPT2Config(vocab_size=256, n_embd=32, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0),
    # MLA (q and kv low-rank, a decoupled rotary part), 1 dense layer then MoE (1 shared + 4 routed, top-2 of
    # groups: a sigmoid router limited to topk_group of n_group groups)
    "deepseek_v3": lambda: DeepseekV3Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, rope_parameters=None),
    # attention sinks, a 4-token window on alternate layers (shorter than the batch's 16 tokens), 4 experts
    "gpt_oss": lambda: GptOssConfig(
        vocab_size=256, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64),
    # hybrid: Mamba-2, MLP, attention and MoE layers (Nemotron-H's pattern letters M - * E), chunks of 5 tokens
    "nemotron_h": lambda: NemotronHConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=6, n_groups=2, chunk_size=5,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
        n_group=1, topk_group=1, max_position_embeddings=64, hybrid_override_pattern="M-M*-ME"),
}
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def saved(tmp_path, name: str, impl: str = "sdpa", seed: int = 0, **changes):
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    for k, v in changes.items():
        setattr(config, k, v)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()
    path = tmp_path / f"{name}-{impl}"
    model.save_pretrained(path)
    return model, path


def pipeline_loss(layers, tokens=TOKENS, labels=None) -> float:
    return SequentialLayers(layers, hf.causal_lm_loss)(tokens, tokens if labels is None else labels).item()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_pipelines_loss_is_the_models_own(tmp_path, name, impl):
    if name == "gpt_oss" and impl == "sdpa":  # transformers runs its sinks through eager attention only
        _, path = saved(tmp_path, name, "eager")
        with pytest.raises(HFPipelineError, match=r"transformers runs gpt_oss through its eager attention only"):
            hf.pipeline_layers(path, attn_implementation="sdpa")
        return
    model, path = saved(tmp_path, name, impl)
    want = model(TOKENS, labels=TOKENS).loss.item()
    assert pipeline_loss(hf.pipeline_layers(path, attn_implementation=impl)) == pytest.approx(want, rel=1e-5)
    assert pipeline_loss(hf.pipeline_layers(model)) == pytest.approx(want, rel=1e-5)  # an instance in memory
    labels = TOKENS.clone()
    labels[:, :5] = -100  # positions without a loss, as transformers ignores them
    assert pipeline_loss(hf.pipeline_layers(model), labels=labels) == pytest.approx(
        model(TOKENS, labels=labels).loss.item(), rel=1e-5)


def test_each_layer_gets_the_mask_its_model_builds(tmp_path, monkeypatch):
    """Without the mask an eager layer attends to the future, and Mistral's layers without the window see
    too far: either changes the loss, so the parity above depends on both."""
    from ds_pipe_ext.hf import layers

    model, path = saved(tmp_path, "mistral", "eager")
    want = model(TOKENS, labels=TOKENS).loss.item()
    monkeypatch.setattr(layers, "attention_type", lambda source, index: "full_attention")
    assert abs(pipeline_loss(hf.pipeline_layers(path, attn_implementation="eager")) - want) > 1e-4 * want  # parity: 1e-5
    monkeypatch.undo()
    import transformers.masking_utils as masks

    monkeypatch.setattr(masks, "create_sliding_window_causal_mask", lambda **kw: None)
    assert abs(pipeline_loss(hf.pipeline_layers(path, attn_implementation="eager")) - want) > 1e-4 * want  # parity: 1e-5


def test_a_stage_reads_only_its_own_tensors(tmp_path, monkeypatch):
    model, path = saved(tmp_path, "llama")
    asked = []
    real = hf.HFSource.tensors
    monkeypatch.setattr(hf.HFSource, "tensors", lambda self, prefix: asked.append(prefix) or real(self, prefix))
    layer = hf.pipeline_layers(path)[2].build()  # decoder layer 1
    assert asked == ["model.layers.1."]
    want = dict(model.model.layers[1].named_parameters())
    assert {k.removeprefix("layer."): v for k, v in layer.named_parameters()}.keys() == want.keys()
    assert all(torch.equal(p, want[k.removeprefix("layer.")]) for k, p in layer.named_parameters())


@pytest.mark.parametrize("name", ["llama", "qwen2-tied", "gpt2"])
def test_a_pipeline_checkpoint_goes_back_to_save_pretrained(tmp_path, name):
    """Per-layer files as DeepSpeed's PipelineModule writes them (layer_NN-model_00-model_states.pt) -> a
    save_pretrained directory that transformers loads with every weight, tied head included."""
    model, path = saved(tmp_path, name, seed=3)
    layers = hf.pipeline_layers(path)
    built = SequentialLayers(layers, hf.causal_lm_loss)
    with torch.no_grad():
        for p in built.parameters():
            p.add_(0.01)  # "trained": the export must carry these weights, not the original ones
    ckpt = tmp_path / "ckpt" / "global_step1"
    ckpt.mkdir(parents=True)
    (ckpt.parent / "latest").write_text("global_step1")
    for index, (module_index, _) in enumerate(built._calls):
        torch.save(built.layers[module_index].state_dict(), ckpt / f"layer_{index:02d}-model_00-model_states.pt")
    out = hf.save_pretrained(ckpt.parent, path, tmp_path / "exported")
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert back(TOKENS, labels=TOKENS).loss.item() == pytest.approx(built(TOKENS, TOKENS).item(), rel=1e-5)


@pytest.mark.parametrize("name", ["mistral", "qwen3"])
def test_the_analytic_cost_model_reads_the_models_config(tmp_path, name):
    _, path = saved(tmp_path, name)
    costs = hf.cost_model(path).layer_costs(TOKENS, tp=1, device=get_device("a100"), dtype="fp32")
    assert len(costs) == len(hf.pipeline_layers(path)) == 5
    block = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).model.layers[0].parameters())
    assert costs[1].param_bytes == 4 * block


def test_what_the_pipeline_cannot_run_is_refused_by_name(tmp_path):
    model, path = saved(tmp_path, "llama")
    padded = torch.ones_like(TOKENS)
    padded[:, -4:] = 0
    with pytest.raises(HFPipelineError, match=r"a padded batch \(an attention_mask with zeros\) cannot cross"):
        SequentialLayers(hf.pipeline_layers(path), hf.causal_lm_loss)((TOKENS, padded), TOKENS)
    unpadded = SequentialLayers(hf.pipeline_layers(path), hf.causal_lm_loss)((TOKENS, torch.ones_like(TOKENS)), TOKENS)
    assert unpadded.item() == pytest.approx(model(TOKENS, labels=TOKENS).loss.item(), rel=1e-5)
    model.gradient_checkpointing_enable()
    with pytest.raises(HFPipelineError, match=r"gradient checkpointing switched on; switch it off"):
        hf.pipeline_layers(model)
    with pytest.raises(HFPipelineError, match=r"attn_implementation 'flash_attention_2': the pipeline runs 'sdpa' or 'eager'"):
        hf.pipeline_layers(path, attn_implementation="flash_attention_2")
    other = tmp_path / "neox"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    _, fp8 = saved(tmp_path, "deepseek_v3")  # a released checkpoint's FP8 weights, as its config.json says
    config = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    with pytest.raises(HFPipelineError, match=r"its weights are quantized \(fp8\); .* quantization_config="
                                              r"FineGrainedFP8Config\(dequantize=True\)"):
        hf.pipeline_layers(fp8)
    with pytest.raises(HFPipelineError, match=r"model_type 'gpt_neox' is not supported as a pipeline; supported: "
                                              r"\['deepseek_v3', 'gpt2', 'gpt_oss', 'llama', 'mistral', 'nemotron_h', "
                                              r"'qwen2', 'qwen3'\]"):
        hf.pipeline_layers(other)


@pytest.mark.multiprocess
@pytest.mark.usefixtures("forked_ranks")
def test_deepspeed_trains_a_save_pretrained_directory_on_2_ranks(tmp_path):
    """deepspeed --num_gpus 2, "profiled", a Llama with 5 decoder layers (7 pipeline layers on 2 stages): the
    first step's loss is the model's own labels= loss; a padded profile batch fails on every rank with the
    same error, no hang; the checkpoint exports to a directory transformers loads with the trained weights."""
    from ds_pipe_ext.runner import launch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from hf_pipeline import MICRO_BATCHES, batches

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, "num_hidden_layers": 5})).eval()
    path = tmp_path / "llama5"
    model.save_pretrained(path)
    data = batches(256, 1234)
    want_first = sum(model(x, labels=y).loss.item() for x, y in (next(data) for _ in range(MICRO_BATCHES))) / MICRO_BATCHES
    proc, ranks = launch(2, None, "--model", str(path), "--steps", "2", "--checkpoint", str(tmp_path / "ckpt"),
                         out_dir=tmp_path, cwd=tmp_path, script="examples/hf_pipeline.py", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(ranks) == [0, 1]
    for r in ranks.values():
        assert r["padded_error"] is not None and "a padded batch (an attention_mask with zeros)" in r["padded_error"]
        assert r["losses"][0] == pytest.approx(want_first, rel=1e-5)
        assert r["parts"] == ranks[0]["parts"] and r["parts"][0] == 0 and r["parts"][-1] == 7
    back = AutoModelForCausalLM.from_pretrained(hf.save_pretrained(tmp_path / "ckpt", path, tmp_path / "exported")).eval()
    evals = batches(256, 99)
    exported = sum(back(x, labels=y).loss.item() for x, y in (next(evals) for _ in range(MICRO_BATCHES))) / MICRO_BATCHES
    assert exported == pytest.approx(ranks[0]["eval_loss"], rel=1e-5)
    assert exported != pytest.approx(want_first, rel=1e-3)  # trained weights, not the saved ones


def test_tensor_parallelism_inside_the_pipeline_is_refused_for_hf_layers(tmp_path):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from ds_pipe_ext import PipelineModule
    from ds_pipe_ext.partition import PartitionError

    _, path = saved(tmp_path, "llama")
    with pytest.raises(PartitionError, match=r"HFDecoderLayerPipe layers hold whole \(unsharded\) weights: tensor "
                                             r"parallelism inside the pipeline \(a 'model' axis of 2"):
        PipelineModule(hf.pipeline_layers(path), topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1),
                       loss_fn=hf.causal_lm_loss, partition_method="uniform")


def test_in_memory_models_of_different_shapes_do_not_share_a_profile_cache_key(tmp_path):
    small, _ = saved(tmp_path, "llama")
    torch.manual_seed(0)
    wide = AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, "intermediate_size": 128}))
    assert repr(hf.as_source(small)) != repr(hf.as_source(wide))
    assert repr(hf.as_source(small)) == repr(hf.as_source(small))  # stable


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["nemotron_h", "deepseek_v3", "gpt_oss"])
def test_todays_models_train_as_pipelines_on_2_and_4_ranks(tmp_path, forked_ranks, name):
    """Nemotron-H's layers (Mamba-2, MLP, attention, MoE: M-M*-ME), DeepSeek-V3's (MLA, a dense layer, routed
    experts) and gpt-oss's (sinks, alternating windows) as 2 and 4 stages of DeepSpeed's pipeline, split by
    "profiled", each stage reading its own tensors: the first step's loss is the model's own labels= loss within
    1e-5 (fp32)."""
    from ds_pipe_ext.runner import launch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from hf_pipeline import MICRO_BATCHES, batches

    model, path = saved(tmp_path, name, "eager" if name == "gpt_oss" else "sdpa", seed=5)
    data = batches(256, 1234)
    want_first = sum(model(x, labels=y).loss.item() for x, y in (next(data) for _ in range(MICRO_BATCHES)))
    want_first /= MICRO_BATCHES
    # ranks forked from this process (conftest's forked_ranks): the check is the pipeline's loss
    for stages in (2, 4):
        out = tmp_path / f"stages{stages}"
        out.mkdir()
        proc, ranks = launch(stages, None, "--model", str(path), "--steps", "1", "--stages", str(stages),
                             "--checkpoint", str(out / "ckpt"), out_dir=out, cwd=tmp_path,
                             script="examples/hf_pipeline.py", timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted(ranks) == list(range(stages)) and len(ranks[0]["parts"]) == stages + 1
        for r in ranks.values():
            assert r["losses"][0] == pytest.approx(want_first, rel=1e-5), stages


def with_mtp_weights(model, path, seed: int = 7) -> dict:
    """DeepSeek-V3's released layout: MTP layer 1's tensors under model.layers.{L}.* in a second safetensors file
    (enorm, hnorm, eh_proj, shared_head.norm, a decoder layer's weights with experts one by one, and copies of
    the table and head), the index listing both files.  The tensors, by name."""
    import json

    from safetensors.torch import save_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg, L = model.config, model.config.num_hidden_layers
    torch.manual_seed(seed)
    layer = DeepseekV3DecoderLayer(cfg, L)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    state = {}
    for name, t in layer.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # the checkpoint's experts one by one, as released
            for i, w in enumerate(t):
                gate, up = w.chunk(2)
                state[f"mlp.experts.{i}.gate_proj.weight"], state[f"mlp.experts.{i}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            for i, w in enumerate(t):
                state[f"mlp.experts.{i}.down_proj.weight"] = w
        else:
            state[name] = t
    h = cfg.hidden_size
    state.update({"enorm.weight": 1 + 0.1 * torch.randn(h), "hnorm.weight": 1 + 0.1 * torch.randn(h),
                  "eh_proj.weight": 0.2 * torch.randn(h, 2 * h), "shared_head.norm.weight": 1 + 0.1 * torch.randn(h),
                  "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
                  "shared_head.head.weight": model.lm_head.weight.detach().clone()})
    tensors = {f"model.layers.{L}.{k}": v.detach().clone().contiguous() for k, v in state.items()}
    save_file(tensors, str(path / "mtp.safetensors"))
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (path / "model.safetensors").rename(path / "main.safetensors")
    weight_map = {**{n: "main.safetensors" for n in names}, **{n: "mtp.safetensors" for n in tensors}}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {**tensors, "layer": layer}


def test_deepseek_v3_mtp_layers_come_from_the_checkpoint_and_train_as_megatron_writes_them(tmp_path):
    """A tiny DeepSeek-V3 directory with MTP layer 1's weights where released checkpoints keep them: the pipeline
    (mtp=True) builds the layer from them and its loss equals transformers' model run by hand with the same
    tensors: the main causal-LM loss plus 0.3 x the MTP layer's, which predicts two tokens ahead from the
    embedding of the next token and the last decoder layer's output (megatron-core's procedure)."""
    import torch.nn.functional as F

    model, path = saved(tmp_path, "deepseek_v3")
    mtp = with_mtp_weights(model, path)
    L = model.config.num_hidden_layers
    layers = hf.pipeline_layers(path, mtp=True)
    assert len(layers) == L + 3
    got = SequentialLayers(layers, hf.mtp_causal_lm_loss(1, 0.3))(TOKENS, TOKENS).item()
    # by hand: the model's last hidden states before its final norm, then the MTP layer
    with torch.no_grad():
        out = model(TOKENS, labels=TOKENS, output_hidden_states=True)
        # hidden_states: the embeddings, then each layer's output, the last one after the final norm; so the last
        # layer is run again on its input
        h = model.model.layers[-1](out.hidden_states[L - 1], **_layer_kwargs(model))
        h = h[0] if isinstance(h, tuple) else h
        main = out.loss.item()
        p = lambda name: mtp[f"model.layers.{L}.{name}"]  # noqa: E731
        rms = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps))  # noqa: E731
        e = model.model.embed_tokens(torch.cat((TOKENS[:, 1:], torch.zeros_like(TOKENS[:, :1])), dim=1))
        x = F.linear(torch.cat((rms(e, p("enorm.weight")), rms(h, p("hnorm.weight"))), dim=-1), p("eh_proj.weight"))
        layer = mtp["layer"]
        y = layer(x, **_layer_kwargs(model))
        y = y[0] if isinstance(y, tuple) else y
        logits = model.lm_head(rms(y, p("shared_head.norm.weight")))
        two_ahead = F.cross_entropy(logits[:, :-2].reshape(-1, logits.shape[-1]), TOKENS[:, 2:].reshape(-1))
    assert got == pytest.approx(main + 0.3 * two_ahead.item(), rel=1e-5)
    with pytest.raises(HFPipelineError, match="no weights under model.layers.3."):
        hf.pipeline_layers(saved(tmp_path / "plain", "deepseek_v3")[1], mtp=True)
    with pytest.raises(HFPipelineError, match="declares no multi-token-prediction"):
        hf.pipeline_layers(saved(tmp_path, "llama")[1], mtp=True)


def _layer_kwargs(model):
    """What the model hands a decoder layer for TOKENS: positions, rotary (cos, sin), no mask (sdpa, causal)."""
    b, s = TOKENS.shape
    position_ids = torch.arange(s)[None].expand(b, -1)
    x = torch.zeros(b, s, model.config.hidden_size)
    return {"attention_mask": None, "position_ids": position_ids,
            "position_embeddings": model.model.rotary_emb(x, position_ids)}
