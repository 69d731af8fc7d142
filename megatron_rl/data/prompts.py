"""Prompts and data sets: the records every source produces (JSONL, parquet, reasoning-gym, CHAMP, the
WaltzRL safety sets), their stable ids and chat messages, and the error bad data raises."""
from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, Iterator

from megatron_rl.config import ConfigError


class DataError(ConfigError):
    """Bad input data; the message names the file, the line or row, and the field. A ConfigError, so the
    CLI prints it as one line and exits 2."""


@dataclasses.dataclass
class Prompt:
    """One prompt of a data set."""

    prompt_id: str
    """Stable id: the row's id field when configured, else `<source>-<hash of question and answer>`."""
    messages: list[dict[str, str]]
    """Chat messages to render with the tokenizer's template ({'role', 'content'}), system prompt first
    when one is configured; with no system message the template's own default applies."""
    question: str
    """The question text (the last user message); the key for de-duplication."""
    answer: str | None = None
    """Reference answer (None for sources without one)."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra data for rewards: for reasoning-gym `{'reasoning_gym': {'task', 'config', 'entry'}}`;
    for files, `{'source': path, 'row': line or row number}` and the row's other fields under 'row_data'."""


@dataclasses.dataclass
class PromptDataset:
    """An ordered, de-duplicated list of prompts with counts of what was dropped."""

    name: str
    prompts: list[Prompt]
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    """rows_read, bad_rows_skipped, duplicates_dropped, heldout_overlap_dropped."""
    first_bad_row: str | None = None
    """With on_bad_row=skip: the error of the first row skipped (logged with the count)."""

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.prompts)

    def questions(self) -> set[str]:
        return {normalize_question(p.question) for p in self.prompts}


def normalize_question(text: str) -> str:
    """The de-duplication key: whitespace collapsed and stripped (case and punctuation kept)."""
    return re.sub(r"\s+", " ", text).strip()


def stable_id(prefix: str, question: str, answer: str | None) -> str:
    digest = hashlib.sha1(f"{normalize_question(question)}\x00{answer}".encode("utf-8")).hexdigest()
    return f"{prefix}-{digest[:16]}"


def message_text(content: Any, where: str, field: str) -> str:
    """A message's content as text: a string, or OpenAI content parts of type 'text', joined with newlines
    as vLLM and SGLang join text-only parts for string chat templates. Any other part is refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)) and content:
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and not isinstance(part.get("text"), str):
                raise DataError(f"{where}: field '{field}' content part {i} of type 'text' has no string 'text'")
            if kind != "text":
                what = f"a part of type {kind!r}" if isinstance(kind, str) else f"the part {part!r}"
                raise DataError(f"{where}: field '{field}' content part {i} is {what}; only text parts "
                                f"({{'type': 'text', 'text': str}}) are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise DataError(f"{where}: field '{field}' must be a string or a non-empty list of text parts, "
                    f"got {content!r}")


def normalize_messages(raw: Any, where: str, field: str) -> list[dict[str, str]]:
    """Chat messages ({'role', 'content'}) with text content, from a row's list of messages."""
    messages = []
    for i, m in enumerate(raw):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
            raise DataError(f"{where}: field '{field}' must be a string or a list of "
                            f"{{'role': str, 'content': str}} messages, got item {m!r}")
        messages.append({"role": m["role"], "content": message_text(m["content"], where, f"{field}[{i}].content")})
    return messages


def split_final_assistant(messages: list[dict[str, str]], mode: str, where: str, field: str,
                          ) -> tuple[list[dict[str, str]], str | None]:
    """(prompt messages, final assistant text or None). A conversation ending with an assistant turn never
    keeps that turn in the prompt: mode 'answer' and 'drop' take it off, 'error' refuses the row."""
    if not messages or messages[-1]["role"] != "assistant":
        return messages, None
    if mode == "error":
        raise DataError(f"{where}: field '{field}' ends with an assistant turn (data.*.final_assistant_turn=error); "
                        f"set final_assistant_turn=answer to use it as the reference answer")
    return messages[:-1], messages[-1]["content"]


def chat_messages(question_or_messages: Any, system: str | None, template: str, where: str,
                  field: str) -> tuple[list[dict[str, str]], str]:
    if isinstance(question_or_messages, str):
        question = question_or_messages
        messages = [{"role": "user", "content": template.format(question=question)}]
    elif isinstance(question_or_messages, (list, tuple)) and question_or_messages:
        messages = normalize_messages(question_or_messages, where, field)
        users = [m["content"] for m in messages if m["role"] == "user"]
        if not users:
            raise DataError(f"{where}: field '{field}' has no user message")
        question = users[-1]
        if system is not None and messages[0]["role"] == "system":
            system = None  # the row's own system message wins
    else:
        raise DataError(f"{where}: field '{field}' must be a non-empty string or list of chat messages, "
                        f"got {type(question_or_messages).__name__}")
    if not question.strip():
        raise DataError(f"{where}: field '{field}' is empty")
    if system is not None:
        messages = [{"role": "system", "content": system}] + messages
    return messages, question
