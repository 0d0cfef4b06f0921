"""agents/chat_tools.py's calculator task over OpenAI's Responses API (client.responses, as Codex and the OpenAI
Agents SDK speak it): the first turn must call the calculator; each call's output goes back with
previous_response_id, so the server continues the episode from the tokens it stored (one segment per chain); the
reward is the final answer's.

    python molt.py --agent agents/chat_responses.py --model tiny:qwen3
"""
import os

import molt
from molt import ChatAgent, ChatAgentRunner, Result

HERE = os.path.dirname(os.path.abspath(__file__))
tools_agent = molt.import_path(os.path.join(HERE, "chat_tools.py"))
grader = molt.import_path(os.path.join(HERE, "..", "rewards", "math_grader.py"))

DEFAULTS = tools_agent.DEFAULTS
CALCULATOR = {"type": "function", **tools_agent.CALCULATOR["function"]}  # Responses tools are flat


class CalculatorResponses(ChatAgent):
    async def run(self, ctx) -> Result:
        client, new, previous, r, calls, forced = ctx.openai(), list(ctx.messages), None, None, 0, 0.0
        for turn in range(ctx.max_turns):
            r = await client.responses.create(
                model=ctx.model_name, input=new, previous_response_id=previous, tools=[CALCULATOR],
                tool_choice="required" if turn == 0 else "auto",
                max_output_tokens=ctx.sampling_params.get("max_tokens"),
                temperature=ctx.sampling_params.get("temperature"))
            asked = [o for o in r.output if o.type == "function_call"]
            forced = float(bool(asked)) if turn == 0 else forced  # the forced call came back parsed
            if not asked:
                break
            calls, previous = calls + len(asked), r.id
            new = [{"type": "function_call_output", "call_id": c.call_id, "output": tools_agent.calculate(c.arguments)}
                   for c in asked]
        verdict = await molt.offload(grader.grade_verdict, r.output_text if r else "", ctx.label)
        return Result(reward=float(verdict.correct), info={"tools/calls": calls, "tools/forced_parsed": forced,
                                                         **verdict.info()})


AgentRunner = ChatAgentRunner(CalculatorResponses)
