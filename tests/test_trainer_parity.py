"""The imported SmolLM2 Megatron model equals HF transformers at TP=1, TP=3 and PP=2 (gloo processes),
and the HF -> Megatron -> HF round trip is bit-exact."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.checkpoints_tools.convert import convert
from megatron_rl.models.megatron_layout import (
    MegatronLayout,
    hf_to_megatron,
    megatron_to_hf,
)
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.placement.launch import run_distributed
from megatron_rl.types import TrainBatch


def _chat_batch(tokenizer, prompts):
    rows = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    length = max(map(len, rows))
    tokens = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row)
    return tokens, [len(r) for r in rows]


def _logits_worker(rank, world_size, checkpoint, tp, pp, tokens):
    from megatron_rl.trainer.config import ParallelConfig, TrainerConfig
    from megatron_rl.trainer.trainer import load_policy

    torch.set_num_threads(1)
    config = TrainerConfig(parallel=ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), micro_batch_size=4)
    trainer = load_policy(checkpoint, config)
    logits = trainer.compute_logits(TrainBatch(tokens=tokens, loss_mask=torch.zeros(tokens.shape)))
    return logits if rank == 0 else None


@pytest.fixture(scope="module")
def reference(smollm2, hf_smollm2, chat_prompts):
    tokens, lengths = _chat_batch(smollm2.tokenizer, chat_prompts)
    with torch.no_grad():
        logits = hf_smollm2(tokens[:, :-1]).logits.float()
    return tokens, lengths, logits


@pytest.mark.parametrize("tp,pp", [(1, 1), (3, 1), (1, 2)])
def test_megatron_logits_equal_transformers(tmp_path, smollm2, reference, tp, pp):
    tokens, lengths, expected = reference
    checkpoint = str(tmp_path / f"smollm2_tp{tp}_pp{pp}")
    convert(smollm2.source, checkpoint, to="megatron", tp=tp, pp=pp)
    logits = run_distributed(_logits_worker, tp * pp, checkpoint, tp, pp, tokens)[0]
    assert logits.shape == expected.shape
    worst = max((logits[i, :n - 1] - expected[i, :n - 1]).abs().max().item() for i, n in enumerate(lengths))
    assert worst <= 1e-3, f"max |logit difference| {worst} at TP={tp} PP={pp}"
    for i, n in enumerate(lengths):
        assert torch.equal(logits[i, :n - 1].argmax(-1), expected[i, :n - 1].argmax(-1))


def test_round_trip_tp3_pp2_is_bit_exact(smollm2):
    layout = MegatronLayout(smollm2.arch, tp=3, pp=2)
    back = megatron_to_hf(hf_to_megatron(smollm2.state, layout), layout)
    assert set(back) == set(smollm2.state)
    for name, tensor in smollm2.state.items():
        assert torch.equal(back[name], tensor), name


def test_round_trip_through_disk(tmp_path, smollm2):
    megatron_dir, hf_dir = str(tmp_path / "megatron"), str(tmp_path / "hf")
    convert(smollm2.source, megatron_dir, to="megatron", tp=3, pp=2)
    convert(megatron_dir, hf_dir, to="hf")
    back = load_pretrained(hf_dir)
    assert back.arch == smollm2.arch
    for name, tensor in smollm2.state.items():
        assert torch.equal(back.state[name], tensor), name
    text = "Hello world, 123 + 456!"
    assert back.tokenizer.encode(text) == smollm2.tokenizer.encode(text)
    assert back.tokenizer.chat_template == smollm2.tokenizer.chat_template


def test_exported_hf_dir_loads_in_transformers(tmp_path, smollm2, hf_smollm2, reference):
    transformers = pytest.importorskip("transformers")
    hf_dir = str(tmp_path / "hf")
    convert(smollm2.source, hf_dir, to="hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens, lengths, expected = reference
    with torch.no_grad():
        logits = model(tokens[:2, :-1]).logits
    assert (logits[0, :lengths[0] - 1] - expected[0, :lengths[0] - 1]).abs().max() <= 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    messages = [{"role": "user", "content": "What is 17 + 25?"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        smollm2.tokenizer.render_chat(messages)


def test_trainer_recomputes_the_engine_logprobs_of_a_rollout(smollm2, chat_prompts):
    """Identical weights (fp32, CPU): the Megatron trainer's log-probs of sampled responses equal the
    native engine's behaviour log-probs within 1e-4, which is what train/logprob_mismatch reports."""
    from megatron_rl.algorithms.config import AdvantageConfig
    from megatron_rl.controller.batching import build_step_batch
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer
    from tests.helpers import sampled_groups

    tokenizer = smollm2.tokenizer
    groups = sampled_groups(smollm2, chat_prompts[:4], samples=2, max_new_tokens=16)
    step = build_step_batch(groups, advantage=AdvantageConfig(), trainer_version=0, micro_batch_size=4,
                            pad_token_id=tokenizer.pad_token_id, drop_uninformative=False)
    trainer = MegatronTrainer(smollm2.arch, TrainerConfig(micro_batch_size=4), hf_state=smollm2.state)
    logprobs = trainer.compute_logprobs(step.batch)
    mask = step.batch.loss_mask.bool()
    gap = (logprobs[mask] - step.batch.behaviour_logprobs[mask]).abs()
    assert mask.sum() >= 8 * 4  # a real amount of sampled tokens
    assert gap.max().item() < 1e-4, gap.max().item()
