"""Mixture-of-experts families in the registry and the converter, against transformers 5 (tiny random Qwen3-MoE and
Mixtral models): configs read and written faithfully, every MoE variant we do not implement refused by name,
published per-expert and transformers' fused expert tensors both read, and HF -> Megatron (EP=2, and TP x PP x EP)
-> HF bit-exact, with the export reloaded by transformers as the same class and the same logits."""
from __future__ import annotations

import json

import pytest
import torch
from megatron_rl.checkpoints_tools.convert import convert

from megatron_rl.config import ConfigError
from megatron_rl.models import families
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.megatron_layout import (
    MegatronLayout,
    canonical_hf_state,
    hf_to_megatron,
    megatron_to_hf,
)
from megatron_rl.models.pretrained import load_pretrained, read_megatron_layout
from tests import moe_helpers

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def built():
    return {name: moe_helpers.build(name) for name in moe_helpers.CASES}


@pytest.mark.parametrize("name", list(moe_helpers.CASES))
def test_config_round_trips_through_the_registry(built, name):
    model, arch, _, _ = built[name]
    config = model.config
    assert arch.family == config.model_type and arch.is_moe
    experts = config.num_local_experts if arch.family in ("mixtral", "glm4_moe", "deepseek_v3", "gpt_oss") \
        else config.num_experts
    assert (arch.num_experts, arch.moe_top_k) == (experts, config.num_experts_per_tok)
    expert_size = config.intermediate_size if arch.family in ("mixtral", "gpt_oss") else config.moe_intermediate_size
    assert arch.moe_ffn_hidden_size == expert_size
    assert arch.moe_norm_topk_prob == getattr(config, "norm_topk_prob", True)
    assert arch.router_aux_loss_coef == config.router_aux_loss_coef
    exported = families.to_hf_config(arch)
    assert families.from_hf_config(exported) == arch
    reread = getattr(transformers, type(config).__name__)(**exported)
    experts_field = "num_experts" if name.startswith("qwen") else "num_local_experts"
    if arch.family == "deepseek_v3":  # multi-latent attention's fields survive the export
        for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                      "rope_interleave", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace"):
            assert getattr(reread, field) == getattr(config, field), field
    for field in (experts_field, "num_experts_per_tok", "intermediate_size", "router_aux_loss_coef"):
        assert getattr(reread, field) == getattr(config, field), field
    shared = getattr(config, "n_shared_experts", 0) * config.moe_intermediate_size \
        if arch.family in ("glm4_moe", "deepseek_v3") \
        else getattr(config, "shared_expert_intermediate_size", 0)
    assert arch.shared_expert_ffn_hidden_size == shared
    if arch.family == "glm4_moe":  # every field the router, attention and RoPE read survives the export
        assert arch.moe_layer_indices == tuple(range(config.first_k_dense_replace, config.num_hidden_layers))
        for field in ("n_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
                      "norm_topk_prob", "attention_bias", "use_qk_norm", "moe_intermediate_size"):
            assert getattr(reread, field) == getattr(config, field), field
        assert reread.rope_parameters["partial_rotary_factor"] == config.rope_parameters["partial_rotary_factor"]
    if arch.family == "gpt_oss":  # its clamped SwiGLU, biases and alternating windows survive the export
        for field in ("swiglu_limit", "swiglu_alpha", "attention_bias", "sliding_window", "layer_types"):
            assert getattr(reread, field) == getattr(config, field), field
        assert (arch.attention_sinks, arch.expert_biases, arch.moe_router_bias, arch.glu_linear_offset) == \
            (True, True, True, 1.0)
    assert arch.shared_expert_gate == (arch.family == "qwen2_moe")
    if arch.family == "qwen2_moe":
        assert reread.shared_expert_intermediate_size == config.shared_expert_intermediate_size
    if name.startswith("qwen"):
        assert (reread.moe_intermediate_size, reread.norm_topk_prob) == (config.moe_intermediate_size,
                                                                          config.norm_topk_prob)
        assert reread.decoder_sparse_step == 1 and reread.mlp_only_layers == config.mlp_only_layers
        assert arch.moe_layer_indices == tuple(i for i in range(config.num_hidden_layers)
                                               if i not in config.mlp_only_layers)


