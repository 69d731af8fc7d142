"""Multi-turn agent episodes (recipes/agent/): token-exact trajectories (each turn's prompt is the
previous prompt, the sampled ids and only the new messages' ids), the trainer's recomputed log-probs
equal the engine's behaviour log-probs on every sampled token, environment tokens carry no loss, the
negative control (a re-tokenizing loop changes tokens), and the tool environment."""
from __future__ import annotations

import dataclasses
import difflib
import threading

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.algorithms.config import AdvantageConfig
from megatron_rl.controller.batching import build_step_batch
from megatron_rl.controller.episodes import Group
from megatron_rl.data.prompts import Prompt
from megatron_rl.recipes.agent.config import CalculatorTaskConfig
from megatron_rl.recipes.agent.environment import EnvStep, ToolEnvironment
from megatron_rl.recipes.agent.episodes import (
    AgentEpisodes,
    TurnRenderer,
    retokenization_changes,
)
from megatron_rl.recipes.agent.tasks import (
    build_calculator_datasets,
    final_integer,
    grade_final_answer,
)
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import SamplingParams

QUESTIONS = ["What is 17 + 25?", "Name a prime number.", "Say hello in French.", "What is 6 * 7?"]


class EchoEnvironment:
    """Every turn is answered with a tool message and a user message (new text of varying shape), until
    `max_turns`; reward: the parity of the final message's length."""

    tools: list = []

    def __init__(self, max_turns: int = 3):
        self.max_turns = max_turns
        self.turns = 0

    def reset(self, prompt: Prompt) -> list[dict]:
        self.turns = 0
        return [dict(m) for m in prompt.messages]

    def step(self, assistant_text: str) -> EnvStep:
        self.turns += 1
        if self.turns >= self.max_turns:
            return EnvStep([], float(len(assistant_text) % 2), True, {"end": "max_turns"})
        return EnvStep([{"role": "tool", "content": f"{len(assistant_text)} characters, {self.turns} turns"},
                        {"role": "user", "content": "Go on."}], None, False, {})

    def close(self) -> None:
        pass


def _prompts() -> list[Prompt]:
    return [Prompt(prompt_id=f"q{i}", messages=[{"role": "user", "content": q}], question=q)
            for i, q in enumerate(QUESTIONS)]


@pytest.fixture(scope="module")
def tiny_model(tiny_chat_model):
    from megatron_rl.models.pretrained import load_pretrained

    return load_pretrained(tiny_chat_model)


def _play(model, *, samples: int, max_new_tokens: int, seed: int = 3, max_turns: int = 3):
    from megatron_rl.rollout.native import NativeEngine

    with NativeEngine(model.arch, model.state, tokenizer=model.tokenizer,
                      config=NativeEngineConfig(max_batch_size=8, max_seq_len=512)) as engine:
        producer = AgentEpisodes(engine, model.tokenizer, lambda: EchoEnvironment(max_turns),
                                 sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0),
                                 samples_per_prompt=samples)
        futures = [producer.start(p, f"s0-p{i}", seed + i) for i, p in enumerate(_prompts())]
        groups = [Group(p, producer.collect(p, fs), 0) for p, fs in zip(_prompts(), futures)]
        episodes = [f.result() for fs in futures for f in fs]
        return groups, episodes, producer.pop_metrics()


def _has_special(tokenizer, ids) -> bool:
    return any(tokenizer.token_text(t) and not tokenizer.decode([t]) for t in ids)


