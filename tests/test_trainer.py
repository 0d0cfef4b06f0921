"""Section 9 and 11: the FSDP2 policy actor on CPU (gloo), weight sync into the real engine, checkpoints."""
import copy
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import molt
from conftest import file_state, run, small_config


def make_samples(n_groups=2, n=4, seed=0):
    rng = random.Random(seed)
    samples = []
    for g in range(n_groups):
        prompt = [rng.randrange(5, 100) for _ in range(6)]
        for k in range(n):
            resp = [rng.randrange(5, 100) for _ in range(rng.randint(3, 9))]
            s = molt.Sample(group_id=f"g{g}-{seed}", rollout_id=f"r{g}-{k}-{seed}", reward=float(rng.random() > 0.5))
            s.extend(prompt)
            s.extend(resp, [-4.7] * len(resp), [0] * len(resp))
            samples.append(s)
    return samples


def weights(group):
    import ray
    return {k: v for ref in group.run("export_weights", 512, False, True)[0]["refs"] for k, v in ray.get(ref).items()}


def trainer(path, ranks=1, **overrides):
    cfg = small_config(**{"train.num_ranks": ranks, "train.lr": 1e-2, "train.micro_batch_size": 3, **overrides})
    return cfg, molt.ModelGroup(cfg, path, "policy", total_steps=10)


@pytest.mark.parametrize("agg", [pytest.param("token", marks=pytest.mark.core), "seq"])
def test_one_rank_and_two_ranks_take_the_same_step(ray_cluster, tiny, agg):
    samples = make_samples()
    results = []
    for ranks in (1, 2):
        cfg, group = trainer(tiny, ranks, **{"algo.loss_agg": agg, "train.mini_batches": 2})
        metrics = molt.learn(cfg, {"policy": group}, samples)
        results.append((metrics, weights(group)))
        for w in group.workers:
            ray_cluster.kill(w)
    (m1, w1), (m2, w2) = results
    assert m1["loss/policy"] == pytest.approx(m2["loss/policy"], abs=1e-5)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
    assert w1.keys() == w2.keys()
    start = file_state(tiny)
    assert any(not torch.equal(w1[k], start[k]) for k in start)  # the step changed the weights
    # Adam divides by sqrt(v): parameters whose gradients are near zero amplify fp32 summation-order noise, so the
    # weights agree to 0.5% of the step size (lr 1e-2) while loss and gradient norm agree to 1e-5 / 1e-4
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-4), (k, float((w1[k] - w2[k]).abs().max()))


def skewed_samples(seed=0):
    """16 samples whose lengths spread over 10x (8 to 80 tokens), in groups of 4."""
    rng, out = random.Random(seed), []
    for k in range(16):
        n = 8 + (72 * k) // 15
        s = molt.Sample(group_id=f"g{k // 4}", rollout_id=f"r{k}", reward=float(rng.random() > 0.5))
        s.extend([rng.randrange(5, 100) for _ in range(4)])
        s.extend([rng.randrange(5, 100) for _ in range(n - 4)], [-4.7] * (n - 4), [0] * (n - 4))
        out.append(s)
    rng.shuffle(out)
    return out


@pytest.mark.core
def test_token_budget_packs_under_the_budget_longest_first():
    samples = skewed_samples()
    t = small_config(**{"train.max_tokens_per_micro_batch": 160}).train
    [[mine]] = molt.shard_plan(samples, 1, 1)
    # lengths 80, 75, 70, ..., 12, 8: padded, count x longest fits the budget; packed, their sum (so more fit)
    for one_row, sizes in ((False, [2, 2, 2, 3, 4, 3]), (True, [2, 2, 2, 3, 7])):
        t.pack_samples = one_row
        packs = molt.pack_micro_batches(samples, mine, t)
        assert sorted(i for p in packs for i in p) == list(range(16))  # every sample once
        assert [len(p) for p in packs] == sizes
        for p in packs:
            lengths = [len(samples[i].tokens) for i in p]
            assert (sum(lengths) if one_row else len(p) * max(lengths)) <= 160, p
    t.max_tokens_per_micro_batch = 50
    for t.pack_samples in (False, True):  # an 80-token sample over the budget: alone
        assert molt.pack_micro_batches(samples, mine, t)[0] == [mine[0]]


