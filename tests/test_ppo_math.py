"""PPO math checked against numbers worked out by hand (rlfabric.algorithms.ppo)."""

import math

import numpy as np
import pytest
import torch

from rlfabric.algorithms import ppo

GAMMA, LAM = 0.9, 0.8  # gamma * lam = 0.72


def _two_env_batch():
    """T=3 steps of N=2 envs with identical rewards and values.

    env 0 terminates at t=1, env 1 is truncated at t=1 (its final observation is worth 4.0).
    After t=1 both envs start a new episode whose first state is worth values[2] = 1.5.
    """
    rewards = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], np.float32)
    values = np.array([[0.5, 0.5], [1.0, 1.0], [1.5, 1.5]], np.float32)
    terminated = np.array([[False, False], [True, False], [False, False]])
    truncated = np.array([[False, False], [False, True], [False, False]])
    last_values = np.array([2.0, 2.0], np.float32)  # V of the state after the fragment
    truncated_index = np.array([[1, 1]], np.int64)
    truncated_values = np.array([4.0], np.float32)  # V(final obs of env 1's truncated episode)
    return rewards, values, terminated, truncated, last_values, truncated_index, truncated_values


def test_next_state_values_shifts_and_uses_last_values():
    values = np.array([[0.5, 0.6], [1.0, 1.1], [1.5, 1.6]], np.float32)
    last = np.array([2.0, 2.1], np.float32)
    out = ppo.next_state_values(values, last, np.zeros((0, 2), np.int64), np.zeros(0, np.float32))
    np.testing.assert_allclose(out, [[1.0, 1.1], [1.5, 1.6], [2.0, 2.1]], rtol=1e-6)


def test_truncation_bootstrap_uses_final_obs_value_not_reset_value():
    """At a truncated (t, n) the next state is the episode's final obs, not the reset obs in row t+1."""
    _, values, _, _, last, t_idx, t_vals = _two_env_batch()
    out = ppo.next_state_values(values, last, t_idx, t_vals)
    # env 0 (terminated, no override): [values[1], values[2], last] = [1.0, 1.5, 2.0]
    # env 1 (truncated at t=1): [1.0, V(final obs) = 4.0 instead of the reset value 1.5, 2.0]
    np.testing.assert_array_equal(out, [[1.0, 1.0], [1.5, 4.0], [2.0, 2.0]])


def test_truncation_bootstrap_on_the_last_row_overrides_last_values():
    values = np.array([[0.5, 0.6], [1.0, 1.1]], np.float32)
    last = np.array([2.0, 2.1], np.float32)  # value of the *reset* obs for env 0
    out = ppo.next_state_values(values, last, np.array([[1, 0]]), np.array([7.0], np.float32))
    np.testing.assert_allclose(out, [[1.0, 1.1], [7.0, 2.1]], rtol=1e-6)


def test_truncation_bootstrap_several_truncations():
    values = np.zeros((4, 3), np.float32)
    last = np.full(3, -1.0, np.float32)
    idx = np.array([[0, 2], [3, 1], [2, 0]])
    out = ppo.next_state_values(values, last, idx, np.array([5.0, 6.0, 7.0], np.float32))
    expected = np.zeros((4, 3), np.float32)
    expected[3] = -1.0
    expected[0, 2], expected[3, 1], expected[2, 0] = 5.0, 6.0, 7.0
    np.testing.assert_array_equal(out, expected)


