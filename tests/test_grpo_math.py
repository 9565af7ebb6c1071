"""GRPO-family math checked against numbers worked out by hand (rlfabric.algorithms.grpo)."""

import math

import numpy as np
import pytest
import torch

from rlfabric.algorithms import grpo
from rlfabric.algorithms.record_rewards import group_has_signal
from rlfabric.objectives import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_RATIOS

F64 = torch.float64
NAN, INF = float("nan"), float("inf")


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=1e-6, atol=atol)


# Two groups: [1, 0, 0, 1] (mean 0.5) and [1, 1] (all equal).
REWARDS = t([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1])
# Uneven groups, shuffled, arbitrary ids: group 10 = {2, 3, 4}, group 3 = {5, 7}, group 42 = {9} (size one).
UNEVEN_REWARDS = t([2.0, 5.0, 3.0, 7.0, 4.0, 9.0])
UNEVEN_GROUPS = torch.tensor([10, 3, 10, 3, 10, 42])


# -- advantages ------------------------------------------------------------------------------------------------


def test_grpo_advantages_by_hand():
    # group 0: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735...
    # group 1: all equal -> 0 / (0 + eps) = 0
    std = math.sqrt(1 / 3)
    assert std == pytest.approx(0.5773503)
    a = 0.5 / (std + 1e-6)
    assert a == pytest.approx(0.8660239, rel=1e-6)
    close(grpo.grpo_advantages(REWARDS, GROUPS), [a, -a, -a, a, 0.0, 0.0])


def test_grpo_advantages_uneven_shuffled_groups_and_a_group_of_one():
    # group 10: mean 3, deviations -1, 0, 1, var = 2 / 2 = 1            -> -1, 0, 1
    # group 3:  mean 6, deviations -1, 1,    var = 2 / 1 = 2, std = 1.414 -> -0.7071, 0.7071
    # group 42: one sample -> 0
    s = 1 / (math.sqrt(2) + 1e-6)
    close(grpo.grpo_advantages(UNEVEN_REWARDS, UNEVEN_GROUPS), [-1 / (1 + 1e-6), -s, 0.0, s, 1 / (1 + 1e-6), 0.0])


def test_dr_grpo_advantages_are_centered_but_not_scaled():
    close(grpo.grpo_advantages(REWARDS, GROUPS, scale_by_std=False), [0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
    close(grpo.grpo_advantages(UNEVEN_REWARDS, UNEVEN_GROUPS, scale_by_std=False), [-1, -1, 0, 1, 1, 0])


@pytest.mark.parametrize("value", [0.1, 0.3, 1.1, 0.7])
def test_a_group_of_equal_float32_rewards_gets_exactly_zero_advantage(value):
    # Eight float32 copies of 0.1 sum to a mean one rounding off 0.1; divided by (std + eps) that rounding once
    # made an advantage of -0.0074 for every sample of a group with no signal.
    rewards = torch.tensor([value] * 8 + [1.0, 0.0, 0.0, 1.0], dtype=torch.float32)
    groups = torch.tensor([0] * 8 + [1] * 4)
    for advantages in (
        grpo.grpo_advantages(rewards, groups),
        grpo.grpo_advantages(rewards, groups, scale_by_std=False),
        grpo.rloo_advantages(rewards, groups),
    ):
        assert advantages[:8].tolist() == [0.0] * 8
        close(advantages[8:] / advantages[8], [1.0, -1.0, -1.0, 1.0])


def test_grpo_advantages_follow_their_samples_under_permutation_and_accept_integer_rewards():
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    full = grpo.grpo_advantages(UNEVEN_REWARDS, UNEVEN_GROUPS)
    close(grpo.grpo_advantages(UNEVEN_REWARDS[perm], UNEVEN_GROUPS[perm]), full[perm])
    ints = grpo.grpo_advantages(torch.tensor([1, 0, 0, 1, 1, 1]), GROUPS)
    assert ints.is_floating_point()
    close(ints.double(), grpo.grpo_advantages(REWARDS, GROUPS))


def test_group_advantages_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="must be \\[N\\]"):
        grpo.grpo_advantages(REWARDS, GROUPS[:3])


def test_rloo_advantages_by_hand():
    # r_i - mean of the others: 1 - (0 + 0 + 1)/3 = 2/3, 0 - (1 + 0 + 1)/3 = -2/3; [1, 1] -> 0
    close(grpo.rloo_advantages(REWARDS, GROUPS), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0])
    # group 10: 2 - 3.5, 3 - 3, 4 - 2.5;  group 3: 5 - 7, 7 - 5;  group 42: one sample -> 0
    close(grpo.rloo_advantages(UNEVEN_REWARDS, UNEVEN_GROUPS), [-1.5, -2.0, 0.0, 2.0, 1.5, 0.0])


