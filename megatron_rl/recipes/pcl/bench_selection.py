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

The value model is the recipe's (`curriculum.value`: its first `num_layers` layers of the policy).
`reference_layers=30,4` adds value models of those depths, built and trained the same way and scored
on the same candidates, each with its own time, ratio and selection quality (`references`): what the
depth buys in selection quality and costs in time.

Options: rounds (4), warmup (1), reference_layers (none), and any dotted config override
(rollout.prompts_per_step=8, curriculum.candidates_factor=4, curriculum.value.num_layers=30, ...).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import tempfile
import time

from megatron_rl.algorithms.pcl import (
    has_mixed_rewards,
    select_closest_to_target,
    value_targets,
)
from megatron_rl.controller.loop import build_controller
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.recipes.pcl.selector import build_value_model
from megatron_rl.run_config import load_run_config

log = logging.getLogger(__name__)

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "configs", "pcl_arith.yaml")


def bench_pcl(options: dict) -> dict:
    rounds = int(options.get("rounds", 4))
    warmup = int(options.get("warmup", 1))
    reference_layers = [int(n) for n in str(options.get("reference_layers", "")).split(",") if n.strip()]
    overrides = [f"{k}={v}" for k, v in options.items() if "." in k]
    with tempfile.TemporaryDirectory() as root:
        config = load_run_config(RECIPE, [f"run_dir={root}", "curriculum.kind=pcl", "logging.wandb=disabled",
                                         *overrides])
        controller = build_controller(config)
        try:
            selector, tokenizer = controller.selector, controller.tokenizer
            m, k = config.rollout.prompts_per_step, config.curriculum.candidates_factor
            # Reference value models of other depths, built like the recipe's (same initial weights,
            # head, optimizer) and scored on the same candidates: what the depth costs in selection.
            models = {"value": selector.value}
            if reference_layers:
                policy = load_pretrained(config.model.path)
                for layers in reference_layers:
                    models[f"layers_{layers}"] = build_value_model(
                        dataclasses.replace(config.curriculum.value, num_layers=layers),
                        policy_arch=policy.arch, policy_state=policy.state, pg_collection=controller.policy.pg)
                del policy
            rows = []
            for round_index in range(rounds):
                candidates = controller.stream.next(k * m)
                picks, times, predicted = {}, {}, {}
                for name, model in models.items():
                    start = time.perf_counter()
                    values = model.predict([tokenizer.encode_chat(p.messages) for p in candidates],
                                           pad_token_id=tokenizer.pad_token_id)
                    picks[name] = select_closest_to_target(values, m, config.curriculum.target)
                    times[name] = time.perf_counter() - start
                    predicted[name] = values

                start = time.perf_counter()
                groups = controller.rollouts.rollout(candidates, tag=f"bench{round_index}", seed=round_index)
                rewards = [[s.reward.reward for s in g.samples if s.reward.ok] for g in groups]
                mixed = [i for i, r in enumerate(rewards) if has_mixed_rewards(r)]
                dynamic_time = time.perf_counter() - start

                pass_rates = value_targets([r or [0.0] for r in rewards])
                row = {"pcl_s": times["value"], "dynamic_sampling_s": dynamic_time,
                       "mixed_fraction_candidates": len(mixed) / len(candidates),
                       "dynamic_sampling_found": min(len(mixed), m),
                       "value_mean": float(predicted["value"].mean()), "pass_rate_mean": float(pass_rates.mean())}
                for name in models:
                    row[f"{name}_s"] = times[name]
                    row[f"{name}_mixed"] = len(set(picks[name]) & set(mixed)) / len(picks[name])
                row["mixed_fraction_pcl_selected"] = row["value_mixed"]
                rows.append(row)
                log.info(f"round {round_index}: PCL {times['value']:.2f} s, dynamic sampling {dynamic_time:.2f} s "
                         f"({len(candidates)} candidates x {config.rollout.samples_per_prompt}); mixed: "
                         f"{row['mixed_fraction_candidates']:.2f} of candidates, "
                         + ", ".join(f"{row[name + '_mixed']:.2f} of {name}'s picks ({times[name]:.2f} s)"
                                     for name in models))
                for model in models.values():
                    model.update([tokenizer.encode_chat(p.messages) for p in candidates], pass_rates,
                                 pad_token_id=tokenizer.pad_token_id)
        finally:
            controller.close()

    measured = rows[warmup:] or rows
    mean = lambda key: statistics.fmean(r[key] for r in measured)  # noqa: E731
    references = [{"value_layers": models[name].arch.num_layers, "identify_s": round(mean(f"{name}_s"), 3),
                   "ratio": round(mean("dynamic_sampling_s") / mean(f"{name}_s"), 2),
                   "mixed_fraction_selected": round(mean(f"{name}_mixed"), 3)}
                  for name in models if name != "value"]
    return {
        "ratio": round(mean("dynamic_sampling_s") / mean("pcl_s"), 2),
        "pcl_identify_s": round(mean("pcl_s"), 3), "dynamic_sampling_identify_s": round(mean("dynamic_sampling_s"), 2),
        "candidates": k * m, "selected": m, "samples_per_prompt": config.rollout.samples_per_prompt,
        "max_new_tokens": config.rollout.max_new_tokens, "value_layers": selector.value.arch.num_layers,
        "policy_layers": controller.policy.arch.num_layers,
        "mixed_fraction_candidates": round(mean("mixed_fraction_candidates"), 3),
        "mixed_fraction_pcl_selected": round(mean("mixed_fraction_pcl_selected"), 3),
        "mixed_fraction_pcl_selected_last_round": round(rows[-1]["mixed_fraction_pcl_selected"], 3),
        "rounds_measured": len(measured), "references": references, "paper_ratios": [12.1, 16.9],
    }