def test_gae_by_hand_termination_and_truncation():
    rewards, values, term, trunc, last, t_idx, t_vals = _two_env_batch()
    next_values = ppo.next_state_values(values, last, t_idx, t_vals)
    adv, ret = ppo.gae(rewards, values, next_values, term, trunc, GAMMA, LAM)

    # env 0, terminated at t=1:
    #   delta_0 = 1 + 0.9*1.0 - 0.5 = 1.4
    #   delta_1 = 2 + 0 (terminated)  - 1.0 = 1.0
    #   delta_2 = 3 + 0.9*2.0 - 1.5 = 3.3
    #   A_2 = 3.3;  A_1 = 1.0 (recursion stops at the done);  A_0 = 1.4 + 0.72*1.0 = 2.12
    a0 = [1 + 0.9 * 1.0 - 0.5 + 0.72 * (2 - 1.0), 2 - 1.0, 3 + 0.9 * 2.0 - 1.5]
    # env 1, truncated at t=1 with V(final obs) = 4.0:
    #   delta_0 = 1.4;  delta_1 = 2 + 0.9*4.0 - 1.0 = 4.6;  delta_2 = 3.3
    #   A_2 = 3.3;  A_1 = 4.6 (recursion stops);  A_0 = 1.4 + 0.72*4.6 = 4.712
    a1 = [1 + 0.9 * 1.0 - 0.5 + 0.72 * (2 + 0.9 * 4.0 - 1.0), 2 + 0.9 * 4.0 - 1.0, 3 + 0.9 * 2.0 - 1.5]
    np.testing.assert_allclose(a0, [2.12, 1.0, 3.3])
    np.testing.assert_allclose(a1, [4.712, 4.6, 3.3])
    np.testing.assert_allclose(adv, np.stack([a0, a1], axis=1), rtol=1e-6)
    # returns = A + V
    np.testing.assert_allclose(ret, [[2.62, 5.212], [2.0, 5.6], [4.8, 4.8]], rtol=1e-6)
    assert adv.dtype == np.float32 and ret.dtype == np.float32


def test_gae_without_dones_is_the_full_discounted_sum_of_deltas():
    # N=1, T=3, no episode end, V = 0 everywhere except the bootstrap V(s_3) = 10.
    rewards = np.array([[1.0], [1.0], [1.0]], np.float32)
    values = np.zeros((3, 1), np.float32)
    next_values = np.array([[0.0], [0.0], [10.0]], np.float32)
    no = np.zeros((3, 1), bool)
    adv, ret = ppo.gae(rewards, values, next_values, no, no, GAMMA, LAM)
    # deltas: 1, 1, 1 + 0.9*10 = 10
    # A_2 = 10;  A_1 = 1 + 0.72*10 = 8.2;  A_0 = 1 + 0.72*8.2 = 6.904
    np.testing.assert_allclose(adv[:, 0], [6.904, 8.2, 10.0], rtol=1e-6)
    np.testing.assert_allclose(ret[:, 0], [6.904, 8.2, 10.0], rtol=1e-6)


def test_gae_lambda_one_gives_monte_carlo_returns_and_lambda_zero_gives_td():
    rewards = np.array([[1.0], [2.0], [3.0]], np.float32)
    values = np.array([[0.3], [0.2], [0.1]], np.float32)
    next_values = np.array([[0.2], [0.1], [5.0]], np.float32)
    no = np.zeros((3, 1), bool)
    _, ret1 = ppo.gae(rewards, values, next_values, no, no, 0.5, 1.0)
    # lambda = 1: R_t = r_t + 0.5 r_{t+1} + ... + 0.5^(T-t) V(s_T)
    np.testing.assert_allclose(
        ret1[:, 0], [1 + 0.5 * 2 + 0.25 * 3 + 0.125 * 5, 2 + 0.5 * 3 + 0.25 * 5, 3 + 0.5 * 5], rtol=1e-6
    )
    adv0, _ = ppo.gae(rewards, values, next_values, no, no, 0.5, 0.0)
    # lambda = 0: A_t = delta_t = r_t + 0.5 V(s_{t+1}) - V(s_t)
    np.testing.assert_allclose(adv0[:, 0], [1 + 0.1 - 0.3, 2 + 0.05 - 0.2, 3 + 2.5 - 0.1], rtol=1e-6)


