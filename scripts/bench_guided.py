"""What compiling each grammar afresh costs (molt.xgrammar_no_compile_cache: xgrammar 0.2.8's compile cache guided a
token another grammar chose). Two engines on one model, one with vLLM's default cache (VLLM_XGRAMMAR_CACHE_MB=512),
one without (Molt's default), each behind its own agent pool; alternating rounds of forced tool calls (the guided
requests Molt makes: a structural tag per call, compiled per request without the cache) and of plain turns.

    .venv/bin/python scripts/bench_guided.py [--model tiny:qwen3] [--rounds 5] [--calls 10]

Prints the median seconds per forced call and per plain turn for each engine, and the ratios off / on.
"""
import argparse
import asyncio
import statistics
import time

import ray

from bench_families import TOOL, molt, pool_for, session


async def timed(pool, n: int, forced: bool) -> float:
    """Median seconds of n turns (a forced call, or a plain 8-token reply)."""
    out = []
    for _ in range(n):
        ctx = session(pool, 40)
        extra = {"tools": [TOOL], "tool_choice": "required"} if forced else {}
        t = time.perf_counter()
        await ctx.openai().chat.completions.create(model="m", messages=ctx.messages, max_tokens=40 if forced else 8,
                                                   **extra)
        out.append(time.perf_counter() - t)
        pool.server.close(ctx.session_id)
    return statistics.median(out)


async def main(args):
    path, cfg = molt.resolve_model(args.model), molt.Config()
    molt.ray_init(cfg)
    pools = {}
    for name, mb in (("cache off", None), ("cache on", "512")):
        env = {"env_vars": {"VLLM_XGRAMMAR_CACHE_MB": mb}} if mb else {}
        actor = ray.remote(molt.EngineActor).options(num_cpus=1, max_concurrency=100_000, runtime_env=env)
        engine = actor.remote(cfg, path, 0)
        ray.get(engine.set_version.remote(0))
        pools[name] = pool_for(path, [engine])
        await pools[name].server.start()
    rows = {(name, kind): [] for name in pools for kind in ("forced", "plain")}
    for _ in range(args.rounds):  # alternating: each contender alone, in turn
        for name, pool in pools.items():
            for kind in ("forced", "plain"):
                rows[name, kind].append(await timed(pool, args.calls, kind == "forced"))
    med = {k: statistics.median(v) for k, v in rows.items()}
    print("| model | turn | cache on (vLLM's default) | cache off (Molt) | off / on |\n|---|---|---|---|---|")
    for kind in ("forced", "plain"):
        on, off = med["cache on", kind], med["cache off", kind]
        print(f"| {args.model} | {kind} | {on * 1e3:.1f} ms | {off * 1e3:.1f} ms | {off / on:.2f} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny:qwen3")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10)
    asyncio.run(main(p.parse_args()))
