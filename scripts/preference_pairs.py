"""Preference pairs graded by a task's own checker, for `objective: reward_model` (docs/reward_models.md):
sample the recipe's policy on its prompts, score every answer with the recipe's reward, and pair a right
answer with a wrong one of the same prompt. Training prompts make the training pairs, the recipe's held-out
prompts the held-out pairs, so the reward model is measured on questions it never saw.

    .venv/bin/python scripts/preference_pairs.py examples/configs/quickstart.yaml --out runs/rm_pairs \\
        --prompts 256 --samples 8 --pairs-per-prompt 2
writes runs/rm_pairs/train.jsonl and heldout.jsonl ({"prompt", "chosen", "rejected"} per line) and prints
one JSON line of counts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl.config import ConfigError  # noqa: E402
from megatron_rl.data.sources import build_datasets  # noqa: E402
from megatron_rl.models.pretrained import load_pretrained  # noqa: E402
from megatron_rl.rewards.registry import Reward  # noqa: E402
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams  # noqa: E402
from megatron_rl.rollout.native import NativeEngine  # noqa: E402
from megatron_rl.run_config import load_run_config  # noqa: E402


def graded_pairs(engine, tokenizer, reward, prompts, *, samples: int, pairs_per_prompt: int, max_new_tokens: int,
                 temperature: float, seed: int) -> tuple[list[dict], dict]:
    requests = [GenerateRequest(request_id=f"pairs-{i}", prompt_ids=tokenizer.encode_chat(p.messages),
                                sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                        n=samples, seed=seed + i))
                for i, p in enumerate(prompts)]
    completions = engine.generate(requests)
    rows, right_total, answers = [], 0, 0
    for index, prompt in enumerate(prompts):
        texts = list(dict.fromkeys(tokenizer.decode(c.output_ids)
                                   for c in completions[index * samples:(index + 1) * samples]))
        graded = [(text, bool(reward(text, prompt).correct)) for text in texts]
        right = [t for t, ok in graded if ok]
        wrong = [t for t, ok in graded if not ok]
        right_total += len(right)
        answers += len(graded)
        if right and wrong:  # the reward model scores [user: question, assistant: answer], as here
            for k in range(min(pairs_per_prompt, max(len(right), len(wrong)))):
                rows.append({"prompt": prompt.question, "chosen": right[k % len(right)],
                             "rejected": wrong[k % len(wrong)]})
    return rows, {"prompts": len(prompts), "distinct_answers": answers, "right_answers": right_total,
                  "pairs": len(rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="an RL recipe: its model, prompts, reward and engine")
    parser.add_argument("--out", required=True, help="folder for train.jsonl and heldout.jsonl")
    parser.add_argument("--prompts", type=int, default=256, help="training prompts to sample")
    parser.add_argument("--samples", type=int, default=8, help="answers per prompt")
    parser.add_argument("--pairs-per-prompt", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        return write_pairs(args)
    except ConfigError as exc:  # a bad recipe or data: one line, as the megatron-rl commands say it
        print(f"preference_pairs: {exc}", file=sys.stderr)
        return 2


def write_pairs(args: argparse.Namespace) -> int:
    paths = {name: os.path.join(args.out, f"{name}.jsonl") for name in ("train", "heldout")}
    for path in paths.values():
        if os.path.exists(path):
            raise ConfigError(f"--out: {path} exists; choose another folder (nothing is overwritten)")
    config = load_run_config(args.config)
    train, heldout = build_datasets(config.data)
    model = load_pretrained(config.model.path)
    model.tokenizer.use_template(config.model.chat_template, config.model.chat_template_kwargs)
    reward = Reward(config.reward)
    os.makedirs(args.out, exist_ok=True)
    counts = {}
    with NativeEngine(model.arch, model.state, tokenizer=model.tokenizer, config=config.engine) as engine:
        for name, prompts in (("train", list(train)[:args.prompts]), ("heldout", list(heldout))):
            path = paths[name]
            rows, counts[name] = graded_pairs(engine, model.tokenizer, reward, prompts, samples=args.samples,
                                              pairs_per_prompt=args.pairs_per_prompt,
                                              max_new_tokens=config.rollout.max_new_tokens,
                                              temperature=args.temperature, seed=args.seed)
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