@pytest.mark.core
def test_a_packed_micro_batch_computes_what_the_padded_one_does(tiny):
    """One row, positions restarting at each sample: every sample's log-probs, entropies (at per-token
    temperatures), gradients and critic values equal the padded micro-batch's; none leaks into its neighbour."""
    import types
    from transformers import AutoModelForTokenClassification
    samples = skewed_samples()[:6]
    for s in samples:
        s.temperatures = [None] * 4 + [0.7] * (len(s.tokens) - 4)
    idx = [0, -1, 1, 2, 3, 4, 5]  # with a masked copy, as FSDP padding adds
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    w = types.SimpleNamespace(model=model, image_token=None, media=[], cfg=small_config())
    model._molt_routers = []
    out = {}
    for pack in (False, True):
        mb = molt.collate(samples, idx, None, torch.device("cpu"), 1.0, pack)
        model.zero_grad()
        logp, ent = molt.step_logprobs(w, mb, True)
        ((logp * mb["mask"]).sum() + (ent * mb["mask"]).sum()).backward()
        out[pack] = (logp * mb["mask"], ent * mb["mask"], {k: p.grad.clone() for k, p in model.named_parameters()})
        if pack:
            assert mb["pos"].shape[1] == sum(len(samples[max(i, 0)].tokens) for i in idx) < mb["ids"].numel()
    assert out[True][0].abs().sum() > 0
    assert torch.allclose(out[False][0], out[True][0], atol=1e-5)
    assert torch.allclose(out[False][1], out[True][1], atol=1e-5)
    for k, g in out[False][2].items():
        assert torch.allclose(g, out[True][2][k], atol=1e-5, rtol=1e-4), k
    # a sample's log-probs do not depend on what it is packed with (reversed order, other neighbours)
    mb = molt.collate(samples, [3], None, torch.device("cpu"), 1.0, True)
    alone = molt.step_logprobs(w, mb)[0] * mb["mask"]
    assert torch.allclose(alone[0], out[True][0][4, :alone.shape[1]], atol=1e-5)
    critic = AutoModelForTokenClassification.from_pretrained(tiny, num_labels=1, dtype=torch.float32)
    critic._molt_routers = []
    v = types.SimpleNamespace(model=critic, image_token=None, media=[])
    values = [molt.step_values(v, molt.collate(samples, idx, None, torch.device("cpu"), 1.0, pack)) for pack in (0, 1)]
    mask = molt.collate(samples, idx, None, torch.device("cpu")).get("attn")[:, 1:]
    assert torch.allclose(values[0] * mask, values[1] * mask, atol=1e-5)


