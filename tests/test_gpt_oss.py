"""GPT-OSS (gpt_oss) against transformers' GptOssForCausalLM, fp32 on CPU, tiny random models from its config class:
the published stacked experts read and written back bit for bit, MXFP4 experts read as transformers dequantizes
them, the convert round trip bit-exact and loading as GptOssForCausalLM, the trainer at EP=2 over 1,000 positions
with a 128-token window within 1e-5 and at TP=2 x EP=2 (logits and training), the experts' down bias trained alike
on every TP rank, the sink attention against a brute-force softmax, and every GPT-OSS numerics the code cannot
honour refused by name. (The parity row is in megatron_rl/cli/parity.py; windows at 1,000 / 2,000 positions in
tests/test_sliding_window.py; PP=2 in tests/test_moe_trainer.py; the engine and weight sync in
tests/test_moe_engine.py.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.cli import parity
from megatron_rl.config import ConfigError
from megatron_rl.models import families
from megatron_rl.models.megatron_layout import canonical_hf_state, published_hf_state
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.placement.launch import run_distributed
from tests import moe_helpers
from tests.test_sliding_window import GPT_OSS_WINDOWED

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt_oss():
    return moe_helpers.build("gpt_oss")


def test_stacked_experts_read_as_per_expert_tensors_and_write_back_bit_for_bit(tmp_path, gpt_oss):
    model, arch, stacked, _ = gpt_oss
    model.save_pretrained(tmp_path)
    published = load_pretrained(str(tmp_path)).state
    family = families.get_family(arch.family)
    gate, up, down = families.hf_expert_names(family, 1, 3)
    gate_bias, up_bias, down_bias = families.hf_expert_bias_names(family, 1, 3)
    gate_up = stacked["model.layers.1.mlp.experts.gate_up_proj"][3]            # [H, 2I]: gate, up, gate, up, ...
    gate_up_bias = stacked["model.layers.1.mlp.experts.gate_up_proj_bias"][3]
    assert torch.equal(published[gate], gate_up[:, 0::2].t()) and torch.equal(published[up], gate_up[:, 1::2].t())
    assert torch.equal(published[down], stacked["model.layers.1.mlp.experts.down_proj"][3].t())
    assert torch.equal(published[gate_bias], gate_up_bias[0::2]) and torch.equal(published[up_bias], gate_up_bias[1::2])
    assert torch.equal(published[down_bias], stacked["model.layers.1.mlp.experts.down_proj_bias"][3])
    canonical = canonical_hf_state(stacked, arch)
    assert canonical.keys() == published.keys() and all(torch.equal(canonical[k], published[k]) for k in published)
    back = published_hf_state(canonical, arch)
    assert back.keys() == stacked.keys() and all(torch.equal(back[k], stacked[k]) for k in stacked)


def test_convert_round_trip_is_bit_exact_and_loads_as_gpt_oss(tmp_path, gpt_oss):
    model, arch, _, tokens = gpt_oss
    assert parity.convert_round_trip(model, arch, tokens, str(tmp_path)) == 0.0
    config = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert type(config).__name__ == "GptOssConfig" and config.layer_types == model.config.layer_types


def test_sink_attention_equals_brute_force():
    from megatron_rl.trainer.packing import causal_attention, causal_window_mask

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 30, 8), torch.randn(2, 2, 30, 8), torch.randn(2, 2, 30, 8)
    sinks = torch.randn(4) * 2
    for window in (None, 7):
        got = causal_attention(q, k, v, scale=0.4, window=window, sinks=sinks)
        kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = (q @ kr.transpose(-1, -2) * 0.4).masked_fill(~causal_window_mask(30, window or 30, q.device),
                                                              float("-inf"))
        weights = scores.exp() / (scores.exp().sum(-1, keepdim=True) + sinks.exp().view(1, 4, 1, 1))
        torch.testing.assert_close(got, weights @ vr, rtol=0, atol=1e-6)


def _ep2_worker(rank, world_size, arch, state, tokens):
    torch.set_num_threads(1)
    logits = parity.trainer_logits(arch, state, tokens, ep=2)
    return logits if rank == 0 else None


def test_trainer_at_ep2_equals_transformers_at_1000_positions():
    model, arch, state = parity.case_model(GPT_OSS_WINDOWED)
    assert arch.sliding_window == 128 and arch.sliding_window_layers == (0,)
    tokens = torch.randint(0, arch.vocab_size, (2, 1001), generator=torch.Generator().manual_seed(1))
    got = run_distributed(_ep2_worker, 2, arch, state, tokens)[0]
    worst = (got - parity.reference_logits(model, tokens)).abs().max().item()
    print(f"gpt_oss EP=2 max |logit difference| at 1,000 positions, 128-token window: {worst:.2e}")
    assert worst <= 1e-5


def _config(**fields) -> dict:
    return {**moe_helpers.build("gpt_oss")[0].config.to_dict(), **fields}


@pytest.mark.parametrize("field,value", [("swiglu_limit", -1.0), ("swiglu_alpha", 0), ("attention_bias", "yes"),
                                         ("layer_types", ["sliding_attention", "chunked_attention"])])
def test_gpt_oss_numerics_the_code_cannot_honour_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=rf"field '{field}'"):
        families.from_hf_config(_config(**{field: value}))


def test_sinks_and_biases_elsewhere_are_refused_by_name(gpt_oss):
    _, arch, _, _ = gpt_oss
    from megatron_rl.models.megatron_layout import MegatronLayout
    from megatron_rl.trainer.model import linear_biases, resolve_layer_spec

    llama = families.from_hf_config(transformers.LlamaConfig(**{**parity._BASE}).to_dict())
    # another family's config cannot spell them
    for other in (dataclasses.replace(llama, attention_sinks=True), dataclasses.replace(llama, swiglu_limit=7.0),
                  dataclasses.replace(arch, family="mixtral", attention_bias=False, attention_output_bias=False,
                                      sliding_window=None, sliding_window_layers=None)):
        with pytest.raises(ConfigError, match="GPT-OSS"):
            families.to_hf_config(other)
    with pytest.raises(ConfigError, match="attention_sinks"):
        dataclasses.replace(arch, attn_logit_softcapping=5.0)
    # Megatron's add_bias_linear is all or nothing: GPT-OSS without q/k/v/o biases but with biased experts
    with pytest.raises(ConfigError, match="attention_output_bias"):
        linear_biases(dataclasses.replace(arch, attention_bias=False, attention_output_bias=False))
    assert families.from_hf_config(families.to_hf_config(arch)) == arch
    # built on the local layers (Transformer Engine's would add the experts' down bias on every TP rank)
    assert resolve_layer_spec("auto", arch) == "local"
    with pytest.raises(ConfigError, match="trainer.layer_spec local"):
        MegatronLayout(arch, tp=2, layer_spec="te")


def _tp2_worker(rank, world_size, arch, state, tokens):
    from tests.test_moe_trainer import _batch, _lm_loss, _trainer

    torch.set_num_threads(1)
    trainer = _trainer(arch, state, tp=2, micro_batch_size=2, lr=1e-2)
    for _ in range(2):
        trainer.train_step(_batch(tokens), _lm_loss(_batch(tokens).loss_mask.sum()))
    return {k: v for k, v in trainer.shard_state().items() if k.endswith("linear_fc2.bias")}


def test_expert_down_biases_train_alike_on_every_tp_rank(gpt_oss):
    """The experts' down bias joins the output on TP rank 0 only (trainer/moe.py ExpertDownProjection); its
    gradient, summed over TP, moves every rank's copy alike."""
    _, arch, state, tokens = gpt_oss
    ranks = run_distributed(_tp2_worker, 2, arch, state, tokens)
    stacked = state["model.layers.0.mlp.experts.down_proj_bias"]
    name = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.bias"
    assert not torch.equal(ranks[0][name], stacked[1])  # trained
    assert ranks[0].keys() == ranks[1].keys() and all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])


