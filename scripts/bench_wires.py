"""The loopback server's latency per turn on each wire, the same engine behind all three.

    .venv/bin/python scripts/bench_wires.py [--models tiny,tiny:qwen3] [--rounds 5] [--turns 10]

Per model, contenders run alone one after another, alternating, --rounds times (medians of per-round medians over
--turns sessions each): one turn with a tool offered and 8 tokens, plain and streamed, on chat completions, messages
and responses; and a conversation's second turn (a tool result, 8 tokens): chat completions resending the history
against responses sending only the result with previous_response_id (the server continues from its stored tokens).
Ratios are against chat completions in the same run.
"""
import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid

import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import molt  # noqa: E402
from bench_families import A_TOOL, TOOL, pool_for  # noqa: E402

FLAT = {"type": "function", **TOOL["function"]}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def session(pool):
    ep = molt.Episode(prompt="Weather in Paris?", label=None, images=[], tools=None, group_id="g",
                      rollout_id=uuid.uuid4().hex, sampling={"temperature": 1.0, "max_tokens": 8})
    return pool.server.open(ep)


async def chat(ctx, stream=False):
    r = await ctx.openai().chat.completions.create(model="m", messages=ctx.messages, tools=[TOOL], max_tokens=8,
                                                   stream=stream)
    if stream:
        async for _ in r:
            pass


async def messages(ctx, stream=False):
    if stream:
        async with ctx.anthropic().messages.stream(model="m", max_tokens=8, messages=ctx.messages,
                                                   tools=[A_TOOL]) as s:
            await s.get_final_message()
    else:
        await ctx.anthropic().messages.create(model="m", max_tokens=8, messages=ctx.messages, tools=[A_TOOL])


async def responses(ctx, stream=False):
    r = await ctx.openai().responses.create(model="m", input=ctx.messages, tools=[FLAT], max_output_tokens=8,
                                            stream=stream)
    if stream:
        async for _ in r:
            pass


async def chat_second(ctx):
    """The tool result turn, the history resent: (first turn, timed second turn)."""
    c = ctx.openai()
    r = await c.chat.completions.create(model="m", messages=ctx.messages, tools=[TOOL], tool_choice="required",
                                        max_tokens=80)
    msgs = [*ctx.messages, r.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "sunny"}]
    t = time.perf_counter()
    await c.chat.completions.create(model="m", messages=msgs, tools=[TOOL], max_tokens=8)
    return time.perf_counter() - t


async def responses_second(ctx):
    c = ctx.openai()
    r = await c.responses.create(model="m", input=ctx.messages, tools=[FLAT], tool_choice="required",
                                 max_output_tokens=80)
    call = next(o for o in r.output if o.type == "function_call")
    t = time.perf_counter()
    await c.responses.create(model="m", input=[{"type": "function_call_output", "call_id": call.call_id,
                                                "output": "sunny"}], previous_response_id=r.id, tools=[FLAT],
                             max_output_tokens=8)
    return time.perf_counter() - t


async def timed(pool, fn, turns, **kw):
    times = []
    for _ in range(turns):
        ctx = session(pool)
        t = time.perf_counter()
        out = await fn(ctx, **kw)
        times.append(out if isinstance(out, float) else time.perf_counter() - t)
        pool.server.close(ctx.session_id)
    return statistics.median(times) * 1e3


CONTENDERS = {"chat": (chat, {}), "messages": (messages, {}), "responses": (responses, {}),
              "chat stream": (chat, {"stream": True}), "messages stream": (messages, {"stream": True}),
              "responses stream": (responses, {"stream": True}),
              "chat 2nd turn (history resent)": (chat_second, {}),
              "responses 2nd turn (previous_response_id)": (responses_second, {})}


async def model(name, args):
    path = molt.resolve_model(name)
    engines = molt.start_engines(molt.Config(), path)
    pool = pool_for(path, engines)
    await pool.server.start()
    for fn, kw in CONTENDERS.values():  # warm-up
        await timed(pool, fn, 2, **kw)
    ms = {k: [] for k in CONTENDERS}
    for _ in range(args.rounds):
        for key, (fn, kw) in CONTENDERS.items():
            ms[key].append(await timed(pool, fn, args.turns, **kw))
    await pool.server.stop()
    for e in engines:
        ray.kill(e)
    return {k: statistics.median(v) for k, v in ms.items()}


async def main(args):
    molt.ray_init(molt.Config())
    for name in args.models.split(","):
        row = await model(name, args)
        print(json.dumps({"model": name, **row}))
        base = {k: row["chat stream" if "stream" in k else "chat 2nd turn (history resent)" if "2nd" in k else "chat"]
                for k in row}
        print(f"\n{name}\n| turn | ms | / chat completions |\n|---|---|---|")
        for k, v in row.items():
            print(f"| {k} | {v:.1f} | {v / base[k]:.2f} |")
    await molt.close_clients()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny,tiny:qwen3")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--turns", type=int, default=10)
    asyncio.run(main(p.parse_args()))
