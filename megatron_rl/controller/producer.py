"""Rollout production: prompts -> engine samples -> rewards, grouped per prompt, under a staleness bound.

One `RolloutProducer` serves the synchronous and the asynchronous loop. It keeps submitting prompt
groups to the engine while admission control allows: a group may be started only if it will be
consumed no more than `max_staleness` weight versions after the version that generates it. With
`max_staleness: 0` it starts a step's groups only once the previous step's weights are in the engine,
which is exactly the synchronous on-policy loop; with k > 0 the engine runs up to k steps ahead while
the trainer trains (LlamaRL's asynchronous off-policy mode, corrected by AIPO).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import Future
from typing import Any, Sequence

import torch

from megatron_rl.controller.episodes import EpisodeProducer, Group, GroupRequest
from megatron_rl.data.prompts import DataError, Prompt
from megatron_rl.data.sources import PromptStream
from megatron_rl.data.tokenizer import ChatTokenizer
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine import caller_driven
from megatron_rl.types import Completion


@dataclasses.dataclass
class _Pending:
    """A prompt group submitted to the engine and not yet handed to the trainer."""

    index: int
    """The prompt's index in the training data set (what a checkpoint records)."""
    prompt: Prompt
    """The prompt."""
    step: int
    """Training step that will consume it."""
    submitted: float
    """perf_counter() at submission."""
    futures: list[Future] = dataclasses.field(default_factory=list)
    """One future per sample (resolves to a Completion)."""
    slot: int = 0
    """Its position among the step's groups (with the step, it names the request and its seed)."""
    prompt_ids: list[int] | None = None
    """Its chat-rendered token ids (None for a group restored from a checkpoint, rendered at submission)."""


