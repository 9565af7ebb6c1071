"""Reward services on a real local Ray cluster: user rewards shipped by value, and every kind of failure isolated.

The reward functions live in this test file, which the actor processes cannot import: they arrive through the
registry snapshot.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlfabric.actors.reward_service import RewardServiceCore, gives_up
from rlfabric.reward_pool import RewardPool
from rlfabric.rewards import RewardInput, Unscored, gives, pointwise, register_reward


def tagged(inputs: list[RewardInput]) -> list[dict[str, float]]:
    """Behaves as the group's tag says; otherwise scores 1 and reports which process it ran in."""
    tag = inputs[0].metadata["tag"]
    if tag == "raise":
        raise ValueError("cannot score the group tagged 'raise'\n(second line)")
    if tag == "hang":
        time.sleep(1000)
    if tag == "freeze":  # stop the whole process, as a reward stuck in C code holding the GIL would
        os.kill(os.getpid(), signal.SIGSTOP)
    if tag == "crash":  # end the whole process, as a reward crashing in C code would
        os._exit(1)
    if tag == "devices":  # what Ray gave this worker
        import ray

        return [{"ok": 1.0, "gpus": float(len(ray.get_gpu_ids()))} for _ in inputs]
    return [{"ok": 1.0, "pid": float(os.getpid())} for _ in inputs]


def clashing(inputs: list[RewardInput]) -> list[dict[str, float]]:
    return [{"ok": 0.5} for _ in inputs]


def short_by_one(inputs: list[RewardInput]) -> list[dict[str, float]]:
    return [{"x": 1.0} for _ in inputs[1:]]


register_reward("tagged", tagged)
register_reward("clashing", clashing)


def group(tag: str, size: int = 2) -> list[RewardInput]:
    return [RewardInput("1+1=", "2", {"tag": tag, "answer": "2"}, "stop", 2) for _ in range(size)]


def make_pool(timeout_s: float = 5.0, grace_s: float = 10.0, specs=("tagged",)) -> RewardPool:
    return RewardPool(list(specs), num_workers=2, timeout_s=timeout_s, num_cpus_per_worker=0.5, grace_s=grace_s)


def scored(results) -> list[bool]:
    return [all(r.error is None and r.components for r in g) for g in results]


def test_user_reward_reaches_the_actors_and_components_merge(local_ray):
    pool = make_pool(specs=("tagged", "arithmetic"))
    try:
        results = pool.score([group("a", 3), group("b"), group("c"), []])
        assert [len(g) for g in results] == [3, 2, 2, 0]
        assert scored(results) == [True, True, True, True]
        assert results[0][0].components.keys() == {"ok", "pid", "correct", "format"}
        pids = {r.components["pid"] for g in results for r in g}
        assert os.getpid() not in pids and pids <= set(pool.pids())
        assert len(pids) == 2  # both workers took a share: one call each
        assert pool.failed_samples == 0 and pool.worker_restarts == 0
    finally:
        pool.shutdown()


def test_a_raising_reward_costs_only_its_group(local_ray):
    pool = make_pool()
    try:
        results = pool.score([group("a"), group("raise"), group("b"), group("c")])
        assert scored(results) == [True, False, True, True]
        error = "tagged: ValueError: cannot score the group tagged 'raise' (second line)"
        assert [r.error for r in results[1]] == [error, error] and results[1][0].components == {}
        assert pool.failed_samples == 2 and pool.worker_restarts == 0 and pool.last_errors == [error]
    finally:
        pool.shutdown()


def test_a_hanging_group_times_out_and_its_poisoned_worker_is_replaced(local_ray):
    pool = make_pool(timeout_s=2.0)
    try:
        pool.pids()  # workers started, so the time below is the scoring alone
        start = time.monotonic()
        results = pool.score([group("a"), group("hang"), group("b"), group("c")])
        assert time.monotonic() - start < 6.0
        assert scored(results) == [True, False, True, True]  # group "a" shared the call with "hang": kept
        assert results[1][0].error == "timed out after 2s in reward 'tagged'"
        assert pool.worker_restarts == 1 and pool.failed_samples == 2
        assert scored(pool.score([group("d"), group("e"), group("f")])) == [True, True, True]
        assert pool.worker_restarts == 1
    finally:
        pool.shutdown()


def test_a_killed_worker_is_replaced_and_its_groups_are_scored_again(local_ray):
    pool = make_pool()
    try:
        victim = pool.pids()[0]
        os.kill(victim, signal.SIGKILL)
        results = pool.score([group("a"), group("b"), group("c"), group("d")])
        assert scored(results) == [True, True, True, True]  # the dead worker's share, scored on its replacement
        assert all(r.components["pid"] != victim for g in results for r in g)
        assert pool.worker_restarts == 1 and pool.failed_samples == 0
        assert victim not in pool.pids()
    finally:
        pool.shutdown()


