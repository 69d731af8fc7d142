"""Prompts and data sets: the records every source produces (JSONL, parquet, reasoning-gym, CHAMP, the
WaltzRL safety sets), their stable ids and chat messages, and the error bad data raises."""
from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, Iterator


class DataError(ValueError):
    """Bad input data; the message names the file, the line or row, and the field."""


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

def chat_messages(question_or_messages: Any, system: str | None, template: str, where: str,
              field: str) -> tuple[list[dict[str, str]], str]:
    if isinstance(question_or_messages, str):
        question = question_or_messages
        messages = [{"role": "user", "content": template.format(question=question)}]
    elif isinstance(question_or_messages, (list, tuple)) and question_or_messages:
        messages = []
        for m in question_or_messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: field '{field}' must be a string or a list of "
                                f"{{'role': str, 'content': str}} messages, got item {m!r}")
            messages.append({"role": m["role"], "content": m["content"]})
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
