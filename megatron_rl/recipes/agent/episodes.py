"""Multi-turn agent episodes as token-exact trajectories, behind the EpisodeProducer interface.

One episode of prompt p with environment E (environment.py):

    ids_0 = template(E.reset(p))                       # the first prompt, rendered once
    y_k   = engine(ids_k)                              # sampled ids, behaviour log-probs, versions
    step  = E.step(decode(y_k))                        # tool results / user reply, reward, done
    ids_{k+1} = ids_k + y_k + delta_k                  # delta_k: only the NEW messages' tokens

`delta_k` is the template's text after the assistant message (its end-of-turn marker, minus the
end-of-turn token the model sampled itself), the new messages and the next generation prompt, found
by rendering the conversation with a probe in place of the assistant's content (`TurnRenderer`) and
tokenized alone. The text of the conversation is never tokenized again, so each turn's prompt holds
exactly the ids the engine sampled before: the trainer scores the tokens the policy produced, and the
engine's behaviour log-probs stay valid (a re-tokenizing loop changes tokens: `retokenization_changes`
measures how many). A template that rewrites earlier turns once more messages follow (Qwen3 drops the
reasoning of turns before the last user message) is followed for everything new and never applied to
the history: the policy keeps its earlier reasoning in context and is trained on the context it saw.

The episode is one sample: a `Completion` whose `output_ids` hold every token after the first prompt,
with `output_mask` 1 on sampled tokens and 0 on environment tokens (log-prob 0, no loss;
controller/batching.py), and per-token weight versions (environment tokens carry the version of the
turn before them). Turns advance from the engines' callbacks, as WaltzRL's episodes do, so asynchronous
runs generate whole episodes while the trainer trains (their environment steps run on a thread pool, so
a slow tool does not hold the engine's batch; synchronous runs step them in the callback thread, which
keeps the order of submissions, hence the batches, independent of timing); a checkpoint keeps only in-flight
prompts and a resumed run plays them again with the same seeds.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import difflib
import json
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from megatron_rl.controller.episodes import EpisodeRuns, Sample
from megatron_rl.data.prompts import Prompt
from megatron_rl.data.tokenizer import ChatTokenizer
from megatron_rl.recipes.agent.environment import Environment, EnvStep, renders_tools
from megatron_rl.rewards.registry import RewardResult
from megatron_rl.rollout.engine import (
    GenerateRequest,
    RequestError,
    SamplingParams,
    caller_driven,
)
from megatron_rl.types import Completion

# Stands for an assistant message's content when rendering finds the text that closes a turn.
_CONTENT_PROBE = "\u2063agent-turn-probe\u2063"


class TemplateDriftError(ValueError):
    """The chat template does not render a conversation as a prefix of its continuation."""


class TurnRenderer:
    """The chat template's token ids for an episode: the first prompt rendered whole, then per turn
    only the ids of what follows the sampled tokens (see the module docstring)."""

    def __init__(self, tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]],
                 tools: Sequence[dict[str, Any]] | None = None):
        self.tokenizer = tokenizer
        self.messages = [dict(m) for m in messages]
        self.tools = list(tools) if tools else None

    def _render(self, messages: Sequence[dict[str, Any]], generation: bool) -> str:
        return self.tokenizer.render_chat(messages, add_generation_prompt=generation, tools=self.tools)

    def prompt_ids(self) -> list[int]:
        """The first turn's prompt: the messages so far with the generation prompt."""
        return self.tokenizer.encode_chat(self.messages, tools=self.tools)

    def next_ids(self, sampled_ids: Sequence[int], assistant_text: str,
                 new_messages: Sequence[dict[str, Any]]) -> list[int]:
        """Ids to append after the sampled ids of an assistant turn so that the next turn's prompt is
        the conversation with `assistant_text` and `new_messages`, plus the generation prompt.

        One render of the conversation with a probe as this turn's content: the text after the probe is the
        template's own closing of the turn, the new messages and the next generation prompt, whatever it
        does to earlier turns. The history is never rendered again: a template that rewrites it (Qwen3 drops
        the reasoning of turns before the last user message) does not rewrite the trajectory, so the policy
        keeps the context it sampled in, and is trained on exactly that."""
        rendered = self._render(self.messages + [{"role": "assistant", "content": _CONTENT_PROBE}]
                                + list(new_messages), True)
        if rendered.count(_CONTENT_PROBE) != 1:
            raise TemplateDriftError("the chat template does not render an assistant message's content verbatim")
        tail = rendered[rendered.index(_CONTENT_PROBE) + len(_CONTENT_PROBE):]
        tail = tail[len(self._sampled_end(sampled_ids, tail)):]
        self.messages = self.messages + [{"role": "assistant", "content": assistant_text}] + [dict(m) for m in new_messages]
        return self.tokenizer.encode(tail)

    def _sampled_end(self, sampled_ids: Sequence[int], closing: str) -> str:
        """The start of `closing` the model already wrote: its end-of-turn special token, when it
        stopped on one (a plain text token is never taken for template text)."""
        if not sampled_ids:
            return ""
        last = sampled_ids[-1]
        text = self.tokenizer.token_text(last)
        special = bool(text) and not self.tokenizer.decode([last])
        return text if special and closing.startswith(text) else ""


