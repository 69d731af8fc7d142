"""The family parity matrix (megatron_rl/cli/parity.py) against transformers, fp32 on CPU, tiny random models
built from transformers' config classes: RoPE frequencies bit-exact for every rope type, trainer logits within
1e-4 at TP=1 / TP=2 / PP=2, the convert round trip bit-exact, the native engine's greedy tokens identical and its
log-probs within 1e-4; and every numerics field we do not honour refused with an error naming it."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_rl.cli import parity
from megatron_rl.config import ConfigError
from megatron_rl.models import families
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.megatron_layout import (
    MegatronLayout,
    hf_to_megatron,
    megatron_to_hf,
)
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.models.rope import rope_inv_freq
from megatron_rl.placement.launch import run_distributed
from tests.helpers import gguf_writer

transformers = pytest.importorskip("transformers")

# the mixture-of-experts rows of the matrix have their own tests (tests/test_moe_*.py, tests/moe_helpers.py)
MOE_CLASSES = {f.config_class for f in families.FAMILIES.values() if f.moe_block}
CASES = [c for c in parity.CASES if c.config_class not in MOE_CLASSES]
SHORT = [c for c in CASES if not c.long]
LONG = [c for c in CASES if c.long]
TOL = parity.TOLERANCE


@pytest.fixture(scope="module")
def built():
    """case name -> (transformers model, arch, state, tokens, transformers logits)."""
    out = {}
    for case in CASES:
        model, arch, state = parity.case_model(case)
        tokens = parity.case_tokens(case, arch)
        out[case.name] = (model, arch, state, tokens, parity.reference_logits(model, tokens))
    return out


def test_every_family_and_rope_type_is_covered():
    assert {c.config_class for c in parity.CASES} == {f.config_class for f in families.FAMILIES.values()}
    rope_types = {c.fields["rope_parameters"]["rope_type"] for c in LONG}
    assert rope_types == {"llama3", "linear", "dynamic", "yarn"}
    assert all(parity.case_tokens(c, parity.case_model(c)[1]).shape[1] - 1 >= 4096 for c in LONG)


@pytest.mark.parametrize("case", [c for c in CASES if c.fields["rope_parameters"].get("rope_type", "default") != "default"],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("seq_len", [10, 4096, 20000])
def test_rope_frequencies_are_bit_exact(built, case, seq_len):
    model, arch, *_ = built[case.name]
    rotary = type(model.model.rotary_emb)(model.config)  # a fresh module: HF caches the longest length seen
    cos, _ = rotary(torch.zeros(1), torch.arange(seq_len)[None])
    inv_freq, scaling = rope_inv_freq(arch, seq_len=seq_len)
    assert torch.equal(rotary.inv_freq, inv_freq) and rotary.attention_scaling == scaling
    angles = torch.arange(seq_len)[:, None].float() * inv_freq
    assert torch.equal(torch.cat([angles, angles], -1).cos() * scaling, cos[0])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_trainer_tp1_matches_transformers(built, case):
    _, arch, state, tokens, expected = built[case.name]
    logits = parity.trainer_logits(arch, state, tokens)
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= TOL


@pytest.mark.slow  # two gloo processes building a trainer per family: ~75 s on 2 shared cores
def test_trainer_tp2_and_pp2_match_transformers(built):
    jobs, expected, labels = [], [], []
    for case in SHORT:
        _, arch, state, tokens, reference = built[case.name]
        for tp, pp in [(2, 1)] + ([(1, 2)] if case.pipeline else []):
            jobs.append((arch, state, tokens, tp, pp))
            expected.append(reference)
            labels.append(f"{case.name} TP={tp} PP={pp}")
    assert any("PP=2" in label for label in labels)
    results = run_distributed(parity._parallel_worker, 2, jobs)[0]
    for label, got, want in zip(labels, results, expected):
        assert (got - want).abs().max().item() <= TOL, label


@pytest.mark.parametrize("case", SHORT, ids=lambda c: c.name)
def test_convert_round_trip_is_bit_exact_and_loads_as_the_family_class(tmp_path, built, case):
    model, arch, _, tokens, _ = built[case.name]
    assert parity.convert_round_trip(model, arch, tokens, str(tmp_path)) == 0.0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == model.config.model_type
    assert config["architectures"] == [type(model).__name__]


@pytest.mark.parametrize("case", SHORT, ids=lambda c: c.name)
@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 2), (2, 1)])
def test_in_memory_round_trip_any_tp_pp(built, case, tp, pp):
    _, arch, state, *_ = built[case.name]
    layout = MegatronLayout(arch, tp=tp, pp=pp, vocab_divisible_by=1)
    back = megatron_to_hf(hf_to_megatron(state, layout), layout)
    expected = {k: v for k, v in state.items() if not (arch.tie_word_embeddings and k == "lm_head.weight")}
    assert set(back) == set(expected)
    assert all(torch.equal(back[k], v) for k, v in expected.items())


def test_biases_and_qk_norms_reach_the_megatron_shards(built):
    _, qwen2, state2, *_ = built["qwen2"]
    shards = hf_to_megatron(state2, MegatronLayout(qwen2, tp=2))
    assert shards[0][0]["decoder.layers.0.self_attention.linear_qkv.bias"].shape == ((4 + 2 * 2) * 16 // 2,)
    _, qwen3, state3, *_ = built["qwen3"]
    shards = hf_to_megatron(state3, MegatronLayout(qwen3, tp=2))
    for t in range(2):
        assert torch.equal(shards[0][t]["decoder.layers.1.self_attention.k_layernorm.weight"],
                           state3["model.layers.1.self_attn.k_norm.weight"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_engine_greedy_and_logprobs_match_transformers(built, case):
    model, arch, state, tokens, _ = built[case.name]
    prompts = [tokens[0, :parity.LONG_POSITIONS].tolist()] if case.long else None
    equal, worst = parity.engine_parity(model, arch, state, prompts=prompts, max_new_tokens=16 if case.long else 64)
    assert equal
    assert worst <= TOL


@pytest.mark.parametrize("case", SHORT, ids=lambda c: c.name)
def test_parameter_count_matches_transformers(built, case):
    model, arch, *_ = built[case.name]
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())


def test_arch_from_dict_round_trips_nested_rope_scaling(built):
    arch = built["llama3.1 (llama3 rope)"][1]
    assert arch.rope_scaling is not None and arch.rope_scaling.rope_type == "llama3"
    assert ModelArch.from_dict(json.loads(json.dumps(dataclasses.asdict(arch)))) == arch
    with pytest.raises(ConfigError, match="unknown architecture field"):
        ModelArch.from_dict({**dataclasses.asdict(arch), "bogus": 1})


def test_megatron_checkpoint_metadata_keeps_the_family(tmp_path, built):
    model, arch, *_ = built["qwen3"]
    model.save_pretrained(tmp_path / "hf")
    parity.convert(str(tmp_path / "hf"), str(tmp_path / "meg"), to="megatron", tp=2)
    assert load_pretrained(str(tmp_path / "meg"), lazy=True).arch == arch


# --- bad input: every numerics field we do not honour is refused, naming the file and field ---------------

def _config(config_class="LlamaConfig", **fields):
    base = {**parity._BASE, **fields}
    return getattr(transformers, config_class)(**base).to_dict()


@pytest.mark.parametrize("config,field", [
    (_config(hidden_act="gelu"), "hidden_act"),
    (_config(mlp_bias=True), "mlp_bias"),
    (_config(attention_bias=True), "attention_bias"),
    (_config("Qwen3Config", attention_bias=True), "attention_bias"),
    (_config(attention_dropout=0.1), "attention_dropout"),
    (_config(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                              "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}),
     "rope_parameters.rope_type"),
    (_config(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_unsupported_numerics_fields_are_refused(tmp_path, config, field):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"config.json: .*field '{field}'"):
        families.from_json(path)


def test_windows_are_read_and_qwen_without_sliding_has_none():
    assert families.from_hf_config(_config("MistralConfig", sliding_window=32)).sliding_window == 32
    assert families.from_hf_config(_config("Qwen2Config", use_sliding_window=False, sliding_window=32)) \
        .sliding_window is None


def test_unknown_family_names_the_model_type_and_the_supported_ones():
    with pytest.raises(ConfigError, match=r"model_type='gemma'.*supported families: llama .*qwen3"):
        families.from_hf_config({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]})
    with pytest.raises(ConfigError, match="unknown model family 'gpt2'"):
        families.to_hf_config(dataclasses.replace(ModelArch(
            vocab_size=8, num_layers=1, hidden_size=8, ffn_hidden_size=8, num_attention_heads=2,
            num_query_groups=1), family="gpt2"))


def test_checkpoint_tensors_that_do_not_match_the_config_are_refused(built):
    _, arch, state, *_ = built["mistral"]
    layout = MegatronLayout(arch, vocab_divisible_by=1)
    with pytest.raises(ConfigError, match=r"'model.layers.0.self_attn.o_proj.bias' does not belong to a mistral"):
        hf_to_megatron({**state, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, layout)
    _, qwen2, state2, *_ = built["qwen2"]
    missing = {k: v for k, v in state2.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(ConfigError, match="missing tensor 'model.layers.1.self_attn.k_proj.bias'"):
        hf_to_megatron(missing, MegatronLayout(qwen2, vocab_divisible_by=1))


def test_planner_counts_biases_and_qk_norms(built):
    from megatron_rl.sim import cost
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    for name in ("qwen2", "qwen3"):
        arch = built[name][1]
        trainer = MegatronTrainer(arch, TrainerConfig(vocab_divisible_by=128), frozen=True)
        assert cost.stage_parameters(arch, 1, 1, 0, 128) == sum(p.numel() for p in trainer.gpt.parameters()), name


# --- GGUF import: a GGUF written the way llama.cpp's converter writes one reads back as the HF model ---------

_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _llama_cpp_permute(weight, heads):
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _write_gguf(path, gguf_arch, model, arch, rope_freqs=None):
    import gguf
    import numpy as np

    writer = gguf_writer(path, gguf_arch, arch)
    writer.add_head_count_kv(arch.num_query_groups)
    writer.add_key_length(arch.head_dim)
    writer.add_rope_dimension_count(arch.head_dim)
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(arch.norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(arch.vocab_size)])
    writer.add_token_merges(["t1 t2"])
    writer.add_token_types([1] * arch.vocab_size)
    writer.add_eos_token_id(0)
    for name, tensor in model.state_dict().items():
        values = tensor.numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if arch.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
            if gguf_arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = arch.num_attention_heads if module == "self_attn.q_proj" else arch.num_query_groups
                values = _llama_cpp_permute(values, heads)
        writer.add_tensor(gname, np.ascontiguousarray(values, dtype=np.float32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("gguf_arch,config_class,fields", [
    ("qwen2", "Qwen2Config", {}),
    ("qwen3", "Qwen3Config", {"head_dim": 32}),
    ("llama", "LlamaConfig", {"max_position_embeddings": 32768, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
])
def test_gguf_import(tmp_path, gguf_arch, config_class, fields):
    from megatron_rl.models.gguf import read_gguf

    case = parity.Case(gguf_arch, config_class, {**parity._BASE, "rms_norm_eps": 2.0 ** -20,
                                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                                                 **fields})
    model, arch, state = parity.case_model(case)
    rope_freqs = None
    if arch.rope_scaling is not None:  # llama.cpp stores Llama 3 scaling as per-dimension divisors only
        rope_freqs = rope_inv_freq(dataclasses.replace(arch, rope_scaling=None))[0] / rope_inv_freq(arch)[0]
    path = tmp_path / "model.gguf"
    _write_gguf(path, gguf_arch, model, arch, rope_freqs)
    read_arch, read_state, _ = read_gguf(path)
    assert read_arch == arch
    assert set(read_state) == set(state) and all(torch.equal(read_state[k], v) for k, v in state.items())


def test_parity_command_prints_the_matrix(capsys):
    from megatron_rl.cli import main

    assert main(["parity", "--only", "qwen3", "--no-parallel", "--no-long"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["case", "family"] and "engine log-prob" in out[0]
    assert out[1].split()[:2] == ["qwen3", "qwen3"] and "identical" in out[1]
    assert out[-1].endswith("all pass")
    assert main(["parity", "--only", "gpt2"]) == 2  # one line naming the unknown case, no traceback


def test_checkpoint_tensor_of_the_wrong_shape_is_refused(built):
    _, qwen3, state, *_ = built["qwen3"]
    bad = {**state, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}
    with pytest.raises(ConfigError, match=r"'model.layers.0.self_attn.q_norm.weight' has shape \(16,\).*needs \(32,\)"):
        hf_to_megatron(bad, MegatronLayout(qwen3, vocab_divisible_by=1))


def _expected_from_transformers(config_class: str, config: dict) -> dict:
    """What transformers' own config class makes of `config`: the values its model runs with."""
    conf = getattr(transformers, config_class).from_dict(dict(config))
    heads = conf.num_attention_heads
    rope = conf.rope_parameters.get("full_attention", conf.rope_parameters)  # (Gemma 3: one per layer type)
    expected = {"norm_eps": conf.rms_norm_eps, "rope_theta": rope["rope_theta"],
                "max_position_embeddings": conf.max_position_embeddings,
                "head_dim": getattr(conf, "head_dim", None) or conf.hidden_size // heads,
                "num_query_groups": conf.num_key_value_heads or heads,
                "tie_word_embeddings": conf.tie_word_embeddings}
    if getattr(conf, "num_experts_per_tok", None) is not None:
        expected.update(moe_top_k=conf.num_experts_per_tok,
                        router_aux_loss_coef=getattr(conf, "router_aux_loss_coef", 0.0))  # GLM-4.5 has none
    if getattr(conf, "n_group", None) is not None:  # DeepSeek-V3's router (GLM-4.5)
        expected.update(moe_router_groups=conf.n_group, moe_router_group_topk=conf.topk_group,
                        moe_routed_scaling_factor=conf.routed_scaling_factor, moe_norm_topk_prob=conf.norm_topk_prob,
                        partial_rotary_factor=conf.rope_parameters.get("partial_rotary_factor", 1.0),
                        moe_layer_indices=tuple(range(conf.first_k_dense_replace, conf.num_hidden_layers)))
    if "sliding_attention" in conf.rope_parameters:
        expected.update(local_rope_theta=conf.rope_parameters["sliding_attention"]["rope_theta"],
                        attention_scale=conf.query_pre_attn_scalar ** -0.5)
    window = getattr(conf, "sliding_window", None)
    kinds = getattr(conf, "layer_types", None) or ["sliding_attention"] * conf.num_hidden_layers
    expected["windows"] = [window if kind == "sliding_attention" else None for kind in kinds]
    return expected


