"""The native engine's column of the parity matrix: greedy tokens and log-probs against transformers.

    engine_parity(hf_model, arch, state, *, prompts=None, max_new_tokens=64) -> (greedy_equal, max_logprob_diff)

`hf_model` is a transformers causal LM (fp32, eval mode) holding the same weights as `state` (HF names),
`arch` the `ModelArch` both describe. Every prompt (random token ids when `prompts` is None) is decoded
greedily for `max_new_tokens` tokens, with no stop token, by the engine (all prompts in one continuous
batch) and by `hf_model.generate(do_sample=False)` one prompt at a time. `greedy_equal`: every engine
continuation equals transformers'. `max_logprob_diff`: the largest |engine log-prob - transformers
log-prob| of the engine's sampled tokens, transformers' taken from the logits `generate` computed at each
step (its KV-cache path), so it compares like with like for every rope type, "dynamic" included.

Dynamic RoPE: transformers recomputes the frequencies in each forward from that forward's longest
position (`dynamic_rope_update`), and its rotary module keeps the longest length seen across calls. One
`generate` on a fresh module therefore rotates prompt tokens with the frequencies for
max(prompt length, max_position_embeddings) and the token at position p of the answer with those for
max(p + 1, max_position_embeddings): the engine does exactly this per sequence. Before each
`generate` this function runs a one-token forward, which resets transformers' module to that state.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from megatron_rl.models.arch import ModelArch
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native.engine import NativeEngine


def default_prompts(arch: ModelArch, lengths: Sequence[int] = (5, 13, 32), seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths over the model's vocabulary (reproducible)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, arch.vocab_size, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def hf_greedy(hf_model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of `prompt` (no stop token) and its fp32 logits per step."""
    hf_model(torch.tensor([[prompt[0]]]))  # resets a dynamic rotary module to its initial length
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                            min_new_tokens=0, eos_token_id=None, pad_token_id=0, output_logits=True,
                            return_dict_in_generate=True, use_cache=True)
    logits = torch.stack([step[0] for step in out.logits]).float()
    return out.sequences[0, len(prompt):].tolist(), logits


def engine_parity(hf_model: Any, arch: ModelArch, state: dict[str, torch.Tensor], *,
                  prompts: Sequence[Sequence[int]] | None = None, max_new_tokens: int = 64,
                  config: NativeEngineConfig | None = None) -> tuple[bool, float]:
    """(greedy_equal, max_logprob_diff) of the native engine against `hf_model` (module docstring)."""
    prompts = [list(map(int, p)) for p in (prompts if prompts is not None else default_prompts(arch))]
    longest = max(len(p) for p in prompts) + max_new_tokens
    config = config or NativeEngineConfig(max_batch_size=len(prompts), max_seq_len=longest, dtype="fp32",
                                          device="cpu")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    with NativeEngine(arch, state, config=config, eos_token_ids=[]) as engine:
        outs = engine.generate([GenerateRequest(f"p{i}", p, greedy) for i, p in enumerate(prompts)])
    equal, worst = True, 0.0
    for prompt, out in zip(prompts, outs):
        hf_ids, logits = hf_greedy(hf_model, prompt, max_new_tokens)
        equal = equal and out.output_ids == hf_ids
        steps = min(len(out.output_ids), logits.shape[0])
        ref = torch.log_softmax(logits[:steps], -1).gather(1, torch.tensor(out.output_ids[:steps])[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(out.output_logprobs[:steps])).abs().max().item())
    return equal, worst
