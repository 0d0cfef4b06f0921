"""LLM-as-judge reward: the policy answers through the OpenAI SDK, then a judge model scores the answer from 0 to
10. By default the judge is the policy's own engines, reached through the loopback server's unrecorded route
(ctx.judge(): those calls are not part of the trajectory); --judge.url / --judge.model / --judge.api-key-env point
it at any OpenAI-compatible endpoint instead. A judge that errs or answers without a parsable score counts as a
judge failure (info judge/failed) and earns no reward.

    python molt.py --agent agents/judge.py
    python molt.py --agent agents/judge.py --judge.url https://api.openai.com/v1 --judge.model gpt-4o-mini
"""
import os
import re

from molt import ChatAgent, ChatAgentRunner, Result

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULTS = {"data.path": os.path.join(HERE, "..", "examples", "math_tiny.jsonl"), "rollout.max_new_tokens": 64,
            "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4, "steps": 4}
JUDGE_PROMPT = ("You grade answers. Question:\n{question}\n\nReference answer: {label}\n\nCandidate answer:\n{answer}"
                "\n\nReply with one line 'Score: N' where N is an integer from 0 (wrong) to 10 (fully correct).")
SCORE = re.compile(r"score\s*[:=]\s*\**\s*(\d+(?:\.\d+)?)\s*(?:/\s*10)?", re.IGNORECASE)


def parse_score(text: str) -> float | None:
    """The judge's score scaled to [0, 1]: the last 'Score: N' (N in 0..10, '/10' allowed); None if absent or
    out of range."""
    found = SCORE.findall(text or "")
    if not found:
        return None
    value = float(found[-1])
    return value / 10 if 0 <= value <= 10 else None


class Judged(ChatAgent):
    async def run(self, ctx) -> Result:
        reply = await ctx.openai().chat.completions.create(model=ctx.model_name, messages=ctx.messages,
                                                           max_tokens=ctx.sampling_params.get("max_tokens"))
        answer = reply.choices[0].message.content or ""
        try:
            verdict = await ctx.judge().chat.completions.create(
                model=ctx.judge_model, max_tokens=32, temperature=0.0, messages=[{"role": "user", "content":
                JUDGE_PROMPT.format(question=ctx.prompt, label=ctx.label, answer=answer)}])
            score = parse_score(verdict.choices[0].message.content)
        except Exception:  # noqa: BLE001 - an unreachable or failing judge is a counted failure, not a crash
            score = None
        return Result(reward=score or 0.0, info={"judge/failed": float(score is None), "judge/score": score or 0.0})


AgentRunner = ChatAgentRunner(Judged)
