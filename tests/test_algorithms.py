"""Section 8: estimators, losses, IS correction and KL against hand-computed values on small tensors."""
import math

import pytest
import torch

import molt

pytestmark = pytest.mark.core  # the RL formulas: every test here is part of the core tier


def algo(**kw):
    a = molt.AlgoConfig()
    for k, v in kw.items():
        setattr(a, k, v)
    return molt.resolve_loss_defaults(a)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float)


MASK = t([0, 1, 1], [0, 1, 0], [1, 1, 1], [0, 0, 1])


def adv(estimator, reward, group, rollout, mask=MASK, **kw):
    return molt.compute_advantages(algo(estimator=estimator, **kw), torch.tensor(reward, dtype=torch.float),
                                   torch.tensor(group), torch.tensor(rollout), mask)


def test_grpo_normalises_within_groups_with_unbiased_std():
    a, _ = adv("grpo", [1.0, 0.0, 3.0, 5.0], [0, 0, 1, 1], [0, 1, 2, 3])
    s = math.sqrt(0.5)  # unbiased std of {1, 0}; {3, 5} has std sqrt(2)
    expect = [0.5 / s, -0.5 / s, -1 / math.sqrt(2), 1 / math.sqrt(2)]
    for i, e in enumerate(expect):
        assert torch.allclose(a[i], e * MASK[i], atol=1e-4)


def test_all_equal_rewards_and_singletons_give_zero_group_advantage():
    for est in ("grpo", "dr_grpo", "reinforce_baseline"):
        a, _ = adv(est, [2.0, 2.0, 7.0, 1.0], [0, 0, 1, 2], [0, 1, 2, 3])
        assert torch.all(a == 0), est


def test_dr_grpo_and_rloo():
    a, _ = adv("dr_grpo", [1.0, 0.0, 0.0, 3.0], [0, 0, 0, 1], [0, 1, 2, 3])
    assert torch.allclose(a[0], (1 - 1 / 3) * MASK[0]) and torch.allclose(a[1], (-1 / 3) * MASK[1])
    assert torch.all(a[3] == 0)
    r, _ = adv("rloo", [1.0, 0.0, 0.0, 3.0], [0, 0, 0, 1], [0, 1, 2, 3])
    assert torch.allclose(r[0], 1.0 * MASK[0]) and torch.allclose(r[1], -0.5 * MASK[1])
    assert torch.allclose(r[3], 3.0 * MASK[3])  # a singleton keeps its raw reward


def test_segments_of_one_episode_share_reward_and_count_once():
    # rollout 0 has two segments (samples 0, 1); the group is {rollout 0, rollout 1}: mean 0.5, not 2/3
    a, _ = adv("dr_grpo", [1.0, 1.0, 0.0, 0.0], [0, 0, 0, 1], [0, 0, 1, 2])
    assert torch.allclose(a[0], 0.5 * MASK[0]) and torch.allclose(a[1], 0.5 * MASK[1])
    assert torch.allclose(a[2], -0.5 * MASK[2])


def test_reinforce_baseline_whitens_over_all_action_tokens():
    a, returns = adv("reinforce_baseline", [1.0, 0.0, 3.0, 5.0], [0, 0, 1, 1], [0, 1, 2, 3])
    assert torch.allclose(returns[2], -1.0 * MASK[2])
    vals = a[MASK.bool()]
    assert abs(float(vals.mean())) < 1e-5 and abs(float(vals.std(unbiased=False)) - 1) < 1e-4


def test_reinforce_puts_reward_on_last_token_and_discounts():
    mask = t([0, 1, 1, 1])
    _, returns = molt.compute_advantages(algo(estimator="reinforce", gamma=0.5), t(4.0)[0:1].reshape(1),
                                         torch.tensor([0]), torch.tensor([0]), mask)
    assert torch.allclose(returns, t([0, 1.0, 2.0, 4.0]))


def test_gae_matches_hand_computation_and_monte_carlo_at_lambda_one():
    mask, values = t([1, 1, 0, 1]), t([0.5, 1.0, 9.0, 2.0])  # position 2 is masked: transparent
    a = algo(estimator="gae", gamma=1.0, lam=1.0)
    _, returns = molt.compute_advantages(a, torch.tensor([3.0]), torch.tensor([0]), torch.tensor([0]), mask,
                                         values=values)
    assert torch.allclose(returns, t([3.0, 3.0, 0.0, 3.0]))  # Monte-Carlo return at every action token
    a = algo(estimator="gae", gamma=0.9, lam=0.5)
    adv_w, returns = molt.compute_advantages(a, torch.tensor([3.0]), torch.tensor([0]), torch.tensor([0]), mask,
                                             values=values)
    d3 = 3.0 - 2.0
    d1 = 0 + 0.9 * 2.0 - 1.0
    a1 = d1 + 0.45 * d3
    d0 = 0 + 0.9 * 1.0 - 0.5
    a0 = d0 + 0.45 * a1
    assert torch.allclose(returns, t([a0 + 0.5, a1 + 1.0, 0.0, d3 + 2.0]), atol=1e-5)