@pytest.mark.parametrize("case", [c for c in parity.CASES if not c.long], ids=lambda c: c.name)
def test_every_missing_field_takes_transformers_default_for_the_family(case):
    """Each numeric field of an exported config dropped in turn (rope_theta with rope_parameters): our
    ModelArch holds what transformers' config class for the family makes of the same file, or the file is
    refused naming the field (a default we cannot honour); the weight shapes are never defaulted."""
    _, arch, _ = parity.case_model(case)
    full = families.to_hf_config(arch)
    numeric = [k for k, v in full.items() if isinstance(v, (int, float)) and k not in families.REQUIRED_FIELDS]
    assert {"rms_norm_eps", "max_position_embeddings", "num_key_value_heads"} <= set(numeric)
    for dropped in [[k] for k in numeric] + [["rope_theta", "rope_parameters"]]:
        config = {k: v for k, v in full.items() if k not in dropped}
        try:
            ours = families.from_hf_config(config)
        except ConfigError as exc:
            assert any(f"field '{k}'" in str(exc) for k in ("sliding_window", *dropped)), (dropped, exc)
            continue
        expected = _expected_from_transformers(case.config_class, config)
        windows = expected.pop("windows")
        moe_layers = expected.pop("moe_layer_indices", ours.moe_layer_indices)
        assert ours.moe_layer_indices == moe_layers, (case.name, dropped)
        assert [ours.layer_window(i) for i in range(ours.num_layers)] == windows, (case.name, dropped)
        got = {k: getattr(ours, k) for k in expected}
        assert got == pytest.approx(expected), (case.name, dropped)
    for shape_field in families.REQUIRED_FIELDS:
        with pytest.raises(ConfigError, match=f"field '{shape_field}': missing"):
            families.from_hf_config({k: v for k, v in full.items() if k != shape_field})