class RolloutProducer:
    """Keeps the engines fed with prompt groups within the staleness bound; hands out scored groups.

    What a group is belongs to the episode producer (controller/episodes.py): n samples of the prompt
    from one engine scored by the reward (`SingleTurnSampling`), WaltzRL's two-agent episodes, ... This
    class owns when groups start (admission), which prompts they are (the stream and the curriculum),
    and the buffer of admitted groups not yet consumed.

    Its state (`state_dict`) is that rollout buffer: every admitted group not yet consumed, with its
    samples' tokens, behaviour log-probs and per-token weight versions. Together with the prompt
    cursor (which has already moved past those prompts) a checkpoint therefore loses no prompt and
    repeats none: a resumed run trains on exactly the groups the interrupted one would have."""

    def __init__(self, episodes: EpisodeProducer, tokenizer: ChatTokenizer, stream: PromptStream,
                 config: RolloutConfig, *, seed: int, timeline=None, max_prompt_tokens: int | None = None,
                 selector=None):
        self.episodes = episodes
        self.tokenizer = tokenizer
        self.stream = stream
        self.config = config
        self.seed = seed
        self.timeline = timeline
        self.max_prompt_tokens = max_prompt_tokens  # longest prompt the engine's context admits
        self._in_flight: list[_Pending] = []
        self._skipped: dict[int, list[str]] = {}  # step -> ids of overlong prompts skipped while drawing it
        self._admitted_steps = 0  # training steps whose groups have been submitted
        self._unsubmitted: list[_Pending] = []  # restored groups to generate again, submitted at the next admission
        self.last_skipped: list[str] = []  # prompt ids skipped for the step next_groups returned last
        # The curriculum hook (controller/curriculum.py): which prompts a step generates
        # (`draw(stream, count, step)` -> (data set index, prompt) pairs) and which scored groups it
        # trains on (`keep_groups`).
        self.selector = selector

    @property
    def reward_time(self) -> float:
        """Seconds spent scoring, cumulative."""
        return self.episodes.reward_time

    @property
    def generated_samples(self) -> int:
        """Responses generated, cumulative (discarded ones included)."""
        return self.episodes.generated_samples

    def begin_step(self, step: int) -> None:
        """Called before the groups of training step `step` are collected (multi-stage episodes)."""
        self.episodes.begin_step(step)

    def pop_metrics(self) -> dict[str, float]:
        """Episode metrics gathered since the last call."""
        return self.episodes.pop_metrics()

    def _draw(self, step: int) -> list[tuple[int, Prompt, list[int]]]:
        """The step's prompts (index, prompt, token ids), overlong ones skipped or reported. Without a
        selector, skipped prompts are replaced from the stream; a selector's pick is taken as it is."""
        count = self.config.prompts_per_step
        drawn: list[tuple[int, Prompt, list[int]]] = []
        while not drawn or (self.selector is None and len(drawn) < count):
            wanted = count - len(drawn)
            candidates = (self.selector.draw(self.stream, wanted, step) if self.selector is not None
                          else self.stream.next_indexed(wanted))
            for index, prompt in candidates:
                ids = self.tokenizer.encode_chat(prompt.messages)
                if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                    if self.config.on_overlong_prompt == "error":
                        raise DataError(
                            f"{_where(prompt)}: prompt {prompt.prompt_id!r} has {len(ids)} tokens after the chat "
                            f"template, more than the {self.max_prompt_tokens} the engine's context leaves for "
                            f"a prompt (engine.max_seq_len); shorten it, raise engine.max_seq_len, or set "
                            f"rollout.on_overlong_prompt=skip")
                    self._skipped.setdefault(step, []).append(prompt.prompt_id)
                    continue
                drawn.append((index, prompt, ids))
        return drawn

    def _admit(self, trainer_version: int) -> None:
        """Submit groups for every step s whose consumption version s stays within the bound.

        Step s (0-based) is consumed by the trainer at version s; its groups may be generated by
        weights of version >= s - max_staleness, and the engine holds `trainer_version` now. All
        groups admitted together go to the episode producer in one submission (one scheduling decision,
        so deterministic mode sees the same batches on every run)."""
        if self._unsubmitted:  # restored from a checkpoint; already in _in_flight, in order
            self._submit(self._unsubmitted)
            self._unsubmitted = []
        admitted = []
        while self._admitted_steps <= trainer_version + self.config.max_staleness:
            step = self._admitted_steps
            for slot, (index, prompt, ids) in enumerate(self._draw(step)):
                admitted.append(_Pending(index, prompt, step, time.perf_counter(), slot=slot, prompt_ids=ids))
            self._admitted_steps += 1
        if admitted:
            self._submit(admitted)
            self._in_flight.extend(admitted)

    def _group_seed(self, step: int, slot: int) -> int:
        # Seeds derive from (run seed, step, slot): a resumed run samples exactly the same.
        return (self.seed * 1_000_003 + step * 1009 + slot) % (2 ** 31)

    def _submit(self, groups: list[_Pending]) -> None:
        requests = []
        for group in groups:
            if group.prompt_ids is None:  # a restored group: render it again
                group.prompt_ids = self.tokenizer.encode_chat(group.prompt.messages)
            requests.append(GroupRequest(group.prompt, group.prompt_ids,
                                         f"s{group.step}-p{group.slot}-{group.prompt.prompt_id}",
                                         self._group_seed(group.step, group.slot)))
        submitted = time.perf_counter()
        for group, futures in zip(groups, self.episodes.submit(requests)):
            group.submitted, group.futures = submitted, futures

    def _steps_here(self) -> contextlib.ExitStack:
        """Synchronous runs: the engines step only in this thread while a step's groups are admitted and
        collected, so their batches (and the log-probs' last bits) do not depend on thread timing (see
        rollout.engine.caller_driven). Asynchronous runs leave the background threads generating the
        next steps' groups while the trainer trains."""
        if self.config.is_async:
            return contextlib.ExitStack()
        return caller_driven(*self.episodes.engines)

    def next_groups(self, trainer_version: int) -> list[Group]:
        """The groups of the next training step (blocks until they are generated and scored)."""
        with self._steps_here():
            return self._next_groups(trainer_version)

    def _next_groups(self, trainer_version: int) -> list[Group]:
        self._admit(trainer_version)
        step = self._in_flight[0].step
        batch = [pending for pending in self._in_flight if pending.step == step]
        self._in_flight = self._in_flight[len(batch):]
        self.last_skipped = self._skipped.pop(step, [])
        groups = []
        for pending in batch:
            samples = self.episodes.collect(pending.prompt, pending.futures)
            elapsed = time.perf_counter() - pending.submitted
            if self.timeline is not None:
                finished = max(getattr(f, "finished_at", time.perf_counter()) for f in pending.futures)
                self.timeline.add(f"generate {pending.prompt.prompt_id}", pending.submitted, finished,
                                  category="generate", lane="generate", step=pending.step,
                                  versions=sorted({s.completion.weight_version for s in samples}))
            groups.append(Group(pending.prompt, samples, pending.step, elapsed))
        if self.selector is not None:
            groups = self.selector.keep_groups(groups, self.config.prompts_per_step)
        return groups

    def rollout(self, prompts: Sequence[Prompt], *, tag: str, seed: int) -> list[Group]:
        """Generate and score `prompts` now with the engine's current weights, outside the training
        stream (pre-filtering, benchmarks); single-turn sampling only."""
        return self.episodes.rollout(prompts, tag=tag, seed=seed)

    def drain(self) -> None:
        """Block until every submitted sample has finished (under the weights the engine holds now)."""
        self.episodes.drain([f for pending in self._in_flight for f in pending.futures])

    def resume_at(self, step: int) -> None:
        """Continue a restored run with an empty buffer: the next groups admitted belong to step `step`."""
        if self._in_flight:
            raise RuntimeError("resume_at() needs an idle producer")
        self._admitted_steps = step

    def pending_prompt_ids(self) -> list[str]:
        return [pending.prompt.prompt_id for pending in self._in_flight]

    # --- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The rollout buffer as (tensors, JSON-able metadata) for a checkpoint.

        Responses still being generated are finished first (under the engine's current weights, as
        they would have been), so the saved buffer holds whole samples with their per-token versions;
        a resumed run consumes them exactly as the interrupted run would have. Groups of an episode
        producer (multi-turn, multi-agent) keep only their prompt, step and slot: a resumed run
        generates them again, with the same seeds, under the restored weights (so no prompt is lost or
        repeated, but their samples are those of the resumed weights, not of the interrupted run)."""
        self.drain()
        skipped = {str(step): ids for step, ids in self._skipped.items()}
        if not self.episodes.keeps_in_flight_samples:
            groups = [{"index": p.index, "prompt_id": p.prompt.prompt_id, "step": p.step, "slot": p.slot}
                      for p in self._in_flight]
            return {}, {"admitted_steps": self._admitted_steps, "groups": [], "episode_groups": groups,
                        "skipped": skipped, "generated_samples": self.generated_samples}
        columns: dict[str, list] = {"prompt_ids": [], "output_ids": [], "output_logprobs": [], "weight_versions": []}
        groups = []
        for pending in self._in_flight:
            samples = []
            for future in pending.futures:
                if future.exception() is not None:
                    samples.append({"error": f"{type(future.exception()).__name__}: {future.exception()}"})
                    continue
                completion: Completion = future.result()
                for name, column in columns.items():
                    column.extend(getattr(completion, name))
                samples.append({"request_id": completion.request_id, "finish_reason": completion.finish_reason,
                                "group_id": completion.group_id, "prompt_len": len(completion.prompt_ids),
                                "output_len": len(completion.output_ids)})
            groups.append({"index": pending.index, "prompt_id": pending.prompt.prompt_id, "step": pending.step,
                           "samples": samples})
        tensors = {"prompt_ids": torch.tensor(columns["prompt_ids"], dtype=torch.int64),
                   "output_ids": torch.tensor(columns["output_ids"], dtype=torch.int64),
                   "output_logprobs": torch.tensor(columns["output_logprobs"], dtype=torch.float64),
                   "weight_versions": torch.tensor(columns["weight_versions"], dtype=torch.int64)}
        metadata = {"admitted_steps": self._admitted_steps, "groups": groups, "skipped": skipped,
                    "generated_samples": self.generated_samples}
        return tensors, metadata

    def load_state_dict(self, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
        """Restore a buffer saved by `state_dict` (the producer must be idle; the prompt cursor is
        restored separately and already points past these prompts)."""
        if self._in_flight:
            raise RuntimeError("load_state_dict() needs an idle producer")
        dataset = self.stream.dataset
        offsets = dict.fromkeys(tensors, 0)

        def take(name: str, count: int) -> list:
            start = offsets[name]
            offsets[name] = start + count
            return tensors[name][start:start + count].tolist()

        def restore(group: dict[str, Any]) -> _Pending:
            index = int(group["index"])
            if not 0 <= index < len(dataset) or dataset[index].prompt_id != group["prompt_id"]:
                raise DataError(f"checkpoint rollout buffer: prompt {group['prompt_id']!r} (data set index {index}) "
                                f"is not in the training data any more (the data or its config changed)")
            return _Pending(index, dataset[index], int(group["step"]), time.perf_counter(),
                            slot=int(group.get("slot", 0)))

        episode_groups = metadata.get("episode_groups", [])
        if episode_groups and self.episodes.keeps_in_flight_samples:
            raise DataError("checkpoint rollout buffer: it holds episode groups to generate again (a multi-agent run's, "
                            "e.g. WaltzRL), but this run's episode producer keeps in-flight samples")
        restored = [restore(group) for group in episode_groups]
        self._unsubmitted = list(restored)  # the engines get their restored weights before the next admission
        for group in metadata["groups"]:
            pending = restore(group)
            for sample in group["samples"]:
                future: Future = Future()
                if "error" in sample:
                    future.set_exception(RuntimeError(sample["error"]))
                else:
                    p, n = int(sample["prompt_len"]), int(sample["output_len"])
                    future.set_result(Completion(
                        request_id=sample["request_id"], prompt_ids=take("prompt_ids", p),
                        output_ids=take("output_ids", n), output_logprobs=take("output_logprobs", n),
                        weight_versions=take("weight_versions", n), finish_reason=sample["finish_reason"],
                        group_id=sample["group_id"]))
                pending.futures.append(future)
            restored.append(pending)
        self._in_flight = restored
        self._skipped = {int(step): list(ids) for step, ids in metadata.get("skipped", {}).items()}
        self._admitted_steps = int(metadata["admitted_steps"])
        # rollout/generated_samples_total continues across a resume (older checkpoints: from 0)
        self.episodes.generated_samples = int(metadata.get("generated_samples", 0))


def _where(prompt: Prompt) -> str:
    """'file:row' for prompts read from files, the task for generated ones."""
    meta = prompt.metadata or {}
    if meta.get("source"):
        return f"{meta['source']}: row {meta.get('row')}"
    if "reasoning_gym" in meta:
        return f"reasoning-gym {meta['reasoning_gym'].get('task')}"
    return "prompt"
