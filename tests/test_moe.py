"""Section 10: MoE routing replay, fp32 router and router freeze on the tiny Qwen3-MoE (transformers' MoE blocks)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig

import molt
from conftest import small_config
from test_trainer import make_samples, weights

ROOT = Path(__file__).resolve().parent.parent


def moe_model(path, replay=True):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    routers = molt.prepare_moe(model, model.config, molt.ActorConfig(), "policy", replay=replay)
    assert len(routers) == 2 and [r.molt_layer for r in routers] == [0, 1]
    return model, routers


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 100, (2, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0  # the second row is padded
    return ids, attn


def logp_sum(model, ids, attn):
    logits = model(input_ids=ids, attention_mask=attn).logits
    return molt.token_logprobs(logits, ids, 1.0)[0][attn[:, 1:].bool()].sum()


def recorded(routers, b, T):
    """[b, T, layers, top_k] from each router's last live selection."""
    return torch.stack([r.molt_live.view(b, T, -1) for r in routers], dim=2)


@pytest.mark.core
def test_replay_reproduces_recorded_choices_and_keeps_router_gradients(tiny_moe):
    model, routers = moe_model(tiny_moe)
    ids, attn = batch()
    molt.set_routing(model, None)
    with torch.no_grad():
        logp_sum(model, ids, attn)
    record = recorded(routers, *ids.shape)
    with torch.no_grad():  # perturb the routers so that their own choice changes
        for r in routers:
            r.weight.add_(torch.randn_like(r.weight) * 2.0)
        free = logp_sum(model, ids, attn)
    assert not torch.equal(recorded(routers, *ids.shape), record), "perturbation did not change the routing"
    molt.set_routing(model, record)
    replayed = logp_sum(model, ids, attn)
    for r, layer in zip(routers, range(2)):
        assert torch.equal(r.molt_selected, record[:, :, layer].reshape(-1, 2))  # every selection is the record
    assert not torch.isclose(replayed, free)
    replayed.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)


def test_partial_routing_replays_exactly_the_recorded_positions_after_padding(tiny_moe):
    model, routers = moe_model(tiny_moe)
    ids, _ = batch()
    T = ids.shape[1]
    rows = []
    for i, length in enumerate((12, 9)):  # two samples of different lengths: collate pads the second
        s = molt.Sample(rollout_id=str(i))
        s.extend(ids[i, :4].tolist())
        s.extend(ids[i, 4:length].tolist(), [-1.0] * (length - 4), [0] * (length - 4))
        routing = torch.randint(0, 4, (length, 2, 2))
        routing[:, :, 1] = (routing[:, :, 0] + 1) % 4  # two distinct experts per token
        routing[length // 2:] = -1  # the engine reported routing only for the first half (e.g. earlier turns)
        s.routing = routing.numpy().astype("int16")
        rows.append(s)
    mb = molt.collate(rows, [0, 1], None, torch.device("cpu"))
    assert mb["routing"].shape == (2, T, 2, 2) and (mb["routing"][1, 9:] == -1).all()
    with torch.no_grad():
        padded = molt.model_forward(model, mb, None)
    for r in routers:
        target = mb["routing"][:, :, r.molt_layer].reshape(-1, 2)
        have = (target >= 0).all(-1)
        assert have.sum() == 6 + 4
        assert torch.equal(r.molt_selected[have], target[have])
        assert torch.equal(r.molt_selected[~have], r.molt_live[~have])
    # packed into one row of 12 + 9 tokens: the same positions replay the same experts, the logits agree
    mb = molt.collate(rows, [0, 1], None, torch.device("cpu"), pack=True)
    with torch.no_grad():
        logits = molt.unpacked(molt.model_forward(model, mb, None), mb)
    for r in routers:
        target = molt.packed(mb["routing"], mb)[0, :, r.molt_layer]
        have = (target >= 0).all(-1)
        assert have.sum() == 6 + 4 and r.molt_selected.shape[0] == 21
        assert torch.equal(r.molt_selected[have], target[have])
    real = mb["attn"].bool()
    assert torch.allclose(logits[real], padded[real], atol=1e-5)


def test_fp32_router_computes_the_gate_in_fp32(tiny_moe):
    model, routers = moe_model(tiny_moe)
    model.to(torch.bfloat16)
    ids, attn = batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attn)
    h = torch.randn(5, 64, dtype=torch.bfloat16)
    logits, _, _ = routers[0].forward(h)
    exact = torch.nn.functional.linear(h.float(), routers[0].weight.float())
    assert torch.allclose(logits.float(), exact.to(torch.bfloat16).float())


