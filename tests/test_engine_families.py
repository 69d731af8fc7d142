"""The native engine for every supported family (Llama incl. SmolLM2-like tied embeddings and every rope
scaling type, Mistral, Qwen2 with q/k/v biases, Qwen3 with q/k norms and a free head_dim), each a tiny
config built from the transformers config class with random fp32 weights: greedy tokens equal
transformers' `generate`, log-probs within 1e-4 of its logits; trainer-layout (Megatron TP=2) shards
resharded into the engine give bit-identical weights; tensors that do not fit the config are refused."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from megatron_rl.config import ConfigError
from megatron_rl.models.arch import ModelArch, RopeScaling
from megatron_rl.models.families import from_hf_config
from megatron_rl.models.megatron_layout import MegatronLayout, hf_to_megatron
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.native.parity import default_prompts, engine_parity, hf_greedy
from megatron_rl.weight_sync import reshard as R

SHAPES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # SmolLM2: Llama with tied embeddings, 3 heads in 1 query group, theta 1e5
    "smollm2": (transformers.LlamaConfig, dict(num_attention_heads=3, num_key_value_heads=1, hidden_size=48,
                                               tie_word_embeddings=True,
                                               rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, head_dim=16)),
    "qwen2": (transformers.Qwen2Config, dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen3: head_dim 24 is not hidden / heads (64 / 4)
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24, tie_word_embeddings=True)),
}
FAMILY_OF = {"llama": "llama", "smollm2": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def _hf_config(kind: str, **override):
    cls, extra = FAMILIES[kind]
    return cls(**{**SHAPES, **extra, **override})


def arch_of(config, family: str) -> ModelArch:
    """The engine's ModelArch for an HF config object, written out here from the HF fields (an independent
    reading of the config) and checked equal to what the family registry reads from its config.json."""
    rope = dict(config.rope_parameters)
    rope_type = rope.pop("rope_type", "default")
    theta = rope.pop("rope_theta")
    scaling = None
    if rope_type != "default":
        fields = {f.name for f in dataclasses.fields(RopeScaling)}
        scaling = RopeScaling(rope_type=rope_type, **{k: v for k, v in rope.items() if k in fields})
    arch = ModelArch(vocab_size=config.vocab_size, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                     ffn_hidden_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
                     num_query_groups=config.num_key_value_heads, head_dim=getattr(config, "head_dim", None),
                     rope_theta=theta, norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
                     max_position_embeddings=config.max_position_embeddings, family=family,
                     attention_bias=family == "qwen2", qk_norm=family == "qwen3", rope_scaling=scaling)
    assert from_hf_config(config.to_dict()) == arch
    return arch


def random_model(config, seed: int = 0):
    """An HF model of `config` (eager attention, fp32) with random weights spread enough that greedy
    decoding has no near-ties; returns (model, HF-named state)."""
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            value = 2.0 + 0.5 * torch.randn(param.shape, generator=g)  # sharpens attention: q/k norms matter
        elif name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=g)
        elif name.endswith(".bias"):
            value = 0.5 * torch.randn(param.shape, generator=g)
        elif name == "model.embed_tokens.weight":
            value = torch.randn(param.shape, generator=g)
        else:
            value = torch.randn(param.shape, generator=g) / param.shape[-1] ** 0.5
            if name == "lm_head.weight":
                value = value * 4.0
        state[name] = value
    model.load_state_dict(state, strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model, state


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_greedy_and_logprobs_match_transformers(kind):
    config = _hf_config(kind)
    model, state = random_model(config)
    arch = arch_of(config, FAMILY_OF[kind])
    equal, diff = engine_parity(model, arch, state, max_new_tokens=64)
    assert equal and diff < 1e-4, (kind, equal, diff)


def test_logprobs_match_a_full_forward_and_packed_paths_agree():
    """Qwen2 (biases fused into the qkv GEMM) and Qwen3: log-probs against transformers' full forward over
    prompt + answer. Answers of 16, 12, 6 and 3 tokens shrink the decode batch from 4 rows (the MKL-packed
    GEMMs) to 2 and 1 (the transposed [in, out] copies); prefill steps take the transposed copies too."""
    for kind in ("qwen2", "qwen3"):
        config = _hf_config(kind)
        model, state = random_model(config, seed=1)
        arch = arch_of(config, FAMILY_OF[kind])
        prompts = default_prompts(arch, lengths=(3, 7, 11, 19), seed=2)
        with NativeEngine(arch, state, config=NativeEngineConfig(max_batch_size=4, max_seq_len=64),
                          eos_token_ids=[]) as engine:
            assert engine.weights.packed is not None or not torch.backends.mkl.is_available()
            outs = engine.generate([GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=n))
                                    for i, (p, n) in enumerate(zip(prompts, (16, 12, 6, 3)))])
        for p, out in zip(prompts, outs):
            with torch.inference_mode():
                logits = model(torch.tensor([p + out.output_ids])).logits[0].float()
            ref = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
            assert (ref - torch.tensor(out.output_logprobs)).abs().max().item() < 1e-4, kind
            assert out.output_ids == logits[len(p) - 1:-1].argmax(-1).tolist(), kind


ROPE_CASES = {
    "linear": dict(max_position_embeddings=8192, rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                                  "rope_theta": 10000.0}),
    # dynamic NTK stretches max_position_embeddings=2048: the 4,096+ positions are past it
    "dynamic": dict(max_position_embeddings=2048, rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                                   "rope_theta": 10000.0}),
    "llama3": dict(max_position_embeddings=8192, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024, "rope_theta": 500000.0}),
    "yarn": dict(max_position_embeddings=8192, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "rope_theta": 10000.0}),
}


@pytest.mark.parametrize("rope_type", list(ROPE_CASES))
def test_rope_scaling_at_4096_positions(rope_type):
    """One layer, tiny width; a 4,040-token prompt (two prefill chunks) and 64 greedy tokens: positions
    0..4103, all compared with transformers' generate."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
                                      **ROPE_CASES[rope_type])
    model, state = random_model(config)
    arch = arch_of(config, "llama")
    assert arch.rope_scaling is not None and arch.rope_scaling.rope_type == rope_type
    prompts = default_prompts(arch, lengths=(4040,), seed=3)
    equal, diff = engine_parity(model, arch, state, prompts=prompts, max_new_tokens=64)
    assert equal and diff < 1e-4, (rope_type, equal, diff)


