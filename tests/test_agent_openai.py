"""Agents written against the OpenAI API, trained through our server: the official `openai` client runs an
ordinary multi-turn agent loop against `RolloutServer`; the adapter's trajectory is token-exact (each
request's prompt ids extend the previous ones by the sampled ids and the new messages only), its
behaviour log-probs equal the trainer's recomputation, and the server's own chat rendering (a
re-tokenizing loop) would have changed tokens."""
from __future__ import annotations

import collections
import itertools
import threading

import pytest

from megatron_rl.algorithms.config import AdvantageConfig
from megatron_rl.controller.batching import build_step_batch
from megatron_rl.controller.episodes import Group
from megatron_rl.data.prompts import Prompt
from megatron_rl.recipes.agent.openai_agent import run_openai_agent
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.server import RolloutServer

openai = pytest.importorskip("openai")
MODEL = "tiny-agent"


@pytest.fixture(scope="module")
def tiny_model(tiny_chat_model):
    from megatron_rl.models.pretrained import load_pretrained

    return load_pretrained(tiny_chat_model)


@pytest.fixture(scope="module")
def served(tiny_model):
    from megatron_rl.rollout.native import NativeEngine

    engine = NativeEngine(tiny_model.arch, tiny_model.state, tokenizer=tiny_model.tokenizer,
                          config=NativeEngineConfig(max_batch_size=4, max_seq_len=512))
    server = RolloutServer(engine, port=0, model_name=MODEL)
    server.start()
    yield server
    server.shutdown()
    engine.close()


def counting_agent(client, model, prompt):
    """An ordinary agent loop: ask, append the reply and a tool result, ask again (3 turns)."""
    messages = list(prompt.messages)
    for turn in range(3):
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0,
                                             seed=100 * turn + len(prompt.question))
        text = out.choices[0].message.content
        assert out.choices[0].message.role == "assistant"
        messages += [{"role": "assistant", "content": text},
                     {"role": "tool", "content": f"{len(text)} characters so far"}]
    return float(len(text) % 2)


PROMPTS = [Prompt(prompt_id=f"q{i}", messages=[{"role": "user", "content": q}], question=q)
           for i, q in enumerate(["What is 17 + 25?", "Name a colour.", "Write a word."])]


def test_openai_client_agent_gives_token_exact_trajectories_and_exact_logprobs(served, tiny_model):
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    tokenizer = tiny_model.tokenizer
    runs = [run_openai_agent(counting_agent, p, base_url=served.url + "/v1", tokenizer=tokenizer, model=MODEL)
            for p in PROMPTS]
    changed = sampled_changed = 0
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    for run, prompt in zip(runs, PROMPTS):
        assert len(run.segments) == 1 and len(run.turns) == 3
        segment = run.segments[0]
        full = segment.prompt_ids + segment.output_ids
        assert segment.prompt_ids == tokenizer.encode_chat(prompt.messages)
        messages = list(prompt.messages)
        for k, turn in enumerate(run.turns):
            c = turn.completion
            assert full[:len(c.prompt_ids)] == c.prompt_ids  # the exact ids so far, never re-tokenized
            start = len(c.prompt_ids) - len(segment.prompt_ids)
            assert segment.output_ids[start:start + len(c.output_ids)] == c.output_ids
            assert segment.mask[start:start + len(c.output_ids)] == [1] * len(c.output_ids)
            if k:
                # The negative control through the server itself: its chat endpoint re-renders and
                # re-tokenizes the same conversation.
                naive = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                       extra_body={"return_token_ids": True}).prompt_token_ids
                assert tokenizer.decode(naive, skip_special_tokens=False) == tokenizer.render_chat(messages)
                changed += sum(a != b for a, b in zip(c.prompt_ids, naive)) + abs(len(c.prompt_ids) - len(naive))
                sampled_changed += int(naive[:len(c.prompt_ids)] != c.prompt_ids)
            messages += [{"role": "assistant", "content": turn.text},
                         {"role": "tool", "content": f"{len(turn.text)} characters so far"}]
        assert len(full) == len(run.turns[-1].completion.prompt_ids) + len(run.turns[-1].completion.output_ids)
    print(f"server chat re-rendering vs token-exact prompts: {changed} position differences, "
          f"{sampled_changed} of {2 * len(runs)} later-turn prompts differ")
    assert sampled_changed > 0

    groups = [Group(p, run.samples(), 0) for p, run in zip(PROMPTS, runs)]
    batch = build_step_batch(groups, advantage=AdvantageConfig(), trainer_version=0, micro_batch_size=1,
                             pad_token_id=tokenizer.pad_token_id, drop_uninformative=False).batch
    trainer = MegatronTrainer(tiny_model.arch, TrainerConfig(micro_batch_size=1), hf_state=tiny_model.state)
    where = batch.loss_mask != 0
    assert int(where.sum()) == sum(len(t.completion.output_ids) for run in runs for t in run.turns)
    diff = (trainer.compute_logprobs(batch)[where] - batch.behaviour_logprobs[where]).abs().max()
    print(f"trainer vs engine (through HTTP) log-probs: max diff {float(diff):.2e} over {int(where.sum())} tokens")
    assert float(diff) < 1e-4