def test_terminated_and_truncated_give_different_advantages_for_the_same_numbers():
    rewards = np.array([[1.0], [2.0], [3.0]], np.float32)
    values = np.array([[0.5], [1.0], [1.5]], np.float32)
    next_values = np.array([[1.0], [4.0], [2.0]], np.float32)
    flag = np.array([[False], [True], [False]])
    none = np.zeros_like(flag)
    adv_term, _ = ppo.gae(rewards, values, next_values, flag, none, GAMMA, LAM)
    adv_trunc, _ = ppo.gae(rewards, values, next_values, none, flag, GAMMA, LAM)
    # terminated: A_1 = 2 - 1.0 = 1.0;          A_0 = 1.4 + 0.72*1.0 = 2.12
    # truncated:  A_1 = 2 + 0.9*4.0 - 1.0 = 4.6; A_0 = 1.4 + 0.72*4.6 = 4.712
    np.testing.assert_allclose(adv_term[:, 0], [2.12, 1.0, 3.3], rtol=1e-6)
    np.testing.assert_allclose(adv_trunc[:, 0], [4.712, 4.6, 3.3], rtol=1e-6)
    # ... and neither equals "no episode end": A_1 = 4.6 + 0.72*3.3 = 6.976, A_0 = 1.4 + 0.72*6.976 = 6.42272
    adv_none, _ = ppo.gae(rewards, values, next_values, none, none, GAMMA, LAM)
    a1 = 4.6 + 0.72 * 3.3
    np.testing.assert_allclose(adv_none[:, 0], [1.4 + 0.72 * a1, a1, 3.3], rtol=1e-6)


# -- clipped surrogate ---------------------------------------------------------------------------------

# (ratio, advantage) pairs with clip_coef = 0.2; per-sample loss = max(-A r, -A clip(r, 0.8, 1.2))
#   r=1.5, A=+2: max(-3.0, -2.4) = -2.4   clipped above (gradient 0)
#   r=0.5, A=+2: max(-1.0, -1.6) = -1.0   ratio out of range, but the unclipped term is the pessimistic one
#   r=0.5, A=-1: max( 0.5,  0.8) =  0.8   clipped below with a negative advantage (gradient 0)
#   r=1.5, A=-1: max( 1.5,  1.2) =  1.5   unclipped
#   r=1.1, A=+3: max(-3.3, -3.3) = -3.3   inside the trust region
_RATIOS = [1.5, 0.5, 0.5, 1.5, 1.1]
_ADVS = [2.0, 2.0, -1.0, -1.0, 3.0]


def _surrogate(clip=0.2):
    old = torch.tensor([-1.0, -0.5, -2.0, -0.1, -1.3], dtype=torch.float64)
    new = (old + torch.log(torch.tensor(_RATIOS, dtype=torch.float64))).requires_grad_(True)
    loss, info = ppo.clipped_surrogate_loss(new, old, torch.tensor(_ADVS, dtype=torch.float64), clip)
    return new, loss, info


def test_clipped_surrogate_loss_by_hand():
    _, loss, _ = _surrogate()
    assert loss.item() == pytest.approx((-2.4 - 1.0 + 0.8 + 1.5 - 3.3) / 5)  # = -0.88
    assert loss.item() == pytest.approx(-0.88)


def test_clipped_surrogate_gradient_is_zero_where_clipped():
    new, loss, _ = _surrogate()
    loss.backward()
    # d/d logp_new of -A r is -A r; divided by 5 for the mean; zero where the clipped term wins.
    expected = [0.0, -2.0 * 0.5 / 5, 0.0, 1.0 * 1.5 / 5, -3.0 * 1.1 / 5]
    np.testing.assert_allclose(new.grad.numpy(), expected, atol=1e-12)


def test_clipped_surrogate_approx_kl_and_clip_fraction():
    _, _, info = _surrogate()
    # k3 estimator: mean((r - 1) - log r)
    kl = sum((r - 1) - math.log(r) for r in _RATIOS) / 5
    assert kl == pytest.approx(0.11601080, abs=1e-7)
    assert info.approx_kl == pytest.approx(kl, rel=1e-9)
    # |r - 1| > 0.2 for r = 1.5, 0.5, 0.5, 1.5; not for 1.1
    assert info.clip_fraction == pytest.approx(4 / 5)


def test_clipped_surrogate_wider_clip_changes_the_loss():
    _, loss, info = _surrogate(clip=0.6)
    # clip range [0.4, 1.6] holds every ratio, so loss = mean(-A r) = (-3 - 1 + 0.5 + 1.5 - 3.3) / 5
    assert loss.item() == pytest.approx((-3.0 - 1.0 + 0.5 + 1.5 - 3.3) / 5)
    assert info.clip_fraction == 0.0