def test_each_turn_prompt_is_the_previous_prompt_plus_sampled_ids_plus_new_message_ids(tiny_model):
    tokenizer = tiny_model.tokenizer
    _, episodes, metrics = _play(tiny_model, samples=2, max_new_tokens=10)
    assert len(episodes) == 8 and all(len(e.turns) == 3 and e.end == "max_turns" for e in episodes)
    checked = 0
    for episode in episodes:
        trajectory = episode.trajectory
        full = trajectory.prompt_ids + trajectory.output_ids
        assert trajectory.prompt_ids == tokenizer.encode_chat(_prompts()[int(episode.prompt_id[1:])].messages)
        position = len(trajectory.prompt_ids)
        for k, turn in enumerate(episode.turns):
            c = turn.completion
            assert c.prompt_ids == full[:position]  # never re-tokenized: the exact ids so far
            assert full[position:position + len(c.output_ids)] == c.output_ids
            mask = trajectory.mask[position - len(trajectory.prompt_ids):][:len(c.output_ids)]
            assert mask == [1] * len(c.output_ids)
            position += len(c.output_ids)
            if k + 1 < len(episode.turns):
                nxt = episode.turns[k + 1]
                env = len(nxt.completion.prompt_ids) - position
                assert env > 0 and trajectory.mask[position - len(trajectory.prompt_ids):][:env] == [0] * env
                position += env
                # Independent reference: transformers' chat template renders the conversation the next
                # turn answers; our ids decode to exactly that text (sampled text has no special tokens
                # other than a final end-of-turn token, which the template writes too).
                if not _has_special(tokenizer, c.output_ids[:-1]):
                    rendered = tokenizer.render_chat(nxt.messages)
                    assert tokenizer.decode(nxt.completion.prompt_ids, skip_special_tokens=False) == rendered
                    checked += 1
        assert position == len(full)
    assert checked >= 8
    assert metrics["agent/turns_per_episode"] == 3.0
    assert metrics["agent/sampled_tokens"] == sum(e.trajectory.sampled_tokens for e in episodes) > 0
    assert metrics["agent/environment_tokens"] == sum(e.trajectory.environment_tokens for e in episodes) > 0


class ThreadRecordingEnvironment(EchoEnvironment):
    """Echo episodes that note which thread ran each environment step."""

    threads: list[str] = []

    def step(self, assistant_text: str) -> EnvStep:
        ThreadRecordingEnvironment.threads.append(threading.current_thread().name)
        return super().step(assistant_text)


@pytest.mark.parametrize("environment_threads", [0, 2])
def test_environment_steps_run_off_the_engine_thread_when_asked(tiny_model, environment_threads):
    """Asynchronous runs step environments (tool calls) on a pool, so a slow tool does not hold the engine's
    batch; synchronous ones in the engine's callback thread. The trajectories stay token-exact either way."""
    from megatron_rl.rollout.native import NativeEngine

    ThreadRecordingEnvironment.threads = []
    with NativeEngine(tiny_model.arch, tiny_model.state, tokenizer=tiny_model.tokenizer,
                      config=NativeEngineConfig(max_batch_size=8, max_seq_len=512)) as engine:
        producer = AgentEpisodes(engine, tiny_model.tokenizer, lambda: ThreadRecordingEnvironment(3),
                                 sampling=SamplingParams(max_new_tokens=6, temperature=1.0), samples_per_prompt=2,
                                 environment_threads=environment_threads)
        futures = [producer.start(p, f"s0-p{i}", 11 + i) for i, p in enumerate(_prompts())]
        for p, fs in zip(_prompts(), futures):
            producer.collect(p, fs)
        producer.close()
    episodes = [f.result() for fs in futures for f in fs]
    assert all(len(e.turns) == 3 for e in episodes)
    for e in episodes:
        full = e.trajectory.prompt_ids + e.trajectory.output_ids
        assert all(full[:len(t.completion.prompt_ids)] == t.completion.prompt_ids for t in e.turns)
    threads = ThreadRecordingEnvironment.threads
    assert len(threads) == 3 * len(episodes)
    on_pool = [name.startswith("agent-env") for name in threads]
    assert all(on_pool) if environment_threads else not any(on_pool)