def test_rewritten_history_starts_a_new_segment_and_unsupported_fields_are_refused(served, tiny_model):
    def forgetful(client, model, prompt):
        first = client.chat.completions.create(model=model, messages=prompt.messages, max_tokens=4, seed=1)
        # drops its own reply: not a continuation, so a fresh render
        client.chat.completions.create(model=model, messages=prompt.messages + [
            {"role": "user", "content": "Again: " + first.choices[0].message.content}], max_tokens=4, seed=2)
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client.chat.completions.create(model=model, messages=prompt.messages, max_tokens=4,
                                           logit_bias={"1": 5})
        return 1.0

    run = run_openai_agent(forgetful, PROMPTS[0], base_url=served.url + "/v1", tokenizer=tiny_model.tokenizer,
                           model=MODEL)
    assert len(run.segments) == 2 and [t.segment for t in run.turns] == [0, 1]
    assert run.reward == 1.0 and len(run.samples()) == 2
    assert all(s.completion.output_mask == [1] * len(s.completion.output_ids) for s in run.samples())


def echo_openai_agent(agent_config, tokenizer):
    """`agent.openai_agent` factory: an OpenAI-client agent over the echo environment (several turns even from
    a random model). It asks for its own temperature and seed, which a training run overrides."""
    from tests.test_agent_episodes import EchoEnvironment

    def agent(client, model, prompt):
        env = EchoEnvironment(agent_config.max_turns)
        messages = env.reset(prompt)
        while True:
            text = client.chat.completions.create(model=model, messages=messages, temperature=0.01,
                                                  seed=5).choices[0].message.content
            step = env.step(text)
            if step.done:
                return step.reward
            messages += [{"role": "assistant", "content": text}, *step.messages]
    return agent


def failing_openai_agent(agent_config, tokenizer):
    """Raises before its first request, always."""
    def agent(client, model, prompt):
        raise RuntimeError("the agent's own bug")
    return agent


def flaky_openai_agent(agent_config, tokenizer):
    """Every second episode of each prompt raises before its first request."""
    started = collections.defaultdict(itertools.count)
    lock = threading.Lock()
    echo = echo_openai_agent(agent_config, tokenizer)

    def agent(client, model, prompt):
        with lock:
            fails = next(started[prompt.prompt_id]) % 2
        if fails:
            raise RuntimeError("the agent's own bug")
        return echo(client, model, prompt)
    return agent


