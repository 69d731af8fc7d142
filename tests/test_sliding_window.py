"""Sliding-window attention (Mistral v0.1, Qwen2 / Qwen3 `use_sliding_window` with `layer_types`, Mixtral, Gemma 3,
Qwen3-MoE): the registry reads the windowed layers as transformers' config classes do, the trainer and the
native engine equal transformers (its sliding-window mask) on sequences far longer than the window, with shared
prefixes longer than the window and batches mixing lengths, and the engine's windowed layers keep about one
window of cache per sequence. Tiny random fp32 models built from transformers' config classes."""
from __future__ import annotations

import dataclasses
import math
import os
import struct
import sys

import pytest
import torch
import transformers

from megatron_rl.cli import parity
from megatron_rl.config import ConfigError
from megatron_rl.models import families
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.native.kv_cache import DROP_POSITIONS
from megatron_rl.rollout.native.parity import engine_parity, hf_greedy
from megatron_rl.sim import cost

WINDOW = 128
# one windowed layer next to a full one (Qwen2's max_window_layers = 1), long enough for 2,000 positions
QWEN2_WINDOWED = parity.Case("qwen2 (128-token window on layer 1)", "Qwen2Config", dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
    use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))

# Gemma 3's pattern (sliding layers, then a full one) with each type's own RoPE base, its (1 + w) and sandwich norms
GEMMA3_WINDOWED = parity.Case("gemma3_text (128-token window on layer 0)", "Gemma3TextConfig", dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
    sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}))
# GPT-OSS's layout (window on even layers, full on odd) with its sinks, biases, clamped-SwiGLU experts and its YaRN
GPT_OSS_WINDOWED = parity.Case("gpt_oss (128-token window on layer 0)", "GptOssConfig", dict(
    vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=False,
    sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=2.0))
LONG_WINDOWED = [QWEN2_WINDOWED, GEMMA3_WINDOWED, GPT_OSS_WINDOWED]


def _config(config_class: str, **fields) -> dict:
    return getattr(transformers, config_class)(**{**parity._BASE, **fields}).to_dict()


@pytest.fixture(scope="module", params=LONG_WINDOWED, ids=lambda c: c.config_class)
def long_windowed(request):
    return parity.case_model(request.param)


@pytest.mark.parametrize("config_class,fields,window,layers", [
    ("MistralConfig", dict(sliding_window=16), 16, None),                       # every layer
    ("MistralConfig", dict(sliding_window=None), None, None),
    ("MixtralConfig", dict(sliding_window=16, num_local_experts=4, num_experts_per_tok=2), 16, None),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), 16, (1,)),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), 16, None),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2), None, None),
    ("Qwen2Config", dict(use_sliding_window=False, sliding_window=16), None, None),
    ("Qwen3Config", dict(use_sliding_window=True, sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"]), 16, (0,)),
    ("Qwen3MoeConfig", dict(use_sliding_window=True, sliding_window=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32), 16, None),
    ("Gemma3TextConfig", dict(sliding_window=16), 16, None),                    # the default pattern: 5 of 6
    ("Gemma3TextConfig", dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"]), 16, (0,)),
    ("Gemma3TextConfig", dict(sliding_window=16, layer_types=["full_attention"] * 2), None, None),
    ("Gemma2Config", dict(sliding_window=16, num_hidden_layers=4), 16, (0, 2)),    # the default: every other
    ("GptOssConfig", dict(sliding_window=16, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2),
     16, (0, 2)),                                                                # the default: even layers
])
def test_the_windowed_layers_are_those_transformers_builds(config_class, fields, window, layers):
    config = _config(config_class, **fields)
    arch = families.from_hf_config(config)
    assert (arch.sliding_window, arch.sliding_window_layers) == (window, layers)
    # independently: the window each of transformers' attention modules applies
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**config))
    held = _windows_applied(model)
    assert [arch.layer_window(i) for i in range(arch.num_layers)] == held
    # the export reads back as the same arch, and transformers builds the same windows from it
    exported = families.to_hf_config(arch)
    assert families.from_hf_config(exported) == arch
    again = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**exported))
    assert _windows_applied(again) == held


def _windows_applied(model) -> list:
    """Per layer, the window transformers' attention passes to its kernel: the module's own `sliding_window`
    (Qwen2, Qwen3, Qwen3-MoE) or, for modules without one (Mistral, Mixtral), the config's."""
    return [layer.self_attn.sliding_window if hasattr(layer.self_attn, "sliding_window")
            else model.config.sliding_window for layer in model.model.layers]