def test_on_policy_distill_uses_reverse_kl_as_advantage():
    kl = t([0.0, 0.3, -0.2])
    a, _ = molt.compute_advantages(algo(estimator="on_policy_distill", kl_coef=2.0), torch.tensor([9.0]),
                                   torch.tensor([0]), torch.tensor([0]), t([0, 1, 1]), kl=kl)
    assert torch.allclose(a, t([0.0, -0.6, 0.4]))


@pytest.mark.parametrize("kind, expect", [("k1", [0.5, -0.5]), ("k2", [0.125, 0.125]),
                                          ("k3", [math.exp(-0.5) - 1 + 0.5, math.exp(0.5) - 1 - 0.5])])
def test_kl_estimators(kind, expect):
    assert torch.allclose(molt.approx_kl(t([0.0, -1.0]), t([-0.5, -0.5]), kind), t(*[expect])[0], atol=1e-6)
    assert torch.isfinite(molt.approx_kl(t([0.0]), t([-math.inf]), kind)).all()


def test_ppo_clip_and_dual_clip():
    logp, old, mask = t([math.log(1.5), math.log(0.5)]), t([0.0, 0.0]), t([1.0, 1.0])
    loss, clipped = molt.loss_ppo(algo(clip_low=0.2, clip_high=0.2), logp, old, t([1.0, -1.0]), mask)
    assert torch.allclose(loss, t([-1.2, 0.8])) and clipped.tolist() == [[1.0, 1.0]]
    big = t([math.log(5.0)])
    loss, _ = molt.loss_ppo(algo(dual_clip=3.0), big, t([0.0]), t([-1.0]), t([1.0]))
    assert torch.allclose(loss, t([3.0]))  # -max(min(-5, -1.2), 3 * -1) = 3


def test_gspo_uses_the_sequence_geometric_mean_with_token_gradients():
    logp = torch.tensor([[0.2, 0.0, 5.0]], requires_grad=True)
    loss, clip = molt.loss_gspo(algo(clip_low=0.2, clip_high=0.2), logp, t([0.0, 0.0, 0.0]), t([1.0, 1.0, 1.0]),
                                t([1.0, 1.0, 0.0]))
    assert torch.allclose(loss[0, :2], -torch.exp(torch.tensor(0.1)).expand(2))  # masked token 2 ignored
    loss[0, :2].sum().backward()
    assert torch.allclose(logp.grad[0, :2], -torch.exp(torch.tensor(0.1)).expand(2))


def test_cispo_clips_detached_weight_from_above_only():
    logp = torch.tensor([[math.log(2.0), math.log(0.5)]], requires_grad=True)
    loss, above = molt.loss_cispo(algo(loss="cispo", clip_high=1.2), logp, t([0.0, 0.0]), t([1.0, 1.0]), t([1.0, 1.0]))
    assert above.tolist() == [[1.0, 0.0]]
    loss.sum().backward()
    assert torch.allclose(logp.grad, t([-1.2, -0.5]))


OLD, BEH, M = t([0.0, 0.0, 0.0]), t([math.log(0.25), 0.0, math.log(1.5)]), t([1.0, 1.0, 1.0])  # w = 4, 1, 2/3


@pytest.mark.parametrize("level, mode, coef, filtered", [
    ("token", "mask", [0, 1, 2 / 3], [1, 0, 0]),
    ("token", "clip", [2.0, 1.0, 2 / 3], [1, 0, 0]),
    ("token", "trunc", [2.0, 1.0, 2 / 3], [1, 0, 0]),
    ("seq", "mask", [0, 0, 0], [1, 1, 1]),  # product 8/3 > 2: the whole sequence is gated out
    ("seq", "clip", [2.0, 2.0, 2.0], [1, 1, 1]),
    ("seq", "trunc", [2.0, 2.0, 2.0], [1, 1, 1]),
    ("geo", "mask", [4.0, 1.0, 2 / 3], [0, 0, 0]),  # geometric mean (8/3)^(1/3) ~ 1.39 lies inside the band
    ("geo", "clip", [(8 / 3) ** (1 / 3)] * 3, [0, 0, 0]),
    ("geo", "trunc", [(8 / 3) ** (1 / 3)] * 3, [0, 0, 0]),
])
def test_is_levels_and_modes(level, mode, coef, filtered):
    c, f = molt.is_correction(algo(is_level=level, is_mode=mode, is_low=0.5, is_high=2.0), OLD, BEH, M)
    assert torch.allclose(c[0], t(coef)[0], atol=1e-5), c
    assert f[0].tolist() == filtered