@pytest.mark.parametrize("family,field,value", [
    ("qwen3_moe", "mlp_only_layers", [0, 1]),   # no MoE layer left
    ("qwen3_moe", "decoder_sparse_step", 0),
    ("qwen3_moe", "first_k_dense_replace", 1),   # another family's spelling
    ("mixtral", "mlp_only_layers", [0]),
    ("mixtral", "decoder_sparse_step", 2),
    ("qwen3_moe", "shared_expert_intermediate_size", 64),
    ("qwen3_moe", "attention_bias", True),
    ("mixtral", "router_jitter_noise", 0.1),
    ("mixtral", "sliding_window", 0),
    ("mixtral", "n_shared_experts", 1),
    ("mixtral", "scoring_func", "sigmoid"),
    ("qwen2_moe", "mlp_only_layers", [2]),       # out of range
    ("qwen2_moe", "mlp_only_layers", "0"),
    ("qwen2_moe", "qkv_bias", False),
    ("qwen2_moe", "shared_expert_intermediate_size", 0),
])
def test_unsupported_moe_variants_are_refused_by_name(built, family, field, value):
    config = built[family][0].config.to_dict()
    config[field] = value
    with pytest.raises(ConfigError, match=field):
        families.from_hf_config(config, where="config.json")


def test_moe_arch_validation():
    base = dict(vocab_size=64, num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                num_query_groups=2, family="mixtral")
    with pytest.raises(ConfigError, match="moe_top_k"):
        ModelArch(**base, num_experts=4, moe_top_k=5, moe_ffn_hidden_size=64)
    with pytest.raises(ConfigError, match="num_experts"):
        ModelArch(**base, moe_top_k=2)
    arch = ModelArch(**base, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16)
    dense = ModelArch(**{**base, "family": "llama"})
    assert arch.num_parameters() - dense.num_parameters() == 4 * 3 * 32 * 16 + 4 * 32 - 3 * 32 * 64
    with pytest.raises(ConfigError, match="expert_parallel=3"):
        MegatronLayout(arch, ep=3)
    with pytest.raises(ConfigError, match="dense"):
        MegatronLayout(dense, ep=2)
    with pytest.raises(ConfigError, match="moe_ffn_hidden_size"):
        MegatronLayout(dataclass_replace(arch, moe_ffn_hidden_size=15), tp=2)
    two = dict(base, num_layers=2, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16)
    assert ModelArch(**two, moe_layers=(1, 0)).moe_layers is None  # every layer: one spelling
    mixed = ModelArch(**two, moe_layers=(1,))
    assert (mixed.moe_layer_indices, mixed.has_dense_mlp) == ((1,), True)
    assert mixed.num_parameters() == ModelArch(**two).num_parameters() - arch.mlp_parameters() + 3 * 32 * 64
    for bad in ((), (2,)):
        with pytest.raises(ConfigError, match="moe_layers"):
            ModelArch(**two, moe_layers=bad)
    with pytest.raises(ConfigError, match="moe_layers"):
        ModelArch(**{**base, "family": "llama"}, moe_layers=(0,))
    with pytest.raises(ConfigError, match="ffn_hidden_size=63"):  # a dense layer's MLP is split over TP too
        MegatronLayout(dataclass_replace(mixed, ffn_hidden_size=63), tp=2)
    MegatronLayout(dataclass_replace(arch, ffn_hidden_size=63), tp=2)  # all-MoE: the dense width is unused


def dataclass_replace(arch, **changes):
    import dataclasses

    return dataclasses.replace(arch, **changes)


@pytest.mark.parametrize("name", [n for n in moe_helpers.FAMILY_CASES if n != "gpt_oss"])  # (tests/test_gpt_oss.py)
def test_published_and_fused_expert_tensors_read_alike(tmp_path, built, name):
    model, arch, fused, _ = built[name]
    assert any(k.endswith("experts.gate_up_proj") for k in fused)  # transformers 5 fuses in memory
    model.save_pretrained(tmp_path)
    published = load_pretrained(str(tmp_path)).state
    gate, up, down = families.hf_expert_names(families.get_family(arch.family), 1, 3)
    assert gate in published and families.hf_router_name(families.get_family(arch.family), 1) in published
    assert torch.equal(published[gate], fused["model.layers.1.mlp.experts.gate_up_proj"][3, :arch.moe_ffn_hidden_size])
    assert torch.equal(published[up], fused["model.layers.1.mlp.experts.gate_up_proj"][3, arch.moe_ffn_hidden_size:])
    assert torch.equal(published[down], fused["model.layers.1.mlp.experts.down_proj"][3])
    canonical = canonical_hf_state(fused, arch)
    assert canonical.keys() == published.keys()
    assert all(torch.equal(canonical[k], published[k]) for k in published)
    layout = MegatronLayout(arch, tp=2, ep=2, vocab_divisible_by=1)
    a, b = hf_to_megatron(fused, layout), hf_to_megatron(published, layout)
    assert all(torch.equal(a[p][i][k], b[p][i][k]) for p in range(1) for i in range(4) for k in a[p][i])


