"""The calculator tool of the vf_calc environment: verifiers runs it as an MCP server (python -m vf_calc_tools)."""
import ast
import operator
from typing import Annotated

import verifiers.v1 as vf
from pydantic import Field

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def evaluate(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](evaluate(node.operand))
    raise ValueError("only integers with + - *")


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def calculator(self, expression: Annotated[str, Field(pattern=r"^[0-9+*-]{1,12}$")]) -> str:
        """Evaluate an integer expression with + - * (e.g. '17*23')."""
        return str(evaluate(ast.parse(expression, mode="eval").body))


if __name__ == "__main__":
    CalcToolset.run()
