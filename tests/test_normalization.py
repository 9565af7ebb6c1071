"""Running statistics merge exactly; normalize clips; discounted returns carry across fragments."""

import itertools

import numpy as np
import pytest

from rlfabric.normalization import RunningStats, discounted_returns, normalize, scale_rewards


def _assert_stats_equal(got: RunningStats, batch: np.ndarray) -> None:
    batch = np.asarray(batch, np.float64)
    assert got.count == batch.shape[0]
    np.testing.assert_allclose(got.mean, batch.mean(axis=0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.var, batch.var(axis=0), rtol=1e-10, atol=1e-12)


def test_of_by_hand():
    s = RunningStats.of(np.array([[1.0, 10.0], [3.0, 10.0], [5.0, 40.0]]))
    assert s.count == 3.0
    np.testing.assert_allclose(s.mean, [3.0, 20.0])
    # M2 = sum of squared deviations: [4 + 0 + 4, 100 + 100 + 400]; var = M2 / n (population)
    np.testing.assert_allclose(s.m2, [8.0, 600.0])
    np.testing.assert_allclose(s.var, [8.0 / 3, 200.0])


def test_merge_two_equals_stats_of_concatenation():
    rng = np.random.default_rng(0)
    a = rng.normal(2.0, 3.0, size=(7, 3))
    b = rng.normal(-5.0, 0.5, size=(13, 3))
    merged = RunningStats.of(a).merge(RunningStats.of(b))
    _assert_stats_equal(merged, np.concatenate([a, b]))
    # hand check on scalars: {1, 2} + {4}: mean 7/3, var = ((4/3)^2 + (1/3)^2 + (5/3)^2) / 3 = 42/27
    s = RunningStats.of(np.array([[1.0], [2.0]])).merge(RunningStats.of(np.array([[4.0]])))
    assert s.count == 3
    assert s.mean[0] == pytest.approx(7 / 3)
    assert s.var[0] == pytest.approx(42 / 27)


def test_merge_with_empty_on_either_side():
    a = np.array([[1.0, -2.0], [4.0, 0.5], [2.5, 3.0]])
    empty = RunningStats.of(np.zeros((0, 2)))
    assert empty.count == 0
    np.testing.assert_array_equal(empty.var, [1.0, 1.0])  # nothing seen: var 1, so normalize is a no-op
    _assert_stats_equal(RunningStats.of(a).merge(empty), a)
    _assert_stats_equal(empty.merge(RunningStats.of(a)), a)
    _assert_stats_equal(RunningStats.empty((2,)).merge(RunningStats.of(a)), a)
    both = RunningStats.empty((2,)).merge(empty)
    assert both.count == 0


def test_merge_many_fragments_in_any_order():
    rng = np.random.default_rng(1)
    sizes = [1, 5, 0, 17, 2, 9]
    frags = [rng.normal(rng.uniform(-10, 10), rng.uniform(0.1, 5), size=(k, 4)) for k in sizes]
    everything = np.concatenate(frags)
    for order in itertools.permutations(range(len(frags))):
        acc = RunningStats.empty((4,))
        for i in order:
            acc = acc.merge(RunningStats.of(frags[i]))
        _assert_stats_equal(acc, everything)
    # a tree of merges (as across runners then across iterations) gives the same
    left = RunningStats.of(frags[0]).merge(RunningStats.of(frags[1])).merge(RunningStats.of(frags[2]))
    right = RunningStats.of(frags[3]).merge(RunningStats.of(frags[4])).merge(RunningStats.of(frags[5]))
    _assert_stats_equal(right.merge(left), everything)


def test_merge_survives_dict_round_trip():
    a, b = np.arange(6.0).reshape(3, 2), np.arange(10.0, 18.0).reshape(4, 2)
    s = RunningStats.from_dict(RunningStats.of(a).to_dict()).merge(RunningStats.from_dict(RunningStats.of(b).to_dict()))
    _assert_stats_equal(s, np.concatenate([a, b]))


def test_merge_does_not_mutate_inputs():
    a = RunningStats.of(np.array([[1.0], [3.0]]))
    b = RunningStats.of(np.array([[10.0]]))
    a.merge(b)
    assert a.count == 2 and a.mean[0] == 2.0 and a.m2[0] == 2.0
    assert b.count == 1 and b.mean[0] == 10.0 and b.m2[0] == 0.0


def test_normalize_and_clip():
    # mean [0, 10], var [4, 1]
    stats = RunningStats(2.0, np.array([0.0, 10.0]), np.array([8.0, 2.0]))
    x = np.array([[2.0, 10.5], [-100.0, 100.0], [1.0, 8.0]])
    out = normalize(x, stats, clip=5.0, eps=0.0)
    # (x - mean) / std = [[1, 0.5], [-50 -> -5, 90 -> 5], [0.5, -2]]
    np.testing.assert_allclose(out, [[1.0, 0.5], [-5.0, 5.0], [0.5, -2.0]], rtol=1e-6)
    assert out.dtype == np.float32
    # eps keeps a zero-variance dimension finite
    flat = RunningStats(3.0, np.array([1.0]), np.array([0.0]))
    out = normalize(np.array([[1.0], [1.0 + 1e-5]]), flat, clip=10.0)
    np.testing.assert_allclose(out[:, 0], [0.0, 0.1], rtol=1e-3)


def test_scale_rewards_divides_by_return_std_without_shift():
    stats = RunningStats(4.0, np.array([100.0]), np.array([16.0]))  # var 4, std 2; the mean must not matter
    out = scale_rewards(np.array([[1.0, -3.0], [50.0, 0.0]]), stats, clip=10.0, eps=0.0)
    np.testing.assert_allclose(out, [[0.5, -1.5], [10.0, 0.0]])


def test_discounted_returns_by_hand():
    gamma = 0.5
    rewards = np.array([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0], [4.0, 1.0]])
    dones = np.array([[False, False], [True, False], [False, False], [False, False]])
    start = np.array([2.0, 0.0])  # env 0 carries R = 2 from the previous fragment
    out, carry = discounted_returns(rewards, dones, gamma, start)
    # env 0: R_0 = 0.5*2 + 1 = 2;  R_1 = 0.5*2 + 2 = 3;  done -> R_2 = 0 + 3 = 3;  R_3 = 0.5*3 + 4 = 5.5
    # env 1: 1;  0.5*1 + 1 = 1.5;  0.5*1.5 + 1 = 1.75;  0.5*1.75 + 1 = 1.875
    np.testing.assert_allclose(out, [[2.0, 1.0], [3.0, 1.5], [3.0, 1.75], [5.5, 1.875]])
    np.testing.assert_allclose(carry, [5.5, 1.875])


def test_discounted_returns_carry_is_reset_after_a_final_done_and_chains():
    gamma = 0.9
    rewards = np.array([[1.0], [1.0], [1.0], [1.0]])
    dones = np.array([[False], [False], [False], [True]])
    out, carry = discounted_returns(rewards, dones, gamma, np.zeros(1))
    np.testing.assert_allclose(out[:, 0], [1.0, 1.9, 2.71, 3.439])
    np.testing.assert_array_equal(carry, [0.0])
    # two fragments chained through the carry equal one long fragment
    rewards = np.arange(1.0, 9.0).reshape(8, 1)
    dones = np.zeros((8, 1), bool)
    dones[2] = True
    whole, _ = discounted_returns(rewards, dones, gamma, np.array([0.7]))
    first, c = discounted_returns(rewards[:5], dones[:5], gamma, np.array([0.7]))
    second, _ = discounted_returns(rewards[5:], dones[5:], gamma, c)
    np.testing.assert_allclose(np.concatenate([first, second]), whole)