def test_frozen_router_stays_bit_identical_while_the_rest_trains(ray_cluster, tiny_moe):
    cfg = small_config(**{"train.lr": 1e-2, "actor.freeze_moe_router": True, "train.micro_batch_size": 4})
    group = molt.ModelGroup(cfg, tiny_moe, "policy", total_steps=10)
    before = weights(group)
    for seed in (1, 2):
        molt.learn(cfg, {"policy": group}, make_samples(seed=seed))
    after = weights(group)
    routers = [k for k in before if k.endswith("mlp.gate.weight")]
    assert routers and all(torch.equal(before[k], after[k]) for k in routers)
    others = [k for k in before if k not in routers]
    assert all(not torch.equal(before[k], after[k]) for k in others if "norm" not in k)
    for w in group.workers:
        ray_cluster.kill(w)


@pytest.mark.slow
def test_moe_trains_through_the_full_loop_and_replay_fails_clearly_on_cpu(tmp_path):
    run = tmp_path / "run"
    base = [sys.executable, str(ROOT / "molt.py"), "--agent", "agents/copy.py", "--model", "tiny-moe", "--run-dir"]
    ok = subprocess.run(base + [str(run), "--steps", "4", "--train.async-queue-size", "0"], cwd=ROOT,
                        capture_output=True, text=True, timeout=900)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (run / "checkpoints" / "step_000004" / "model.safetensors").exists()
    m = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in m] == [1, 2, 3, 4] and all(r["rollout/staleness_max"] == 0 for r in m)
    # without replay, vLLM's fused MoE and transformers' experts agree on the synced weights (fp32 on CPU), step
    # after step: every update reached the experts and routers (measured gap <= 1e-6)
    assert max(r["rollout/logprob_gap"] for r in m) <= 1e-3
    assert any(r["grad_norm"] > 0 for r in m)
    bad = subprocess.run(base + [str(tmp_path / "bad"), "--steps", "2", "--train.routing-replay"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "on CUDA" in bad.stderr and "routing-replay" in bad.stderr


def test_every_trainer_build_path_applies_the_router_flags(tiny_moe):
    """transformers routers through build_model, as a policy rank builds them (fp32 gate, frozen)."""
    cfg = small_config(**{"actor.freeze_moe_router": True, "train.backend": "hf"})
    model = molt.build_model(cfg, tiny_moe, "policy", AutoConfig.from_pretrained(tiny_moe), world=1, cuda=False)
    routers = model._molt_routers
    assert len(routers) == 2 and all(r.molt_fp32 and not r.weight.requires_grad for r in routers)
    assert all(p.requires_grad for n, p in model.named_parameters() if "gate" not in n)


def test_automodel_gates_get_the_fp32_and_freeze_flags():
    """AutoModel cannot build a model on CPU, but its Gate (the router of its own MoE implementations) can run here."""
    from nemo_automodel.components.moe.config import MoEConfig
    from nemo_automodel.components.moe.layers import Gate
    conf = MoEConfig(n_routed_experts=4, n_shared_experts=0, n_activated_experts=2, n_expert_groups=1,
                     n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
                     score_func="softmax", route_scale=1.0, dim=64, inter_dim=128, moe_inter_dim=64,
                     norm_topk_prob=True, dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.ModuleDict({"gate": Gate(conf)}) for _ in range(2)])
    for g in molt.automodel_gates(model):
        torch.nn.init.normal_(g.weight)
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    before = molt.automodel_gates(model)[0](x, torch.ones(64, dtype=torch.bool), None)[0].detach()
    molt.prepare_moe(model, Qwen3MoeConfig(num_experts=4), molt.ActorConfig(freeze_moe_router=True), "policy")
    gates = molt.automodel_gates(model)
    assert len(gates) == 2 and all(g.gate_precision == torch.float32 and not g.weight.requires_grad for g in gates)
    weights, idx, _ = gates[0](x, torch.ones(64, dtype=torch.bool), None)
    logits = torch.nn.functional.linear(x.float(), gates[0].weight.float())  # the projection itself in fp32
    top, expect_idx = logits.topk(2, dim=-1)
    expect = top.softmax(-1).to(torch.bfloat16)  # the gate returns its weights in the input's dtype
    assert torch.equal(idx, expect_idx) and torch.equal(weights.detach(), expect)
    assert not torch.equal(before, expect)  # with the projection in bf16 the weights differ


def tiny_moe_family(name: str, **kw):
    import transformers
    torch.manual_seed(0)
    cfg = getattr(transformers, name)(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=0, num_experts_per_tok=2, **kw)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # biased routers (gpt-oss), a correction bias (MiniMax-M2): large enough to change choices
        for name_, p in model.named_parameters():
            if "router" in name_ or "gate" in name_:
                p.normal_(0, 2.0)
    return model


@pytest.mark.parametrize("family", ["gpt-oss", "minimax-m2"])
def test_the_trainer_computes_each_router_as_its_model_does(family):
    """gpt-oss's routers add a bias to the gate; MiniMax-M2's score experts with a sigmoid and a correction bias.
    After prepare_moe the model's log-probs are unchanged (Molt's router forward takes the bias; a router it cannot
    reproduce keeps its own forward, and routing replay is refused on it). Was: both replaced by a softmax over the
    gate without bias: the trainer computed another model than the one the engine serves."""
    name, kw = {"gpt-oss": ("GptOssConfig", {"num_local_experts": 4}),
                "minimax-m2": ("MiniMaxM2Config", {"num_local_experts": 4})}[family]
    model, (ids, attn) = tiny_moe_family(name, **kw), batch()
    with torch.no_grad():
        before = logp_sum(model, ids, attn)
        routers = molt.prepare_moe(model, model.config, molt.ActorConfig(), "policy", replay=False)
        assert torch.allclose(logp_sum(model, ids, attn), before, rtol=0, atol=1e-5)
    assert len(routers) == (2 if family == "gpt-oss" else 0)  # what Molt reproduces, and so can replay
    if family == "minimax-m2":
        with pytest.raises(RuntimeError, match="MiniMaxM2TopKRouter"):
            molt.prepare_moe(tiny_moe_family(name, **kw), model.config, molt.ActorConfig(), "policy", replay=True)


def test_a_moe_model_with_unknown_routers_is_refused():
    with pytest.raises(RuntimeError, match="--train.backend hf"):
        molt.prepare_moe(torch.nn.Linear(4, 4), Qwen3MoeConfig(num_experts=4), molt.ActorConfig(), "policy")


def test_the_critic_is_a_value_model_on_every_backend(tiny):
    cfg = small_config(**{"train.backend": "automodel", "algo.estimator": "gae"})
    critic = molt.build_model(cfg, tiny, "critic", AutoConfig.from_pretrained(tiny), world=1, cuda=False)
    with torch.no_grad():
        out = critic(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert out.shape == (1, 3, 1)  # one value per token, not a vocabulary logit


@pytest.mark.core
def test_sample_routing_is_stored_by_position_and_the_first_writer_wins():
    s = molt.Sample()
    s.add_context([5, 6, 7])
    first = np.arange(5 * 2 * 2, dtype=np.int16).reshape(5, 2, 2) % 4  # turn 1: prompt (3) + 2 sampled tokens
    s.add_turn(molt.Completion([8, 9], [-1.0, -1.0], [0, 0], "stop", routing=first))
    s.add_context([10])  # an observation: no routing for it yet
    second = np.full((8, 2, 2), 3, dtype=np.int16)  # turn 2 recomputes positions 0-5 (a cache miss) and adds 6-7
    s.add_turn(molt.Completion([11, 12], [-1.0, -1.0], [1, 1], "stop", routing=second))
    s.add_context([13])
    s.merge_routing(None)  # as an episode's end does: rows cover every token
    assert s.routing.shape == (9, 2, 2) and len(s.routing) == len(s.tokens)
    assert (s.routing[:5] == first).all()  # turn 1's choices stand where turn 2 recomputed them
    assert (s.routing[5:8] == 3).all() and (s.routing[8] == -1).all()
