"""Shared test helpers: a tiny random Llama in HF naming, random prompts."""
from __future__ import annotations

import math

import torch

FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7: a float32 ulp at 1


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


def gguf_writer(path, gguf_arch: str, arch, blocks: int | None = None):
    """A `gguf.GGUFWriter` for `arch` with the shape metadata llama.cpp's converter writes for every model (blocks,
    default the layers; context; widths; query heads); callers add the rest of their family's."""
    import gguf  # the tests that write GGUF files import it (or skip) themselves

    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(arch.num_layers if blocks is None else blocks)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_feed_forward_length(arch.ffn_hidden_size)
    writer.add_head_count(arch.num_attention_heads)
    return writer


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


# --- weights compared after Adam steps -----------------------------------------------------------------
# Two runs that differ only in float rounding (another parallel layout, another CPU's kernels) cannot be
# held to a rounding-sized weight tolerance after Adam: its update lr * m_hat / (sqrt(v_hat) + eps) has a
# size set by lr, not by the gradient, so an element whose gradient is itself rounding noise (a sum that
# cancels) gets an update of up to lr * R_t either way. Such elements are rare; a lost or wrong moment
# moves every element that had a gradient. So: every element within the noise bound, and all but a small
# fraction within the rounding bound.

NOISE_GRADIENT_FRACTION = 0.01
"""The most elements of a tensor that may be off by more than rounding. A gradient near-cancels to its
rounding in ~1e-5 of the elements (measured: 1 of 1e5 weights beyond the rounding bound, reshard test on
an AVX2 EPYC); a wrong or lost moment moves every element with a gradient: all of a matrix, at least
the quarter of the embedding rows whose tokens a batch holds. 1% sits between the two by >10x each way."""

RESOLVED_GRADIENT = 1e-4
"""A gradient counts as resolved if the layouts round it alike to this relative size (a sum of n ~ 100
token terms rounds at ~ FP32_EPS * sqrt(n) ~ 1e-6 of its absolute terms: resolved unless it cancels ~100x)."""


def adam_ratio_bound(step: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The largest |m_hat| / sqrt(v_hat) at Adam step `step` (1-based) for any gradients: with the moments'
    weights a_i, b_i, Cauchy-Schwarz gives |sum a_i g_i| <= sqrt(sum a_i^2 / b_i) * sqrt(sum b_i g_i^2).
    1.0 at step 1, 1.01 at step 5, 1.05 at step 11."""
    a = [(1 - beta1) * beta1 ** (step - i) / (1 - beta1 ** step) for i in range(1, step + 1)]
    b = [(1 - beta2) * beta2 ** (step - i) / (1 - beta2 ** step) for i in range(1, step + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b)))


def adam_noise_bound(lrs, first_step: int = 1) -> float:
    """How far two runs' copies of one weight can drift over Adam steps at learning rates `lrs` (steps
    first_step, first_step + 1, ...) when its gradient is rounding noise: updates of opposite signs,
    2 * lr_t * R_t per step."""
    return sum(2 * lr * adam_ratio_bound(first_step + k) for k, lr in enumerate(lrs))


def _beyond_rounding(got: torch.Tensor, want: torch.Tensor, noise: float, steps: int):
    """|got - want| and the fraction of it beyond the rounding bound: a resolved gradient's relative
    rounding RESOLVED_GRADIENT moves m_hat / sqrt(v_hat) (degree 0 in the gradient) by at most that
    fraction of the noise bound, plus a weight ulp (FP32_EPS * max |w|) per step."""
    diff = (got.float() - want.float()).abs()
    atol = RESOLVED_GRADIENT * noise + steps * FP32_EPS * want.float().abs().max().item()
    return diff, (diff > atol).float().mean().item(), atol


def assert_close_after_adam(got: dict, want: dict, lrs, first_step: int = 1):
    """`got` and `want` (name -> tensor) end the same Adam steps at learning rates `lrs` up to float
    rounding: every element within adam_noise_bound, all but NOISE_GRADIENT_FRACTION of each tensor
    within the rounding bound."""
    noise = adam_noise_bound(lrs, first_step)
    for name, tensor in want.items():
        diff, beyond, atol = _beyond_rounding(got[name], tensor, noise, len(lrs))
        # At least one element may be a cancelled gradient: a tensor of 64 norm weights has no 1% to spare,
        # and one element of 64 is still far from the all-of-it a wrong moment moves.
        allowed = max(NOISE_GRADIENT_FRACTION, 1.0 / max(tensor.numel(), 1))
        assert diff.max().item() <= noise and beyond <= allowed, \
            f"{name}: max |difference| {diff.max().item():.3g} (noise bound {noise:.3g}), " \
            f"{beyond:.2%} of it beyond the rounding bound {atol:.3g} (at most {allowed:.2%})"


def fraction_beyond_rounding_after_adam(got: dict, want: dict, lrs, first_step: int = 1) -> float:
    """For negative controls: the largest fraction of a tensor's elements beyond assert_close_after_adam's
    rounding bound."""
    noise = adam_noise_bound(lrs, first_step)
    return max(_beyond_rounding(got[n], t, noise, len(lrs))[1] for n, t in want.items())
