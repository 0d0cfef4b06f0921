"""agents/chat_tools.py's calculator task run by the OpenAI Agents SDK, as a Codex-style agent loop: the SDK's own
Runner and its Responses model class (OpenAIResponsesModel) pointed at the loopback server, streamed, each turn
continued by previous_response_id (auto_previous_response_id: only the new items are sent; the server extends the
segment from the tokens it stored). The first turn must call the calculator (tool_choice required; the SDK resets it
to auto once the tool ran). The reward is the final answer's.

The SDK raises on a response cut at max_output_tokens (status incomplete): that ends the episode with reward 0 (the
policy ran out of room; every turn up to it is recorded). Any other failure is the episode's error, counted.

    python molt.py --agent agents/chat_agents_sdk.py --model tiny:qwen3
"""
import json
import os
from typing import Annotated

import molt
from molt import ChatAgent, ChatAgentRunner, Result

HERE = os.path.dirname(os.path.abspath(__file__))
tools_agent = molt.import_path(os.path.join(HERE, "chat_tools.py"))
grader = molt.import_path(os.path.join(HERE, "..", "rewards", "math_grader.py"))

DEFAULTS = tools_agent.DEFAULTS


class CalculatorAgentsSDK(ChatAgent):
    async def run(self, ctx) -> Result:
        from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
        from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
        from agents.models.openai_responses import OpenAIResponsesModel
        from pydantic import Field

        @function_tool
        def calculate(expression: Annotated[str, Field(pattern=tools_agent.EXPRESSION)]) -> str:
            """Evaluate an arithmetic expression: numbers, + - * / and parentheses."""
            return tools_agent.calculate(json.dumps({"expression": expression}))

        settings = ModelSettings(tool_choice="required", temperature=ctx.sampling_params.get("temperature"),
                                 max_tokens=ctx.sampling_params.get("max_tokens"))
        agent = Agent(name="calculator", model=OpenAIResponsesModel(model=ctx.model_name, openai_client=ctx.openai()),
                      tools=[calculate], model_settings=settings)
        result = Runner.run_streamed(agent, list(ctx.messages), max_turns=ctx.max_turns, auto_previous_response_id=True,
                                     run_config=RunConfig(tracing_disabled=True))
        done, last = [], None  # the responses completed; the last raw event's type
        try:
            async for event in result.stream_events():
                if event.type == "raw_response_event":
                    last = event.data.type
                    done += [event.data.response] if last == "response.completed" else []
        except MaxTurnsExceeded:
            pass  # the policy kept calling the tool: no final answer
        except ModelBehaviorError:
            if last != "response.incomplete":
                raise
        calls = [o for r in done for o in r.output if o.type == "function_call"]
        forced = float(bool(done) and any(o.type == "function_call" for o in done[0].output))
        answer = result.final_output if result.is_complete and isinstance(result.final_output, str) else ""
        verdict = await molt.offload(grader.grade_verdict, answer, ctx.label)
        return Result(reward=float(verdict.correct), info={"tools/calls": len(calls), "tools/forced_parsed": forced,
                                                         "agent/cut": float(last == "response.incomplete"),
                                                         **verdict.info()})


AgentRunner = ChatAgentRunner(CalculatorAgentsSDK)
