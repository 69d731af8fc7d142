"""GGUF import of the mixture-of-experts families: a GGUF written as llama.cpp's converter (convert_hf_to_gguf.py)
writes one (tensor names from the gguf package's own TensorNameMap, experts stacked per layer, DeepSeek's kv_b split
into a transposed k_b and v_b, MLA written as MQA metadata, GLM-4.5's multi-token-prediction block appended) reads
back as the published HF model bit for bit, and its ModelArch is the HF config's. For Qwen2-MoE and Qwen3-MoE,
transformers' own GGUF loader reads the same file, and its model's logits equal the original's."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.megatron_layout import canonical_hf_state
from tests import moe_helpers
from tests.helpers import gguf_writer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "glm4_moe": "glm4moe", "deepseek_v3": "deepseek2"}


YARN = moe_helpers.parity.Case("deepseek_v3 (yarn)", "DeepseekV3Config", {
    **moe_helpers.CASES["deepseek_v3"].fields, "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "original_max_position_embeddings": 1024}})


@pytest.fixture(scope="module")
def built():
    cases = {name: moe_helpers.build(name) for name in GGUF_ARCH}
    model, arch, state = moe_helpers.parity.case_model(YARN)
    cases[YARN.name] = (model, arch, state, None)
    return cases


def _metadata(writer, name, model, arch, mtp_blocks, gating):
    c = model.config
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_count(arch.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if name == "deepseek_v3":  # llama.cpp: MLA as MQA with one KV head of kv_lora_rank + rope dims
        writer.add_head_count_kv(1)
        writer.add_q_lora_rank(c.q_lora_rank)
        writer.add_kv_lora_rank(c.kv_lora_rank)
        writer.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        writer.add_value_length(c.kv_lora_rank)
        writer.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        writer.add_value_length_mla(c.v_head_dim)
        writer.add_rope_dimension_count(c.qk_rope_head_dim)
    else:
        writer.add_head_count_kv(c.num_key_value_heads)
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        writer.add_rope_dimension_count(int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0)))
    if name == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if name in ("glm4_moe", "deepseek_v3"):
        writer.add_expert_shared_count(c.n_shared_experts)
        writer.add_leading_dense_block_count(c.first_k_dense_replace)
        writer.add_expert_weights_scale(c.routed_scaling_factor)
        writer.add_expert_weights_norm(c.norm_topk_prob)
        writer.add_expert_gating_func(gating)
        writer.add_expert_group_count(c.n_group)
        writer.add_expert_group_used_count(c.topk_group)
    scaling = c.rope_parameters
    if scaling.get("rope_type") == "yarn":  # llama.cpp keeps DeepSeek's mscale_all_dim as 0.1 x it
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
    if mtp_blocks:
        writer.add_nextn_predict_layers(mtp_blocks)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(arch.vocab_size)])
    writer.add_token_merges(["t1 t2"])
    writer.add_token_types([1] * arch.vocab_size)
    writer.add_eos_token_id(0)


def _tensors(name, model, arch, published):
    """(GGUF name, values) as llama.cpp's converter writes the published checkpoint."""
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == GGUF_ARCH[name])
    names = gguf.get_tensor_name_map(arch_id, arch.num_layers + 1)
    c = model.config
    stacked: dict[str, list] = {}
    for hf, tensor in published.items():
        values = tensor.numpy()
        if ".experts." in hf:  # model.layers.{i}.mlp.experts.{e}.{w}.weight -> ffn_{w}_exps, [E, out, in]
            layer_prefix, rest = hf.split(".experts.")
            stacked.setdefault(f"{layer_prefix}.experts.{rest.split('.')[1]}", []).append(values)
            continue
        if hf.endswith("e_score_correction_bias"):  # the converter's own rename
            hf = hf.replace("e_score_correction_bias", "e_score_correction.bias")
        if hf.endswith("kv_b_proj.weight"):
            kv_b = values.reshape(c.num_key_value_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
            k_b, v_b = kv_b[:, :c.qk_nope_head_dim], kv_b[:, c.qk_nope_head_dim:]
            yield names.get_name(hf.replace("kv_b_proj", "k_b_proj"), try_suffixes=(".weight",)), k_b.swapaxes(1, 2)
            yield names.get_name(hf.replace("kv_b_proj", "v_b_proj"), try_suffixes=(".weight",)), v_b
            continue
        if hf.endswith("shared_expert_gate.weight"):
            values = values.reshape(-1)  # llama.cpp stores the [1, H] gate as [H]
        gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf
        yield gname, values
    for merged, experts in stacked.items():
        yield names.get_name(merged) + ".weight", np.stack(experts)


def write_gguf(path, name, model, arch, state, mtp_blocks=0, gating=None):
    writer = gguf_writer(path, GGUF_ARCH[name], arch, blocks=arch.num_layers + mtp_blocks)
    _metadata(writer, name, model, arch, mtp_blocks, gguf.ExpertGatingFuncType.SIGMOID if gating is None else gating)
    for gname, values in _tensors(name, model, arch, canonical_hf_state(state, arch)):
        writer.add_tensor(gname, np.ascontiguousarray(values, dtype=np.float32))
    for block in range(arch.num_layers, arch.num_layers + mtp_blocks):  # GLM-4.5's MTP block, as llama.cpp adds it
        writer.add_tensor(f"blk.{block}.nextn.eh_proj.weight", np.ones((arch.hidden_size, 2 * arch.hidden_size),
                                                                      dtype=np.float32))
        writer.add_tensor(f"blk.{block}.attn_norm.weight", np.ones(arch.hidden_size, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", [*GGUF_ARCH, YARN.name])
def test_moe_gguf_reads_back_the_published_model(tmp_path, built, name):
    from megatron_rl.models.gguf import read_gguf

    model, arch, state, _ = built[name]
    path = tmp_path / "model.gguf"
    write_gguf(path, name.split()[0], model, arch, state, mtp_blocks=1 if name == "glm4_moe" else 0)
    read_arch, read_state, _ = read_gguf(path)
    # GGUF keeps the norm epsilon as float32 (what the norms compute with anyway) and no auxiliary-loss coefficient
    # (a training setting): transformers' default for the family, as for a config.json without the field
    default_aux = getattr(type(model.config)(), "router_aux_loss_coef", 0.0)
    assert read_arch.norm_eps == float(np.float32(arch.norm_eps)) and read_arch.router_aux_loss_coef == default_aux
    assert dataclasses.replace(read_arch, norm_eps=arch.norm_eps, router_aux_loss_coef=arch.router_aux_loss_coef) == arch
    published = canonical_hf_state(state, arch)
    assert read_state.keys() == published.keys()
    assert all(torch.equal(read_state[k], published[k]) for k in published)


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_transformers_reads_the_same_moe_gguf(tmp_path, built, name):
    """transformers' own GGUF loader (its Qwen2-MoE tensor processor) on the file the test writes: the loaded model's
    logits equal the original's, so the file is what llama.cpp's format says it is."""
    model, arch, state, tokens = built[name]
    write_gguf(tmp_path / "model.gguf", name, model, arch, state)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", config=model.config, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(tokens[:, :-1]).logits, model(tokens[:, :-1]).logits)


def test_deepseek_v2_softmax_router_is_refused_by_name(tmp_path, built):
    """deepseek2 also holds DeepSeek-V2 (a softmax router without the expert bias): refused in one line."""
    from megatron_rl.models.gguf import read_gguf

    model, arch, state, _ = built["deepseek_v3"]
    path = tmp_path / "v2.gguf"
    write_gguf(path, "deepseek_v3", model, arch, state, gating=gguf.ExpertGatingFuncType.SOFTMAX)
    with pytest.raises(ConfigError, match=r"'deepseek2.expert_gating_func' = 1: only the sigmoid router"):
        read_gguf(path)