def test_trainer_logprobs_equal_engine_behaviour_logprobs_on_every_sampled_token(tiny_model):
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    groups, episodes, _ = _play(tiny_model, samples=2, max_new_tokens=12, seed=11)
    step = build_step_batch(groups, advantage=AdvantageConfig(), trainer_version=0, micro_batch_size=2,
                            pad_token_id=tiny_model.tokenizer.pad_token_id, drop_uninformative=False)
    batch = step.batch
    sampled = sum(e.trajectory.sampled_tokens for e in episodes)
    assert int(batch.loss_mask.sum()) == sampled  # environment tokens carry no loss
    for e in episodes:  # every environment position of every trajectory is masked in its row
        ids = e.trajectory.prompt_ids + e.trajectory.output_ids
        (row,) = [i for i in range(batch.batch_size) if batch.tokens[i, :len(ids)].tolist() == ids]
        p = len(e.trajectory.prompt_ids)
        assert batch.loss_mask[row, p:p + len(e.trajectory.mask)].tolist() == [float(m) for m in e.trajectory.mask]
        assert batch.behaviour_logprobs[row, p:p + len(e.trajectory.mask)].tolist() == pytest.approx(
            [lp if m else 0.0 for lp, m in zip(e.trajectory.logprobs, e.trajectory.mask)])
    trainer = MegatronTrainer(tiny_model.arch, TrainerConfig(micro_batch_size=2), hf_state=tiny_model.state)
    recomputed = trainer.compute_logprobs(batch)
    where = batch.loss_mask != 0
    diff = (recomputed[where] - batch.behaviour_logprobs[where]).abs()
    print(f"sampled tokens {int(where.sum())}, max |trainer - engine| log-prob {float(diff.max()):.2e}")
    assert int(where.sum()) == sampled and float(diff.max()) < 1e-4


def test_naive_retokenizing_loop_changes_tokens_of_the_same_episodes(tiny_model):
    """The negative control: re-rendering and re-tokenizing the conversation each turn does not give
    back the ids the engine sampled (a random model's tokens are rarely the canonical tokenization)."""
    _, episodes, _ = _play(tiny_model, samples=2, max_new_tokens=10)
    totals = {}
    for episode in episodes:
        for key, value in retokenization_changes(tiny_model.tokenizer, episode).items():
            totals[key] = totals.get(key, 0) + value
    print(f"re-tokenizing loop on {len(episodes)} episodes: {totals}")
    assert totals["turns"] == 16
    assert totals["changed_sampled"] > 0 and totals["changed_turns"] > 0


def test_renderer_strips_the_sampled_end_of_turn_token_only():
    """The template's closing text is appended unless the model sampled its end-of-turn token."""
    from megatron_rl.models.pretrained import load_pretrained

    tokenizer = load_pretrained("smollm2-135m", lazy=True).tokenizer
    messages = [{"role": "user", "content": "hi"}]
    eos = tokenizer.eos_token_id
    hello = tokenizer.encode("Hello")
    new = [{"role": "tool", "content": "42"}]
    stopped = TurnRenderer(tokenizer, messages).next_ids(hello + [eos], "Hello", new)
    cut = TurnRenderer(tokenizer, messages).next_ids(hello, "Hello", new)
    assert tokenizer.decode(cut, skip_special_tokens=False) == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert cut == [eos] + stopped


def test_calculator_tasks_are_seeded_disjoint_and_graded_on_the_final_integer():
    config = CalculatorTaskConfig(train_size=20, heldout_size=5, seed=7)
    train, heldout = build_calculator_datasets(config)
    again, _ = build_calculator_datasets(config)
    assert [p.prompt_id for p in train] == [p.prompt_id for p in again]
    assert not {p.question for p in train} & {p.question for p in heldout}
    prompt = train[0]
    a, b = (int(x) for x in prompt.question.removeprefix("What is ").rstrip("?").split(" * "))
    assert int(prompt.answer) == a * b and len(str(a)) == 4 and len(str(b)) == 3
    assert grade_final_answer(f"The answer is {a * b:,}.", prompt) == 1.0
    assert grade_final_answer(f"{a * b + 1}", prompt) == 0.0 and final_integer("no number") is None
    sums, _ = build_calculator_datasets(dataclasses.replace(config, kind="chain_sum", digits=[3], terms=5))
    terms = [int(x) for x in sums[0].question.removeprefix("What is ").rstrip("?").split(" + ")]
    assert len(terms) == 5 and int(sums[0].answer) == sum(terms)



@pytest.mark.parametrize("task, options", [("products", {"min_digits": 3, "max_digits": 4}),
                                           ("chain_sum", {"min_terms": 6, "max_terms": 6, "min_digits": 4,
                                                          "max_digits": 4})])
