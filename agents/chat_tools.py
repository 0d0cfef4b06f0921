"""A tool-using ChatAgent through the stock OpenAI SDK: the math task with a calculator. The first turn must call it
(tool_choice required: the call is written in the model's own format and parsed by vLLM's parser for it); the agent
runs each call, sends the result back as a tool message, and lets the model go on until it answers without a call or
runs out of turns. The reward is the final answer's, graded as agents/math.py grades it.

    python molt.py --agent agents/chat_tools.py --model tiny:qwen3
"""
import ast
import json
import operator
import os

import molt
from molt import ChatAgent, ChatAgentRunner, Result

HERE = os.path.dirname(os.path.abspath(__file__))
grader = molt.import_path(os.path.join(HERE, "..", "rewards", "math_grader.py"))

DEFAULTS = {"data.path": os.path.join(HERE, "..", "examples", "math_tiny.jsonl"), "rollout.max_turns": 3,
            "rollout.max_new_tokens": 96, "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4, "steps": 4}
# 96 tokens: room for the forced call, whose expression the schema holds to 32 characters (the call is 90 tokens at
# most on tiny's character vocabulary, 50 on Qwen3's)
EXPRESSION = r"^[0-9+*/(). -]{1,32}$"  # what the calculator reads, short: a forced call is guided to fit it and end
CALCULATOR = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression: numbers, + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "pattern": EXPRESSION}},
                   "required": ["expression"]}}}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(arguments: str) -> str:
    """The calculator: the expression is parsed, never executed; anything but numbers and + - * / is an error
    message for the model (the policy writes the arguments: they are input, not code)."""
    try:
        expression = json.loads(arguments)["expression"]
        if not isinstance(expression, str) or len(expression) > 200:
            raise ValueError("the expression must be a string of at most 200 characters")
        return repr(evaluate(ast.parse(expression, mode="eval").body))
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError, OverflowError, RecursionError) as err:
        return f"error: {type(err).__name__}: {err}"[:200]


def evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.operand))
    raise ValueError(f"not arithmetic: {type(node).__name__}")


class CalculatorChat(ChatAgent):
    async def run(self, ctx) -> Result:
        client, messages, calls, reply, forced = ctx.openai(), list(ctx.messages), 0, None, 0.0
        for turn in range(ctx.max_turns):
            r = await client.chat.completions.create(
                model=ctx.model_name, messages=messages, tools=[CALCULATOR],
                tool_choice="required" if turn == 0 else "auto", max_tokens=ctx.sampling_params.get("max_tokens"),
                temperature=ctx.sampling_params.get("temperature"))
            reply = r.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))  # sent back as the SDK returns it
            forced = float(bool(reply.tool_calls)) if turn == 0 else forced  # the forced call came back parsed
            if not reply.tool_calls:
                break
            calls += len(reply.tool_calls)
            messages += [{"role": "tool", "tool_call_id": c.id, "content": calculate(c.function.arguments)}
                         for c in reply.tool_calls]
        verdict = await molt.offload(grader.grade_verdict, (reply.content or "") if reply else "", ctx.label)
        return Result(reward=float(verdict.correct), info={"tools/calls": calls, "tools/forced_parsed": forced,
                                                         **verdict.info()})


AgentRunner = ChatAgentRunner(CalculatorChat)