def test_is_respects_the_mask_and_off_means_one():
    beh = t([-math.log(1.2), -math.log(10.0), -math.log(1.1)])  # w = 1.2, 10 (masked out), 1.1
    c, f = molt.is_correction(algo(is_level="seq", is_mode="mask", is_low=0.5, is_high=2.0), OLD, beh,
                              t([1.0, 0.0, 1.0]))
    assert torch.allclose(c[0, [0, 2]], t([1.2, 1.1])[0]) and f.sum() == 0  # 1.32 inside; with the masked 10: out
    c, f = molt.is_correction(algo(is_level="off"), OLD, BEH, M)
    assert torch.all(c == 1) and torch.all(f == 0)


def test_aggregation_token_and_sequence_means():
    loss, mask = t([1.0, 2.0, 9.0], [3.0, 0.0, 0.0]), t([1.0, 1.0, 0.0], [1.0, 0.0, 0.0])
    assert molt.aggregate(loss, mask, "token", n_tokens=3, n_seqs=2).item() == pytest.approx(2.0)
    assert molt.aggregate(loss, mask, "seq", n_tokens=3, n_seqs=2).item() == pytest.approx((1.5 + 3.0) / 2)


def test_samples_without_ids_are_separate_episodes_and_groups():
    samples = [molt.Sample(tokens=[5, 6, 7], mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0], versions=[-1, 0, 0],
                           reward=r) for r in (1.0, 0.0, 1.0)]
    mask, reward, group, rollout = molt.step_tensors(samples)
    assert len(set(group.tolist())) == 3 and len(set(rollout.tolist())) == 3
    a, _ = molt.compute_advantages(algo(estimator="grpo"), reward, group, rollout, mask)
    assert torch.all(a == 0)  # three singletons: no group to compare with


TWO_SIDED = t([math.log(0.25), 0.0, math.log(4.0)])  # w = 4 (above the band), 1, 1/4 (below it)
LOW_SEQ = t([math.log(4.0), math.log(4.0), 0.0])  # w = 1/4, 1/4, 1: product 1/16, geometric mean 0.397


@pytest.mark.parametrize("beh, level, mode, coef, filtered", [
    (TWO_SIDED, "token", "mask", [0, 1, 0], [1, 0, 1]),
    (TWO_SIDED, "token", "clip", [2.0, 1.0, 0.5], [1, 0, 1]),
    (TWO_SIDED, "token", "trunc", [2.0, 1.0, 0.25], [1, 0, 0]),  # truncation caps from above only
    (LOW_SEQ, "seq", "mask", [0, 0, 0], [1, 1, 1]),
    (LOW_SEQ, "seq", "clip", [0.5] * 3, [1, 1, 1]),
    (LOW_SEQ, "seq", "trunc", [1 / 16] * 3, [0, 0, 0]),
    (LOW_SEQ, "geo", "mask", [0, 0, 0], [1, 1, 1]),
    (LOW_SEQ, "geo", "clip", [0.5] * 3, [1, 1, 1]),
    (LOW_SEQ, "geo", "trunc", [(1 / 16) ** (1 / 3)] * 3, [0, 0, 0]),
])
def test_is_modes_differ_below_the_band(beh, level, mode, coef, filtered):
    c, f = molt.is_correction(algo(is_level=level, is_mode=mode, is_low=0.5, is_high=2.0), OLD, beh, M)
    assert torch.allclose(c[0], t(coef)[0], atol=1e-5), c
    assert f[0].tolist() == filtered


def test_rewards_are_clipped_before_the_estimator():
    a, _ = adv("dr_grpo", [100.0, 0.0, 0.0, 0.0], [0, 0, 1, 1], [0, 1, 2, 3], reward_clip=10.0)
    assert torch.allclose(a[0], 5.0 * MASK[0]) and torch.allclose(a[1], -5.0 * MASK[1])  # 10 vs 0, not 100 vs 0


def test_prompt_mean_token_mean_is_the_mean_over_prompts_of_their_token_means():
    """Prompt a: samples 0 (3 action tokens) and 1 (1); prompt b: sample 2 (2), in one mini-batch split over two
    micro-batches: the weighted sums add up to ((1 + 2 + 3 + 4) / 4 + (5 + 6) / 2) / 2 = 4.0, where the token-mean
    is 21 / 6 = 3.5 and the seq-mean (2 + 4 + 5.5) / 3."""
    def sample(group, actions):
        return molt.Sample(group_id=group, tokens=[1] * 4, mask=[0] + actions, logprobs=[0.0] * 4, versions=[-1] * 4)
    samples = [sample("a", [1, 1, 1]), sample("a", [0, 1, 0]), sample("b", [1, 1, 0])]
    weights = molt.prompt_weights(samples, [[[0, 2], [1, -1]]])  # one mini-batch, two ranks (-1: FSDP padding)
    losses = {0: t([1.0, 2.0, 3.0]), 1: t([0.0, 4.0, 0.0]), 2: t([5.0, 6.0, 0.0])}
    total = sum(molt.aggregate(losses[i][None], t(samples[i].mask[1:]), "prompt", 0, 0, torch.tensor(weights[i])[None])
                for i in range(3))
    assert total.item() == pytest.approx(4.0)
    assert weights[0][0] == pytest.approx(1 / (2 * 4)) and weights[2][0] == pytest.approx(1 / (2 * 2))