def test_reasoning_gym_tasks_keep_its_questions_and_answers_and_the_calculator_solves_them(task, options):
    from megatron_rl.data.reasoning_gym_tasks import create_task_dataset
    from megatron_rl.recipes.agent.arithmetic import evaluate_arithmetic  # the calculator tool's arithmetic
    from megatron_rl.recipes.agent.tasks import worked_examples

    config = CalculatorTaskConfig(kind="reasoning_gym", reasoning_gym_task=task, task_config=options,
                                  train_size=30, heldout_size=6, seed=3)
    train, heldout = build_calculator_datasets(config)
    assert (len(train), len(heldout)) == (30, 6) and not {p.question for p in train} & {p.question for p in heldout}
    # reasoning-gym's own entries, in its order (integer answers only), with our instruction appended
    source = create_task_dataset(task, options, size=80, seed=3)
    by_question = {source[i]["question"].strip(): source[i] for i in range(80)}
    for prompt in list(heldout) + list(train)[:10]:
        entry = by_question[prompt.question]
        assert prompt.answer == str(entry["answer"]) and prompt.messages[0]["content"].endswith(config.instruction)
        expression = prompt.metadata["agent_task"]["expression"]
        assert evaluate_arithmetic(expression) == prompt.answer  # the tool solves every problem
    example = worked_examples(config, 2)
    assert len(example) == 2 and example[0].question.split(" Use the")[0] not in {p.question for p in train}
    assert evaluate_arithmetic(example[0].call.arguments["expression"]) == example[0].result
    with pytest.raises(ConfigError, match="no expression"):
        build_calculator_datasets(dataclasses.replace(config, reasoning_gym_task="gcd", task_config={}))
    with pytest.raises(ConfigError, match="only 81 distinct problems"):
        build_calculator_datasets(CalculatorTaskConfig(digits=[1, 1], train_size=200, heldout_size=8))

def test_tool_environment_runs_calls_answers_errors_and_grades_the_final_answer():
    from megatron_rl.data.tool_calls import tool_call_format_for
    from megatron_rl.recipes.agent.tools import Calculator

    fmt = tool_call_format_for("")  # a template without a tool format: hermes
    prompt = Prompt(prompt_id="p", messages=[{"role": "user", "content": "What is 1234 * 5678?"}],
                    question="What is 1234 * 5678?", answer=str(1234 * 5678))
    env = ToolEnvironment([Calculator()], fmt, grade_final_answer, max_turns=3)
    try:
        messages = env.reset(prompt)
        assert messages[0]["role"] == "system" and "calculator" in messages[0]["content"].lower()
        assert messages[1:] == prompt.messages
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>'
        step = env.step(call)
        assert not step.done and step.info["tool_calls"] == 1 and step.info["malformed_calls"] == 0
        assert step.messages[0]["role"] == "tool" and str(1234 * 5678) in step.messages[0]["content"]
        step = env.step("<tool_call>{not json</tool_call>")
        assert not step.done and step.info["malformed_calls"] == 1 and step.messages[0]["content"].startswith("Error: tool call 1: invalid JSON")
        step = env.step(f"The answer is {1234 * 5678}.")
        assert step.done and step.reward == 1.0 and step.info["end"] == "answer"
    finally:
        env.close()
    env = ToolEnvironment([Calculator()], fmt, grade_final_answer, max_turns=1)
    env.reset(prompt)
    step = env.step(call)
    env.close()
    assert step.done and step.reward == 0.0 and step.info["end"] == "max_turns"


@pytest.mark.slow
def test_smollm2_multi_turn_episodes_are_token_exact_and_on_policy(smollm2):
    """The same checks on the real SmolLM2-135M-Instruct: trainer log-probs equal the engine's on every
    sampled token, and the re-tokenizing loop's changes on the same episodes."""
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer

    groups, episodes, _ = _play(smollm2, samples=2, max_new_tokens=24, seed=5)
    totals = {}
    for episode in episodes:
        for key, value in retokenization_changes(smollm2.tokenizer, episode).items():
            totals[key] = totals.get(key, 0) + value
    batch = build_step_batch(groups, advantage=AdvantageConfig(), trainer_version=0, micro_batch_size=2,
                             pad_token_id=smollm2.tokenizer.pad_token_id, drop_uninformative=False).batch
    trainer = MegatronTrainer(smollm2.arch, TrainerConfig(micro_batch_size=2), hf_state=smollm2.state)
    where = batch.loss_mask != 0
    diff = (trainer.compute_logprobs(batch)[where] - batch.behaviour_logprobs[where]).abs()
    print(f"SmolLM2: {int(where.sum())} sampled tokens, max |trainer - engine| {float(diff.max()):.2e}; "
          f"re-tokenizing loop: {totals}")
    assert float(diff.max()) < 1e-4 and totals["turns"] == 16


