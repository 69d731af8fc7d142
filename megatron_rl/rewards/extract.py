"""Final-answer extraction from a model response: answer tag, boxed, last number, last line.

`extract_answer(text, mode, reference)` with mode:
- `answer_tag`: the content of the last `<answer>...</answer>` (reasoning-gym's format);
- `boxed`: the content of the last `\\boxed{...}` / `\\fbox{...}`, braces balanced;
- `last_number`: the last number (sign, thousands commas, decimals, a/b fractions; commas removed);
- `last_line`: the last non-empty line;
- `none`: the whole response, stripped;
- `auto`: answer tag, else boxed, else (when the reference answer is a number) last number, else last line.
Each returns None when nothing matches.
"""
from __future__ import annotations

import re
from typing import Literal

ExtractMode = Literal["auto", "answer_tag", "boxed", "last_number", "last_line", "none"]

_ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL | re.IGNORECASE)
# A sign only when it is not a binary minus (not after a word character, ')' or ']').
_NUMBER = re.compile(
    r"(?:(?<![\w)\]])[-\u2212])?"
    r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:\s*/\s*\d+)?|\.\d+)"
)
_NUMERIC_REFERENCE = re.compile(r"^\s*[-+\u2212]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:\s*/\s*\d+)?\s*$")


def answer_tag(text: str) -> str | None:
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) with nested braces balanced."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def last_number(text: str) -> str | None:
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    number = matches[-1].replace(",", "").replace("\u2212", "-")
    return re.sub(r"\s+", "", number)


def last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def is_numeric(reference: str | None) -> bool:
    return reference is not None and bool(_NUMERIC_REFERENCE.match(reference))


def extract_answer(text: str, mode: ExtractMode = "auto", reference: str | None = None) -> str | None:
    if mode == "answer_tag":
        return answer_tag(text)
    if mode == "boxed":
        return last_boxed(text)
    if mode == "last_number":
        return last_number(text)
    if mode == "last_line":
        return last_line(text)
    if mode == "none":
        return text.strip()
    if mode != "auto":
        raise ValueError(f"unknown extraction mode {mode!r}")
    for found in (answer_tag(text), last_boxed(text)):
        if found is not None:
            return found
    if is_numeric(reference):
        return last_number(text)
    return last_line(text)