@pytest.mark.core
def test_chunked_logprobs_equal_the_whole_logits_and_never_hold_them(monkeypatch):
    """--train.logits-chunk-mb: on a 152k vocabulary (Qwen3's), padded and packed, at per-token temperatures and with
    a media bias, the log-probs and entropies equal the whole-logits path's to 1e-6, every gradient to 1e-6 of its
    largest entry (the same sums in another order); the head computes at most one chunk's logits at a time, and only
    at the trained positions (each twice: the backward recomputes chunk by chunk), nothing of vocabulary size is kept
    for backward, and the head's own forward is back afterwards."""
    import types
    from transformers import Qwen3Config
    torch.manual_seed(0)
    V = 151_936
    config = Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).float()
    model._molt_routers = []
    samples = skewed_samples()[:5]
    for s in samples:
        s.temperatures = [None] * 4 + [0.7] * (len(s.tokens) - 4)
        s.tokens[5] = 151_000  # an id past the tiny vocabulary, under a media bias below
    rows, linear = [], torch.nn.Linear.forward  # rows of logits each head call computes
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda m, x: rows.append(x.shape[:-1].numel() if
                                                                              m.out_features == V else 0) or linear(m, x))
    out = {}
    for pack in (False, True):
        mb = molt.collate(samples, [0, -1, 1, 2, 3, 4], None, torch.device("cpu"), 1.0, pack)
        # 10 MiB: 17 positions of 151,936 fp32 logits per chunk (11 chunks of the 186 trained). Not fewer rows: a
        # head matmul of under 16 rows takes another BLAS kernel on some CPUs (AMD EPYC without AVX-512), whose
        # 152k-term sums are 10x less exact (gradients 7-12e-6 off the float64 ones where both paths are 1.2e-6)
        for chunk_mb in (0, 10):
            w = types.SimpleNamespace(model=model, image_token=None, media=[151_000],
                                      cfg=small_config(**{"train.logits_chunk_mb": chunk_mb}))
            model.zero_grad()
            rows.clear()
            kept = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t, lambda t: t):
                logp, ent = molt.step_logprobs(w, mb, True)
            ((logp * mb["mask"]).sum() + 0.1 * (ent * mb["mask"]).sum()).backward()
            out[pack, chunk_mb] = (logp * mb["mask"], ent * mb["mask"], {k: p.grad.clone()
                                                                         for k, p in model.named_parameters()})
            n = mb["pos"].shape[1] if pack else mb["ids"].numel()  # positions the model runs
            trained = int((mb["mask"] > 0).sum())
            assert max(rows) == (n if chunk_mb == 0 else 17) and 17 < trained < n
            assert sum(rows) == (n if chunk_mb == 0 else 2 * trained)
            assert any(s[-1] == V for s in kept) == (chunk_mb == 0)
        whole, chunked = out[pack, 0], out[pack, 10]
        assert whole[0].abs().sum() > 0 and (whole[1] > 0).any()
        assert torch.allclose(whole[0], chunked[0], rtol=0, atol=1e-6)
        assert torch.allclose(whole[1], chunked[1], rtol=0, atol=1e-6)
        for k, g in whole[2].items():
            scale = float(g.abs().max())  # fp32 sums in another order: agreement relative to the largest entry
            assert scale > 0 and float((g - chunked[2][k]).abs().max()) <= 1e-6 * scale, k
    assert "forward" not in vars(model.get_output_embeddings())
    rows.clear()
    mb = molt.collate(samples, [0, 1], None, torch.device("cpu"))
    with torch.no_grad():  # a forward without gradients (the old and reference log-probs) chunks too, once
        molt.step_logprobs(w, mb)
    assert max(rows) == 17 and sum(rows) == int((mb["mask"] > 0).sum())


@pytest.mark.parametrize("ranks", [1, 2])
def test_token_budget_step_equals_the_fixed_count_step(ray_cluster, tiny, ranks):
    """Same batch (lengths over 10x), same step: 3 samples per micro-batch; padded micro-batches under 160 tokens;
    or packed rows under 160 (--train.pack-samples, CUDA-only at launch for speed, run here through SDPA's block
    mask). Unequal numbers of micro-batches per rank when sharded: the short rank runs masked copies."""
    samples, results = skewed_samples(), []
    for budget, pack in ((0, False), (160, False), (160, True)):
        cfg = small_config(**{"train.num_ranks": ranks, "train.lr": 1e-2, "train.micro_batch_size": 3,
                              "train.max_tokens_per_micro_batch": budget})
        cfg.train.pack_samples = pack
        group = molt.ModelGroup(cfg, tiny, "policy", total_steps=10)
        results.append((molt.learn(cfg, {"policy": group}, samples), weights(group)))
        for w in group.workers:
            ray_cluster.kill(w)
    (m1, w1) = results[0]
    for m2, w2 in results[1:]:
        assert m1["loss/policy"] == pytest.approx(m2["loss/policy"], abs=1e-5)
        assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
        for k in w1:
            assert torch.allclose(w1[k], w2[k], atol=1e-4), (k, float((w1[k] - w2[k]).abs().max()))


def engine_gap(ray_cluster, engine, group, version):
    """Largest |engine log-prob - trainer log-prob| over 24 sampled tokens, and their versions."""
    [c] = run(engine.generate.remote(molt.EngineRequest([5, 6, 7, 8], sampling={
        "max_tokens": 24, "temperature": 1.0, "ignore_eos": True})))
    s = molt.Sample(rollout_id="probe")
    s.extend([5, 6, 7, 8])
    s.add_turn(c)
    ours = group.forward(ray_cluster.put([s]), molt.shard_plan([s], 1, 1))[0][3:]
    return max(abs(a - b) for a, b in zip(ours, c.logprobs)), c, s