def _strip_reasoning(text: str) -> str:
    """The text without `<think>...</think>` blocks and the blank lines after them (what Qwen3's template
    drops from turns before the last user message, and writes empty when thinking is off)."""
    import re

    return re.sub(r"<think>.*?</think>\n*", "", text, flags=re.DOTALL)


@pytest.mark.parametrize("family,kwargs", [("smollm2", {}), ("qwen2.5", {}), ("llama-3.1", {}),
                                           ("qwen3", {"enable_thinking": True}), ("qwen3", {"enable_thinking": False})])
def test_multi_turn_prompts_follow_each_published_template(tmp_path, family, kwargs):
    """Three turns with tool results and a new user message on each family's published template: no drift;
    every turn's prompt (the previous prompt, the sampled ids, the template's ids for what is new) is, as
    text, the template's full render of the conversation so far, except that Qwen3 keeps the reasoning
    its template drops from earlier turns (the policy keeps what it sampled in its context)."""
    from megatron_rl.data.tokenizer import ChatTokenizer
    from megatron_rl.models.gguf import read_gguf_tokenizer
    from megatron_rl.models.pretrained import smollm2_gguf_path
    import gguf

    from tests.chat_families import FAMILIES, save_family_tokenizer

    path = smollm2_gguf_path()
    vocabulary = ChatTokenizer.from_spec(read_gguf_tokenizer(gguf.GGUFReader(path), path)).hf_tokenizer \
        .backend_tokenizer.to_str()
    if family == "smollm2":
        tokenizer = ChatTokenizer.from_spec(read_gguf_tokenizer(gguf.GGUFReader(path), path))
    else:
        save_family_tokenizer(tmp_path / family, FAMILIES[family], vocabulary)
        tokenizer = ChatTokenizer.from_hf_dir(str(tmp_path / family))
    tokenizer.use_template(None, kwargs)
    thinking = family == "qwen3" and kwargs.get("enable_thinking", True)
    messages = [{"role": "user", "content": "What is 17 * 23? Use the calculator."}]
    answers = ["I will compute it.\n<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"x\": \"17*23\"}}\n</tool_call>",
               "17 * 23 = 391.", "Twice that is 782."]
    replies = [[{"role": "tool", "content": "391"}], [{"role": "user", "content": "And twice that?"}], []]
    renderer = TurnRenderer(tokenizer, messages)
    ids = renderer.prompt_ids()
    conversation = list(messages)
    eos = tokenizer.eos_token_id
    for k, (answer, reply) in enumerate(zip(answers, replies)):
        text = f"<think>\nstep {k}\n</think>\n\n{answer}" if thinking else answer
        sampled = tokenizer.encode(text) + [eos]
        ids = ids + sampled
        conversation += [{"role": "assistant", "content": text}]
        if not reply:
            break
        ids = ids + renderer.next_ids(sampled, text, reply)
        conversation += reply
        full = tokenizer.render_chat(conversation, add_generation_prompt=True)
        ours = tokenizer.decode(ids, skip_special_tokens=False)
        if family == "qwen3":  # the template drops earlier reasoning, and writes an empty block when it is off
            assert _strip_reasoning(ours) == _strip_reasoning(full), (k, ours, full)
            opening = "<|im_start|>assistant"  # the next generation prompt is the template's own, exactly
            assert ours[ours.rindex(opening):] == full[full.rindex(opening):]
        else:
            assert ours == full, (k, ours, full)
    if thinking:  # the earlier turns' reasoning is still in the prompt the policy sees
        assert "step 0" in tokenizer.decode(ids, skip_special_tokens=False)