def test_clipped_surrogate_at_ratio_one():
    logp = torch.tensor([-0.3, -2.0])
    loss, info = ppo.clipped_surrogate_loss(logp, logp.clone(), torch.tensor([1.0, 3.0]), 0.2)
    assert loss.item() == pytest.approx(-2.0)  # -mean(A)
    assert info.approx_kl == pytest.approx(0.0, abs=1e-7)
    assert info.clip_fraction == 0.0


# -- value loss ----------------------------------------------------------------------------------------


def _values():
    new = torch.tensor([1.0, 2.0, 0.3], dtype=torch.float64)
    old = torch.tensor([0.5, 2.5, 0.0], dtype=torch.float64)
    returns = torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64)
    return new, old, returns


def test_value_loss_unclipped_by_hand():
    new, old, ret = _values()
    # 0.5 * mean((1-2)^2, (2-1)^2, (0.3-0)^2) = 0.5 * (1 + 1 + 0.09) / 3
    assert ppo.value_loss(new, old, ret, None).item() == pytest.approx(0.5 * 2.09 / 3)


def test_value_loss_clipped_by_hand():
    new, old, ret = _values()
    # clip 0.2: clipped V = old + clamp(new - old, -0.2, 0.2) = [0.7, 2.3, 0.2]
    #   sample 0: max((1-2)^2, (0.7-2)^2) = max(1, 1.69) = 1.69
    #   sample 1: max((2-1)^2, (2.3-1)^2) = max(1, 1.69) = 1.69
    #   sample 2: max(0.3^2, 0.2^2)       = max(0.09, 0.04) = 0.09
    assert ppo.value_loss(new, old, ret, 0.2).item() == pytest.approx(0.5 * (1.69 + 1.69 + 0.09) / 3)
    # a clip wide enough to contain every step is the unclipped loss
    assert ppo.value_loss(new, old, ret, 1.0).item() == pytest.approx(0.5 * 2.09 / 3)


# -- advantage normalization and learning-rate schedule -------------------------------------------------


def test_normalize_advantages():
    out = ppo.normalize_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    # mean 2.5; unbiased std = sqrt((2.25 + 0.25 + 0.25 + 2.25) / 3) = sqrt(5/3)
    std = math.sqrt(5 / 3)
    np.testing.assert_allclose(out.numpy(), [-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std], rtol=1e-7)
    assert out.mean().item() == pytest.approx(0.0, abs=1e-12)


def test_normalize_advantages_single_and_constant():
    one = torch.tensor([5.0])
    assert ppo.normalize_advantages(one).item() == 5.0
    const = ppo.normalize_advantages(torch.tensor([3.0, 3.0, 3.0]))
    np.testing.assert_array_equal(const.numpy(), [0.0, 0.0, 0.0])
    assert torch.isfinite(const).all()


@pytest.mark.parametrize(
    "index, total, expected",
    [
        (0, 10, 1e-3),  # starts at base
        (5, 10, 5e-4),  # halfway
        (9, 10, 1e-4),  # last update: base / total
        (10, 10, 1e-4),  # past the end: floor at base / total
        (50, 10, 1e-4),
        (0, 1, 1e-3),
        (3, 0, 1e-3),  # total_updates 0 treated as 1
    ],
)
def test_linear_lr(index, total, expected):
    assert ppo.linear_lr(1e-3, index, total) == pytest.approx(expected)


def test_explained_variance():
    returns = np.array([1.0, 2.0, 3.0, 4.0])
    assert ppo.explained_variance(returns, returns) == 1.0
    assert ppo.explained_variance(np.full(4, 2.5), returns) == 0.0  # the mean is no better than a constant
    # Var(R - V) = Var([1, 0, 1, 0]) = 0.25; Var(R) = 1.25 -> 1 - 0.2
    assert ppo.explained_variance(np.array([0.0, 2.0, 2.0, 4.0]), returns) == pytest.approx(0.8)
    assert np.isnan(ppo.explained_variance(returns, np.ones(4)))
