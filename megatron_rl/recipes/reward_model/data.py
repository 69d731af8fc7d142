"""Preference pairs from files: each row a prompt with a chosen and a rejected answer (TRL's preference
format: `prompt`, `chosen`, `rejected`; strings or chat messages; without `prompt`, each answer is a whole
conversation). Rendered with the reward model's chat template exactly as `reward.name: reward_model`
renders what it scores (rewards/reward_model.py: conversation_ids)."""
from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

from megatron_rl.data.prompts import DataError, message_text, normalize_messages
from megatron_rl.data.sources import file_rows
from megatron_rl.rewards.reward_model import conversation_ids


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """Two whole conversations that differ in their answer; `where`: file:line, for messages."""

    chosen: list[dict[str, str]]
    rejected: list[dict[str, str]]
    where: str


def _messages(value: Any, role: str, where: str, field: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value:
        return normalize_messages(value, where, field)
    raise DataError(f"{where}: field '{field}' must be a string or a non-empty list of chat messages, got {value!r}")


def _pair(row: Any, where: str) -> PreferencePair:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a preference pair must be an object with 'chosen' and 'rejected', got {row!r}")
    for field in ("chosen", "rejected"):
        if field not in row:
            raise DataError(f"{where}: field '{field}' is missing (a row needs 'chosen' and 'rejected'; "
                            "'prompt' is optional)")
    prompt = _messages(row["prompt"], "user", where, "prompt") if row.get("prompt") not in (None, "") else []
    sides = [prompt + _messages(row[field], "assistant", where, field) for field in ("chosen", "rejected")]
    for field, messages in zip(("chosen", "rejected"), sides):
        if messages[-1]["role"] != "assistant":
            raise DataError(f"{where}: field '{field}' must end with the assistant's answer, "
                            f"got a last message of role {messages[-1]['role']!r}")
        message_text(messages[-1]["content"], where, field)
    if sides[0] == sides[1]:
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same conversation")
    return PreferencePair(chosen=sides[0], rejected=sides[1], where=where)


def load_pairs(path: str, field: str = "data.train") -> list[PreferencePair]:
    """Every pair of a file; the first bad row is refused with its file, line and field."""
    if not os.path.isfile(path):
        raise DataError(f"{field}: no file {path}", field=field)
    pairs = []
    for _, where, row in file_rows(path):
        if isinstance(row, DataError):
            raise row
        pairs.append(_pair(row, where))
    if not pairs:
        raise DataError(f"{path}: no preference pairs")
    return pairs


def split_heldout(pairs: list[PreferencePair], fraction: float, seed: int,
                  ) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out): a seeded draw of round(fraction * N) pairs (at least one each side)."""
    if len(pairs) < 2:
        raise DataError(f"{pairs[0].where if pairs else 'data'}: {len(pairs)} pair(s) cannot be split into "
                        "training and held-out pairs (give data.heldout)")
    count = min(max(1, round(fraction * len(pairs))), len(pairs) - 1)
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]


def tokenize_pairs(tokenizer, pairs: list[PreferencePair], max_length: int,
                   ) -> tuple[list[list[int]], list[list[int]], int]:
    """(chosen ids, rejected ids, pairs left out because a side is longer than max_length tokens)."""
    chosen, rejected, dropped = [], [], 0
    for pair in pairs:
        c, r = conversation_ids(tokenizer, pair.chosen), conversation_ids(tokenizer, pair.rejected)
        if max(len(c), len(r)) > max_length:
            dropped += 1
            continue
        chosen.append(c)
        rejected.append(r)
    return chosen, rejected, dropped