class _ScriptedAgentEngine:
    """Answers each turn with `script(prompt text)` and the end-of-turn token (a policy that calls the
    calculator, then answers), as the engine interface episodes drive: submit, wait."""

    max_seq_len = 4096

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script

    def submit(self, requests, on_token=None):
        from concurrent.futures import Future

        from megatron_rl.types import Completion

        futures = []
        for request in requests:
            ids = self.tokenizer.encode(self.script(self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)))
            ids.append(self.tokenizer.eos_token_id)
            future = Future()
            future.set_result(Completion(request.request_id, list(request.prompt_ids), ids, [-0.5] * len(ids),
                                         [0] * len(ids), "stop", request.group_id))
            futures.append(future)
        return futures

    def wait(self, futures):
        pass


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_calculator_episodes_complete_and_each_turn_equals_transformers_render(tmp_path, thinking):
    """The calculator agent on Qwen3's published template (thinking on and off), with the worked example:
    every episode completes (no template drift), and each turn's prompt ids equal transformers' own
    tokenization of its full render of the conversation so far, token for token with thinking on (in a
    tool loop every assistant turn follows the last user message, where Qwen3's template keeps the
    reasoning); with thinking off, but for the empty reasoning block of each earlier generation prompt."""
    from transformers import AutoTokenizer
    from megatron_rl.data.tokenizer import ChatTokenizer
    from megatron_rl.data.tool_calls import ToolCall, tool_call_format
    from megatron_rl.models.gguf import read_gguf_tokenizer
    from megatron_rl.models.pretrained import smollm2_gguf_path
    from megatron_rl.recipes.agent.tasks import worked_examples
    from megatron_rl.recipes.agent.tools import Calculator
    import gguf

    from tests.chat_families import FAMILIES, save_family_tokenizer

    path = smollm2_gguf_path()
    vocabulary = ChatTokenizer.from_spec(read_gguf_tokenizer(gguf.GGUFReader(path), path)).hf_tokenizer \
        .backend_tokenizer.to_str()
    save_family_tokenizer(tmp_path / "qwen3", FAMILIES["qwen3"], vocabulary)
    tokenizer = ChatTokenizer.from_hf_dir(str(tmp_path / "qwen3"))
    tokenizer.use_template(None, {"enable_thinking": thinking})
    reference = AutoTokenizer.from_pretrained(str(tmp_path / "qwen3"))
    task = CalculatorTaskConfig(train_size=6, heldout_size=0)
    train, _ = build_calculator_datasets(task)
    hermes = tool_call_format("hermes")

    def policy(prompt_text: str) -> str:
        import re

        *_, (a, b) = re.findall(r"What is (\d+) \* (\d+)\?", prompt_text)
        a, b = int(a), int(b)
        think = "<think>\nI should use the calculator.\n</think>\n\n" if thinking else ""
        if "</tool_response>" in prompt_text[prompt_text.rindex(f"What is {a} * {b}?"):]:
            return f"{think}The answer is {a * b}."
        return think + hermes.render_call(ToolCall(name="calculator", arguments={"expression": f"{a} * {b}"}))

    environment = lambda: ToolEnvironment([Calculator()], hermes, grade_final_answer, max_turns=3,  # noqa: E731
                                          chat_template=tokenizer.chat_template, examples=worked_examples(task, 1))
    producer = AgentEpisodes(_ScriptedAgentEngine(tokenizer, policy), tokenizer, environment,
                             sampling=SamplingParams(max_new_tokens=64, temperature=0.0))
    episodes = producer.play(list(train), tag="qwen3")
    tools = [Calculator().schema()]
    empty_block = tokenizer.encode("<think>\n\n</think>\n\n")
    compared = 0
    for episode in episodes:
        assert episode.end == "answer" and episode.reward == 1.0 and len(episode.turns) == 2
        for k, turn in enumerate(episode.turns):
            ours = turn.completion.prompt_ids
            full = list(reference.apply_chat_template(turn.messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False, enable_thinking=thinking))
            compared += len(full)
            if thinking:
                assert ours == full
                continue
            # Thinking off: the generation prompt of each earlier turn carried an empty reasoning block that
            # the policy saw and the trajectory keeps; the template's re-render of history leaves it out.
            # Those 4 tokens per earlier turn are the only difference.
            extra = [op for op in difflib.SequenceMatcher(None, ours, full, autojunk=False).get_opcodes()
                     if op[0] != "equal"]
            assert [(tag, ours[i1:i2], j1 == j2) for tag, i1, i2, j1, j2 in extra] == [("delete", empty_block, True)] * k
    assert compared > 6 * 2 * 100
