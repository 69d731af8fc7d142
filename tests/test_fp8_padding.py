"""FP8 token alignment (controller/batching.py FP8_TOKEN_MULTIPLE, TrainBatch.token_multiple): every
micro-batch the trainer runs has a token count Transformer Engine's FP8 GEMMs accept, and the padding
changes neither the loss nor any gradient (reference: the same tiny HF Llama on the unpadded rows)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.config import LossConfig
from megatron_rl.algorithms.losses import compute_normalizer, make_loss_fn
from megatron_rl.controller.batching import FP8_TOKEN_MULTIPLE
from megatron_rl.types import TrainBatch

transformers = pytest.importorskip("transformers")


def _batch(lengths: list[int], prompt: int, token_multiple: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    width = max(lengths)
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width)
    for r, n in enumerate(lengths):
        tokens[r, :n] = torch.randint(1, 64, (n,), generator=g)
        mask[r, prompt:n] = 1.0
    advantages = torch.randn(len(lengths), 1, generator=g) * mask
    behaviour = -torch.rand(len(lengths), width, generator=g) * mask
    return TrainBatch(tokens=tokens, loss_mask=mask, advantages=advantages, behaviour_logprobs=behaviour,
                      token_multiple=token_multiple)


def _model():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _loss_and_grads(model, micro_batches: list[TrainBatch], loss_fn):
    model.zero_grad()
    total = torch.zeros(())
    for mb in micro_batches:
        logits = model(input_ids=mb.tokens).logits.float()
        logprobs = torch.zeros(mb.tokens.shape)
        logprobs[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, mb.tokens[:, 1:, None])[..., 0]
        loss, _ = loss_fn(logprobs, mb)
        loss.backward()
        total = total + loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_name", ["pg", "ppo_clip"])
def test_fp8_padding_aligns_every_micro_batch_and_changes_nothing(loss_name):
    lengths = [13, 7, 21, 5]  # micro_batch_size 1, as the cluster recipes: 13 x 1 tokens is not FP8-able
    plain = _batch(lengths, prompt=3, token_multiple=1)
    aligned = _batch(lengths, prompt=3, token_multiple=FP8_TOKEN_MULTIPLE).token_aligned()
    assert aligned.seq_length % FP8_TOKEN_MULTIPLE == 0 and aligned.seq_length > plain.seq_length
    config = LossConfig(name=loss_name)
    loss_fn = make_loss_fn(config, compute_normalizer(plain.loss_mask, config))
    model = _model()
    reference = _loss_and_grads(model, [mb.trimmed() for mb in plain.micro_batches(1)], loss_fn)
    micro = [mb.trimmed() for mb in aligned.micro_batches(1)]
    # TE asserts prod(leading dims) % 8 == 0 and, for the transposed weight-gradient input, % 16 == 0
    assert all(mb.tokens.numel() % FP8_TOKEN_MULTIPLE == 0 for mb in micro)
    assert [mb.seq_length for mb in micro] == [16, 16, 32, 16]
    assert all(float(mb.loss_mask[:, n:].sum()) == 0.0 for mb, n in zip(micro, lengths))
    padded = _loss_and_grads(model, micro, loss_fn)
    torch.testing.assert_close(padded[0], reference[0], rtol=1e-5, atol=1e-6)
    assert padded[1].keys() == reference[1].keys()
    for name in reference[1]:
        torch.testing.assert_close(padded[1][name], reference[1][name], rtol=1e-4, atol=1e-6, msg=name)
