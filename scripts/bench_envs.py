"""What hosting an environment library costs per episode, against a plain agent on the same prompts and token budget,
alternating in one run on one tiny engine:

    .venv/bin/python scripts/bench_envs.py [--episodes 32] [--tokens 32] [--rounds 3]

- verifiers (agents/verifiers_env.py on examples/verifiers/vf_qa.py: its harness program in a subprocess per
  episode, its interception proxy, its scoring) against a ChatAgent making the same one call through the OpenAI SDK;
- reasoning-gym (agents/reasoning_gym.py: its rows, its score_answer off the event loop) against an Env that scores
  nothing;
- TextArena tic-tac-toe against the random opponent (agents/textarena_env.py): episodes/s and turns/s, and the
  game's own cost per turn without a model (ms).
Prints episodes/s per contender (median over rounds) and each library's ratio to its baseline.
"""
import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import molt  # noqa: E402
from bench_agents import Chat, Echo  # noqa: E402  (an Env scoring nothing; one OpenAI SDK call)

ENVS = os.path.join(ROOT, "examples", "verifiers")


def pool_for(engines, model_path, agent, env_id="", **args):
    cfg = molt.Config()
    cfg.data.max_len, cfg.agent, cfg.env.id, cfg.env.args = 2048, os.path.join(ROOT, "agents", agent), env_id, \
        json.dumps(args)
    return cfg, molt.AgentPool(molt.validate_config(cfg), cfg.agent, model_path, engines)


async def rate(pool, runner, rows, n, sampling):
    """Episodes/s (and sampled turns) of n episodes over rows, all concurrent, through `runner`."""
    eps = [molt.Episode(prompt=rows[i % len(rows)]["prompt"], label=rows[i % len(rows)].get("label"), images=[],
                        tools=None, sampling=dict(sampling), group_id="g", rollout_id=uuid.uuid4().hex)
           for i in range(n)]
    t = time.perf_counter()
    out = await asyncio.gather(*[runner.run(ep, pool) for ep in eps])
    dt = time.perf_counter() - t
    turns = sum(1 for samples in out for s in samples for a, b in zip([0] + s.mask, s.mask) if b and not a)
    return n / dt, turns / dt


async def game_cost(rows, n=200):
    """ms per policy turn of the game alone (reset, steps, the random opponent), random legal moves as the policy."""
    ta = molt.import_path(os.path.join(ROOT, "agents", "textarena_env.py"))
    turns, t = 0, time.perf_counter()
    for i in range(n):
        env = ta.Game()
        await env.reset(rows[i % len(rows)]["prompt"], rows[i % len(rows)]["label"])
        result = molt.Result(terminated=False)
        while not result.terminated:
            result = await env.step(random.choice(env.legal_moves()))
            turns += 1
    return (time.perf_counter() - t) / turns * 1e3


async def main(args):
    molt.ray_init(molt.Config())
    path = molt.resolve_model(args.model)
    cfg = molt.Config()
    cfg.data.max_len = 2048
    engines = molt.start_engines(cfg, path)
    sampling = {"temperature": 1.0, "max_tokens": args.tokens}
    vf_cfg, vf_pool = pool_for(engines, path, "verifiers_env.py", "vf_qa", path=ENVS)
    rg_cfg, rg_pool = pool_for(engines, path, "reasoning_gym.py", size=64)
    ta_cfg, ta_pool = pool_for(engines, path, "textarena_env.py", size=64)
    vf_rows = molt.load_rows("", vf_cfg.data, vf_cfg)
    rg_rows = molt.load_rows("reasoning-gym:basic_arithmetic,leg_counting,letter_counting", rg_cfg.data, rg_cfg)
    ta_rows = molt.load_rows("textarena:TicTacToe-v0", ta_cfg.data, ta_cfg)
    for p in (vf_pool, rg_pool, ta_pool):
        await p.server.start()
    contenders = {  # name: (pool, runner, rows)
        "chat (OpenAI SDK), vf_qa prompts": (vf_pool, molt.ChatAgentRunner(Chat), vf_rows),
        "verifiers vf_qa": (vf_pool, vf_pool.runner, vf_rows),
        "plain Env, reasoning-gym prompts": (rg_pool, molt.StepEnvRunner(Echo), rg_rows),
        "reasoning-gym Env": (rg_pool, rg_pool.runner, rg_rows),
        "textarena tic-tac-toe Env": (ta_pool, ta_pool.runner, ta_rows),
    }
    for pool, runner, rows in contenders.values():  # warm-up: imports, the interception server, the first subprocess
        await rate(pool, runner, rows, 4, sampling)
    rates = {name: [] for name in contenders}
    for r in range(args.rounds):
        for name, (pool, runner, rows) in contenders.items():
            rates[name].append(await rate(pool, runner, rows, args.episodes, sampling))
            print(f"round {r}: {name:34s} {rates[name][-1][0]:7.2f} episodes/s  {rates[name][-1][1]:7.2f} turns/s",
                  flush=True)
    med = {name: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for name, v in rates.items()}
    for name, (eps, turns) in med.items():
        print(f"median: {name:34s} {eps:7.2f} episodes/s  {turns:7.2f} turns/s")
    v, names = list(rates.values()), list(rates)

    def paired(a, b):  # median over rounds of each round's ratio (the CPU's speed drifts between rounds)
        return statistics.median(x[0] / y[0] for x, y in zip(v[a], v[b]))
    print(f"paired medians: verifiers / chat {paired(1, 0):.4f}   reasoning-gym / plain Env {paired(3, 2):.3f}   "
          f"tic-tac-toe game logic {await game_cost(ta_rows):.3f} ms per policy turn")
    await vf_pool.runner.agent_cls.run.__globals__["close"]()  # the pool's own copy of the module (import_path
    # executes a module anew each time)
    await molt.close_clients()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(p.parse_args()))