def test_dynamic_rope_follows_transformers_per_forward_length():
    """Dynamic RoPE short of and across max_position_embeddings: a prompt inside the plain range whose
    answer crosses it, and two prompts past it batched together (each keeps its own lengths) while a
    shorter prompt sharing their prefix must not borrow K/V rotated for another length."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model, state = random_model(config, seed=4)
    arch = arch_of(config, "llama")
    base = default_prompts(arch, lengths=(90,), seed=5)[0]
    prompts = [base[:40], base[:90], base[:80], base]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30)
    config_e = NativeEngineConfig(max_batch_size=4, max_seq_len=128, max_prefill_tokens=32)
    with NativeEngine(arch, state, config=config_e, eos_token_ids=[]) as engine:
        assert engine.max_seq_len == 128  # dynamic RoPE serves up to factor x max_position_embeddings
        outs = engine.generate([GenerateRequest(f"r{i}", p, greedy) for i, p in enumerate(prompts)])
        logits = engine.forward_logits(base)
    for p, out in zip(prompts, outs):
        hf_ids, hf_logits = hf_greedy(model, p, 30)
        assert out.output_ids == hf_ids
        ref = torch.log_softmax(hf_logits, -1).gather(1, torch.tensor(hf_ids)[:, None])[:, 0]
        assert (ref - torch.tensor(out.output_logprobs)).abs().max().item() < 1e-4
    with torch.inference_mode():
        model(torch.tensor([[0]]))
        full = model(torch.tensor([base])).logits[0].float()  # one forward: every row at length 90
    assert (full - logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_megatron_tp2_shards_resharded_into_the_engine_are_bit_identical(kind):
    config = _hf_config(kind)
    _, state = random_model(config, seed=6)
    arch = arch_of(config, FAMILY_OF[kind])
    layout = MegatronLayout(arch, tp=2)
    shards = hf_to_megatron(state, layout)
    plan = R.build_reshard_plan(layout, R.EngineLayout(arch, tp=1))
    resharded = R.execute_plan(plan, 0, shards, backend="torch")
    zeros = {k: torch.zeros_like(v) for k, v in state.items()}
    with NativeEngine(arch, zeros, config=NativeEngineConfig(max_batch_size=2, max_seq_len=32)) as engine:
        assert engine.update_weights(resharded, version=1) == len(state)
        held = engine.named_weights()
        names = set(state) | ({"lm_head.weight"} if arch.tie_word_embeddings else set())
        assert set(held) == names
        assert [n for n in state if not torch.equal(held[n], state[n])] == []
        fused = engine.weights.layers[0]
        if arch.attention_bias:
            assert torch.equal(fused.qkv_bias, torch.cat([state[f"model.layers.0.self_attn.{x}_proj.bias"]
                                                          for x in "qkv"]))
        if arch.qk_norm:
            assert torch.equal(fused.k_norm, state["model.layers.0.self_attn.k_norm.weight"])


def test_tensors_that_do_not_fit_the_config_are_refused_by_name():
    llama = arch_of(_hf_config("llama"), "llama")
    _, qwen2_state = random_model(_hf_config("qwen2"))
    with pytest.raises(ConfigError, match=r"'model\.layers\.0\.self_attn\.q_proj\.bias'.*attention_bias=False"):
        NativeEngine(llama, qwen2_state, config=NativeEngineConfig(max_batch_size=1, max_seq_len=16))
    qwen3 = arch_of(_hf_config("qwen3"), "qwen3")
    _, qwen3_state = random_model(_hf_config("qwen3"))
    with NativeEngine(qwen3, qwen3_state, config=NativeEngineConfig(max_batch_size=1, max_seq_len=16)) as engine:
        with pytest.raises(ConfigError, match=r"'model\.layers\.1\.self_attn\.q_norm\.weight' has shape \(64,\), "
                                              r"expected \(24,\)"):
            engine.update_weights({"model.layers.1.self_attn.q_norm.weight": torch.ones(64)})
        with pytest.raises(ConfigError, match=r"q_proj\.bias.*attention_bias=False"):
            engine.update_weights({"model.layers.0.self_attn.q_proj.bias": torch.ones(96)})
    missing = {k: v for k, v in qwen3_state.items() if "k_norm" not in k}
    with pytest.raises(ConfigError, match=r"missing model\.layers\.0\.self_attn\.k_norm\.weight"):
        NativeEngine(qwen3, missing, config=NativeEngineConfig(max_batch_size=1, max_seq_len=16))
