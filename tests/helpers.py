"""Shared test helpers: a tiny random Llama in HF naming, random prompts."""
from __future__ import annotations

import torch


def tiny_state(arch, seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random HF-named weights for `arch`, scaled so logits are well spread (few near-ties)."""
    g = torch.Generator().manual_seed(seed)
    h, f = arch.hidden_size, arch.ffn_hidden_size

    def w(*shape):
        return torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5

    state = {"model.embed_tokens.weight": torch.randn(arch.vocab_size, h, generator=g),
             "model.norm.weight": 1.0 + 0.1 * torch.randn(h, generator=g)}
    if not arch.tie_word_embeddings:
        state["lm_head.weight"] = w(arch.vocab_size, h) * 4.0
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": w(arch.q_size, h), p + "self_attn.k_proj.weight": w(arch.kv_size, h),
            p + "self_attn.v_proj.weight": w(arch.kv_size, h), p + "self_attn.o_proj.weight": w(h, arch.q_size),
            p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h), p + "mlp.down_proj.weight": w(h, f),
            p + "input_layernorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
            p + "post_attention_layernorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        })
    return state


def near_uniform_state(arch, seed: int = 0) -> dict[str, torch.Tensor]:
    """Small random HF-named weights: predictions near uniform, losses near log V (training comparisons
    at an absolute tolerance stay meaningful)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, arch.hidden_size),
              "lm_head.weight": (arch.vocab_size, arch.hidden_size),
              "model.norm.weight": (arch.hidden_size,)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (arch.q_size, arch.hidden_size),
                       p + "self_attn.k_proj.weight": (arch.kv_size, arch.hidden_size),
                       p + "self_attn.v_proj.weight": (arch.kv_size, arch.hidden_size),
                       p + "self_attn.o_proj.weight": (arch.hidden_size, arch.q_size),
                       p + "mlp.gate_proj.weight": (arch.ffn_hidden_size, arch.hidden_size),
                       p + "mlp.up_proj.weight": (arch.ffn_hidden_size, arch.hidden_size),
                       p + "mlp.down_proj.weight": (arch.hidden_size, arch.ffn_hidden_size),
                       p + "input_layernorm.weight": (arch.hidden_size,),
                       p + "post_attention_layernorm.weight": (arch.hidden_size,)})
    if arch.tie_word_embeddings:
        del shapes["lm_head.weight"]
    return {k: (1.0 + 0.1 * torch.randn(s, generator=generator)) if len(s) == 1
            else 0.05 * torch.randn(s, generator=generator) for k, s in shapes.items()}


def prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def sampled_groups(model, prompts: list[str], samples: int, max_new_tokens: int) -> list:
    """`samples` completions of each chat prompt sampled from `model` (a loaded pretrained model) by the
    native engine, as scored groups rewarded 0, 1, 2, ... within each group."""
    from megatron_rl.controller.episodes import Group, Sample
    from megatron_rl.rewards.registry import RewardResult
    from megatron_rl.rollout.config import NativeEngineConfig
    from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
    from megatron_rl.rollout.native import NativeEngine

    tokenizer = model.tokenizer
    requests = [GenerateRequest(request_id=f"r{i}", prompt_ids=tokenizer.encode_chat([{"role": "user", "content": p}]),
                                sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, n=samples, seed=i))
                for i, p in enumerate(prompts)]
    with NativeEngine(model.arch, model.state, tokenizer=tokenizer, config=NativeEngineConfig(max_batch_size=8)) as engine:
        completions = engine.generate(requests)
    return [Group(prompt=None, samples=[Sample(c, "", RewardResult(reward=float(k)))
                                        for k, c in enumerate(completions[samples * i:samples * (i + 1)])],
                  requested_at_version=0) for i in range(len(prompts))]