@pytest.mark.core
def test_synced_engine_matches_the_trainer(ray_cluster, engine, tiny):
    """Three updates: through the trainer's shared-memory files (created, then overwritten in place: the engine's
    cached mapping must see the new bytes), then as if the engine were on another node (object store, the engine's
    own files). After each, the engine samples with exactly the trainer's weights."""
    cfg, group = trainer(tiny, **{"train.check_weight_sync": True})
    version = run(engine.stats.remote())["version"]
    sync = molt.WeightSync(cfg, group, [engine])
    try:
        assert sync.local == {engine: True}
        for k in range(3):
            molt.learn(cfg, {"policy": group}, make_samples(seed=k))
            sync.local[engine] = k < 2
            sync.start(version + k + 1)
            sync.wait()
            out = sync.take()
            assert out["sync/stale_params"] == 0 and out["sync/bytes"] > 0
            gap, c, s = engine_gap(ray_cluster, engine, group, version + k + 1)
            assert gap < 1e-3 and c.versions == [version + k + 1] * 24, (k, gap)
        files = list(molt.shm_dir().glob(ray_cluster.get(group.workers[0].__ray_call__.remote(
            lambda w: w.shm.prefix)) + "-*"))
        assert files
        base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        with torch.no_grad():
            ids = torch.tensor([s.tokens])
            old = torch.log_softmax(base(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[3:, 0]
        assert max(abs(a - b) for a, b in zip(old.tolist(), c.logprobs)) > 1e-2  # the weights really changed
        sync.close()
        assert not any(f.exists() for f in files)  # the shared-memory buffers are freed
    finally:
        import ray
        ray.get(engine.update.remote({"refs": [ray.put(file_state(tiny))]}, version + 4))
        for w in group.workers:
            ray_cluster.kill(w)


def lr(group):
    import ray
    return ray.get(group.workers[0].__ray_call__.remote(lambda w: w.sched.get_last_lr()[0]))


def test_checkpoint_resume_continues_weights_optimizer_and_schedule_exactly(ray_cluster, tiny, tmp_path):
    """Warm-up then linear decay over 6 steps; a checkpoint after 3; the resumed run's next 3 steps equal the straight
    run's: same weights after each step and the same learning rate (the scheduler resumes, it does not restart)."""
    batches = [make_samples(seed=k) for k in range(6)]
    sched = {"train.lr_schedule": "linear", "train.warmup_steps": 2, "train.min_lr_ratio": 0.1}
    cfg = small_config(**{"train.lr": 1e-2, "train.micro_batch_size": 3, **sched})
    a = molt.ModelGroup(cfg, tiny, "policy", total_steps=6)
    for b in batches[:3]:
        molt.learn(cfg, {"policy": a}, b)
    ckpt = molt.save_checkpoint(str(tmp_path), 3, {"policy": a}, {"step": 3}, keep=2)
    assert (ckpt / "molt_state.json").exists()
    straight = []
    for b in batches[3:]:
        molt.learn(cfg, {"policy": a}, b)
        straight.append((lr(a), weights(a)))
    # a later save killed midway leaves a temporary directory behind; the complete checkpoint still wins
    # (and a step directory without its state file, as an interrupted copy leaves, is not a checkpoint either)
    for name in (".step_000004.tmp", "step_000005"):
        partial = tmp_path / "checkpoints" / name
        partial.mkdir()
        (partial / "model.safetensors").write_bytes(b"truncated")
    assert molt.latest_checkpoint(str(tmp_path)) == ckpt
    b_group = molt.ModelGroup(cfg, str(ckpt), "policy", total_steps=6)
    b_group.run("load", str(ckpt))
    for k, b in enumerate(batches[3:]):
        molt.learn(cfg, {"policy": b_group}, b)
        lr_b, w_b = lr(b_group), weights(b_group)
        assert lr_b == pytest.approx(straight[k][0], rel=1e-9), k
        for name in w_b:
            assert torch.allclose(straight[k][1][name], w_b[name], atol=1e-6), (k, name)
    assert [x[0] for x in straight] == pytest.approx([1e-2 * (0.1 + 0.9 * f) for f in (0.5, 0.25, 0.0)])
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt))  # loadable as is by transformers...
    assert hf.config.vocab_size == 128
    engine = molt.start_engines(small_config(), str(ckpt))[0]  # ...and by vLLM (an engine of its own: this model)
    try:
        out = run(engine.generate.remote(molt.EngineRequest([5, 6], sampling={"max_tokens": 3, "ignore_eos": True})))
        assert len(out[0].ids) == 3
    finally:
        for actor in [engine, *a.workers, *b_group.workers]:
            ray_cluster.kill(actor)


