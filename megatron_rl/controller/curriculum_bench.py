"""`megatron-rl bench pcl`: time to identify m intermediate-difficulty prompts among k*m candidates,
with PCL's value model (one forward pass over the candidates, keep the m closest to tau) vs with
dynamic sampling (DAPO: roll out all k*m candidates n times, score them, keep groups with mixed
rewards), same candidates, same run, same process.

Each round draws k*m fresh candidates from the pcl_arith recipe's prompt stream and times both. The
dynamic-sampling rollouts then show how good each selection is: the fraction of PCL's m picks whose
groups actually had mixed rewards, against the fraction among all candidates (what a random pick of
m gets). Between rounds the value model is trained on those rollouts' mean rewards (one update per
round, like one PCL step), so later rounds measure a value model that has seen data.

    ratio = mean dynamic-sampling identification time / mean PCL identification time   (rounds after warm-up)

Options: rounds (4), warmup (1), and any dotted config override (rollout.prompts_per_step=8,
curriculum.candidates_factor=4, rollout.samples_per_prompt=8, rollout.max_new_tokens=32, ...).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

from megatron_rl.config import load_yaml

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "pcl_arith.yaml")


def bench_pcl(options: dict) -> dict:
    from megatron_rl.algorithms.pcl import has_mixed_rewards, select_closest_to_target, value_targets
    from megatron_rl.controller.loop import Controller
    from megatron_rl.run_config import RunConfig

    rounds = int(options.get("rounds", 4))
    warmup = int(options.get("warmup", 1))
    overrides = [f"{k}={v}" for k, v in options.items() if "." in k]
    with tempfile.TemporaryDirectory() as root:
        config = load_yaml(RunConfig, RECIPE, [f"run_dir={root}", "curriculum.kind=pcl", "logging.wandb=disabled",
                                               *overrides])
        controller = Controller(config)
        try:
            selector, tokenizer = controller.selector, controller.tokenizer
            m, k = config.rollout.prompts_per_step, config.curriculum.candidates_factor
            rows = []
            for round_index in range(rounds):
                candidates = controller.stream.next(k * m)

                start = time.perf_counter()
                values = selector.value.predict([tokenizer.encode_chat(p.messages) for p in candidates],
                                                pad_token_id=tokenizer.pad_token_id)
                chosen = select_closest_to_target(values, m, config.curriculum.target)
                pcl_time = time.perf_counter() - start

                start = time.perf_counter()
                groups = controller.rollouts.rollout(candidates, tag=f"bench{round_index}", seed=round_index)
                rewards = [[s.reward.reward for s in g.samples if s.reward.ok] for g in groups]
                mixed = [i for i, r in enumerate(rewards) if has_mixed_rewards(r)]
                dynamic_time = time.perf_counter() - start

                pass_rates = value_targets([r or [0.0] for r in rewards])
                row = {"pcl_s": pcl_time, "dynamic_sampling_s": dynamic_time,
                       "mixed_fraction_candidates": len(mixed) / len(candidates),
                       "mixed_fraction_pcl_selected": len(set(chosen) & set(mixed)) / len(chosen),
                       "dynamic_sampling_found": min(len(mixed), m),
                       "value_mean": float(values.mean()), "pass_rate_mean": float(pass_rates.mean())}
                rows.append(row)
                print(f"round {round_index}: PCL {pcl_time:.2f} s, dynamic sampling {dynamic_time:.2f} s "
                      f"({len(candidates)} candidates x {config.rollout.samples_per_prompt}); mixed: "
                      f"{row['mixed_fraction_candidates']:.2f} of candidates, "
                      f"{row['mixed_fraction_pcl_selected']:.2f} of PCL's picks", flush=True)
                selector.value.update([tokenizer.encode_chat(p.messages) for p in candidates], pass_rates,
                                      pad_token_id=tokenizer.pad_token_id)
        finally:
            controller.close()

    measured = rows[warmup:] or rows
    mean = lambda key: statistics.fmean(r[key] for r in measured)  # noqa: E731
    return {
        "ratio": round(mean("dynamic_sampling_s") / mean("pcl_s"), 2),
        "pcl_identify_s": round(mean("pcl_s"), 3), "dynamic_sampling_identify_s": round(mean("dynamic_sampling_s"), 2),
        "candidates": k * m, "selected": m, "samples_per_prompt": config.rollout.samples_per_prompt,
        "max_new_tokens": config.rollout.max_new_tokens, "value_layers": selector.value.arch.num_layers,
        "mixed_fraction_candidates": round(mean("mixed_fraction_candidates"), 3),
        "mixed_fraction_pcl_selected": round(mean("mixed_fraction_pcl_selected"), 3),
        "mixed_fraction_pcl_selected_last_round": round(rows[-1]["mixed_fraction_pcl_selected"], 3),
        "rounds_measured": len(measured), "paper_ratios": [12.1, 16.9],
    }