@pytest.mark.parametrize("staleness", [0, 1])
def test_openai_client_agent_trains_through_the_recipe(tmp_path, tiny_chat_model, staleness):
    """agent.openai_agent: the recipe serves the policy's engine, the agent's own client loop produces the
    episodes, the loop trains on them (sync and asynchronous) and the server is gone after the run."""
    import json
    import os

    from megatron_rl.controller.loop import train
    from megatron_rl.run_config import load_run_config
    from tests.test_agent_recipe import RECIPE, _overrides

    run_dir = str(tmp_path / f"staleness{staleness}")
    config = load_run_config(RECIPE, _overrides(tiny_chat_model, run_dir, "steps=2", f"rollout.max_staleness={staleness}",
                                                "agent.openai_agent=tests.test_agent_openai:echo_openai_agent"))
    before = set(threading.enumerate())  # other tests' servers (the module's `served`) may be up
    assert train(config).steps == 2
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [m for m in metrics if "agent/episodes" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["agent/episodes"] == 4 and m["agent/turns_per_episode"] == 3.0
        assert m["agent/segments_per_episode"] == 1.0 and m["agent/environment_tokens"] > 0
        if m["rollout/staleness_max"] == 0:
            assert m["train/logprob_mismatch"] < 1e-4
    assert any("eval/accuracy" in m for m in metrics)
    episodes = [json.loads(line) for line in open(os.path.join(run_dir, "agent_episodes.jsonl"))]
    assert len(episodes) == 8 and all(len(e["turns"]) == 3 for e in episodes)
    # the run's temperature 1 and per-episode seeds replaced the agent's own (0.01, seed 5): a group's
    # episodes differ
    first_turns = {}
    for e in episodes:
        first_turns.setdefault((e["step"], e["prompt_id"]), []).append(e["turns"][0]["text"])
    assert all(len(set(texts)) > 1 for texts in first_turns.values())
    assert not [t for t in threading.enumerate()
                if t not in before and (t.name == "rollout-http" or t.name.startswith("openai-agent"))]


def test_openai_agent_errors_are_counted_and_a_group_that_all_failed_is_reported(tmp_path, tiny_chat_model):
    import json
    import os

    from megatron_rl.controller.loop import train
    from megatron_rl.run_config import load_run_config
    from tests.test_agent_recipe import RECIPE, _overrides

    def config(name, agent):
        return load_run_config(RECIPE, _overrides(tiny_chat_model, str(tmp_path / name), "steps=1",
                                                  "rollout.samples_per_prompt=4", "eval.before_training=false",
                                                  "eval.after_training=false",
                                                  f"agent.openai_agent=tests.test_agent_openai:{agent}"))
    # half the episodes raise: the run goes on, on the others
    assert train(config("flaky", "flaky_openai_agent")).steps == 1
    (m,) = [json.loads(line) for line in open(os.path.join(tmp_path, "flaky", "metrics.jsonl"))
            if "agent/episodes" in line]
    assert m["agent/episodes"] == 8 and m["agent/agent_errors"] == 4 and m["agent/turns_per_episode"] == 1.5
    with pytest.raises(RuntimeError, match="every agent episode of prompt .* raised before sampling anything.*"
                                           "the agent's own bug"):
        train(config("failing", "failing_openai_agent"))


def test_the_calculator_task_as_an_openai_client_agent_trains(tmp_path, tiny_chat_model):
    """The built-in example (recipes/agent/calculator_agent.py): the calculator environment's tools and
    worked example, driven by an OpenAI-client loop; no episode of it raises."""
    import json
    import os

    from megatron_rl.controller.loop import train
    from megatron_rl.run_config import load_run_config
    from tests.test_agent_recipe import RECIPE, _overrides

    run_dir = str(tmp_path / "calculator")
    config = load_run_config(RECIPE, _overrides(
        tiny_chat_model, run_dir, "steps=1", "eval.before_training=false",
        "agent.openai_agent=megatron_rl.recipes.agent.calculator_agent:calculator_agent"))
    assert train(config).steps == 1
    with open(os.path.join(run_dir, "agent_episodes.jsonl")) as f:
        episodes = [json.loads(line) for line in f]
    assert len(episodes) == 4 and not any(e["error"] for e in episodes)
    assert all(1 <= len(e["turns"]) <= 3 for e in episodes)
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert "eval/accuracy" in f.read()