def test_optimizer_offload_steps_host_copies_and_resumes(ray_cluster, tiny, tmp_path):
    """--train.offload optimizer (CUDA only at launch; its mechanics here on two CPU ranks, so FSDP2 shards): AdamW
    steps fp32 host copies of each rank's shards and writes them back. Steps equal the plain optimizer's, the moments
    belong to the copies, a checkpoint resumes exactly from its per-rank files, and one group cannot load the other
    kind of optimizer state."""
    import ray
    batches = [make_samples(seed=k) for k in range(4)]
    cfgs = {mode: small_config(**{"train.lr": 1e-2, "train.micro_batch_size": 3, "train.num_ranks": 2,
                                  "train.offload": mode}) for mode in ("none", "optimizer")}
    plain, off = (molt.ModelGroup(cfgs[m], tiny, "policy", total_steps=4) for m in ("none", "optimizer"))
    for b in batches[:2]:
        for g, m in ((plain, "none"), (off, "optimizer")):
            molt.learn(cfgs[m], {"policy": g}, b)
    w_plain, w_off = weights(plain), weights(off)
    assert any(not torch.equal(w_off[k], v) for k, v in file_state(tiny).items())  # it trained
    for k in w_plain:
        assert torch.allclose(w_plain[k], w_off[k], atol=1e-6), k

    def where_moments(w):
        own = {id(p) for p in w.model.parameters()}
        return [(id(m) in own, tuple(m.shape) == tuple(molt.local_shard(p).shape), set(w.optim.state[m]))
                for p, m in w.masters.items()]
    for rank in ray.get([w.__ray_call__.remote(where_moments) for w in off.workers]):
        assert rank and all(not is_param and shard and {"exp_avg", "exp_avg_sq"} <= keys
                            for is_param, shard, keys in rank)
    ckpt = molt.save_checkpoint(str(tmp_path), 2, {"policy": off}, {"step": 2}, keep=2)
    assert {f.name for f in ckpt.glob("optim_rank*.pt")} == {"optim_rank0.pt", "optim_rank1.pt"}
    with pytest.raises(ray.exceptions.RayTaskError, match="saved with --train.offload optimizer"):
        plain.run("load", str(ckpt))
    straight = []
    for b in batches[2:]:
        molt.learn(cfgs["optimizer"], {"policy": off}, b)
        straight.append(weights(off))
    resumed = molt.ModelGroup(cfgs["optimizer"], str(ckpt), "policy", total_steps=4)
    resumed.run("load", str(ckpt))
    for k, b in enumerate(batches[2:]):
        molt.learn(cfgs["optimizer"], {"policy": resumed}, b)
        w = weights(resumed)
        for name in w:
            assert torch.allclose(straight[k][name], w[name], atol=1e-6), (k, name)
    for actor in [*plain.workers, *off.workers, *resumed.workers]:
        ray_cluster.kill(actor)


