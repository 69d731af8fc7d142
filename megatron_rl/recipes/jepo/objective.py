"""The JEPO and SFT objectives (controller/objectives.py): scored groups -> rows x + c_i + a* -> loss.

JEPO (algorithms/jepo.py) needs l_i = log pi(a* | x, c_i) of all n samples of a prompt to form its
advantages. Rows are laid out group by group and `trainer.micro_batch_size` must be a multiple of n,
so every micro-batch holds whole groups: ONE forward pass of the rows x + c_i + a* gives both the
c_i log-probs (policy-gradient term, `loss_mask`) and the a* log-probs (the bound, `answer_mask`);
there is no separate scoring pass. With a KL term (`algorithm.loss.kl_coef > 0`) a frozen copy of the
starting weights supplies the reference log-probs (one extra forward, no backward).

References are checked once, before training: a prompt without a reference, or whose reference is
longer than `max_reference_tokens` or does not fit the context with the prompt and max_new_tokens,
is an error naming the prompt and its source row, or (on_bad_reference: skip) dropped and counted.
"""
from __future__ import annotations

import logging

import torch

from megatron_rl.algorithms.advantages import compute_advantages
from megatron_rl.algorithms.jepo import (
    JepoTrainBatch,
    make_jepo_loss_fn,
    make_sft_loss_fn,
)
from megatron_rl.config import require
from megatron_rl.controller.batching import StepBatch, rollout_metrics
from megatron_rl.controller.objectives import frozen_reference, reference_logprobs
from megatron_rl.data.prompts import DataError, PromptDataset
from megatron_rl.recipes.jepo.likelihood import cut_at_marker, reference_ids
from megatron_rl.types import TrainBatch

log = logging.getLogger(__name__)


def _where(prompt) -> str:
    meta = prompt.metadata or {}
    if meta.get("source"):
        return f"{meta['source']}: row {meta.get('row')} (prompt {prompt.prompt_id})"
    return f"prompt {prompt.prompt_id}"


class _ReferenceObjective:
    """What JEPO and SFT share: the reference budget check and reference tokenisation."""

    def __init__(self, config, tokenizer, model, policy=None):
        self.config = config
        self.jepo = config.algorithm.jepo
        self.tokenizer = tokenizer
        context = model.arch.max_position_embeddings
        if config.engine.max_seq_len:
            context = min(context, config.engine.max_seq_len)
        self.context = context
        self.skipped: dict[str, int] = {}
        self._reference_cache: dict[str, list[int]] = {}

    def reference(self, prompt) -> list[int]:
        ids = self._reference_cache.get(prompt.prompt_id)
        if ids is None:
            ids = reference_ids(self.tokenizer, prompt.answer, end_of_turn=self.jepo.score_end_of_turn)
            self._reference_cache[prompt.prompt_id] = ids
        return ids

    def _problem(self, prompt) -> str | None:
        if not prompt.answer or not str(prompt.answer).strip():
            return "has no reference answer"
        ref = len(self.reference(prompt))
        if ref > self.jepo.max_reference_tokens:
            return (f"reference is {ref} tokens, over algorithm.jepo.max_reference_tokens="
                    f"{self.jepo.max_reference_tokens}")
        need = len(self.tokenizer.encode_chat(prompt.messages)) + self.config.rollout.max_new_tokens + ref
        if need > self.context:
            return (f"prompt + rollout.max_new_tokens + reference = {need} tokens, over the context of "
                    f"{self.context} tokens")
        return None

    def filter_prompts(self, dataset: PromptDataset, split: str) -> PromptDataset:
        """The prompts whose reference fits the budget (the others: error or counted skip, as configured)."""
        kept, skipped = [], 0
        for prompt in dataset:
            problem = self._problem(prompt)
            if problem is None:
                kept.append(prompt)
            elif self.jepo.on_bad_reference == "error":
                raise DataError(f"{_where(prompt)}: {problem} (algorithm.jepo.on_bad_reference: skip drops "
                                f"such prompts and counts them)")
            else:
                skipped += 1
        self.skipped[split] = skipped
        if skipped:
            log.warning(f"{split}: skipped {skipped} of {len(dataset)} prompts without a usable reference "
                        f"(algorithm.jepo.on_bad_reference: skip)")
        if not kept and split == "train":
            raise DataError(f"training source {dataset.name}: no prompt has a usable reference "
                            f"({skipped} skipped)")
        return PromptDataset(dataset.name, kept, {**dataset.stats, "bad_reference_skipped": skipped})

    def prepare_data(self, train, heldout):
        return self.filter_prompts(train, "train"), self.filter_prompts(heldout, "heldout")

    def _metrics(self, groups, trainer_version: int, rows: int) -> dict[str, float]:
        rewards = torch.tensor([s.reward.reward for g in groups for s in g.samples if s.reward.ok],
                               dtype=torch.float64)
        metrics = rollout_metrics(groups, rewards, torch.zeros(0), trainer_version, rows)
        metrics["rollout/bad_reference_skipped"] = float(sum(self.skipped.values()))
        return metrics


