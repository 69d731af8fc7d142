"""Tiny random mixture-of-experts models of each MoE family, built from transformers' config classes (no hub),
and a transformers reference forward that routes by a given record (for the routing-replay tests)."""
from __future__ import annotations

import contextlib

import torch

from megatron_rl.cli import parity

_BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False,
             num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             router_aux_loss_coef=0.01)

CASES = {
    # 4 experts so that EP=2 holds 2 per rank; expert width 32 divides by TP=2.
    "qwen3_moe": parity.Case("qwen3_moe", "Qwen3MoeConfig", {**_BASE, "intermediate_size": 96,
                                                            "moe_intermediate_size": 32, "num_experts": 4,
                                                            "norm_topk_prob": True}),
    "qwen3_moe (raw top-k weights)": parity.Case("qwen3_moe (raw top-k weights)", "Qwen3MoeConfig", {
        **_BASE, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4, "norm_topk_prob": False}),
    "mixtral": parity.Case("mixtral", "MixtralConfig", {**_BASE, "intermediate_size": 32, "num_local_experts": 4,
                                                        "sliding_window": None}),
    # Qwen2-MoE: q/k/v biases, raw (not renormalised) top-k weights, a gated shared expert of width 48.
    "qwen2_moe": parity.Case("qwen2_moe", "Qwen2MoeConfig", {**_BASE, "intermediate_size": 96,
                                                            "moe_intermediate_size": 32, "num_experts": 4,
                                                            "shared_expert_intermediate_size": 48,
                                                            "norm_topk_prob": False}),
    # GLM-4.5: layer 0 dense (first_k_dense_replace), a sigmoid router with a random expert bias choosing top-4 of 8
    # within the best 2 of 4 groups, weights renormalised and scaled by 2.5, one ungated shared expert, q/k/v biases,
    # q/k norms, RoPE on half of each head.
    "glm4_moe": parity.Case("glm4_moe", "Glm4MoeConfig", {
        **_BASE, "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 4,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "attention_bias": True, "use_qk_norm": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    # DeepSeek-V3: multi-latent attention (q latent 24, kv latent 16, 12 + 8 q/k dims with 8 rotary, interleaved, values
    # 12 per head), then GLM-4.5's router and layout (it is DeepSeek-V3's).
    "deepseek_v3": parity.Case("deepseek_v3", "DeepseekV3Config", {
        **_BASE, "head_dim": 8, "num_key_value_heads": 4, "intermediate_size": 96, "moe_intermediate_size": 32,
        "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "q_lora_rank": 24,
        "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 12, "rope_interleave": True}),
    # GPT-OSS: layer 0 a 16-token window, layer 1 full; sinks, q/k/v/o biases, a biased router, biased experts with
    # the SwiGLU clamped at 2 (random activations reach it) and its +1 offset.
    "gpt_oss": parity.Case("gpt_oss", "GptOssConfig", {**_BASE, "intermediate_size": 32, "num_local_experts": 4,
                                                      "sliding_window": 16, "swiglu_limit": 2.0}),
}
FAMILY_CASES = ("qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3", "gpt_oss")
# Dense layers among the MoE ones: Qwen2-MoE's mlp_only_layers (layer 0 dense, 1 to 3 MoE; PP=2 puts a dense and an
# MoE layer on stage 0). Dense MLP width 96, shared expert 48, experts 32: all divide by TP=2.
DENSE_LAYERS = parity.Case("qwen2_moe (dense layer 0)", "Qwen2MoeConfig", {
    **_BASE, "num_hidden_layers": 4, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
    "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [0]})
CASES[DENSE_LAYERS.name] = DENSE_LAYERS
FAMILY_CASES += (DENSE_LAYERS.name,)


def build(name: str, seed: int = 0):
    """(transformers model, ModelArch, HF state in transformers' in-memory form, tokens [2, 49])."""
    model, arch, state = parity.case_model(CASES[name], seed)
    return model, arch, state, parity.case_tokens(CASES[name], arch, seed)


@contextlib.contextmanager
def hf_forced_routing(model, record: torch.Tensor):
    """transformers' routers take the experts of `record` [B, S, L, k] (-1: the router's own top-k) for a
    forward of B x S tokens; the weights are the router's own probabilities of those experts, renormalised
    when the family renormalises (the semantics of routing replay)."""
    routers = [(index, _router(layer)) for index, layer in enumerate(model.model.layers) if _is_moe(layer)]
    originals = []
    for index, router in routers:
        originals.append(router.forward)

        def forced(hidden_states, router=router, index=index, original=router.forward):
            hidden_states = hidden_states.reshape(-1, router.hidden_dim)
            logits, _, own = original(hidden_states)
            wanted = record[:, :, index].reshape(-1, router.top_k).long()
            chosen = torch.where((wanted >= 0).all(-1, keepdim=True), wanted, own)
            if hasattr(router, "e_score_correction_bias"):  # sigmoid router (GLM-4.5, DeepSeek-V3)
                weights = logits.float().sigmoid().gather(1, chosen)
                if router.norm_topk_prob:
                    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
                return logits, weights * router.routed_scaling_factor, chosen
            weights = torch.softmax(logits.float(), dim=-1).gather(1, chosen)
            if getattr(router, "norm_topk_prob", True):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen

        router.forward = forced
    try:
        yield
    finally:
        for (_, router), original in zip(routers, originals):
            router.forward = original


def _is_moe(layer) -> bool:
    return hasattr(layer.mlp, "gate") or hasattr(layer.mlp, "router")  # a dense layer's MLP has gate_proj, no router


def _router(layer):
    return layer.mlp.router if hasattr(layer.mlp, "router") else layer.mlp.gate


def hf_own_routing(model, tokens: torch.Tensor) -> torch.Tensor:
    """The experts transformers' routers choose for tokens [B, S]: [B, S, L, k] in ascending expert id (-1 in dense
    layers)."""
    chosen: dict[int, torch.Tensor] = {}
    hooks = [_router(layer).register_forward_hook(lambda m, i, o, index=index: chosen.__setitem__(index, o[2]))
             for index, layer in enumerate(model.model.layers) if _is_moe(layer)]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    b, s = tokens.shape
    k = next(iter(chosen.values())).shape[-1]
    return torch.stack([chosen[i].reshape(b, s, k).sort(dim=-1).values if i in chosen else torch.full((b, s, k), -1)
                        for i in range(len(model.model.layers))], dim=2)