def test_mxfp4_experts_as_openai_publishes_them_read_as_transformers_dequantizes_them(tmp_path, gpt_oss):
    """openai/gpt-oss-20b and -120b ship their experts in MXFP4 (`*_blocks` / `*_scales`): read bit-equal to
    transformers' own dequantizing loader (Mxfp4Config(dequantize=True)), and the trainer equals that model."""
    import json

    from safetensors.torch import load_file, save_file

    model, arch, _, tokens = gpt_oss
    model.save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(0)
    e, h, i = arch.num_experts, arch.hidden_size, arch.moe_ffn_hidden_size
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        for projection, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            del tensors[prefix + projection]
            tensors[prefix + projection + "_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g,
                                                                     dtype=torch.uint8)
            # shared exponents 2^-5 .. 2^0: the codes' values (up to 6) times these keep activations O(1)
            tensors[prefix + projection + "_scales"] = torch.randint(122, 128, (e, rows, cols // 32), generator=g,
                                                                     dtype=torch.uint8)
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    ours = load_pretrained(str(tmp_path))
    published = published_hf_state(ours.state, ours.arch)
    expected = reference.state_dict()
    assert published.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(published[k].float(), expected[k])] == []
    logits = parity.reference_logits(reference, tokens)
    worst = (parity.trainer_logits(ours.arch, ours.state, tokens) - logits).abs().max().item()
    assert worst <= 1e-5 * max(1.0, logits.abs().max().item())  # fp32 sums of O(1) terms, relative to the logits


def test_tp2_ep2_logits_and_training_equal_transformers_and_one_rank(gpt_oss):
    """Biased experts split over TP (Megatron refuses them; ExpertDownProjection makes them exact) and over EP."""
    from tests.test_moe_trainer import _check_parallel

    _check_parallel({"gpt_oss": gpt_oss}, ["gpt_oss"], tp=2, ep=2, world=4, steps=3)
