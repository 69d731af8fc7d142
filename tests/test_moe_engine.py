"""The native engine's mixture-of-experts forward (Mixtral, Qwen3-MoE), its routing record and MoE weight sync,
against transformers: tiny configs built from each family's transformers config class with random fp32
weights. Greedy tokens equal transformers' `generate`, log-probs within 1e-4; the recorded expert ids equal
the ids transformers' own routers choose (captured by forward hooks on them) for every position, through
chunked prefill, decode and prefix-shared prompts; Megatron shards (TP=2, EP=2) resharded into the engine
(TP=1 and TP=2) give bit-identical weights."""
from __future__ import annotations

import pytest
import torch
import transformers

from megatron_rl.config import ConfigError
from megatron_rl.models.families import from_hf_config, get_family, hf_expert_names, hf_router_name
from megatron_rl.models.megatron_layout import MegatronLayout, canonical_hf_state, hf_to_megatron
from megatron_rl.models.pretrained import read_safetensors_dir
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.native.parity import default_prompts, engine_parity
from megatron_rl.weight_sync import reshard as R
from megatron_rl.weight_sync.shared_memory import write_shard
from tests import moe_helpers
from tests.test_engine_families import random_model

SHAPES = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6)
CONFIGS = {
    # Mixtral: 8 experts, top-2, always renormalized
    "mixtral": lambda: transformers.MixtralConfig(**SHAPES, intermediate_size=48, num_local_experts=8,
                                                  num_experts_per_tok=2, sliding_window=None),
    # Qwen3-MoE: q/k norms, free head_dim, top-3 of 8 without renormalization
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SHAPES, intermediate_size=96, moe_intermediate_size=32,
                                                     num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                                                     head_dim=24),
    "qwen3_moe_norm": lambda: transformers.Qwen3MoeConfig(**SHAPES, intermediate_size=96, moe_intermediate_size=32,
                                                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                                          tie_word_embeddings=True),
    # Qwen2-MoE: q/k/v biases, top-4 of 8 without renormalization, a gated shared expert
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SHAPES, intermediate_size=96, moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=48, num_experts=8,
                                                     num_experts_per_tok=4, norm_topk_prob=False),
    # dense layers among the MoE ones: layer 0 Qwen2-MoE's dense MLP (mlp_only_layers), layer 1 MoE
    "qwen2_moe_dense": lambda: transformers.Qwen2MoeConfig(**SHAPES, intermediate_size=96, moe_intermediate_size=32,
                                                           shared_expert_intermediate_size=48, num_experts=8,
                                                           num_experts_per_tok=2, norm_topk_prob=True,
                                                           mlp_only_layers=[0]),
    # GLM-4.5: dense layer 0, sigmoid router with a random expert bias, top-4 of 8 within 2 of 4 groups, scaled by
    # 2.5, an ungated shared expert, q/k/v biases and q/k norms, RoPE on half of each head
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**SHAPES, intermediate_size=96, moe_intermediate_size=32,
                                                   n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                                                   routed_scaling_factor=2.5, n_shared_experts=1,
                                                   first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True,
                                                   use_qk_norm=True, rope_parameters={
                                                       "rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5}),
    # GPT-OSS: sinks, q/k/v/o biases, a biased router choosing top-2 of 8 biased experts with the SwiGLU clamped at 2,
    # a 16-token window on layer 0
    "gpt_oss": lambda: transformers.GptOssConfig(**SHAPES, intermediate_size=48, num_local_experts=8,
                                                 num_experts_per_tok=2, swiglu_limit=2.0, sliding_window=16),
    # DeepSeek-V3: multi-latent attention (latent cache), the same router and layout as GLM-4.5
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**{**SHAPES, "num_key_value_heads": 4}, intermediate_size=96,
                                                         moe_intermediate_size=32, n_routed_experts=8,
                                                         num_experts_per_tok=4, n_group=4, topk_group=2,
                                                         routed_scaling_factor=2.5, n_shared_experts=1,
                                                         first_k_dense_replace=1, norm_topk_prob=True, q_lora_rank=24,
                                                         kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
                                                         v_head_dim=12),
}


def _model(kind: str, seed: int = 0):
    config = CONFIGS[kind]()
    model, state = random_model(config, seed=seed)
    return config, model, state, from_hf_config(config.to_dict())


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_greedy_and_logprobs_match_transformers(kind):
    config, model, state, arch = _model(kind)
    assert arch.is_moe and arch.moe_norm_topk_prob == (kind not in ("qwen3_moe", "qwen2_moe"))
    assert (arch.shared_expert_ffn_hidden_size > 0) == kind.startswith(("qwen2_moe", "glm4_moe", "deepseek_v3"))
    assert arch.moe_layer_indices == ((1,) if kind in ("qwen2_moe_dense", "glm4_moe", "deepseek_v3") else (0, 1))
    equal, diff = engine_parity(model, arch, state, max_new_tokens=32)
    assert equal and diff < 1e-4, (kind, equal, diff)