def test_reinforce_pp_normalizes_over_the_batch():
    # mean 4/6 = 2/3; deviations 1/3 (x4), -2/3 (x2); sum of squares 4/9 + 8/9 = 4/3; unbiased var 4/15
    std = math.sqrt(4 / 15)
    assert std == pytest.approx(0.5163978)
    hi, lo = (1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6)
    assert hi == pytest.approx(0.6454960, rel=1e-6) and lo == pytest.approx(-1.2909921, rel=1e-6)
    close(grpo.reinforce_pp_advantages(REWARDS), [hi, lo, lo, hi, hi, hi])


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    # a = r - group mean = [0.5, -0.5, -0.5, 0.5, 0, 0]; batch mean 0; sum of squares 1; var 1/5; std 0.4472136
    a = 0.5 / (math.sqrt(0.2) + 1e-6)
    assert a == pytest.approx(1.1180315, rel=1e-6)
    out = grpo.reinforce_pp_advantages(REWARDS, GROUPS, subtract_group_mean=True)
    close(out, [a, -a, -a, a, 0.0, 0.0])
    with pytest.raises(ValueError, match="needs group_ids"):
        grpo.reinforce_pp_advantages(REWARDS, subtract_group_mean=True)


def test_reinforce_pp_single_sample_is_zero_not_nan():
    close(grpo.reinforce_pp_advantages(t([3.0])), [0.0])


@pytest.mark.parametrize(
    "name, expected",
    [
        ("grpo", lambda: grpo.grpo_advantages(REWARDS, GROUPS)),
        ("rloo", lambda: grpo.rloo_advantages(REWARDS, GROUPS)),
        ("reinforce_pp", lambda: grpo.reinforce_pp_advantages(REWARDS)),
        ("reinforce_pp_baseline", lambda: grpo.reinforce_pp_advantages(REWARDS, GROUPS, subtract_group_mean=True)),
    ],
)
def test_compute_advantages_dispatches_by_name(name, expected):
    close(grpo.compute_advantages(name, REWARDS, GROUPS), expected())