@pytest.mark.core
@pytest.mark.parametrize("schedule, expect", [
    ("constant", [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [1 / 3, 2 / 3, 1.0, 0.1 + 0.9 * 2 / 3, 0.1 + 0.9 / 3, 0.1]),
    ("cosine", [1 / 3, 2 / 3, 1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.25, 0.1]),
])
def test_lr_schedule_warms_up_then_decays_to_the_floor(schedule, expect):
    f = molt.lr_lambda(molt.TrainConfig(lr_schedule=schedule, warmup_steps=2, min_lr_ratio=0.1), total_steps=5)
    assert [f(step) for step in range(6)] == pytest.approx(expect)


@pytest.mark.core
def test_segments_of_one_episode_share_its_advantage_through_learn(tiny_trainer):
    """Episode A has two segments (reward 1), episode B one (reward 0), one group: dr_grpo gives A +0.5 on both segments
    and B -0.5; counting A's segments as two rollouts would give +1/3 and -2/3."""
    cfg, group = tiny_trainer
    cfg = copy.deepcopy(cfg)
    cfg.algo.estimator = "dr_grpo"
    samples = []
    for rid, segment, n, reward in [("A", 0, 3, 1.0), ("A", 1, 4, 1.0), ("B", 0, 5, 0.0)]:
        s = molt.Sample(group_id="g", rollout_id=rid, segment=segment, reward=reward)
        s.add_context([5, 6, 7])
        s.add_turn(molt.Completion([8 + i for i in range(n)], [-4.0] * n, [0] * n, "stop"))
        samples.append(s)
    metrics = molt.learn(cfg, {"policy": group}, samples)
    assert metrics["adv/mean"] == pytest.approx(0.5 * (3 + 4 - 5) / 12, abs=1e-6)


def test_bad_batches_are_refused_naming_the_sample(ray_cluster, tiny):
    cfg, group = trainer(tiny)
    before = weights(group)
    bad_len = make_samples()
    bad_len[3].logprobs.pop()
    bad_reward = make_samples()
    bad_reward[5].reward = math.nan
    for batch, message in [(bad_len, bad_len[3].name()), (bad_reward, "reward is nan"), ([], "empty batch")]:
        with pytest.raises(ValueError, match=message):
            molt.learn(cfg, {"policy": group}, batch)
    after = weights(group)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was trained
    for w in group.workers:
        ray_cluster.kill(w)


def test_transfer_ranks_number_every_engine_worker_once():
    """vLLM's NCCL transfer group: rank 0 is the trainer, each engine worker takes dp_rank * tp + tp_rank + its
    engine's offset (vllm/distributed/weight_transfer/nccl_common.py). Every rank in 1..world-1 exactly once."""
    for engines, tp, dp in [(1, 1, 1), (2, 2, 1), (2, 1, 2), (3, 2, 2)]:
        cfg = small_config(**{"engine.num_engines": engines, "engine.tp_size": tp, "engine.dp_size": dp})
        world = molt.transfer_ranks(cfg, 0, engines)[1]
        ranks = [molt.transfer_ranks(cfg, i, engines)[0] + d * tp + t
                 for i in range(engines) for d in range(dp) for t in range(tp)]
        assert sorted(ranks) == list(range(1, world)), (engines, tp, dp, ranks)


def test_native_sender_yields_what_it_declares_in_the_engine_dtype(tiny, monkeypatch):
    """The trainer side of vLLM's NCCL weight transfer (CUDA only; no NCCL here): vLLM's group opener is replaced by
    nothing and the engines' side of the protocol by a recorder, so what runs is Molt's side: the world size it
    announces, and a WeightSource whose tensors match its metadata (names, dtypes, shapes: the engine sizes its
    receive buffers from it) and carry the trainer's weights in the engine's dtype."""
    import types

    from vllm.distributed.weight_transfer import nccl_engine
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: None)
    calls = []
    monkeypatch.setattr(molt.EngineSyncClient, "_all", lambda self, call, arg=None: calls.append((call, arg)))
    cfg = small_config(**{"engine.dtype": "bfloat16", "engine.tp_size": 2})
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    worker = types.SimpleNamespace(model=model, tied=model.config.tie_word_embeddings, rank=0, cfg=cfg,
                                   device=torch.device("cpu"), address=lambda: ("127.0.0.1", 1))
    sender = molt.native_sender(worker, ["engine-0", "engine-1"])
    assert [c for c, _ in calls] == ["init"] and calls[0][1]["world_size"] == 5
    meta, sent = sender.source.metadata(), list(sender.source)
    assert [(m.name, m.dtype, tuple(m.shape)) for m in meta] == [(n, t.dtype, tuple(t.shape)) for n, t in sent]
    expected = {k: v for k, v in model.state_dict().items() if not (worker.tied and k == "lm_head.weight")}
    assert [n for n, _ in sent] == list(expected)
    for name, t in sent:
        assert t.dtype == torch.bfloat16 and torch.equal(t, expected[name].to(torch.bfloat16)), name