class JepoObjective(_ReferenceObjective):
    """JEPO, combined (verifier where a sample is verified correct, JEPO elsewhere) and verifier-only."""

    def __init__(self, config, tokenizer, model, policy=None):
        super().__init__(config, tokenizer, model)
        n = config.rollout.samples_per_prompt
        self.n = n
        require(config.trainer.micro_batch_size % n == 0, "trainer.micro_batch_size",
                f"must be a multiple of rollout.samples_per_prompt={n}: JEPO's advantages need every sample "
                f"of a prompt in the same micro-batch")
        require(not config.trainer.max_tokens_per_micro_batch, "trainer.max_tokens_per_micro_batch",
                "JEPO's advantages need every sample of a prompt in the same micro-batch; token-budget "
                "micro-batches split groups (use sequence_packing with micro_batch_size instead)")
        require(not self.jepo.normalize_advantages or n >= 2, "algorithm.jepo.normalize_advantages",
                "needs rollout.samples_per_prompt >= 2 (the std of one advantage is undefined)")
        if self.jepo.mode != "jepo":
            require(self.jepo.answer_marker not in config.rollout.stop, "rollout.stop",
                    f"must not stop at the answer marker in mode {self.jepo.mode!r}: the verifier needs the "
                    f"model's own answer after it")
        self.marker_ids = tokenizer.encode(" " + self.jepo.answer_marker)
        self.reference_model = frozen_reference(config, model, policy)

    def prepare_step(self, groups, trainer_version):
        cfg, jepo, n = self.config, self.jepo, self.n
        tok = self.tokenizer
        verified = [jepo.mode == "verifier" or (jepo.mode == "combined" and any(bool(s.reward.correct)
                                                                                 for s in g.samples))
                    for g in groups]
        verifier_adv: dict[int, torch.Tensor] = {}
        if any(verified):
            rewards = torch.tensor([[s.reward.reward if s.reward.ok else 0.0 for s in g.samples]
                                    for g, v in zip(groups, verified) if v], dtype=torch.float64)
            adv = compute_advantages(rewards, None, cfg.algorithm.advantage).float()
            for k, gi in enumerate(i for i, v in enumerate(verified) if v):
                verifier_adv[gi] = adv[k]

        rows = []  # (tokens, pg span, answer span, behaviour log-probs, advantage, verifier row)
        marker_found = 0
        for gi, group in enumerate(groups):
            if len(group.samples) != n:
                raise ValueError(f"group of prompt {group.prompt.prompt_id} has {len(group.samples)} samples, "
                                 f"expected rollout.samples_per_prompt={n}")
            ref = self.reference(group.prompt)
            for si, sample in enumerate(group.samples):
                c = sample.completion
                prompt_ids = list(c.prompt_ids)
                if verified[gi]:
                    body, answer = list(c.output_ids), []
                    adv = float(verifier_adv[gi][si])
                else:
                    body, found = cut_at_marker(tok, c.output_ids, jepo.answer_marker)
                    marker_found += int(found)
                    answer = ref if found else []
                    adv = 0.0
                context = []  # tokens between c and a* that are neither trained on nor scored
                if not verified[gi] and not found and jepo.missing_marker == "append":
                    while body and body[-1] == tok.eos_token_id:
                        body = body[:-1]
                    context, answer = self.marker_ids, ref
                behaviour = list(c.output_logprobs[:len(body)])
                a0 = len(prompt_ids) + len(body) + len(context)
                rows.append((prompt_ids + body + context + answer, (len(prompt_ids), len(prompt_ids) + len(body)),
                             (a0, a0 + len(answer)), behaviour, adv, verified[gi]))

        micro = cfg.trainer.micro_batch_size
        padded = -(-len(rows) // micro) * micro
        width = max(len(r[0]) for r in rows)
        tokens = torch.full((padded, width), tok.pad_token_id, dtype=torch.long)
        loss_mask, answer_mask = torch.zeros(padded, width), torch.zeros(padded, width)
        behaviour_lp, advantages = torch.zeros(padded, width), torch.zeros(padded, width)
        verifier_rows = torch.zeros(padded, dtype=torch.bool)
        for r, (ids, (c0, c1), (a0, a1), behaviour, adv, is_verifier) in enumerate(rows):
            tokens[r, :len(ids)] = torch.tensor(ids)
            loss_mask[r, c0:c1] = 1.0
            answer_mask[r, a0:a1] = 1.0
            behaviour_lp[r, c0:c1] = torch.tensor(behaviour, dtype=torch.float32)
            advantages[r, c0:c1] = adv
            verifier_rows[r] = is_verifier
        batch = JepoTrainBatch(tokens=tokens, loss_mask=loss_mask, advantages=advantages,
                               behaviour_logprobs=behaviour_lp, answer_mask=answer_mask,
                               verifier_rows=verifier_rows, group_size=n)
        if cfg.algorithm.loss.kl_coef > 0:
            batch.reference_logprobs = reference_logprobs(self.reference_model, TrainBatch(tokens=tokens,
                                                                                           loss_mask=loss_mask))
        metrics = self._metrics(groups, trainer_version, len(rows))
        jepo_rows = sum(n for v in verified if not v)
        metrics["rollout/marker_fraction"] = marker_found / max(jepo_rows, 1)
        metrics["rollout/verifier_groups"] = float(sum(verified))
        metrics["rollout/reference_tokens_mean"] = sum(len(self.reference(g.prompt)) for g in groups) / len(groups)
        return StepBatch(batch, loss_mask, metrics), make_jepo_loss_fn(jepo, cfg.algorithm.loss, float(len(rows)))


class SftObjective(_ReferenceObjective):
    """Supervised fine-tuning baseline on the same prompts and references: NLL of a* given x (rows
    x + ' ' + a*, the reference scored as JEPO scores it). The step's generated samples are not used
    (a recipe sets rollout.samples_per_prompt: 1 and a small max_new_tokens to keep their cost low)."""

    def prepare_step(self, groups, trainer_version):
        tok = self.tokenizer
        rows = []
        for group in groups:
            prompt_ids = tok.encode_chat(group.prompt.messages)
            ref = self.reference(group.prompt)
            rows.append((prompt_ids + ref, len(ref)))
        micro = self.config.trainer.micro_batch_size
        padded = -(-len(rows) // micro) * micro
        width = max(len(ids) for ids, _ in rows)
        tokens = torch.full((padded, width), tok.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros(padded, width)
        for r, (ids, k) in enumerate(rows):
            tokens[r, :len(ids)] = torch.tensor(ids)
            loss_mask[r, len(ids) - k:len(ids)] = 1.0
        batch = TrainBatch(tokens=tokens, loss_mask=loss_mask)
        return StepBatch(batch, loss_mask, self._metrics(groups, trainer_version, len(rows))), \
            make_sft_loss_fn(float(len(rows)))