@pytest.mark.parametrize("longest, finish, buffer, coef, expect", [
    (10, "stop", 0, 1.0, 1.0),  # both off
    (10, "stop", 8, 1.0, 1.0),  # L <= Lmax - b = 24: no overlong term
    (28, "stop", 8, 1.0, 1.0 + (24 - 28) / 8),  # inside the buffer: linear, -0.5
    (32, "length", 8, 1.0, 1.0 - 1.0),  # at Lmax: -1
    (32, "length", 0, 0.5, 0.5),  # cut without a stop: reward x coef
    (32, "length", 8, 0.0, -1.0),  # both: zeroed, then -1
])
def test_length_penalties_by_hand(longest, finish, buffer, coef, expect):
    """DAPO's overlong term on the episode's longest reply (Lmax = max_new_tokens 32) and ProRL's stop-properly factor
    on an episode whose last reply was cut; both segments of the episode get the episode's shaped reward."""
    first = molt.Sample(rollout_id="e", tokens=[1] * 13, mask=[0] * 3 + [1] * 10, reward=1.0, finish_reason="stop")
    last = molt.Sample(rollout_id="e", tokens=[1] * (longest + 2), mask=[0, 0] + [1] * longest, reward=1.0,
                       finish_reason=finish)
    out = molt.length_penalties(algo(overlong_buffer=buffer, stop_penalty=coef), 32, [first, last])
    assert out == pytest.approx([expect, expect])


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("level", ["token", "seq", "geo"])
@pytest.mark.parametrize("mode", ["mask", "clip", "trunc"])
def test_a_padded_sample_loses_and_weighs_as_it_does_alone(loss, level, mode):
    """Second case of every loss and IS level: a 2-token sample padded to 4 beside a 4-token one, with garbage where
    the padding is (the trainer computes log-probs on pad tokens, the engine's are 0), has the per-token loss, IS
    coefficient and filter it has alone."""
    g = torch.Generator().manual_seed(7)
    beh = -torch.rand(2, 4, generator=g) * 2
    old, logp = (beh + (torch.rand(2, 4, generator=g) - 0.5) * 0.2 for _ in range(2))  # ratios inside the band
    adv, mask = t([1.0, -0.5, 0.7, 2.0], [-1.0, 0.3, 0.0, 0.0]), t([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0])
    old[1, 2:], beh[1, 2:], logp[1, 2:] = 9.0, 0.0, -30.0  # the padding's garbage
    a = algo(loss=loss, is_level=level, is_mode=mode, is_low=0.7, is_high=1.3)
    together, stats = molt.policy_loss(a, logp, old, beh, adv, mask)
    alone, stats_alone = molt.policy_loss(a, logp[1:, :2], old[1:, :2], beh[1:, :2], adv[1:, :2], mask[1:, :2])
    assert torch.allclose(together[1, :2], alone[0], atol=1e-6)
    for key in ("is/weight", "is/masked_frac"):
        assert torch.allclose(stats[key][1, :2], stats_alone[key][0], atol=1e-6), key


def test_the_longest_reply_may_sit_in_any_segment_and_only_the_last_reply_is_judged_cut():
    """Second case of the length penalties: the episode's longest reply is in its first segment (the last is short),
    and that first reply was cut while the last one stopped (no stop-properly factor: only the last reply counts),
    with another episode's segments interleaved in the batch."""
    first = molt.Sample(rollout_id="e", tokens=[1] * 33, mask=[0] * 3 + [1] * 30, reward=1.0, finish_reason="length")
    other = molt.Sample(rollout_id="o", tokens=[1] * 6, mask=[0, 0] + [1] * 4, reward=0.0, finish_reason="length")
    last = molt.Sample(rollout_id="e", tokens=[1] * 6, mask=[0, 0] + [1] * 4, reward=1.0, finish_reason="stop")
    out = molt.length_penalties(algo(overlong_buffer=8, stop_penalty=0.5), 32, [first, other, last])
    # e: L = 30 -> (32 - 8 - 30) / 8 = -0.75 on 1.0, no factor; o: L = 4 -> no term, its only reply cut -> 0.0 * 0.5
    assert out == pytest.approx([0.25, 0.0, 0.25])
