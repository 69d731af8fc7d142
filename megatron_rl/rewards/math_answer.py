"""Math final-answer equivalence: HuggingFace's math-verify when installed, else exact numbers.

`answers_match(gold, predicted)` parses both with math-verify (LaTeX and plain expressions, sympy
equivalence: 0.5 == \\frac{1}{2}, x^2+1 == 1+x^2). Without math-verify it falls back to exact rational
comparison of plain numbers (1,000 == 1000.0, 3/6 == 0.5) and to whitespace/case-insensitive string
equality otherwise; the fallback never evaluates model text as code.

math-verify's own timeouts use SIGALRM, which only works in the main thread; elsewhere they are off.
"""
from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation
from fractions import Fraction

try:
    import math_verify as _math_verify
except ImportError:  # optional dependency
    _math_verify = None


def have_math_verify() -> bool:
    return _math_verify is not None


def _to_fraction(text: str) -> Fraction | None:
    s = text.strip().strip("$").replace(",", "").replace("\u2212", "-").replace(" ", "")
    s = s.rstrip(".")
    if not s:
        return None
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return Fraction(Decimal(num)) / Fraction(Decimal(den))
        return Fraction(Decimal(s))
    except (InvalidOperation, ValueError, ZeroDivisionError):
        return None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().strip("$").rstrip(".")).casefold()


def _mv_parse(text: str, timeout: int | None, isolated: bool) -> list:
    """An isolated answer is read whole as LaTeX math ('1+x^2' is 1+x^2, not the first number in it);
    free text lets math-verify find the answer in it."""
    parsed = []
    if isolated and "$" not in text and "\\boxed" not in text:
        parsed = _math_verify.parse(f"${text}$", parsing_timeout=timeout)
    if not parsed:
        parsed = _math_verify.parse(text, parsing_timeout=timeout)
    return parsed


def answers_match(gold: str, predicted: str | None, *, isolated: bool = True, timeout_s: int = 5) -> bool:
    """True when `predicted` is mathematically equivalent to the reference answer `gold`.

    `isolated`: `predicted` is an extracted final answer (boxed, tagged, a number); False when it is
    free text (a whole line) in which math-verify should look for the answer."""
    if predicted is None or not predicted.strip():
        return False
    g, p = _to_fraction(gold), _to_fraction(predicted)
    if g is not None and p is not None:
        return g == p
    if _math_verify is not None:
        timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
        gold_parsed = _mv_parse(gold, timeout, True)
        pred_parsed = _mv_parse(predicted, timeout, isolated)
        if gold_parsed and pred_parsed:
            return bool(_math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    return _normalise(gold) == _normalise(predicted)
