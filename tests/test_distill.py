"""On-policy distillation: the per-token advantage is coef * (log pi_teacher - log mu) (+ rl_coef * the
reward's), with the teacher's log-probs equal to transformers' forward of the teacher, whether the teacher
runs on the policy's ranks or behind `megatron-rl serve`'s OpenAI API; a short run lowers the student's
reverse KL to the teacher."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_rl.checkpoints_tools.convert import save_hf
from megatron_rl.config import ConfigError, load_yaml
from megatron_rl.controller.loop import train
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.run_config import RunConfig
from tests.helpers import sampled_groups, tiny_state
from tests.test_loop import QUICKSTART, _config


@pytest.fixture(scope="module")
def teacher_model(smollm2, tmp_path_factory):
    """A tiny Llama with peaked next-token distributions (random, larger weights) and SmolLM2's tokenizer,
    wider than the student (another architecture: the teacher may be larger)."""
    arch = ModelArch(vocab_size=smollm2.arch.vocab_size, num_layers=2, hidden_size=96, ffn_hidden_size=192,
                     num_attention_heads=4, num_query_groups=2, rope_theta=10000.0, tie_word_embeddings=True,
                     max_position_embeddings=512)
    path = str(tmp_path_factory.mktemp("teacher") / "hf")
    save_hf(path, arch, tiny_state(arch, seed=11, scale=3.0), smollm2.tokenizer)
    return path


@pytest.fixture(scope="module")
def perturbed_student(tiny_chat_model, tmp_path_factory):
    """The student with noise (std 0.05) added to every matrix: a teacher the student can reach by moving its
    weights (its reverse KL to the student is ~0.2 nats per token)."""
    student = load_pretrained(tiny_chat_model)
    g = torch.Generator().manual_seed(5)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in student.state.items()}
    path = str(tmp_path_factory.mktemp("perturbed") / "hf")
    save_hf(path, student.arch, state, student.tokenizer)
    return path


def _hf_logprobs(model_path: str, tokens: torch.Tensor) -> torch.Tensor:
    """Token-aligned log p(tokens[:, t] | tokens[:, :t]) from transformers (column 0: 0)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(tokens).logits.float()
    picked = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(tokens.shape[0], 1), picked], dim=1)


def _objective(student_path, teacher, *extra):
    from megatron_rl.controller.objectives import make_objective
    from megatron_rl.trainer.trainer import load_policy

    config = _config(student_path, "/tmp/unused-run", "algorithm.objective=distill", f"algorithm.distill.teacher={teacher}",
                     *extra)
    model = load_pretrained(student_path)
    policy = load_policy(student_path, config.trainer, pretrained=model)
    return make_objective(config, model.tokenizer, model, policy=policy), model


def test_the_distillation_advantage_is_the_teachers_log_ratio(tiny_chat_model, teacher_model, chat_prompts):
    objective, student = _objective(tiny_chat_model, teacher_model, "algorithm.distill.coef=0.5",
                                    "algorithm.distill.rl_coef=2.0", "algorithm.advantage.scale_by_std=false",
                                    "algorithm.distill.baseline=false")
    groups = sampled_groups(student, chat_prompts[:3], samples=2, max_new_tokens=6)
    step, loss_fn = objective.prepare_step(groups, trainer_version=0)
    batch = step.batch
    m = batch.loss_mask != 0
    teacher = _hf_logprobs(teacher_model, batch.tokens)
    # the sampled groups are rewarded 0 and 1: Dr.GRPO's advantages are -0.5 and +0.5 on every token
    rewards = torch.zeros_like(batch.advantages)
    for r in range(batch.tokens.shape[0]):
        if m[r].any():
            match = [s for g in groups for s in g.samples
                     if s.completion.prompt_ids + s.completion.output_ids == batch.tokens[r][:int(m[r].nonzero().max()) + 1].tolist()]
            rewards[r] = (match[0].reward.reward - 0.5) * m[r]
    expected = 0.5 * (teacher - batch.behaviour_logprobs) * m + 2.0 * rewards
    torch.testing.assert_close(batch.advantages[m], expected[m], rtol=1e-4, atol=2e-4)
    assert step.metrics["distill/reverse_kl"] == pytest.approx(float((batch.behaviour_logprobs - teacher)[m].mean()),
                                                               rel=1e-3)
    assert loss_fn is not None


def test_a_served_teacher_scores_like_the_local_one(tiny_chat_model, teacher_model, chat_prompts):
    from megatron_rl.rollout.client import PromptLogprobScorer
    from megatron_rl.rollout.config import NativeEngineConfig
    from megatron_rl.rollout.native import NativeEngine
    from megatron_rl.rollout.server import RolloutServer

    teacher = load_pretrained(teacher_model)
    engine = NativeEngine(teacher.arch, teacher.state, tokenizer=teacher.tokenizer,
                          config=NativeEngineConfig(max_batch_size=4, max_seq_len=256))
    server = RolloutServer(engine, port=0, model_name="teacher")
    server.start()
    try:
        sequences = [teacher.tokenizer.encode_chat([{"role": "user", "content": p}]) + [42, 43, 44]
                     for p in chat_prompts[:3]]
        scorer = PromptLogprobScorer(server.url + "/v1", model="teacher")
        scored = scorer.score(sequences)
        scorer.close()
    finally:
        server.shutdown()
        engine.close()
    for ids, values in zip(sequences, scored):
        reference = _hf_logprobs(teacher_model, torch.tensor([ids]))[0]
        torch.testing.assert_close(torch.tensor(values), reference, rtol=1e-4, atol=2e-4)


def test_a_short_distillation_run_lowers_the_reverse_kl(tmp_path, tiny_chat_model, perturbed_student):
    """Ten steps of 512 sampled tokens: the student's reverse KL to the teacher falls well below that of the
    same run with a zero learning rate (the control: the same samples' KL without any learning)."""
    kl = {}
    for lr in ("1e-3", "0"):
        run_dir = str(tmp_path / f"lr{lr}")
        train(_config(tiny_chat_model, run_dir, "algorithm.objective=distill",
                      f"algorithm.distill.teacher={perturbed_student}", "algorithm.loss.name=aipo", "steps=10",
                      f"trainer.lr={lr}", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=8",
                      "rollout.max_new_tokens=16", "checkpoint.every_steps=0", "eval.before_training=false",
                      "eval.after_training=false"))
        kl[lr] = [json.loads(line)["distill/reverse_kl"] for line in open(os.path.join(run_dir, "metrics.jsonl"))
                  if "distill/reverse_kl" in line]
    assert len(kl["1e-3"]) == 10 and min(kl["0"]) > 0
    learned, control = sum(kl["1e-3"][-5:]) / 5, sum(kl["0"][-5:]) / 5
    assert learned < 0.75 * control, kl


def test_distillation_needs_a_teacher_and_bounded_weights():
    with pytest.raises(ConfigError, match="field 'algorithm.distill.teacher': objective distill needs a teacher"):
        load_yaml(RunConfig, QUICKSTART, ["algorithm.objective=distill"])
    for override, field in (("algorithm.distill.coef=-1", "coef"), ("algorithm.distill.rl_coef=2000", "rl_coef"),
                            ("algorithm.distill.timeout_s=0", "timeout_s")):
        with pytest.raises(ConfigError, match=f"field 'algorithm.distill.{field}'"):
            load_yaml(RunConfig, QUICKSTART, ["algorithm.objective=distill", "algorithm.distill.teacher=x", override])