def test_a_reward_that_crashes_its_process_fails_its_call_after_one_retry(local_ray):
    pool = make_pool()
    try:
        results = pool.score([group("crash"), group("a"), group("b"), group("c")])
        # worker 0's call held "crash" and "a": it died, its replacement died on the same groups, then they failed
        assert scored(results) == [False, False, True, True]
        assert all(
            r.error.startswith("reward worker 0 died: ")
            and r.error.endswith("the second worker to die on these groups)")
            for g in results[:2]
            for r in g
        )
        assert pool.worker_restarts == 2 and pool.failed_samples == 4
        assert scored(pool.score([group("e"), group("f")])) == [True, True]
    finally:
        pool.shutdown()


def test_a_stuck_process_hits_the_driver_deadline(local_ray):
    pool = make_pool(timeout_s=1.0, grace_s=3.0)
    frozen = None
    try:
        pids = pool.pids()
        start = time.monotonic()
        ticket = pool.submit([group("freeze"), group("a"), group("b"), group("c")])
        results = pool.collect(ticket)
        assert time.monotonic() - start < 8.0  # the backstop: 1s per group of the call + 3s grace
        assert scored(results) == [False, False, True, True]
        assert results[0][0].error == "reward worker 0 missed its 5s deadline and was replaced"
        frozen = pids[0]
        assert pool.worker_restarts == 1
        assert scored(pool.score([group("d"), group("e")])) == [True, True]
    finally:
        pool.shutdown()
        if frozen is not None:
            _kill_if_alive(frozen)


def test_a_reward_that_hangs_on_every_group_costs_a_few_deadlines_per_call_not_one_per_group(local_ray):
    """Three groups time out of three tried: the call's other groups are not tried on that worker but once more on
    its replacement, where three time out again and the rest fail unscored. Before, every group waited its deadline
    (here 7 seconds per worker, at rewards.timeout_s = 30 an evaluation of 200 groups took 100 minutes)."""
    pool = make_pool(timeout_s=1.0)
    try:
        pool.pids()
        results = pool.score([group("hang") for _ in range(14)])  # 7 per worker
        timed_out = "timed out after 1s in reward 'tagged'"
        skipped = f"not scored: 3 of the 3 groups tried before it {timed_out}"
        for first in (0, 7):  # each worker's share: 3 timed out, 4 skipped; on the replacement 3 + 1
            errors = [g[0].error for g in results[first : first + 7]]
            assert errors == [timed_out] * 3 + [timed_out] * 3 + [skipped], errors
        assert pool.failed_samples == 28
        assert pool.worker_restarts == 4  # each worker and its replacement, poisoned by their stuck threads
        assert scored(pool.score([group("a"), group("b")])) == [True, True]
    finally:
        pool.shutdown()


def test_a_reward_that_hangs_on_some_groups_costs_only_those_even_three_running(local_ray):
    """Twice three groups running time out, among twenty that did not: under half the groups tried, so the call
    goes on and every other group is scored (before, three in a row gave up on the rest of the call, and on the
    replacement the second three did so again: at a 15% hang rate, about half of a 200-prompt evaluation)."""
    pool = RewardPool(["tagged"], num_workers=1, timeout_s=0.5, num_cpus_per_worker=0.5, grace_s=10.0)
    try:
        hung = [10, 11, 12, 18, 19, 20]
        results = pool.score([group("hang" if i in hung else f"g{i}") for i in range(26)])
        assert scored(results) == [i not in hung for i in range(26)]
        assert {g[0].error for i, g in enumerate(results) if i in hung} == {"timed out after 0.5s in reward 'tagged'"}
        assert pool.failed_samples == 12 and pool.worker_restarts == 1  # poisoned, replaced after the call
    finally:
        pool.shutdown()


@pytest.mark.parametrize(
    ("timeouts", "tried", "in_a_row", "expected"),
    [
        (3, 3, 3, True),  # a reward that always hangs: three deadlines
        (3, 5, 1, True),  # more than half
        (3, 6, 3, False),  # half is not more than half
        (2, 2, 2, False),  # fewer than three
        (6, 60, 6, True),  # went down after 54 good groups: six running
        (5, 60, 5, False),
    ],
)
def test_when_a_call_gives_up_on_its_remaining_groups(timeouts, tried, in_a_row, expected):
    assert gives_up(timeouts, tried, in_a_row) is expected


