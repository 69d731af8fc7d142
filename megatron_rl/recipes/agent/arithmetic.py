"""Safe arithmetic for the calculator tool: numbers, + - * / // % ** and parentheses through `ast`, exact
integers of any size up to MAX_RESULT_BITS. Stdlib only, so the sandboxed process imports it quickly."""
from __future__ import annotations

import ast
import math
import operator
import sys

MAX_RESULT_BITS = 1 << 20  # about 315,000 decimal digits
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ExpressionError(ValueError):
    """A refused or failing expression; the message is the one line the model sees."""


def calculate(expression: str) -> dict:
    """The sandbox entry of `Calculator`: {"result": text} or {"error": one line}."""
    try:
        return {"result": evaluate_arithmetic(expression)}
    except ExpressionError as err:
        return {"error": str(err)}


def evaluate_arithmetic(expression: str) -> str:
    """The value of an arithmetic expression, as Python writes it (str of an int, repr of a float).
    Only numbers, + - * / // % ** and parentheses; a result over MAX_RESULT_BITS is refused."""
    if not isinstance(expression, str) or not expression.strip():
        raise ExpressionError("empty expression")
    if len(expression) > 10_000:
        raise ExpressionError("expression longer than 10000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ExpressionError(f"not an arithmetic expression: {err.msg}") from None
    value = _evaluate(tree.body)
    if isinstance(value, int):
        return _int_text(value)
    return repr(value)


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant):
        if type(node.value) in (int, float):
            return node.value
        raise ExpressionError(f"unsupported constant {node.value!r} (numbers only)")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _refuse_huge(node.op, left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ExpressionError("division by zero") from None
        except OverflowError:
            raise ExpressionError("result too large") from None
        if isinstance(value, complex):
            raise ExpressionError("the result is not a real number")
        return value
    raise ExpressionError(f"unsupported syntax: {ast.unparse(node)[:60]!r} "
                           "(numbers, + - * / // % ** and parentheses only)")


def _refuse_huge(op: ast.operator, left: float, right: float) -> None:
    """Refuse integer results over MAX_RESULT_BITS before computing them (10**10**10 would not finish)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return
    if isinstance(op, ast.Pow) and right > 0 and abs(left) > 1:
        bits = right * math.log2(abs(left))
    elif isinstance(op, ast.Mult):
        bits = left.bit_length() + right.bit_length()
    else:
        return
    if bits > MAX_RESULT_BITS:
        raise ExpressionError(f"result too large (over {MAX_RESULT_BITS} bits)")


def _int_text(value: int) -> str:
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # the result is bounded by MAX_RESULT_BITS already
    try:
        return str(value)
    finally:
        sys.set_int_max_str_digits(limit)