@pytest.mark.parametrize("name", list(moe_helpers.FAMILY_CASES))
@pytest.mark.parametrize("tp,pp,ep,first,last", [(1, 1, 2, None, None), (2, 2, 2, None, None), (1, 1, 4, None, None),
                                                   (2, 1, 1, None, None), (1, 2, 2, 1, None)])
def test_in_memory_round_trip_any_layout(built, name, tp, pp, ep, first, last):
    """Any TP x PP x EP, a first-stage layer count set as Megatron's uneven split does."""
    _, arch, state, _ = built[name]
    layout = MegatronLayout(arch, tp=tp, pp=pp, ep=ep, vocab_divisible_by=1, first_stage_layers=first,
                            last_stage_layers=last)
    shards = hf_to_megatron(state, layout)
    assert len(shards) == pp and all(len(row) == tp * ep for row in shards)
    counts = layout.stage_layer_counts
    assert sum(counts) == arch.num_layers and (first is None or counts[0] == first)
    for stage, count in enumerate(counts):
        assert {int(k.split(".")[2]) for k in shards[stage][0] if k.startswith("decoder.layers.")} == set(range(count))
    for layer in layout.stage_layers(0):
        experts = [k for k in shards[0][0] if ".local_experts." in k and f"layers.{layer}." in k
                   and k.endswith("fc1.weight")]
        assert len(experts) == (arch.num_experts // ep if arch.layer_is_moe(layer) else 0)
        assert (f"decoder.layers.{layer}.mlp.linear_fc1.weight" in shards[0][0]) == (not arch.layer_is_moe(layer))
    back = megatron_to_hf(shards, layout)
    published = canonical_hf_state(state, arch)
    assert back.keys() == published.keys()
    assert all(torch.equal(back[k], published[k]) for k in back)


@pytest.mark.parametrize("tp,pp,ep,first,last", [(2, 3, 1, 1, 1), (1, 2, 2, 3, None), (1, 2, 2, None, 3)])
def test_uneven_pipeline_round_trip(built, tp, pp, ep, first, last):
    """Qwen2-MoE's 4 layers (layer 0 dense) over Megatron's uneven splits: 1 + 2 + 1, 3 + 1, 1 + 3; each stage
    numbers its layers from 0 and holds the right ones (dense names on the dense layer), and the round trip is exact."""
    _, arch, state, _ = built[moe_helpers.DENSE_LAYERS.name]
    layout = MegatronLayout(arch, tp=tp, pp=pp, ep=ep, vocab_divisible_by=1, first_stage_layers=first,
                            last_stage_layers=last)
    counts = {(2, 3, 1, 1, 1): (1, 2, 1), (1, 2, 2, 3, None): (3, 1), (1, 2, 2, None, 3): (1, 3)}
    assert layout.stage_layer_counts == counts[tp, pp, ep, first, last]
    shards = hf_to_megatron(state, layout)
    for stage in range(pp):
        for local, layer in enumerate(layout.stage_layers(stage)):
            assert layout.stage_of(layer) == (stage, local)
            dense = f"decoder.layers.{local}.mlp.linear_fc1.weight" in shards[stage][0]
            assert dense == (not arch.layer_is_moe(layer))
        assert not any(k.startswith(f"decoder.layers.{len(layout.stage_layers(stage))}.") for k in shards[stage][0])
    back = megatron_to_hf(shards, layout)
    published = canonical_hf_state(state, arch)
    assert back.keys() == published.keys() and all(torch.equal(back[k], published[k]) for k in back)


def test_expert_placement_on_ep_ranks(built):
    """Local expert j of EP rank r is global expert r * E/EP + j (Megatron's placement)."""
    _, arch, state, _ = built["mixtral"]
    published = canonical_hf_state(state, arch)
    layout = MegatronLayout(arch, ep=2, vocab_divisible_by=1)
    shards = hf_to_megatron(state, layout)
    for ep_rank in range(2):
        shard = shards[0][layout.shard_index(0, ep_rank)]
        for j in range(2):
            gate, up, _ = families.hf_expert_names(families.get_family("mixtral"), 0, ep_rank * 2 + j)
            fc1 = shard[f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc1.weight"]
            assert torch.equal(fc1, torch.cat([published[gate], published[up]]))


def test_a_checkpoint_with_other_experts_is_refused(built):
    _, arch, state, _ = built["qwen3_moe"]
    fewer = dataclass_replace(arch, num_experts=2, moe_top_k=2)
    with pytest.raises(ConfigError, match="experts.2"):
        hf_to_megatron(canonical_hf_state(state, arch), MegatronLayout(fewer, vocab_divisible_by=1))
    missing = {k: v for k, v in canonical_hf_state(state, arch).items() if "experts.3.down_proj" not in k}
    with pytest.raises(ConfigError, match="experts.3.down_proj"):
        hf_to_megatron(missing, MegatronLayout(arch, vocab_divisible_by=1))


@pytest.mark.parametrize("name", list(moe_helpers.FAMILY_CASES))
def test_convert_round_trip_at_ep2_is_bit_exact_and_reloads_in_transformers(tmp_path, built, name):
    model, arch, state, tokens = built[name]
    source, megatron_dir, back_dir = tmp_path / "hf", tmp_path / "megatron", tmp_path / "back"
    model.save_pretrained(source)
    convert(str(source), str(megatron_dir), to="megatron", tp=2, pp=2, ep=2)
    assert sorted(p.name for p in megatron_dir.iterdir() if p.name.startswith("mp_rank")) == [
        f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2)]
    assert read_megatron_layout(str(megatron_dir)).ep == 2
    convert(str(megatron_dir), str(back_dir), to="hf")
    back = load_pretrained(str(back_dir))
    assert back.arch == arch
    published = canonical_hf_state(state, arch)
    assert back.state.keys() == published.keys()
    assert max((back.state[k] - published[k]).abs().max().item() for k in published) == 0.0
    config = json.loads((back_dir / "config.json").read_text())
    assert config["model_type"] == model.config.model_type
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back_dir, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    assert type(reloaded) is type(model)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens[:, :-1]).logits, model(tokens[:, :-1]).logits)