@pytest.mark.parametrize("config,field", [
    (_config("LlamaConfig", sliding_window=16), "sliding_window"),
    (_config("Qwen2Config", use_sliding_window=True, sliding_window=16,
             layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    (_config("MistralConfig", sliding_window=0), "sliding_window"),
    (_config("Gemma3TextConfig", attn_logit_softcapping=50.0), "attn_logit_softcapping"),  # (never applied)
    (_config("Gemma2Config", final_logit_softcapping=-1.0), "final_logit_softcapping"),
    (_config("Gemma3TextConfig", use_bidirectional_attention=True), "use_bidirectional_attention"),
    (_config("Gemma3TextConfig", hidden_activation="gelu"), "hidden_activation"),
    (_config("Gemma3TextConfig", attention_bias=True), "attention_bias"),
    (_config("Gemma3TextConfig", rope_parameters={
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}), "rope_parameters.sliding_attention"),
])
def test_a_window_the_code_cannot_honour_is_refused_by_name(config, field):
    with pytest.raises(ConfigError, match=rf"field '{field}'"):
        families.from_hf_config(config)


def test_a_mistral_window_on_some_layers_only_cannot_be_exported():
    arch = dataclasses.replace(families.from_hf_config(_config("MistralConfig", sliding_window=16)),
                               sliding_window_layers=(0,))
    with pytest.raises(ConfigError, match="sliding_window_layers"):
        families.to_hf_config(arch)


def test_trainer_logits_equal_transformers_at_1000_positions(long_windowed):
    model, arch, state = long_windowed
    tokens = torch.randint(0, arch.vocab_size, (1, 1001), generator=torch.Generator().manual_seed(1))
    expected = parity.reference_logits(model, tokens)
    got = parity.trainer_logits(arch, state, tokens)
    # fp32 sums over at most 1,000 keys of O(1) terms: ~1e-6 relative, logits are O(1)
    assert (got - expected).abs().max().item() <= 1e-5
    dense = dataclasses.replace(arch, sliding_window=10 ** 6)  # the same layers, a window wider than the sequence
    assert (parity.trainer_logits(dense, state, tokens) - expected).abs().max().item() > 1e-2  # the window bites


@pytest.mark.parametrize("long_case", LONG_WINDOWED, ids=lambda c: c.config_class)
def test_trainer_logits_equal_transformers_at_1000_positions_at_tp2(long_case):
    from megatron_rl.placement.launch import run_distributed

    # two KV heads, so that TP=2 splits them
    case = dataclasses.replace(long_case, fields={**long_case.fields, "num_key_value_heads": 2})
    model, arch, state = parity.case_model(case)
    tokens = torch.randint(0, arch.vocab_size, (1, 1001), generator=torch.Generator().manual_seed(1))
    got = run_distributed(parity._parallel_worker, 2, [(arch, state, tokens, 2, 1)])[0][0]
    worst = (got - parity.reference_logits(model, tokens)).abs().max().item()
    print(f"{arch.family} TP=2 max |logit difference| at 1,000 positions, 128-token window: {worst:.2e}")
    assert worst <= 1e-5


MOE_WINDOWED = [
    parity.Case("mixtral (16-token window)", "MixtralConfig", {
        **parity._BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    parity.Case("qwen3_moe (16-token window)", "Qwen3MoeConfig", {
        **parity._BASE, "head_dim": 32, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
        "use_sliding_window": True, "sliding_window": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
]


@pytest.mark.parametrize("case", MOE_WINDOWED, ids=lambda c: c.name)
def test_windowed_mixture_of_experts_equals_transformers(case):
    model, arch, state = parity.case_model(case)
    assert arch.sliding_window == 16 and arch.sliding_window_layers is None
    tokens = parity.case_tokens(case, arch)  # 2 x 49 tokens: three windows long
    assert (parity.trainer_logits(arch, state, tokens) - parity.reference_logits(model, tokens)).abs().max() <= 1e-5
    greedy_equal, worst = engine_parity(model, arch, state)  # prompts of 5, 13 and 32 tokens, 64 new ones
    assert greedy_equal and worst <= 1e-5


def test_packed_rows_attend_within_the_window():
    from megatron_rl.trainer.packing import causal_window_mask, varlen_causal_attention

    torch.manual_seed(0)
    lengths, heads, groups, d, window = [40, 7, 25], 4, 2, 8, 6
    q = torch.randn(sum(lengths), heads, d)
    k, v = torch.randn(sum(lengths), groups, d), torch.randn(sum(lengths), groups, d)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    got = varlen_causal_attention(q, k, v, cu, scale=0.3, window=window)
    # brute force: softmax over the allowed keys of each document, K/V repeated per query head
    for start, end in zip(cu.tolist(), cu[1:].tolist()):
        n = end - start
        kr, vr = (t[start:end].repeat_interleave(heads // groups, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[start:end], kr) * 0.3
        scores = scores.masked_fill(~causal_window_mask(n, window, q.device), float("-inf"))
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vr).reshape(n, -1)
        torch.testing.assert_close(got[start:end], expected, rtol=0, atol=1e-5)


def _private_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s pages that hold memory of their own: present and exclusively mapped in
    /proc/self/pagemap (a released page that is read maps the shared zero page: present, not exclusive)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        entries = struct.unpack(f"{end - start}Q", f.read(8 * (end - start)))
    return sum(page for e in entries if e >> 63 & 1 and e >> 56 & 1)


def test_engine_equals_transformers_at_2000_positions_with_shared_prefixes_and_mixed_lengths(long_windowed):
    model, arch, state = long_windowed
    windowed = arch.windowed_layers[0]
    full = next(i for i in range(arch.num_layers) if arch.layer_window(i) is None)
    g = torch.Generator().manual_seed(2)
    base = torch.randint(0, arch.vocab_size, (1900,), generator=g).tolist()
    prompts = [
        base,                                                                     # 1,900 + 100 = 2,000 positions
        base[:1500] + torch.randint(0, arch.vocab_size, (120,), generator=g).tolist(),  # shares 1,500 > window
        base,                                                                     # the whole prompt shared
        torch.randint(0, arch.vocab_size, (37,), generator=g).tolist(),          # short, inside the window
        base[:600],
    ]
    new_tokens = 100
    config = NativeEngineConfig(max_batch_size=len(prompts), max_seq_len=2048, dtype="fp32", device="cpu",
                                max_prefill_tokens=512)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    resident: dict[str, int] = {}

    def measure(sample_id, token, logprob, version):
        # the cache mid-generation (every prefix copied, the long sequences past 1,900 positions): the windowed
        # layer against the full one
        counts[sample_id] = counts.get(sample_id, 0) + 1
        if sample_id == "p0" and counts[sample_id] == 50 and sys.platform.startswith("linux"):
            cache = engine.kv_cache
            resident["full"] = _private_bytes(cache.k[full]) + _private_bytes(cache.v[full])
            resident["windowed"] = _private_bytes(cache.k[windowed]) + _private_bytes(cache.v[windowed])
            # positions each sequence has computed since its windowed-layer release point
            resident["held"] = sum(len(s.prompt) + len(s.output) - cache.dropped[s.slot] for s in engine._running)

    counts: dict[str, int] = {}
    with NativeEngine(arch, state, config=config, eos_token_ids=[]) as engine:
        futures = engine.submit([GenerateRequest(f"p{i}", p, greedy) for i, p in enumerate(prompts)],
                                on_token=measure)
        outs = [f.result() for f in futures]
        shared = engine.health()["shared_prefix_tokens"]
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        hf_ids, logits = hf_greedy(model, prompt, new_tokens)
        assert out.output_ids == hf_ids
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(out.output_logprobs)).abs().max().item())
    print(f"{arch.family} engine at 2,000 positions: max |log-prob difference| {worst:.2e}, shared prefix tokens "
          f"{shared}")
    assert worst <= 1e-5
    assert shared >= 1500 + 1899  # prompts 1 and 2 copied their prefixes rather than recomputing them
    if sys.platform.startswith("linux"):
        row = arch.kv_size * 4  # bytes per position per layer, K or V
        full_positions = resident["full"] / (2 * row)
        windowed_positions = resident["windowed"] / (2 * row)
        print(f"{arch.family} resident KV positions (5 sequences, 3 past 1,600 tokens): full layer {full_positions:.0f}, "
              f"windowed layer {windowed_positions:.0f}")
        # the full layer holds every position of the long sequences; a windowed one only each sequence's
        # positions since its release point (at most a window and DROP_POSITIONS), plus partial pages
        assert full_positions >= 3 * 1600
        slack = 3 * os.sysconf("SC_PAGE_SIZE") // row
        assert windowed_positions <= resident["held"] + len(prompts) * slack
        assert windowed_positions <= len(prompts) * (WINDOW + DROP_POSITIONS + slack)
