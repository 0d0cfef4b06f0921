"""The geo3k task as a ChatAgent: the stock OpenAI SDK with real `tools`; tool results go back as tool messages,
with any plot the code saved attached as an image. Same data and grading as agents/geo3k.py.

    python molt.py --agent agents/chat_geo3k.py
"""
import os

import molt
from molt import ChatAgent, ChatAgentRunner, Result

HERE = os.path.dirname(os.path.abspath(__file__))
grader = molt.import_path(os.path.join(HERE, "..", "rewards", "math_grader.py"))
sandbox = molt.import_path(os.path.join(HERE, "..", "rewards", "sandbox.py"))
sandbox.require()  # no sandbox, no launch: it fails here, at start, saying how to get bubblewrap

DEFAULTS = {"model": "tiny-vl", "data.path": os.path.join(HERE, "..", "examples", "geo3k_tiny.jsonl"),
            "rollout.max_new_tokens": 128, "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4,
            "rollout.max_turns": 4, "data.max_len": 2048, "train.lr": 1e-5, "steps": 20}


def run_tool(arguments: str) -> list[dict]:
    """The tool's output and its plots (downscaled by the sandbox) as message parts: blocking work (the sandbox, PNG
    encoding), so it runs off the pool's event loop."""
    out, images = sandbox.run_python(sandbox.tool_code({"arguments": arguments}) or "", with_images=True)
    return [{"type": "text", "text": out}] + [{"type": "image_url", "image_url": {"url": molt.image_data_uri(img)}}
                                              for img in images]


async def tool_message(call_id: str, arguments: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": await molt.offload(run_tool, arguments)}


class ChatGeo3k(ChatAgent):
    async def run(self, ctx) -> Result:
        client, messages, tool_calls = ctx.openai(), list(ctx.messages), 0
        for _ in range(ctx.max_turns):
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                         tools=ctx.tools or [sandbox.TOOL_SCHEMA],
                                                         max_tokens=ctx.sampling_params.get("max_tokens"))
            msg = reply.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                break
            for call in msg.tool_calls:
                messages.append(await tool_message(call.id, call.function.arguments))
                tool_calls += 1
        answer = next((m.get("content") or "" for m in reversed(messages) if m["role"] == "assistant"), "")
        verdict = await molt.offload(grader.grade_verdict, answer if isinstance(answer, str) else "", ctx.label)
        reward = float(verdict.correct)
        return Result(reward=reward, info={"geo3k/correct": reward, "geo3k/tool_calls": tool_calls, **verdict.info()})


AgentRunner = ChatAgentRunner(ChatGeo3k)
