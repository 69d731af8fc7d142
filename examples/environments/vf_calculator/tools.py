"""The calculator toolset of vf_calculator: a module of its own, because the library starts each toolset
as an MCP server with `python -m <its module>`."""
from __future__ import annotations

import ast
import operator

import verifiers.v1 as vf

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """Integer arithmetic (+, -, *, parentheses) without eval."""
    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")
    return value(ast.parse(expression.replace(",", ""), mode="eval"))


class CalculatorTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the model sees the bare name `calculator`

    @vf.tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression with integers, +, -, * and parentheses."""
        return str(evaluate(expression))


if __name__ == "__main__":
    CalculatorTools.run()