def test_compute_advantages_passes_scale_by_std_and_rejects_unknown_names():
    close(grpo.compute_advantages("grpo", REWARDS, GROUPS, scale_by_std=False), [0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="'ppo'.*grpo, rloo, reinforce_pp, reinforce_pp_baseline"):
        grpo.compute_advantages("ppo", REWARDS, GROUPS)


# -- masked reductions ------------------------------------------------------------------------------------------

X = t([[1.0, 2.0, NAN], [4.0, INF, -INF]])
M = t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_masked_sum_and_mean_ignore_garbage_at_masked_positions():
    close(grpo.masked_sum(X, M), 7.0)  # 1 + 2 + 4
    close(grpo.masked_mean(X, M), 7.0 / 3)
    close(grpo.masked_sum(X, M, dim=-1), [3.0, 4.0])
    close(grpo.masked_mean(X, M.bool(), dim=-1), [1.5, 4.0])


def test_masked_mean_of_an_empty_mask_is_zero_and_weights_count():
    close(grpo.masked_mean(X, torch.zeros_like(M)), 0.0)
    close(grpo.masked_mean(X, t([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), dim=-1), [1.5, 0.0])
    # float weights: (0.5*1 + 1*2) / 1.5
    close(grpo.masked_mean(X[:1], t([[0.5, 1.0, 0.0]])), 2.5 / 1.5)


def test_masked_sum_gradient_is_zero_at_masked_positions():
    x = t([[1.0, NAN, INF]]).requires_grad_(True)
    grpo.masked_sum(3.0 * x, t([[1.0, 0.0, 0.0]])).backward()
    close(x.grad, [[3.0, 0.0, 0.0]])  # 0, not NaN, where x is NaN or inf


# -- log ratio -------------------------------------------------------------------------------------------------

MASK = t([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def _logps():
    """new - old = [0.3, 0.6, 0.9 | pad] and [-0.2, 0.4 | pad, pad]; padding holds garbage."""
    old = t([[-1.0, -2.0, -3.0, NAN], [-0.5, -1.5, INF, 0.0]])
    new = t([[-0.7, -1.4, -2.1, -INF], [-0.7, -1.1, NAN, NAN]]).requires_grad_(True)
    return new, old


def test_token_log_ratio_is_new_minus_old_and_zero_at_padding():
    new, old = _logps()
    close(grpo.log_ratio(new, old, MASK, "token"), [[0.3, 0.6, 0.9, 0.0], [-0.2, 0.4, 0.0, 0.0]])


def test_gspo_log_ratio_value_is_the_sequence_mean_but_gradient_is_per_token():
    new, old = _logps()
    lr = grpo.log_ratio(new, old, MASK, "sequence")
    # sequence means: (0.3 + 0.6 + 0.9) / 3 = 0.6;  (-0.2 + 0.4) / 2 = 0.1
    close(lr, [[0.6, 0.6, 0.6, 0.0], [0.1, 0.1, 0.0, 0.0]])
    # d/d new of sum(c * lr) is c at each trained token, as for new_logp itself (not c averaged over the sequence)
    c = t([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    (lr * c).sum().backward()
    close(new.grad, c * MASK)


def test_gspo_token_gradient_equals_the_sequence_level_objective():
    """With seq_mean_token_mean, -A * s_{i,t} has GSPO's gradient: -A * s_i * mean_t grad new_t."""
    new, old = _logps()
    adv = t([1.5, -2.0])
    loss, _ = grpo.clipped_policy_loss(new, old, adv, MASK, 10.0, 10.0, ratio_level="sequence")  # never clips
    grpo.aggregate_loss(loss, MASK, "seq_mean_token_mean").backward()
    # direct: s_i = exp(mean_t(new - old)); loss = mean_i(-A_i s_i), so d/d new_{i,t} = -A_i s_i / |y_i| / 2
    expected = torch.zeros(2, 4, dtype=F64)
    expected[0, :3] = -1.5 * math.exp(0.6) / 3 / 2
    expected[1, :2] = 2.0 * math.exp(0.1) / 2 / 2
    close(new.grad, expected)


def test_log_ratio_rejects_unknown_levels():
    new, old = _logps()
    with pytest.raises(ValueError, match="'seq'.*token, sequence"):
        grpo.log_ratio(new, old, MASK, "seq")


# -- clipped policy loss --------------------------------------------------------------------------------------

# seq 0, A = +2, ratios [1.25, 1.5, 0.5]; seq 1, A = -1, ratios [0.7, 1.5, padding]. Per token -min(rA, clip(r)A):
#   clip [0.8, 1.2]:  r=1.25 A=+2: -min(2.5, 2.4) = -2.4 clipped | r=1.5 A=+2: -min(3.0, 2.4) = -2.4 clipped
#                     r=0.5  A=+2: -min(1.0, 1.6) = -1.0         | r=0.7 A=-1: -min(-0.7, -0.8) = 0.8 clipped
#                     r=1.5  A=-1: -min(-1.5, -1.2) = 1.5 (ratio outside the range, but the unclipped term is worse)
#   clip [0.8, 1.28]: r=1.25 A=+2: -min(2.5, 2.56) = -2.5 not clipped any more | r=1.5: -2.56 clipped
RATIOS = [[1.25, 1.5, 0.5, 1.0], [0.7, 1.5, 1.0, 1.0]]
PADDING = t([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
ADV = t([2.0, -1.0])


def _ratio_batch():
    old = t([[-1.0, -0.5, -2.0, NAN], [-0.3, -1.2, -INF, INF]])
    new = torch.where(PADDING.bool(), old + t(RATIOS).log(), t(NAN)).requires_grad_(True)
    return new, old


@pytest.mark.parametrize(
    "clip_high, losses, grads, clip_fraction",
    [
        # gradient of -A r wrt new_logp is -A r where unclipped, 0 where the clipped term wins
        (0.2, [[-2.4, -2.4, -1.0, 0.0], [0.8, 1.5, 0.0, 0.0]], [[0, 0, -1.0, 0], [0, 1.5, 0, 0]], 3 / 5),
        (0.28, [[-2.5, -2.56, -1.0, 0.0], [0.8, 1.5, 0.0, 0.0]], [[-2.5, 0, -1.0, 0], [0, 1.5, 0, 0]], 2 / 5),
    ],
)
def test_clipped_policy_loss_by_hand_with_asymmetric_clip(clip_high, losses, grads, clip_fraction):
    new, old = _ratio_batch()
    loss, frac = grpo.clipped_policy_loss(new, old, ADV, PADDING, clip_low=0.2, clip_high=clip_high)
    close(loss, losses)
    close(frac, clip_fraction)
    loss.sum().backward()
    close(new.grad, grads)  # finite: the NaN/inf padding leaks into neither the loss nor the gradient


def test_cispo_loss_by_hand_keeps_every_tokens_gradient():
    """CISPO: loss = -sg(clip(r, 0.8, 1.2)) A logp. Ratios [2, 1, 0.5] with A = 1: weights [1.2, 1, 0.8]; the
    loss's gradient wrt logp is -w A on every token, the clipped ones included (the clipped surrogate's is 0
    there)."""
    old = t([[math.log(0.25), math.log(0.5), math.log(0.5), NAN]])  # the last position is padding
    new = t([[math.log(0.5), math.log(0.5), math.log(0.25), INF]]).requires_grad_(True)
    mask = t([[1.0, 1.0, 1.0, 0.0]])
    loss, frac = grpo.cispo_policy_loss(new, old, t([1.0]), mask, clip_low=0.2, clip_high=0.2)
    close(loss, [[1.2 * math.log(2.0), math.log(2.0), 0.8 * math.log(4.0), 0.0]])
    close(frac, 2 / 3)
    loss.sum().backward()
    close(new.grad, [[-1.2, -1.0, -0.8, 0.0]])  # the padding leaks into neither
    # by its name, through the objective: the same pg loss, token-averaged
    total, metrics = grpo.policy_objective(new.detach(), old, t([1.0]), mask, policy_loss="cispo")
    close(total, (1.2 * math.log(2.0) + math.log(2.0) + 0.8 * math.log(4.0)) / 3)
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)


def test_dual_clip_loss_by_hand_caps_a_negative_advantages_loss_at_three_times_it():
    """Dual-clip, c = 3, clip 0.2: ratios [5, 2, 0.5] with A = -1 give PPO-clip's [5, 2, 0.8], capped to
    [3, 2, 0.8]; the first (capped) and the last (clipped) have no gradient, the middle's is -A r = 2. With A = +1
    the cap never applies: the loss is PPO-clip's [-1.2, -1.2, -0.5]."""
    old = t([[math.log(0.1), math.log(0.25), math.log(0.5), NAN], [math.log(0.1), math.log(0.25), math.log(0.5), 0]])
    new = t([[math.log(0.5), math.log(0.5), math.log(0.25), INF], [math.log(0.5), math.log(0.5), math.log(0.25), 0]])
    new.requires_grad_(True)
    mask = t([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    loss, frac = grpo.dual_clip_policy_loss(new, old, t([-1.0, 1.0]), mask, clip_low=0.2, clip_high=0.2)
    close(loss, [[3.0, 2.0, 0.8, 0.0], [-1.2, -1.2, -0.5, 0.0]])
    close(frac, 4 / 6)  # capped or clipped: 5 and 0.5 under A = -1; 5 and 2 under A = +1
    loss.sum().backward()
    close(new.grad, [[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, -0.5, 0.0]])
    clip_only, _ = grpo.clipped_policy_loss(new.detach(), old, t([-1.0, 1.0]), mask, 0.2, 0.2)
    close(clip_only[0], [5.0, 2.0, 0.8, 0.0])  # what the cap changed
    total, _ = grpo.policy_objective(new.detach(), old, t([-1.0, 1.0]), mask, policy_loss="dual_clip")
    close(total, (3.0 + 2.0 + 0.8 - 1.2 - 1.2 - 0.5) / 6)


def test_clipped_policy_loss_accepts_per_token_advantages():
    new, old = _ratio_batch()
    per_seq, _ = grpo.clipped_policy_loss(new, old, ADV, PADDING, 0.2, 0.2)
    per_token, _ = grpo.clipped_policy_loss(new, old, ADV[:, None].expand(2, 4), PADDING, 0.2, 0.2)
    close(per_token, per_seq)


def test_sequence_level_clipping_clips_whole_sequences():
    # log ratios [0.1, 0.3]: GSPO ratio exp(0.2) = 1.2214 > 1.2 on both tokens, so with A > 0 both are clipped
    old = t([[-1.0, -1.0]])
    new = (old + t([[0.1, 0.3]])).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=F64)
    loss, frac = grpo.clipped_policy_loss(new, old, t([1.0]), mask, 0.2, 0.2, ratio_level="sequence")
    close(loss, [[-1.2, -1.2]])
    close(frac, 1.0)
    loss.sum().backward()
    close(new.grad, [[0.0, 0.0]])
    # token level: exp(0.1) = 1.105 unclipped, exp(0.3) = 1.350 clipped
    _, frac = grpo.clipped_policy_loss(new, old, t([1.0]), mask, 0.2, 0.2)
    close(frac, 0.5)


def test_huge_log_ratio_is_clamped_not_inf():
    old = t([[0.0]])
    loss, _ = grpo.clipped_policy_loss(t([[500.0]]), old, t([-1.0]), torch.ones(1, 1), 0.2, 0.2)
    close(loss, [[math.exp(20.0)]], atol=1e-3)  # -min(-e^20, -1.2) = e^20, finite


# -- aggregation -------------------------------------------------------------------------------------------------

# Three sequences with 3, 1 and 2 loss tokens, and a fourth with none (e.g. overlong-filtered).
LOSS = t([[1.0, 2.0, 3.0, NAN], [4.0, NAN, INF, 0.0], [6.0, 8.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
LOSS_MASK = t([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected, numerator, denominator",
    [
        ("token_mean", 24 / 6, 24.0, 6.0),  # (1+2+3+4+6+8) / 6 tokens
        ("seq_mean_token_mean", 13 / 3, 13.0, 3.0),  # means 2, 4, 7 over 3 sequences with tokens
        ("seq_mean_token_sum_norm", 6 / 3, 6.0, 3.0),  # sums 6, 4, 14, each / 4 -> 1.5 + 1 + 3.5, over 3
    ],
)
def test_aggregate_loss_by_hand(mode, expected, numerator, denominator):
    close(grpo.aggregate_loss(LOSS, LOSS_MASK, mode, norm_length=4), expected)
    num, den = grpo.aggregate_loss_sum(LOSS, LOSS_MASK, mode, norm_length=4)
    close(num, numerator)
    assert den == denominator and grpo.aggregate_denominator(LOSS_MASK, mode, 4) == denominator


def test_aggregate_loss_with_nothing_to_train_on_is_zero():
    close(grpo.aggregate_loss(LOSS, torch.zeros_like(LOSS_MASK), "seq_mean_token_mean"), 0.0)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_micro_batch_accumulation_equals_the_full_batch(mode):
    torch.manual_seed(0)
    base = torch.randn(4, 4, dtype=F64)
    mask = LOSS_MASK.bool()

    full_x = base.clone().requires_grad_(True)
    full = grpo.aggregate_loss(full_x * full_x, mask, mode, norm_length=4)
    full.backward()

    micro_x = base.clone().requires_grad_(True)
    splits = [slice(0, 1), slice(1, 4)]  # uneven on purpose: 3 tokens / 1 sequence, then 3 tokens / 2 sequences
    denominator = sum(grpo.aggregate_denominator(mask[s], mode, 4) for s in splits)
    total = 0.0
    for s in splits:
        part = grpo.aggregate_loss(micro_x[s] * micro_x[s], mask[s], mode, norm_length=4, denominator=denominator)
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), rel=1e-12)
    close(micro_x.grad, full_x.grad)
    # the same through (numerator, denominator) pairs
    pairs = [grpo.aggregate_loss_sum(base[s] ** 2, mask[s], mode, 4) for s in splits]
    assert sum(n.item() for n, _ in pairs) / sum(d for _, d in pairs) == pytest.approx(full.item(), rel=1e-12)


def test_aggregation_mode_errors_name_what_is_allowed():
    with pytest.raises(ValueError, match="'mean'.*token_mean, seq_mean_token_mean, seq_mean_token_sum_norm"):
        grpo.aggregate_loss(LOSS, LOSS_MASK, "mean")
    with pytest.raises(ValueError, match="needs norm_length"):
        grpo.aggregate_loss(LOSS, LOSS_MASK, "seq_mean_token_sum_norm")


# -- KL, entropy, log-probs --------------------------------------------------------------------------------------


def test_adaptive_kl_coefficient_by_hand():
    # Ziegler et al.: e = clip(KL / target - 1, -0.2, 0.2), coef * (1 + e * samples / horizon); 64 samples of 640
    assert grpo.adaptive_kl_coef(0.1, kl=0.2, target=0.1, samples=64, horizon=640) == pytest.approx(0.102)  # e 0.2
    assert grpo.adaptive_kl_coef(0.1, kl=0.11, target=0.1, samples=64, horizon=640) == pytest.approx(0.101)  # e 0.1
    assert grpo.adaptive_kl_coef(0.1, kl=0.0, target=0.1, samples=64, horizon=640) == pytest.approx(0.098)  # e -0.2
    assert grpo.adaptive_kl_coef(0.1, kl=NAN, target=0.1, samples=64, horizon=640) == 0.1  # not measured: kept


def test_kl_penalty_k1_and_k3_by_hand():
    logp, ref = t([math.log(0.5), math.log(0.25), -1.0]), t([math.log(0.25), math.log(0.5), -1.0])
    ln2 = math.log(2)
    close(grpo.kl_penalty(logp, ref, "k1"), [ln2, -ln2, 0.0])
    # k3 = exp(d) - d - 1, d = ref - logp:  d = -ln2 -> 0.5 + ln2 - 1 = 0.193147;  d = ln2 -> 2 - ln2 - 1 = 0.306853
    close(grpo.kl_penalty(logp, ref, "k3"), [0.5 + ln2 - 1, 2 - ln2 - 1, 0.0])
    close(grpo.kl_penalty(logp, ref), [0.1931472, 0.3068528, 0.0])


def test_k1_and_k3_are_unbiased_for_the_kl_under_the_sampling_policy():
    # p = [0.5, 0.25, 0.25], q = [0.25, 0.5, 0.25]: KL(p||q) = 0.5 ln 2 + 0.25 ln 0.5 + 0 = 0.25 ln 2
    p, q = t([0.5, 0.25, 0.25]), t([0.25, 0.5, 0.25])
    for estimator in ("k1", "k3"):
        assert (p * grpo.kl_penalty(p.log(), q.log(), estimator)).sum().item() == pytest.approx(0.25 * math.log(2))


def test_k3_clamps_the_log_difference():
    out = grpo.kl_penalty(t([-100.0, -INF, 100.0]), t([0.0, 0.0, 0.0]), "k3")
    close(out, [math.exp(20) - 21, math.exp(20) - 21, math.exp(-20) + 19], atol=1e-3)
    with pytest.raises(ValueError, match="'k2'.*k1, k3"):
        grpo.kl_penalty(t([0.0]), t([0.0]), "k2")


def test_entropy_from_logits():
    uniform = torch.full((2, 3, 5), 7.0, dtype=F64)
    close(grpo.entropy_from_logits(uniform), torch.full((2, 3), math.log(5), dtype=F64))
    # p = [0.75, 0.25] from logits [ln 3, 0]: H = -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.5623351
    two = t([[[math.log(3), 0.0]]])
    close(grpo.entropy_from_logits(two), [[0.5623351]])
    close(grpo.entropy_from_logits(two + 1e4), [[0.5623351]])  # shift-invariant, no overflow


def test_token_logprobs_from_logits():
    # logits [0, ln 2, 0] -> p = [0.25, 0.5, 0.25]
    logits = t([[[0.0, math.log(2), 0.0], [0.0, math.log(2), 0.0]]])
    close(grpo.token_logprobs_from_logits(logits, torch.tensor([[1, 2]])), [[math.log(0.5), math.log(0.25)]])


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_token_logprobs_at_a_temperature_match_log_softmax_of_scaled_logits(temperature):
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3))
    out = grpo.token_logprobs_from_logits(logits, tokens, temperature)
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    close(out, ref)
    if temperature == 0.5:
        close(out, torch.log_softmax(2 * logits, -1).gather(-1, tokens[..., None]).squeeze(-1))
    (grad,) = torch.autograd.grad(out.sum(), logits)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    close(grad, ref_grad)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        grpo.token_logprobs_from_logits(logits, tokens, 0.0)


# -- the whole objective ------------------------------------------------------------------------------------------


def _objective_batch():
    """new = old = ln 0.5 on trained tokens (ratio 1), ref = ln 0.25, padding is garbage."""
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    half, quarter = math.log(0.5), math.log(0.25)
    new = t([[half, half], [half, NAN]]).requires_grad_(True)
    old = t([[half, half], [half, INF]])
    ref = t([[quarter, quarter], [quarter, -INF]])
    entropy = t([[1.0, 2.0], [3.0, NAN]])
    return new, old, ref, entropy, mask


def test_policy_objective_by_hand():
    new, old, ref, entropy, mask = _objective_batch()
    loss, metrics = grpo.policy_objective(
        new, old, t([1.0, -1.0]), mask, ref_logp=ref, kl_coef=0.1, entropy=entropy, entropy_coef=0.01
    )
    # pg: ratio 1, loss -A per token: (-1 - 1 + 1) / 3 = -1/3
    # kl: k3 with d = ln 0.25 - ln 0.5 = -ln 2 on every token: 0.5 + ln 2 - 1 = 0.1931472
    # entropy: (1 + 2 + 3) / 3 = 2
    kl = 0.5 + math.log(2) - 1
    assert loss.item() == pytest.approx(-1 / 3 + 0.1 * kl - 0.01 * 2.0)
    assert metrics == pytest.approx(
        {"pg_loss": -1 / 3, "kl": kl, "entropy": 2.0, "clip_fraction": 0.0, "ratio_mean": 1.0, "approx_kl": 0.0}
    )
    assert all(type(v) is float for v in metrics.values())
    loss.backward()
    assert torch.isfinite(new.grad).all() and new.grad[1, 1] == 0.0
    # d/d new of pg: -A r / 3 -> [-1/3, -1/3, +1/3]; of 0.1 * k3: 0.1 * (1 - exp(d)) / 3 = 0.1 * 0.5 / 3
    close(new.grad, [[-1 / 3 + 0.05 / 3, -1 / 3 + 0.05 / 3], [1 / 3 + 0.05 / 3, 0.0]])


@pytest.mark.parametrize("kl_estimator", KL_ESTIMATORS.names())
@pytest.mark.parametrize("ratio_level", POLICY_RATIOS.names())
def test_policy_objective_garbage_at_padding_leaks_nowhere(kl_estimator, ratio_level):
    new, old, ref, entropy, mask = _objective_batch()
    loss, metrics = grpo.policy_objective(
        new,
        old,
        t([1.0, -1.0]),
        mask,
        ratio_level=ratio_level,
        aggregation="seq_mean_token_mean",
        ref_logp=ref,
        kl_coef=0.1,
        kl_estimator=kl_estimator,
        entropy=entropy,
        entropy_coef=0.01,
    )
    loss.backward()
    assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in metrics.values())
    assert torch.isfinite(new.grad).all() and new.grad[1, 1] == 0.0


def test_policy_objective_ratio_metrics_and_optional_terms():
    old = t([[0.0, 0.0]])
    new = t([[math.log(2.0), 0.0]])
    _, metrics = grpo.policy_objective(new, old, t([1.0]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    # ratios [2, 1]: mean 1.5; approx_kl = mean((2 - 1 - ln 2), 0) = 0.1534264; A > 0 and r = 2 > 1.2 -> 1/2 clipped
    assert metrics == pytest.approx(
        {"pg_loss": (-1.2 - 1.0) / 2, "clip_fraction": 0.5, "ratio_mean": 1.5, "approx_kl": (1 - math.log(2)) / 2}
    )
    assert "kl" not in metrics and "entropy" not in metrics


def test_policy_objective_requires_the_inputs_its_coefficients_need():
    new, old, _, _, mask = _objective_batch()
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logp"):
        grpo.policy_objective(new, old, t([1.0, 1.0]), mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy_coef=0.01 needs entropy"):
        grpo.policy_objective(new, old, t([1.0, 1.0]), mask, entropy_coef=0.01)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_policy_objective_micro_batches_sum_to_the_full_batch(mode):
    torch.manual_seed(1)
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]]).bool()
    old = torch.randn(3, 4, dtype=F64) - 2
    base_new = old + 0.3 * torch.randn(3, 4, dtype=F64)
    ref = old + 0.1 * torch.randn(3, 4, dtype=F64)
    entropy = torch.rand(3, 4, dtype=F64)
    adv = t([1.0, -0.5, 2.0])
    kwargs = dict(aggregation=mode, norm_length=4, kl_coef=0.05, entropy_coef=0.01, clip_high=0.28)
    mb = dict(ref_logp=ref, entropy=entropy)

    full_new = base_new.clone().requires_grad_(True)
    full, full_metrics = grpo.policy_objective(full_new, old, adv, mask, **mb, **kwargs)
    full.backward()

    micro_new = base_new.clone().requires_grad_(True)
    splits = [slice(0, 2), slice(2, 3)]
    denominator = sum(grpo.aggregate_denominator(mask[s], mode, 4) for s in splits)
    total, pg = 0.0, 0.0
    for s in splits:
        sliced = {k: v[s] for k, v in mb.items()}
        part, metrics = grpo.policy_objective(
            micro_new[s], old[s], adv[s], mask[s], denominator=denominator, **sliced, **kwargs
        )
        part.backward()
        total, pg = total + part.item(), pg + metrics["pg_loss"]
    assert total == pytest.approx(full.item(), rel=1e-12)
    assert pg == pytest.approx(full_metrics["pg_loss"], rel=1e-12)
    close(micro_new.grad, full_new.grad)


# -- filters and reward shaping -----------------------------------------------------------------------------------


def test_group_has_signal():
    # group 0 = [1, 0, 0, 1] mixed, group 1 = [1, 1] all equal, group 2 = [0.5] alone
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5], np.float32)
    groups = np.array([0, 0, 0, 0, 1, 1, 2])
    expected = [True, True, True, True, False, False, False]
    assert group_has_signal(rewards, groups).tolist() == expected
    assert group_has_signal(np.array([1, 0, 0, 1, 1, 1, 0]), groups).tolist() == expected
    assert group_has_signal(rewards, np.array([7, 7, 7, 7, 3, 3, 9])).tolist() == expected  # ids need not be 0..G-1


def test_overlong_mask():
    out = grpo.overlong_mask(torch.tensor([False, True, False]))
    assert out.is_floating_point() and out.tolist() == [1.0, 0.0, 1.0]


def test_soft_overlong_penalty():
    # max 20, buffer 4: free up to 16; then (16 - len) / 4; -1 at 20 and beyond
    lengths = torch.tensor([10, 16, 17, 18, 20, 21, 30])
    close(grpo.soft_overlong_penalty(lengths, 20, 4).double(), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="0 < buffer <= max_length"):
        grpo.soft_overlong_penalty(lengths, 20, 0)