def test_convert_to_an_uneven_pipeline_split_records_it(tmp_path, built):
    """`convert --to megatron` with Megatron's uneven split: the checkpoint records it (so a run or a reshard reads
    its stages right) and converts back bit-exactly."""
    model, arch, state, _ = built[moe_helpers.DENSE_LAYERS.name]
    source, megatron_dir, back_dir = tmp_path / "hf", tmp_path / "megatron", tmp_path / "back"
    model.save_pretrained(source)
    convert(str(source), str(megatron_dir), to="megatron", pp=2, last_stage_layers=3)
    saved = read_megatron_layout(str(megatron_dir))
    assert (saved.first_stage_layers, saved.last_stage_layers, saved.stage_layer_counts) == (None, 3, (1, 3))
    convert(str(megatron_dir), str(back_dir), to="hf")
    back, published = load_pretrained(str(back_dir)).state, canonical_hf_state(state, arch)
    assert back.keys() == published.keys() and all(torch.equal(back[k], published[k]) for k in published)
    with pytest.raises(ConfigError, match="leave 0 of the model's 4 layers"):
        convert(str(source), str(tmp_path / "bad"), to="megatron", pp=2, first_stage_layers=4)


def test_glm_multi_token_prediction_layers_are_ignored_as_transformers_does(built):
    """A GLM-4.5 checkpoint stores its MTP layer after the decoder's (layer num_layers); transformers builds none
    and skips those tensors, and so does the converter. Any other family keeps refusing an extra layer."""
    _, arch, state, _ = built["glm4_moe"]
    published = canonical_hf_state(state, arch)
    mtp = {k.replace("model.layers.1.", f"model.layers.{arch.num_layers}."): v for k, v in published.items()
           if k.startswith("model.layers.1.")}
    mtp["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    read = canonical_hf_state({**published, **mtp}, arch)
    assert read.keys() == published.keys()
    layout = MegatronLayout(arch, vocab_divisible_by=1)
    assert megatron_to_hf(hf_to_megatron({**published, **mtp}, layout), layout).keys() == published.keys()
    _, qwen, qwen_state, _ = built["qwen3_moe"]
    extra = {"model.layers.2.input_layernorm.weight": torch.ones(64)}
    with pytest.raises(ConfigError, match="model.layers.2"):
        hf_to_megatron({**canonical_hf_state(qwen_state, qwen), **extra}, MegatronLayout(qwen, vocab_divisible_by=1))
