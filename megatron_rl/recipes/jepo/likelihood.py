"""Likelihood of reference answers under the policy: the pieces JEPO trains on and the held-out metric.

    c_ids, found = cut_at_marker(tokenizer, output_ids, marker)   # chain of thought up to the marker
    a_ids = reference_ids(tokenizer, prompt.answer)               # " " + a* (+ end-of-turn), teacher-forced
    row   = prompt_ids + c_ids + a_ids                            # l = sum of log pi over a_ids

`evaluate_likelihood` is the held-out proxy NLL of JEPO (arXiv 2503.19618): for each prompt, n chains
of thought are sampled from the policy up to the answer marker, the reference a* is scored after each,
and -log (1/n) sum_i pi(a* | x, c_i) (the n-sample bound of log pi(a* | x), negated) is averaged over
prompts. A sample that never wrote the marker gets the marker appended (so every prompt is scored
from n samples); the fraction that wrote it is reported as `marker_fraction`.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from megatron_rl.algorithms.jepo import proxy_nll
from megatron_rl.ranks import broadcast_records
from megatron_rl.recipes.jepo.config import LikelihoodEvalConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.types import TrainBatch


def cut_at_marker(tokenizer, output_ids: Sequence[int], marker: str) -> tuple[list[int], bool]:
    """(the shortest prefix of `output_ids` whose text contains `marker`, True), or (all ids, False).
    The token that completes the marker is kept (it may carry a few characters after it)."""
    ids = list(output_ids)
    if marker not in tokenizer.decode(ids):
        return ids, False
    lo, hi = 1, len(ids)  # containment is monotone in the prefix length: binary search the first
    while lo < hi:
        mid = (lo + hi) // 2
        if marker in tokenizer.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo], True


def reference_ids(tokenizer, reference: str, *, end_of_turn: bool = True) -> list[int]:
    """Token ids of the reference as it follows the marker: ' ' + a*, then the end-of-turn token."""
    ids = tokenizer.encode(" " + reference.strip())
    if end_of_turn:
        ids.append(tokenizer.eos_token_id)
    return ids


def _strip_stop(tokenizer, ids: list[int]) -> list[int]:
    while ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return ids


def score_rows(scorer, rows: list[tuple[list[int], int]], *, pad_token_id: int, micro_batch_rows: int) -> list[float]:
    """Sum of log pi over the last `k` tokens of each row (row ids, k), with `scorer.compute_logprobs`."""
    out: list[float] = []
    for start in range(0, len(rows), micro_batch_rows):
        chunk = rows[start:start + micro_batch_rows]
        width = max(len(ids) for ids, _ in chunk)
        tokens = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), width)
        for r, (ids, k) in enumerate(chunk):
            tokens[r, :len(ids)] = torch.tensor(ids)
            mask[r, len(ids) - k:len(ids)] = 1.0
        logprobs = scorer.compute_logprobs(TrainBatch(tokens=tokens, loss_mask=mask))
        out.extend((logprobs.double() * mask).sum(-1).tolist())
    return out


def evaluate_likelihood(engine, scorer, tokenizer, prompts, config: LikelihoodEvalConfig, *, seed: int,
                        progress: bool = False) -> dict[str, float]:
    """Held-out proxy NLL of the references with the n-sample bound (module docstring).

    `scorer` has `compute_logprobs(TrainBatch) -> [B, S]` (the trainer, or any model wrapper);
    `engine` samples the chains of thought. Prompts without a reference are an error. With several
    trainer ranks every rank calls this: the driver (rank 0) with the engine and the prompts, the others
    with engine=None; the rows are broadcast, every rank scores them (the trainer's forward is a
    collective), and the driver returns the metrics ({} elsewhere)."""
    sampled = _sample_reference_rows(engine, tokenizer, prompts, config, seed) if engine is not None else None
    rows, ref_tokens, found_count = broadcast_records(sampled)
    scores = score_rows(scorer, rows, pad_token_id=tokenizer.pad_token_id, micro_batch_rows=config.micro_batch_rows)
    if engine is None:
        return {}
    n = config.samples
    l = torch.tensor(scores, dtype=torch.float64).view(len(prompts), n)
    nll = proxy_nll(l, torch.ones_like(l, dtype=torch.bool))
    total_tokens = sum(ref_tokens)
    return {"nll_bound": float(nll.mean()) if len(prompts) else math.nan,
            "nll_bound_per_token": float(nll.sum()) / max(total_tokens, 1),
            "nll_jensen": float(-l.mean()) if len(prompts) else math.nan,
            "marker_fraction": found_count / max(len(rows), 1),
            "likelihood_prompts": float(len(prompts)), "likelihood_samples": float(n)}


def _sample_reference_rows(engine, tokenizer, prompts, config: LikelihoodEvalConfig, seed: int):
    """n chains of thought per prompt from `engine`, each followed by the prompt's reference: (rows of
    (token ids, reference length), reference lengths per prompt, chains that had the answer marker)."""
    missing = [p.prompt_id for p in prompts if not p.answer]
    if missing:
        raise ValueError(f"likelihood evaluation needs a reference answer for every prompt; missing for "
                         f"{len(missing)} prompts, e.g. {missing[:3]}")
    n = config.samples
    def sampling(index: int) -> SamplingParams:  # seeded per prompt: before/after comparisons are paired
        return SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature, n=n,
                              seed=(seed * 7919 + index) % 2 ** 31, stop=[config.answer_marker])

    requests = [GenerateRequest(request_id=f"lik-{i}-{p.prompt_id}", prompt_ids=tokenizer.encode_chat(p.messages),
                                sampling=sampling(i), group_id=p.prompt_id) for i, p in enumerate(prompts)]
    completions = engine.wait(engine.submit(requests))
    marker_ids = tokenizer.encode(" " + config.answer_marker)
    rows, ref_tokens, found_count = [], [], 0
    for index, prompt in enumerate(prompts):
        ref = reference_ids(tokenizer, prompt.answer, end_of_turn=config.score_end_of_turn)
        ref_tokens.append(len(ref))
        for completion in completions[index * n:(index + 1) * n]:
            c_ids, found = cut_at_marker(tokenizer, completion.output_ids, config.answer_marker)
            found_count += int(found)
            if not found:
                c_ids = _strip_stop(tokenizer, c_ids) + marker_ids
            rows.append((list(completion.prompt_ids) + c_ids + ref, len(ref)))
    return rows, ref_tokens, found_count


def likelihood_metric(engine, policy, tokenizer, prompts, run_config) -> dict[str, float]:
    """`eval.metrics: [likelihood]` (controller/evaluate.py's EVAL_METRICS): the held-out proxy NLL of the
    references with the run's trained policy as the scorer."""
    return evaluate_likelihood(engine, policy, tokenizer, prompts, run_config.eval.likelihood, seed=run_config.seed)