def test_a_config_json_that_is_not_an_object_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json: expected a JSON object \(an HF model config\), got a list"):
        families.from_json(path)


@pytest.mark.parametrize("config_class", ["Gemma3TextConfig", "Gemma2Config"])
def test_gemma_full_parameter_gradients_equal_transformers(config_class):
    """One policy-gradient loss through every Gemma part (offset norms, post-norms, scaled tied embeddings, local RoPE,
    soft caps): the trainer's gradient of every parameter equals transformers' autograd, mapped back to HF names by
    the converter. transformers' Gemma embedding has padding_idx 0, whose row gets no gradient from the input side
    there (ours does): the tokens avoid id 0."""
    from megatron_rl.models.megatron_layout import megatron_to_hf
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer
    from megatron_rl.types import TrainBatch

    case = next(c for c in parity.CASES if c.config_class == config_class)
    model, arch, state = parity.case_model(case)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, arch.vocab_size, (4, 33), generator=g)
    mask = torch.zeros(tokens.shape)
    mask[:, 10:] = 1.0
    advantages = torch.randn(tokens.shape, generator=g) * mask
    batch = TrainBatch(tokens=tokens, loss_mask=mask, advantages=advantages)

    def loss_fn(logprobs, mb, entropy):
        return -(logprobs * mb.advantages * mb.loss_mask).sum() / mask.sum(), {}

    trainer = MegatronTrainer(arch, TrainerConfig(lr=0.0, clip_grad=0.0, vocab_divisible_by=1, micro_batch_size=4),
                              hf_state=state)
    trainer.train_step(batch, loss_fn)
    ours = megatron_to_hf([[{n.removeprefix("module."): p.main_grad.clone()
                             for n, p in trainer.gpt.named_parameters()}]], trainer.layout)
    logits = model(tokens[:, :-1]).logits.float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    (-(logprobs * advantages[:, 1:] * mask[:, 1:]).sum() / mask.sum()).backward()
    for name, param in model.named_parameters():
        want = param.grad
        # fp32 sums over a few hundred terms per element: ~1e-6 relative to the largest gradient of the tensor
        worst = (ours[name] - want).abs().max().item()
        assert worst <= 1e-5 * want.abs().max().item(), f"{name}: {worst:.3g}"