def _hf_routing(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), layers, k]: the expert ids transformers' routers choose in one forward over `ids` (-1 in
    dense layers)."""
    return moe_helpers.hf_own_routing(model, torch.tensor([ids]))[0]


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe_dense", "glm4_moe", "deepseek_v3", "gpt_oss"])
def test_routing_record_equals_transformers_routing(kind, tmp_path):
    """Sampled answers (temperature 1), a 40-token prompt sampled twice (the second copy shares its prefix's
    K/V and routing) plus a prompt sharing 24 tokens with it, prefill chunked at 16 tokens."""
    config, model, state, arch = _model(kind, seed=1)
    base = default_prompts(arch, lengths=(40, 12), seed=7)
    prompts = [base[0], base[0][:24] + base[1], base[1][:5]]
    engine_config = NativeEngineConfig(max_batch_size=4, max_seq_len=96, max_prefill_tokens=16, record_routing=True)
    requests = [GenerateRequest("a", prompts[0], SamplingParams(temperature=1.0, max_new_tokens=20, n=2, seed=3)),
                GenerateRequest("b", prompts[1], SamplingParams(temperature=1.0, max_new_tokens=12, seed=4)),
                GenerateRequest("c", prompts[2], SamplingParams(temperature=0.0, max_new_tokens=9))]
    with NativeEngine(arch, state, config=engine_config, eos_token_ids=[]) as engine:
        outs = engine.generate(requests)
        assert engine.health()["shared_prefix_tokens"] >= 24
    for out in outs:
        rec = out.routed_experts
        ids = out.prompt_ids + out.output_ids
        assert rec is not None and rec.dtype == torch.int16
        assert tuple(rec.shape) == (len(ids) - 1, arch.num_layers, arch.moe_top_k)
        ref = _hf_routing(model, ids[:-1])
        rec = rec.long().sort(dim=-1).values
        assert torch.equal(rec, ref.long()), (out.request_id, (rec != ref).nonzero()[:5])


def test_routing_record_off_by_default_and_none_for_dense():
    _, _, state, arch = _model("mixtral")
    with NativeEngine(arch, state, config=NativeEngineConfig(max_batch_size=1, max_seq_len=32), eos_token_ids=[]) as e:
        out, = e.generate([GenerateRequest("r", [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=3))])
    assert out.routed_experts is None
    dense = transformers.LlamaConfig(**SHAPES, intermediate_size=48)
    _, dense_state = random_model(dense)
    dense_arch = from_hf_config(dense.to_dict())
    with NativeEngine(dense_arch, dense_state, config=NativeEngineConfig(max_batch_size=1, max_seq_len=32,
                                                                         record_routing=True), eos_token_ids=[]) as e:
        out, = e.generate([GenerateRequest("r", [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=3))])
    assert out.routed_experts is None


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_published_and_fused_names_load_the_same_and_bad_names_are_refused(kind, tmp_path):
    """save_pretrained writes the published per-expert names; the engine loads them and transformers 5's fused
    in-memory form into the same arena."""
    config, model, state, arch = _model(kind)
    model.save_pretrained(tmp_path)
    published = read_safetensors_dir(str(tmp_path))
    family = get_family(arch.family)
    assert hf_expert_names(family, 1, 7)[0] in published and hf_router_name(family, 1) in published
    prompt = SamplingParams(temperature=0.0, max_new_tokens=8)
    cfg = NativeEngineConfig(max_batch_size=1, max_seq_len=32)
    with NativeEngine(arch, published, config=cfg, eos_token_ids=[]) as a, \
            NativeEngine(arch, state, config=cfg, eos_token_ids=[]) as b:
        held_a, held_b = a.named_weights(), b.named_weights()
        assert set(held_a) == set(held_b)
        assert [n for n in held_a if not torch.equal(held_a[n], held_b[n])] == []
        for name, tensor in published.items():
            assert torch.equal(held_a[name], tensor), name
        assert a.generate([GenerateRequest("r", [5, 6, 7], prompt)])[0].output_ids == \
            b.generate([GenerateRequest("r", [5, 6, 7], prompt)])[0].output_ids
        with pytest.raises(ConfigError, match="num_experts"):
            a.update_weights({"model.layers.0.mlp.experts.9.gate_proj.weight": torch.zeros(32, 64)})
        with pytest.raises(ConfigError, match="unknown tensor name"):
            a.update_weights({"model.layers.0.mlp.gate_proj.weight": torch.zeros(48, 64)})
    dense = transformers.LlamaConfig(**SHAPES, intermediate_size=48)
    _, dense_state = random_model(dense)
    with NativeEngine(from_hf_config(dense.to_dict()), dense_state, config=cfg) as e:
        with pytest.raises(ConfigError, match="is dense"):
            e.update_weights({hf_router_name(family, 0): torch.zeros(8, 64)})


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe_dense", "glm4_moe", "deepseek_v3", "gpt_oss"])
def test_megatron_ep2_tp2_shards_resharded_into_the_engine_are_bit_identical(kind):
    config, model, state, arch = _model(kind, seed=6)
    layout = MegatronLayout(arch, tp=2, ep=2)
    shards = hf_to_megatron(state, layout)
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in shards[0][layout.shard_index(1, 1)]
    plan = R.build_reshard_plan(layout, R.EngineLayout(arch, tp=1))
    resharded = R.execute_plan(plan, 0, shards, backend="torch")
    family = get_family(arch.family)
    g, u, d = hf_expert_names(family, 1, 5)
    if family.gpt_oss:  # stacked [E, H, 2I], gate and up columns interleaved
        gate_up = state["model.layers.1.mlp.experts.gate_up_proj"].transpose(1, 2)
        gate, up = gate_up[5, 0::2], gate_up[5, 1::2]
        down = state["model.layers.1.mlp.experts.down_proj"][5].t()
        state = canonical_hf_state(state, arch)  # (the names the engine holds)
    else:  # transformers 5's fused in-memory form
        gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
        gate, up = gate_up[5, :arch.moe_ffn_hidden_size], gate_up[5, arch.moe_ffn_hidden_size:]
        down = state["model.layers.1.mlp.experts.down_proj"][5]
    assert torch.equal(resharded[g], gate) and torch.equal(resharded[u], up) and torch.equal(resharded[d], down)
    zeros = {k: torch.zeros_like(v) for k, v in state.items()}
    with NativeEngine(arch, zeros, config=NativeEngineConfig(max_batch_size=2, max_seq_len=32)) as engine:
        engine.update_weights(resharded, version=1)
        held = engine.named_weights()
        assert [n for n, t in state.items() if not torch.equal(held[n], t)] == []
        assert engine.version == 1
        # each trainer rank (tp, ep) writes its own shard straight into a fresh engine arena (the shared-memory
        # channel's path) and the engine adopts it
        arena = torch.full((engine.weights.layout.numel,), float("nan"))
        views = R.Bucket(engine.weights.layout, arena).unpack()
        for ep_rank in range(2):
            for tp_rank in range(2):
                index = layout.shard_index(tp_rank, ep_rank)
                write_shard(plan, 0, index, shards[0][index], {0: views})
        engine.adopt_weight_arena(arena, version=2)
        held = engine.named_weights()
        assert [n for n, t in state.items() if not torch.equal(held[n], t)] == []  # NaN where nothing was written
    # an EP rank > 0 feeds only its experts; an engine at TP=2 gets row halves of every expert
    ep1 = plan.copies_from(0, layout.shard_index(0, 1))[0]
    assert ep1 and all(".experts." in c.dst for c in ep1)
    if arch.is_mla:  # resharded for one-rank engines only
        with pytest.raises(ConfigError, match="multi-latent"):
            R.EngineLayout(arch, tp=2)
        return
    plan2 = R.build_reshard_plan(layout, R.EngineLayout(arch, tp=2))
    halves = [R.execute_plan(plan2, r, shards, backend="torch") for r in range(2)]
    assert torch.equal(torch.cat([h[g] for h in halves]), resharded[g])
    assert torch.equal(torch.cat([h[d] for h in halves], dim=1), resharded[d])
    router = hf_router_name(family, 1)
    assert torch.equal(halves[1][router], resharded[router])


def test_routing_record_served_as_sglang_does_and_decoded_by_our_sglang_client():
    """`megatron-rl serve` returns an MoE engine's routing record as SGLang 0.5.23 does (return_routed_experts ->
    meta_info.routed_experts, base64 int32 [positions from routed_experts_start_len to P + R - 1, layers, k]),
    and HTTPEngine(routing=...), the client a run's SGLang generator group uses, decodes it into exactly the
    record the engine holds; an engine that does not record refuses the field."""
    from megatron_rl.rollout.client import HTTPEngine, decode_routed_experts
    from megatron_rl.rollout.engine import RequestError
    from megatron_rl.rollout.server import RolloutServer

    _, _, state, arch = _model("mixtral", seed=4)
    layers, k = arch.num_layers, arch.moe_top_k
    prompt, greedy = [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=6, temperature=0.0)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
            "return_routed_experts": True}
    recording = NativeEngineConfig(max_batch_size=4, max_seq_len=64, record_routing=True)
    with NativeEngine(arch, state, config=recording, eos_token_ids=[]) as engine:
        direct = engine.generate([GenerateRequest("direct", prompt, greedy)])[0]
        server = RolloutServer(engine, port=0).start()
        try:
            client = HTTPEngine(server.url, routing=(layers, k))
            served = client.generate([GenerateRequest("served", prompt, greedy)])[0]
            assert served.output_ids == direct.output_ids and len(served.output_ids) == 6
            assert served.routed_experts.dtype == torch.int16
            assert served.routed_experts.shape == (len(prompt) + 6 - 1, layers, k)
            assert torch.equal(served.routed_experts, direct.routed_experts)
            _, out = client.request("POST", "/generate", {**body, "routed_experts_start_len": 3})
            assert torch.equal(decode_routed_experts(out["meta_info"]["routed_experts"], layers, k),
                               direct.routed_experts[3:])
            with pytest.raises(RequestError, match="routed_experts_start_len"):
                client.request("POST", "/generate", {**body, "routed_experts_start_len": 6})
            with pytest.raises(RequestError, match="return_routed_experts"):
                client.request("POST", "/generate", {**body, "return_routed_experts": [True]})
            with pytest.raises(ConfigError, match="not a multiple of layers x top_k"):
                HTTPEngine(server.url, routing=(layers + 1, k)).generate([GenerateRequest("x", prompt, greedy)])
        finally:
            server.shutdown()
    with NativeEngine(arch, state, config=NativeEngineConfig(max_batch_size=2, max_seq_len=64)) as plain:
        server = RolloutServer(plain, port=0).start()
        try:
            with pytest.raises(RequestError, match="'return_routed_experts' needs a mixture-of-experts model"):
                HTTPEngine(server.url, routing=(layers, k)).generate([GenerateRequest("y", prompt, greedy)])
        finally:
            server.shutdown()


def test_mla_cache_holds_the_latent_and_rotary_key_alone():
    """DeepSeek-V3's cache: kv_lora_rank + qk_rope_head_dim numbers per token and layer (16 + 8 here), against K and
    V of every head for a grouped-query model of the same width (4 heads of 8 dims: 64), and the planner's count
    equals the engine's bytes."""
    from megatron_rl.rollout.native.kv_cache import KVCache
    from megatron_rl.sim.cost import kv_bytes_per_sequence

    _, _, state, arch = _model("deepseek_v3")
    assert arch.kv_cache_width == arch.kv_lora_rank + arch.qk_rope_head_dim == 24
    with NativeEngine(arch, state, config=NativeEngineConfig(max_batch_size=2, max_seq_len=32, dtype="fp32"),
                      eos_token_ids=[]) as engine:
        engine.generate([GenerateRequest("r", [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=4))])
        cache = engine.kv_cache
        per_token = cache.nbytes / (cache.slots * cache.max_len * arch.num_layers)
    assert per_token == 4 * 24
    gqa = from_hf_config(transformers.LlamaConfig(**{**SHAPES, "num_key_value_heads": 4}, intermediate_size=96).to_dict())
    gqa_cache = KVCache(gqa, 2, 32, torch.device("cpu"), torch.float32)
    gqa_cache.ensure()
    assert gqa_cache.nbytes / (2 * 32 * gqa.num_layers) == 4 * 2 * 64  # 5.3x the latent cache
    assert kv_bytes_per_sequence(arch, 32, 4) == cache.nbytes / cache.slots


def test_mla_with_yarn_equals_transformers_over_2000_positions():
    """DeepSeek-V3's attention as it ships (latent cache, interleaved rotary rows, YaRN with mscale_all_dim) past
    YaRN's original context: a 1,000-token prompt and 1,000 greedy tokens, the tokens transformers' generate gives and
    log-probs within 1e-5 (fp32)."""
    config = transformers.DeepseekV3Config(
        **{**SHAPES, "num_key_value_heads": 4, "max_position_embeddings": 4096}, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=12,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 1024})
    model, state = random_model(config, seed=0)
    arch = from_hf_config(config.to_dict())
    assert arch.is_mla and arch.rope_interleave and arch.rope_scaling.rope_type == "yarn"
    prompt = torch.randint(0, arch.vocab_size, (1000,), generator=torch.Generator().manual_seed(5)).tolist()
    equal, diff = engine_parity(model, arch, state, prompts=[prompt], max_new_tokens=1000)
    assert equal and diff <= 1e-5, (equal, diff)
