"""`megatron-rl bench trainer`: Megatron trainer forward+backward+Adam tokens/s against HF transformers'
model on the same SmolLM2 batch, in one process (8 x 256 tokens)."""
from __future__ import annotations

import time

import torch

from megatron_rl.models import families
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.trainer.config import TrainerConfig
from megatron_rl.trainer.trainer import MegatronTrainer
from megatron_rl.types import TrainBatch


def _timed(step, steps: int) -> float:
    step()  # warm-up: allocator, autograd graph caches, optimizer state
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def bench_trainer(options: dict) -> dict:
    rows, length = int(options.get("batch", 8)), int(options.get("seq", 256))
    steps = int(options.get("steps", 2))
    threads = int(options.get("threads", 2))
    torch.set_num_threads(threads)
    model = load_pretrained(str(options.get("model", "smollm2-135m")))
    tokens = torch.randint(0, model.arch.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))
    batch = TrainBatch(tokens=tokens, loss_mask=torch.ones(rows, length).index_fill_(1, torch.tensor([0]), 0.0))
    normalizer = batch.loss_mask.sum()
    lr = 1e-6
    results = {}

    trainer = MegatronTrainer(model.arch, TrainerConfig(micro_batch_size=rows, lr=lr, clip_grad=1.0),
                              hf_state=model.state)
    lm_loss = lambda logprobs, mb, entropy: (-(logprobs * mb.loss_mask).sum() / normalizer, {})  # noqa: E731
    results["megatron_step_s"] = _timed(lambda: trainer.train_step(batch, lm_loss), steps)
    del trainer

    import transformers  # the baseline only (dev extra), never the library's code path

    config = transformers.LlamaConfig(**{k: v for k, v in families.to_hf_config(model.arch).items()
                                         if k not in ("architectures", "model_type", "torch_dtype")})
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(model.state, strict=False)
    hf.train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.0)

    def hf_step():
        optimizer.zero_grad(set_to_none=True)
        logits = hf(tokens[:, :-1]).logits.float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
        loss = -(logprobs * batch.loss_mask[:, 1:]).sum() / normalizer
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimizer.step()

    results["hf_step_s"] = _timed(hf_step, steps)
    tokens_per_step = rows * length
    ours, theirs = tokens_per_step / results["megatron_step_s"], tokens_per_step / results["hf_step_s"]
    print(f"megatron trainer: {results['megatron_step_s']:.2f} s/step = {ours:.0f} tok/s; "
          f"HF transformers: {results['hf_step_s']:.2f} s/step = {theirs:.0f} tok/s "
          f"({rows} x {length} tokens, fwd+bwd+Adam, fp32, {threads} threads)")
    return {"ratio": round(ours / theirs, 3), "tokens_per_s": round(ours, 1), "hf_tokens_per_s": round(theirs, 1),
            "batch": rows, "seq": length, "threads": threads,
            "megatron_step_s": round(results["megatron_step_s"], 3), "hf_step_s": round(results["hf_step_s"], 3)}
