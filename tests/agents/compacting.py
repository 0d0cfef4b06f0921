"""Test agent: a ChatAgent that talks for two turns, then compacts its history (replaces the conversation with a
summary) and talks once more, through the stock OpenAI SDK. The episode is recorded as two segments."""
from molt import ChatAgent, ChatAgentRunner, Result

DEFAULTS = {"rollout.max_new_tokens": 8, "rollout.n_samples_per_prompt": 2, "rollout.batch_size": 2, "steps": 2}


class Compacting(ChatAgent):
    async def run(self, ctx) -> Result:
        client, messages = ctx.openai(), list(ctx.messages)

        async def turn():
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=8)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        await turn()
        messages.append({"role": "user", "content": "Go on."})
        await turn()
        messages[:] = [{"role": "user", "content": "Summary of the talk so far: " + messages[1]["content"][:40]}]
        await turn()
        return Result(reward=float(len(messages[-1]["content"]) % 2))


AgentRunner = ChatAgentRunner(Compacting)