@dataclasses.dataclass
class Trajectory:
    """An episode's tokens after the first prompt, with who wrote each (1: the policy sampled it)."""

    prompt_ids: list[int]
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    routed: torch.Tensor | None = None
    """MoE routing record of the positions so far (`Completion.routed_experts`), None without one."""

    def next_prompt(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def add_sampled(self, completion: Completion) -> None:
        n = len(completion.output_ids)
        self.output_ids += completion.output_ids
        self.logprobs += completion.output_logprobs
        self.versions += completion.weight_versions
        self.mask += [1] * n
        record = completion.routed_experts
        if record is not None:
            # Positions recorded by earlier turns keep the experts chosen when those tokens were fed; the
            # rest (the previous turn's last token, the environment's tokens, this turn's) take this turn's.
            kept = 0 if self.routed is None else self.routed.shape[0]
            self.routed = record.clone() if self.routed is None else torch.cat([self.routed, record[kept:]])

    def add_environment(self, ids: Sequence[int]) -> None:
        # Environment tokens take the version of the turn before them: they do not change the
        # sample's staleness, which only its sampled tokens have.
        version = self.versions[-1] if self.versions else 0
        self.output_ids += list(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.mask += [0] * len(ids)

    def completion(self, request_id: str, group_id: str, finish_reason: str) -> Completion:
        routed = self.routed
        if routed is not None:  # [P + R - 1] positions; -1 where no turn recorded one
            positions = len(self.prompt_ids) + len(self.output_ids) - 1
            routed = routed[:positions]
            if routed.shape[0] < positions:
                routed = torch.cat([routed, routed.new_full((positions - routed.shape[0], *routed.shape[1:]), -1)])
        return Completion(request_id=request_id, prompt_ids=list(self.prompt_ids), output_ids=list(self.output_ids),
                          output_logprobs=list(self.logprobs), weight_versions=list(self.versions),
                          finish_reason=finish_reason, group_id=group_id, output_mask=list(self.mask),
                          routed_experts=routed)

    @property
    def sampled_tokens(self) -> int:
        return sum(self.mask)

    @property
    def environment_tokens(self) -> int:
        return len(self.mask) - sum(self.mask)


@dataclasses.dataclass
class AgentTurn:
    """One assistant turn and the environment's answer."""

    completion: Completion
    """The engine's output for this turn (its prompt_ids are the trajectory so far)."""
    text: str
    """The decoded assistant message."""
    messages: list[dict[str, Any]]
    """The conversation this turn answered (what a re-tokenizing loop would render)."""
    step: EnvStep | None = None
    """The environment's answer (None when the episode ended before it, e.g. context_full)."""


@dataclasses.dataclass
class AgentEpisode:
    """One finished episode."""

    prompt_id: str
    trajectory: Trajectory
    turns: list[AgentTurn] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    end: str = ""
    """'answer' (a final answer), 'max_turns', 'context_full', 'template_drift'."""
    request_id: str = ""
    """The episode's id in the run ('<group request id>-e<k>'): the sample's request id."""

    def count(self, key: str) -> int:
        return sum(int(t.step.info.get(key, 0)) for t in self.turns if t.step is not None)

    def sample(self) -> Sample:
        completion = self.trajectory.completion(self.request_id or self.prompt_id, self.prompt_id,
                                                self.turns[-1].completion.finish_reason if self.turns else "length")
        return Sample(completion, self.turns[-1].text if self.turns else "",
                      RewardResult(self.reward, correct=self.reward >= 1.0))


class _EpisodeRun:
    """An episode in flight: a chain of engine requests, each submitted from the previous one's callback."""

    def __init__(self, owner: "AgentEpisodes", prompt: Prompt, request_id: str, seed: int | None):
        self.owner, self.prompt, self.request_id, self.seed = owner, prompt, request_id, seed
        self.future: Future = Future()
        self.future.run = self  # type: ignore[attr-defined]
        self.current: Future | None = None
        self.changed = threading.Event()
        self.env: Environment | None = None
        self.episode: AgentEpisode | None = None

    def start(self) -> None:
        try:
            self.env = self.owner.make_environment()
            messages = self.env.reset(self.prompt)
            self.renderer = TurnRenderer(self.owner.tokenizer, messages, self.owner.tool_schemas(self.env))
            self.episode = AgentEpisode(self.prompt.prompt_id, Trajectory(self.renderer.prompt_ids()),
                                        request_id=self.request_id)
            self._submit()
        except BaseException as exc:  # noqa: BLE001 - surfaces in collect()
            self._fail(exc)

    def _submit(self) -> None:
        o, episode = self.owner, self.episode
        turn = len(episode.turns)
        prompt_ids = episode.trajectory.next_prompt()
        if o.max_seq_len is not None and len(prompt_ids) >= o.max_seq_len:
            self._finish("context_full", 0.0)
            return
        sampling = dataclasses.replace(o.sampling, n=1, seed=None if self.seed is None else
                                       (self.seed * 31 + turn) % (2 ** 31))
        request = GenerateRequest(request_id=f"{self.request_id}-t{turn}", prompt_ids=prompt_ids, sampling=sampling,
                                  group_id=self.prompt.prompt_id)
        try:
            (future,) = o.engine.submit([request])
        except RequestError as exc:
            if exc.field == "prompt_ids":  # the conversation outgrew the context
                self._finish("context_full", 0.0)
                return
            raise
        self.current = future
        self.changed.set()
        future.add_done_callback(self._on_sampled)

    def _on_sampled(self, future: Future) -> None:
        if self.owner.environment_pool is None:
            self._advance(future)
            return
        try:
            self.owner.environment_pool.submit(self._advance, future)
        except RuntimeError as exc:  # the producer closed: the run is ending
            self._fail(exc)

    def _advance(self, future: Future) -> None:
        """The environment answers the turn just sampled, and the next turn is submitted."""
        try:
            completion = future.result()
            o, episode = self.owner, self.episode
            text = o.tokenizer.decode(completion.output_ids)
            turn = AgentTurn(completion, text, [dict(m) for m in self.renderer.messages])
            episode.turns.append(turn)
            episode.trajectory.add_sampled(completion)
            turn.step = step = self.env.step(text)
            if step.done:
                self._finish(step.info.get("end", "done"), step.reward or 0.0)
                return
            try:
                ids = self.renderer.next_ids(completion.output_ids, text, step.messages)
            except TemplateDriftError:
                self._finish("template_drift", 0.0)
                return
            episode.trajectory.add_environment(ids)
            self._submit()
        except BaseException as exc:  # noqa: BLE001 - surfaces in collect(), never lost in a callback
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self._close()
        if not self.future.done():
            self.future.set_exception(exc)
        self.changed.set()

    def _finish(self, end: str, reward: float) -> None:
        self._close()
        self.episode.end, self.episode.reward = end, float(reward)
        self.future.finished_at = time.perf_counter()  # type: ignore[attr-defined]
        self.future.set_result(self.episode)
        self.changed.set()

    def _close(self) -> None:
        if self.env is not None:
            self.env.close()

    def drive(self) -> AgentEpisode:
        """Run the engine on this thread until the episode ends (the result, or its error)."""
        while not self.future.done():
            current = self.current
            if current is None or current.done():  # between two turns: the callback is submitting
                self.changed.wait(0.01)
                self.changed.clear()
                continue
            self.owner.engine.wait([current])
        return self.future.result()


class AgentEpisodes(EpisodeRuns):
    """Episode producer of multi-turn agent runs (controller/episodes.py's interface): each prompt's
    group is `samples_per_prompt` episodes, each one sample. `make_environment()` builds one episode's
    environment."""

    keeps_in_flight_samples = False

    def __init__(self, engine, tokenizer: ChatTokenizer, make_environment: Callable[[], Environment], *,
                 sampling: SamplingParams, samples_per_prompt: int = 1, record_path: str | None = None,
                 max_seq_len: int | None = None, environment_threads: int = 0):
        """`environment_threads` > 0: environment steps (tool calls) run on that many threads, so a slow
        tool does not hold the engine's batch; 0: in the engine's callback thread, which submits the next
        turns in a timing-independent order (synchronous runs, bit-exact resume)."""
        self.engine = engine
        self.environment_pool = (concurrent.futures.ThreadPoolExecutor(environment_threads, thread_name_prefix="agent-env")
                                 if environment_threads > 0 else None)
        self.tokenizer = tokenizer
        self.make_environment = make_environment
        self.sampling = sampling
        self.samples_per_prompt = samples_per_prompt
        self.record_path = record_path
        self.max_seq_len = max_seq_len or getattr(engine, "max_seq_len", None)
        self.reward_time = 0.0
        self.generated_samples = 0
        self.step = 0
        self._counts: dict[str, float] = {}
        self._renders_tools = renders_tools(tokenizer.chat_template)

    @property
    def engines(self) -> list:
        return [self.engine]

    def tool_schemas(self, env: Environment) -> list[dict[str, Any]] | None:
        """Tool schemas for templates that render `tools` (others get them in the system prompt)."""
        return [t.schema() for t in env.tools] if env.tools and self._renders_tools else None

    def begin_step(self, step: int) -> None:
        self.step = step

    def episode_run(self, prompt: Prompt, run_id: str, seed: int | None) -> "_EpisodeRun":
        return _EpisodeRun(self, prompt, run_id, seed)

    def collect(self, prompt: Prompt, futures: Sequence[Future]) -> list[Sample]:
        episodes = [f.run.drive() for f in futures]  # type: ignore[attr-defined]
        self.generated_samples += len(episodes)
        if self.record_path:
            with open(self.record_path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(episode_record(e, step=self.step + 1)) + "\n" for e in episodes)
        for episode in episodes:
            count_episode(self._counts, episode)
        return [e.sample() for e in episodes]

    def pop_metrics(self) -> dict[str, float]:
        counts, self._counts = self._counts, {}
        return {f"agent/{k}": v for k, v in episode_metrics(counts).items()}

    def close(self) -> None:
        if self.environment_pool is not None:
            self.environment_pool.shutdown(wait=False, cancel_futures=True)
        close_source = getattr(self.make_environment, "close", None)
        if close_source is not None:  # an environment library's process or server (verifiers, OpenEnv)
            close_source()

    def play(self, prompts: Sequence[Prompt], *, tag: str) -> list[AgentEpisode]:
        """One episode per prompt now, outside the training stream (evaluation), batched together."""
        with caller_driven(self.engine):
            futures = [f for i, p in enumerate(prompts) for f in self.start(p, f"{tag}-{i}", None)]
            return [f.run.drive() for f in futures]  # type: ignore[attr-defined]


def count_episode(counts: dict[str, float], episode: AgentEpisode) -> None:
    """Add one episode to running counts (`episode_metrics` turns them into rates)."""
    def add(key: str, value: float) -> None:
        counts[key] = counts.get(key, 0.0) + value

    add("episodes", 1)
    add(f"end_{episode.end}", 1)
    add("turns", len(episode.turns))
    add("tool_calls", episode.count("tool_calls"))
    add("malformed_calls", episode.count("malformed_calls"))
    add("tool_errors", episode.count("tool_errors"))
    add("reward", episode.reward)
    add("correct", float(episode.reward >= 1.0))
    add("sampled_tokens", episode.trajectory.sampled_tokens)
    add("environment_tokens", episode.trajectory.environment_tokens)
    add("used_tool", float(episode.count("tool_calls") > 0))
    final = episode.turns[-1].step if episode.turns else None
    for key, value in (final.info if final is not None else {}).items():
        if key.startswith("env/"):  # an environment library's own reward terms and metrics (per-episode means)
            add(key, float(value))


def episode_metrics(counts: dict[str, float]) -> dict[str, float]:
    """Per-episode means and rates of counts gathered by `count_episode`."""
    n = max(counts.get("episodes", 0.0), 1.0)
    attempts = counts.get("tool_calls", 0.0) + counts.get("malformed_calls", 0.0)
    out = {"episodes": counts.get("episodes", 0.0),
           "turns_per_episode": counts.get("turns", 0.0) / n,
           "tool_calls_per_episode": counts.get("tool_calls", 0.0) / n,
           "tool_errors": counts.get("tool_errors", 0.0),
           "malformed_tool_calls": counts.get("malformed_calls", 0.0),
           "wellformed_tool_call_rate": counts.get("tool_calls", 0.0) / attempts if attempts else 0.0,
           "tool_use_rate": counts.get("used_tool", 0.0) / n,
           "episode_reward": counts.get("reward", 0.0) / n,
           "accuracy": counts.get("correct", 0.0) / n,
           "sampled_tokens": counts.get("sampled_tokens", 0.0),
           "environment_tokens": counts.get("environment_tokens", 0.0)}
    for key, value in counts.items():
        if key.startswith("end_"):
            out[key] = value
        elif key.startswith("env/"):
            out[key] = value / n
    return out


def episode_record(episode: AgentEpisode, step: int | None = None) -> dict[str, Any]:
    """A JSON-able record of an episode: each turn's text, environment messages, versions and counts."""
    turns = [{"text": t.text, "versions": sorted(set(t.completion.weight_versions)),
              "tokens": len(t.completion.output_ids),
              "environment": t.step.messages if t.step is not None else [],
              "info": t.step.info if t.step is not None else {}} for t in episode.turns]
    return {"prompt_id": episode.prompt_id, **({"step": step} if step is not None else {}), "end": episode.end,
            "reward": episode.reward, "sampled_tokens": episode.trajectory.sampled_tokens,
            "environment_tokens": episode.trajectory.environment_tokens, "turns": turns}


def retokenization_changes(tokenizer: ChatTokenizer, episode: AgentEpisode,
                           tools: Sequence[dict[str, Any]] | None = None) -> dict[str, int]:
    """The negative control: what a loop that re-renders and re-tokenizes the whole conversation each
    turn (`encode_chat(messages)`) would have fed the engine instead of the token-exact prompts.
    Per turn after the first, the exact prompt is aligned with the re-tokenized one (difflib); counts:
    `prompt_tokens` (exact prompts' tokens, summed over turns), `changed_tokens` (exact tokens the
    re-tokenized prompt does not keep), `changed_sampled` (those the policy had sampled),
    `changed_turns` (turns whose prompt differs at all)."""
    out = {"turns": 0, "prompt_tokens": 0, "changed_tokens": 0, "changed_sampled": 0, "changed_turns": 0}
    trajectory = episode.trajectory
    sampled = [0] * len(trajectory.prompt_ids) + trajectory.mask
    for turn in episode.turns[1:]:
        exact = turn.completion.prompt_ids
        naive = tokenizer.encode_chat(turn.messages, tools=tools)
        matcher = difflib.SequenceMatcher(None, exact, naive, autojunk=False)
        kept = [0] * len(exact)
        for block in matcher.get_matching_blocks():
            kept[block.a:block.a + block.size] = [1] * block.size
        changed = [i for i, k in enumerate(kept) if not k]
        out["turns"] += 1
        out["prompt_tokens"] += len(exact)
        out["changed_tokens"] += len(changed)
        out["changed_sampled"] += sum(sampled[i] for i in changed)
        out["changed_turns"] += int(exact != naive)
    return out
