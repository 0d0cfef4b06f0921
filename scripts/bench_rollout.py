"""Rollout throughput: Molt's router + engine actors vs a raw vLLM AsyncLLM with the same settings, one run.

    .venv/bin/python scripts/bench_rollout.py [--model tiny] [--prompts 256] [--tokens 64] [--rounds 6]

Both sides get the same batch (random prompts, ignore EOS, temperature 1) and alternate, so machine noise hits both;
prints tokens/s of each, the ratio (goal >= 0.95), and the pause -> load -> resume latency of a weight update.
"""
import argparse
import asyncio
import os
import random
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import molt  # noqa: E402


async def molt_round(router, prompts, sampling):
    t = time.perf_counter()
    outs = await asyncio.gather(*[router.generate(molt.EngineRequest(p, sampling=sampling), uuid.uuid4().hex) for p in prompts])
    return sum(len(o[0].ids) for o in outs) / (time.perf_counter() - t)


async def raw_round(engine, prompts, sampling):
    from vllm import SamplingParams
    params = SamplingParams(**sampling, logprobs=0, detokenize=False)

    async def one(p):
        async for out in engine.generate({"prompt_token_ids": p}, params, request_id=uuid.uuid4().hex):
            final = out
        return len(final.outputs[0].token_ids)
    t = time.perf_counter()
    n = sum(await asyncio.gather(*[one(p) for p in prompts]))
    return n / (time.perf_counter() - t)


async def update_latency(ray, engine, state, version, prompts, sampling):
    inflight = [engine.generate.remote(molt.EngineRequest(p, sampling={**sampling, "max_tokens": 512})) for p in prompts[:8]]
    await asyncio.sleep(0.5)
    ref = ray.put(state)
    t = time.perf_counter()
    await engine.update.remote({"refs": [ref]}, version)
    dt = time.perf_counter() - t
    outs = await asyncio.gather(*inflight)
    assert all(o[0].finish_reason == "length" for o in outs)  # nothing was aborted
    return dt * 1e3


async def main(args):
    import ray
    from safetensors.torch import load_file
    from vllm.v1.engine.async_llm import AsyncLLM
    cfg = molt.Config()
    cfg.data.max_len, cfg.engine.kv_cache_gb = 1024, 1.0
    cfg.engine.gpu_memory_utilization = 0.4  # CUDA: Molt's engine and the raw one share the GPU
    path = molt.resolve_model(args.model)
    molt.ray_init(cfg)
    engines = molt.start_engines(cfg, path)
    router = molt.Router(engines)
    raw = AsyncLLM.from_engine_args(molt.engine_args(cfg, path, 0))
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 100) for _ in range(16)] for _ in range(args.prompts)]
    sampling = {"max_tokens": args.tokens, "temperature": 1.0, "ignore_eos": True}
    await molt_round(router, prompts[:16], sampling)  # warm-up both
    await raw_round(raw, prompts[:16], sampling)
    ours, theirs = [], []
    for r in range(args.rounds):  # paired rounds, the order swapped each time so drift hits both sides alike
        first, second = (molt_round(router, prompts, sampling), raw_round(raw, prompts, sampling))[::1 - 2 * (r % 2)]
        a, b = await first, await second
        ours.append(a if r % 2 == 0 else b)
        theirs.append(b if r % 2 == 0 else a)
        print(f"round {r}: molt {ours[-1]:8.0f} tok/s   raw vLLM {theirs[-1]:8.0f} tok/s   ratio {ours[-1] / theirs[-1]:.3f}")
    ratio = statistics.median(o / t for o, t in zip(ours, theirs))
    print(f"median: molt {statistics.median(ours):.0f} tok/s, raw vLLM {statistics.median(theirs):.0f} tok/s, "
          f"median paired ratio {ratio:.3f} (goal >= 0.95)")
    state = load_file(os.path.join(path, "model.safetensors"))
    lat = [await update_latency(ray, engines[0], state, i + 1, prompts, sampling) for i in range(5)]
    print(f"pause -> load -> resume with 8 requests in flight ({args.model}): {statistics.median(lat):.1f} ms "
          f"(median of 5)")
    raw.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    asyncio.run(main(p.parse_args()))