def test_groups_skipped_after_timeouts_are_scored_on_the_replacement(local_ray):
    """A reward that hung on three groups in a row: the call's other groups, skipped there, are scored on the
    fresh worker, each in its own place."""
    pool = RewardPool(["tagged"], num_workers=1, timeout_s=1.0, num_cpus_per_worker=0.5, grace_s=10.0)
    try:
        results = pool.score([group("hang"), group("hang"), group("hang"), group("a", 3), group("b")])
        assert [r.error for g in results[:3] for r in g] == ["timed out after 1s in reward 'tagged'"] * 6
        assert scored(results) == [False, False, False, True, True] and [len(g) for g in results[3:]] == [3, 2]
        assert pool.worker_restarts == 1 and pool.failed_samples == 6  # the replacement was not poisoned
    finally:
        pool.shutdown()


def test_groups_in_flight_when_the_pool_shuts_down_fail_without_a_replacement(local_ray):
    """A run closing (Ctrl-C) shuts its pool down while a call is still scoring: that call's groups fail with the
    reason, a call that had returned keeps its results, and nothing is restarted or tried again."""
    pool = make_pool(timeout_s=30.0)
    pool.pids()  # both workers are up
    ticket = pool.submit([group("hang"), group("a")])  # one call each
    time.sleep(1.0)  # "a" is scored, "hang" is not
    pool.shutdown()
    results = pool.collect(ticket)
    assert [r.error for r in results[0]] == ["reward worker 0 was stopped: the reward pool shut down"] * 2
    assert scored(results) == [False, True]
    assert pool.worker_restarts == 0 and pool.workers == []


def _kill_if_alive(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_malformed_results_and_component_clashes_fail_the_group_in_process():
    service = RewardServiceCore(["tagged", "clashing"], group_timeout_s=5.0)
    results = service.score([group("a")])
    assert results[0][0].error == "component 'ok' comes from both 'tagged' and 'clashing'"
    register_reward("short_by_one", short_by_one)
    service = RewardServiceCore(["short_by_one"], group_timeout_s=5.0)
    results = service.score([group("a", 3)])
    assert results[0][0].error == (
        "short_by_one: returned 2 results for a group of 3 completions; expected a list of 3, one dict per completion"
    )
    assert not service.poisoned
    # a component the function does not declare fails the group: a declaration cannot drift from the code
    register_reward("declares_too_little", gives("ok")(lambda inputs: tagged(inputs)))  # tagged also gives pid
    results = RewardServiceCore(["declares_too_little"], group_timeout_s=5.0).score([group("a", 2)])
    assert [r.error for r in results[0]] == [
        "declares_too_little: sample 0 gave component 'pid', which it does not declare (@gives: ok)"
    ] * 2


def test_a_bare_float_or_none_for_a_sample_is_told_what_to_give_instead():
    register_reward("bare_floats", lambda inputs: [1.0 for _ in inputs])
    register_reward("nones", lambda inputs: [None for _ in inputs])
    floats = RewardServiceCore(["bare_floats"], group_timeout_s=5.0).score([group("a")])
    assert floats[0][0].error == (
        "bare_floats: sample 0 got a float, expected a dict, e.g. {'correct': 1.0} ('correct' is what held-out "
        "accuracy reads)"
    )
    nones = RewardServiceCore(["nones"], group_timeout_s=5.0).score([group("a")])
    assert nones[0][0].error == (
        "nones: sample 0 got a NoneType, expected a dict (rlfabric.rewards.Unscored('why') for a "
        "sample it cannot score)"
    )


def test_pool_validates_specs_before_starting_actors():
    with pytest.raises(ValueError, match="not a registered reward"):
        RewardPool(["no-such-reward"], num_workers=1, timeout_s=1.0)


def odd_unscored(inputs: list[RewardInput]) -> list[dict[str, float] | Unscored]:
    """Cannot score the samples whose completion is odd (as a judge whose answer would not parse)."""
    return [Unscored("no verdict") if int(s.completion) % 2 else {"even": 1.0} for s in inputs]


def test_an_unscored_sample_fails_alone_in_per_group_and_pointwise_functions():
    register_reward("odd_unscored", odd_unscored)
    register_reward("odd_unscored_pointwise", pointwise(lambda inputs: odd_unscored(inputs)))
    groups = [
        [RewardInput("1+1=", c, {"tag": "a"}, "stop", 1) for c in ("2", "3")],
        [RewardInput("2+2=", c, {"tag": "a"}, "stop", 1) for c in ("5", "4", "7")],
    ]
    for specs in (["odd_unscored", "tagged"], ["odd_unscored_pointwise", "tagged"]):
        results = RewardServiceCore(specs, group_timeout_s=5.0).score(groups)
        errors = [[r.error for r in g] for g in results]
        name = specs[0]
        assert errors == [[None, f"{name}: no verdict"], [f"{name}: no verdict", None, f"{name}: no verdict"]]
        assert results[0][0].components == {"even": 1.0, "ok": 1.0, "pid": float(os.getpid())}
        assert results[1][1].components["even"] == 1.0
