"""Agent-path overhead: the same prompts through an Env (Molt owns the loop) and through a ChatAgent using the stock
OpenAI SDK against the loopback server, alternating in one run.

    .venv/bin/python scripts/bench_agents.py [--episodes 128] [--tokens 128] [--rounds 3]

Prints episodes/s of each, the ratio chat/env (goal >= 0.85), the server's added latency per request (sequential
single-turn requests, chat minus env), the same at 256 concurrent sessions (amortised per request), and the time to
the first streamed text delta against the time to the whole (unstreamed) turn.
"""
import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import molt  # noqa: E402


class Echo(molt.Env):
    async def step(self, action):
        return molt.Result(reward=float(len(action)))


class Chat(molt.ChatAgent):
    async def run(self, ctx):
        r = await ctx.openai().chat.completions.create(model=ctx.model_name, messages=ctx.messages,
                                                       max_tokens=ctx.sampling_params["max_tokens"])
        return molt.Result(reward=float(len(r.choices[0].message.content or "")))


async def episodes(pool, runner, n, sampling):
    eps = [molt.Episode(prompt=f"Tell me about number {i}.", label=None, images=[], tools=None,
                        sampling=dict(sampling), group_id="g", rollout_id=uuid.uuid4().hex) for i in range(n)]
    t = time.perf_counter()
    await asyncio.gather(*[runner.run(ep, pool) for ep in eps])
    return n / (time.perf_counter() - t)


async def latency(pool, runner, sampling, n=20):
    times = []
    for i in range(n):
        ep = molt.Episode(prompt="Hi.", label=None, images=[], tools=None, sampling=dict(sampling), group_id="g",
                          rollout_id=uuid.uuid4().hex)
        t = time.perf_counter()
        await runner.run(ep, pool)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


async def concurrent_overhead(pool, env, chat, sessions=256, rounds=3):
    """Wall time of `sessions` concurrent one-token episodes, chat minus env, per request (ms)."""
    one = {"temperature": 1.0, "max_tokens": 1, "ignore_eos": True}
    diffs = []
    for _ in range(rounds):
        t_env = sessions / await episodes(pool, env, sessions, one)
        t_chat = sessions / await episodes(pool, chat, sessions, one)
        diffs.append((t_chat - t_env) / sessions * 1e3)
    return statistics.median(diffs)


async def first_byte(pool, tokens=256, n=10):
    """Median ms to the first streamed text delta, and to the whole unstreamed reply, through the stock OpenAI SDK."""
    ep = molt.Episode(prompt="Go.", label=None, images=[], tools=None, group_id="g", rollout_id=uuid.uuid4().hex,
                      sampling={"temperature": 1.0, "max_tokens": tokens, "ignore_eos": True})
    ctx = pool.server.open(ep)
    client, firsts, wholes = ctx.openai(), [], []
    for _ in range(n):
        t = time.perf_counter()
        async for chunk in await client.chat.completions.create(model="m", messages=ctx.messages, stream=True,
                                                                  max_tokens=tokens):
            if any(c.delta.content for c in chunk.choices):
                firsts.append(time.perf_counter() - t)
                break
        t = time.perf_counter()
        await client.chat.completions.create(model="m", messages=ctx.messages, max_tokens=tokens)
        wholes.append(time.perf_counter() - t)
    pool.server.close(ctx.session_id)
    return statistics.median(firsts) * 1e3, statistics.median(wholes) * 1e3


async def main(args):
    cfg = molt.Config()
    cfg.data.max_len = 1024
    path = molt.resolve_model(args.model)
    molt.ray_init(cfg)
    engines = molt.start_engines(cfg, path)
    pool = molt.AgentPool(cfg, "", path, engines)
    await pool.server.start()
    env, chat = molt.StepEnvRunner(Echo), molt.ChatAgentRunner(Chat)
    sampling = {"temperature": 1.0, "max_tokens": args.tokens, "ignore_eos": True}
    await episodes(pool, env, 16, sampling)
    await episodes(pool, chat, 16, sampling)
    e_rates, c_rates = [], []
    for r in range(args.rounds):
        e_rates.append(await episodes(pool, env, args.episodes, sampling))
        c_rates.append(await episodes(pool, chat, args.episodes, sampling))
        print(f"round {r}: env {e_rates[-1]:6.1f} episodes/s   chat (OpenAI SDK) {c_rates[-1]:6.1f} episodes/s")
    e, c = statistics.median(e_rates), statistics.median(c_rates)
    print(f"median: env {e:.1f}/s, chat {c:.1f}/s, ratio chat/env {c / e:.3f} (goal >= 0.85)")
    one = {**sampling, "max_tokens": 1}
    le, lc = await latency(pool, env, one), await latency(pool, chat, one)
    print(f"single-token request latency: env {le:.1f} ms, chat {lc:.1f} ms, server adds {lc - le:.1f} ms per request")
    overhead = await concurrent_overhead(pool, env, chat)
    print(f"256 concurrent sessions: the server adds {overhead:.2f} ms per request (amortised wall time)")
    ttfb, whole = await first_byte(pool)
    print(f"streamed first text delta {ttfb:.1f} ms vs whole 256-token turn {whole:.1f} ms (ratio {ttfb / whole:.3f})")
    await molt.close_clients()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(p.parse_args()))
