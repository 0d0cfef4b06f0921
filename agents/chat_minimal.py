"""One-turn ChatAgent through the stock OpenAI SDK, pointed at Molt's loopback server (which records the turn
token-exactly). The same math task as agents/math.py, from the agent's side of the wire.

    python molt.py --agent agents/chat_minimal.py
"""
import os

import molt
from molt import ChatAgent, ChatAgentRunner, Result

HERE = os.path.dirname(os.path.abspath(__file__))
grader = molt.import_path(os.path.join(HERE, "..", "rewards", "math_grader.py"))

DEFAULTS = {"data.path": os.path.join(HERE, "..", "examples", "math_tiny.jsonl"),
            "rollout.max_new_tokens": 64, "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4, "steps": 4}


class MinimalChat(ChatAgent):
    async def run(self, ctx) -> Result:
        # ctx.openai() is AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) sharing one connection pool
        reply = await ctx.openai().chat.completions.create(model=ctx.model_name, messages=ctx.messages,
                                                     max_tokens=ctx.sampling_params.get("max_tokens"),
                                                     temperature=ctx.sampling_params.get("temperature"))
        verdict = await molt.offload(grader.grade_verdict, reply.choices[0].message.content or "", ctx.label)
        reward = float(verdict.correct)
        return Result(reward=reward, info={"math/correct": reward, **verdict.info()})


AgentRunner = ChatAgentRunner(MinimalChat)
