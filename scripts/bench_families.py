"""Per model family: what the loopback server does with the family's real tokenizer, chat template and vLLM's parsers.

    .venv/bin/python scripts/bench_families.py [--families qwen3,llama3.1,deepseek-v3,mistral,gpt-oss] [--episodes 8]
        [--calls 20]

Per family (tiny:FAMILY, one engine each, random weights):
- forced calls: the share of `tool_choice` required (OpenAI) / any (Anthropic) replies that come back as parsed calls;
- a tool episode as agent code writes it (OpenAI SDK: a forced call, the reply sent back as the SDK returns it with
  the tool's result, a free reply, a new question, a streamed reply), in each --server.history mode: segments per
  episode and drift/tokens_changed_frac (the drift report's, at the episode's end);
- the server's latency per turn (tools offered, 8 tokens) with the family's parsers against the same engine with
  both parsers off, alternating rounds, medians; and the parse of one reply by vLLM's parser against the regex hermes
  parse Molt had before (parse_tool_calls, kept for Env agents) on the same replies.
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

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
A_TOOL = {"name": "get_weather", "description": "Weather in a city.",
          "input_schema": TOOL["function"]["parameters"]}


def pool_for(path, engines, **server):
    cfg = molt.Config()
    cfg.data.max_len = 2048
    for key, value in server.items():
        setattr(cfg.server, key, value)
    return molt.AgentPool(cfg, "", path, engines)


def session(pool, tokens=32):
    ep = molt.Episode(prompt="Weather?", label=None, images=[], tools=None, group_id="g", rollout_id=uuid.uuid4().hex,
                      sampling={"temperature": 1.0, "max_tokens": tokens})
    return pool.server.open(ep)


async def forced_calls(pool, n):
    """(OpenAI parsed, Anthropic parsed) out of n each."""
    o = a = 0
    for _ in range(n):
        ctx = session(pool, 80)
        r = await ctx.openai().chat.completions.create(model="m", messages=ctx.messages, tools=[TOOL],
                                                       tool_choice="required", max_tokens=80)
        o += bool(r.choices[0].message.tool_calls)
        r = await ctx.anthropic().messages.create(model="m", max_tokens=80, messages=ctx.messages, tools=[A_TOOL],
                                                  tool_choice={"type": "any"})
        a += any(b.type == "tool_use" for b in r.content)
        pool.server.close(ctx.session_id)
    return o, a


async def tool_episode(pool):
    """(segments, drift/tokens_changed_frac) of one OpenAI tool episode."""
    ctx = session(pool)
    c, msgs = ctx.openai(), list(ctx.messages)
    r = await c.chat.completions.create(model="m", messages=msgs, tools=[TOOL], tool_choice="required", max_tokens=80)
    call = r.choices[0].message.tool_calls[0]
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = await c.chat.completions.create(model="m", messages=msgs, tools=[TOOL], max_tokens=16)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And tomorrow?"}]
    async for _ in await c.chat.completions.create(model="m", messages=msgs, tools=[TOOL], max_tokens=16, stream=True):
        pass
    s = pool.server.close(ctx.session_id)
    return len(s.segments), molt.drift_report(pool.codec, s, s.segments)["metrics"].get("drift/tokens_changed_frac")


async def turn_ms(pool, n=10):
    times = []
    for _ in range(n):
        ctx = session(pool)
        t = time.perf_counter()
        await ctx.openai().chat.completions.create(model="m", messages=ctx.messages, tools=[TOOL], max_tokens=8)
        times.append(time.perf_counter() - t)
        pool.server.close(ctx.session_id)
    return statistics.median(times) * 1e3


async def replies(pool, n=20):
    """The sampled ids of n 64-token replies with tools offered."""
    out = []
    for _ in range(n):
        ctx = session(pool, 64)
        await ctx.openai().chat.completions.create(model="m", messages=ctx.messages, tools=[TOOL], max_tokens=64)
        seg = pool.server.close(ctx.session_id).segments[0]
        out.append([t for t, m in zip(seg.tokens, seg.mask) if m])
    return out


def parse_us(pool, replies):
    """Median µs to parse one reply: vLLM's parser for the family, and the regex hermes parse on the same text."""
    server, turn = pool.server, molt.Turn(messages=[], tools=[TOOL], stream=False, usage_in_stream=False, sampling={})
    ours, regex = [], []
    for ids in replies:
        raw = server.codec.raw_decode(ids)
        t = time.perf_counter()
        server.parser.parse(raw, ids, turn)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        molt.parse_tool_calls(server.codec.decode(ids))
        regex.append(time.perf_counter() - t)
    return statistics.median(ours) * 1e6, statistics.median(regex) * 1e6


async def family(name, args):
    path = molt.resolve_model("tiny:" + name)
    engines = molt.start_engines(molt.Config(), path)
    pools = {mode: pool_for(path, engines, history=mode) for mode in ("template", "append")}
    off = pool_for(path, engines, tool_parser="none", reasoning_parser="none")
    for p in [*pools.values(), off]:
        await p.server.start()
    parser = pools["template"].server.parser
    row = {"family": name, "parsers": f"{parser.tool} + {parser.reasoning}"}
    row["forced_openai"], row["forced_anthropic"] = await forced_calls(pools["template"], args.calls)
    for mode, pool in pools.items():
        runs = [await tool_episode(pool) for _ in range(args.episodes)]
        row[f"segments_{mode}"] = statistics.median(r[0] for r in runs)
        row[f"drift_{mode}"] = statistics.mean(r[1] for r in runs if r[1] is not None)
    with_p, without = [], []
    for _ in range(args.rounds):
        with_p.append(await turn_ms(pools["template"]))
        without.append(await turn_ms(off))
    row["turn_ms"], row["turn_ms_off"] = statistics.median(with_p), statistics.median(without)
    row["parse_us"], row["regex_us"] = parse_us(pools["template"], await replies(pools["template"]))
    for p in [*pools.values(), off]:
        await p.server.stop()
    for e in engines:
        ray.kill(e)
    return row


async def main(args):
    molt.ray_init(molt.Config())
    rows = [await family(name, args) for name in args.families.split(",")]
    for row in rows:
        print(json.dumps(row))
    print("\n| family | parsers | forced calls parsed (OpenAI, Anthropic) | segments per tool episode (template, "
          "append) | drift/tokens_changed_frac (template, append) | turn with parsers / without | parse, vLLM / regex |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['parsers']} | {r['forced_openai']}/{args.calls}, {r['forced_anthropic']}/"
              f"{args.calls} | {r['segments_template']:g}, {r['segments_append']:g} | {r['drift_template']:.3f}, "
              f"{r['drift_append']:.3f} | {r['turn_ms']:.1f} / {r['turn_ms_off']:.1f} ms "
              f"({r['turn_ms'] / r['turn_ms_off']:.2f}) | {r['parse_us']:.0f} / {r['regex_us']:.0f} µs |")
    await molt.close_clients()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--families", default="qwen3,llama3.1,deepseek-v3,mistral,gpt-oss")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(p.parse_args()))
