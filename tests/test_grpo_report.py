"""A GRPO step's metrics row, an evaluation's row and the run's summary, from hand-made rollout metadata."""

from __future__ import annotations

import numpy as np
import pytest

from rlfabric.actors.rollout_meta import sums_by_source
from rlfabric.data import data_sources
from rlfabric.grpo_report import eval_row, run_summary, step_row
from rlfabric.llm_run_state import Counters
from rlfabric.run.progress import grpo_progress_line as progress_line


def rollout(rows: int, means: list[float], correct: float, length: float) -> dict:
    """One rollout's metadata: groups of 4 rows with the given mean rewards (count, mean, std, rows)."""
    stats = np.array([[4, m, 0.5, 4] for m in means], dtype=np.float64)
    return {
        "rows": rows,
        "samples": rows,
        "component_means": {"correct": correct},
        "group_stats": stats,
        "response_length_mean": length,
    }


def test_a_step_row_weights_rewards_by_rows_and_counts_the_lag_of_trained_samples():
    scored = [rollout(8, [1.0, 0.0], correct=0.5, length=3.0), rollout(4, [2.0], correct=1.0, length=6.0)]
    counters = Counters(tokens_generated=90, failed_samples=2)
    # two groups sampled by version 4, one by version 2; the learner is at version 5 before this update
    row = step_row(scored, [(0, 4, 4), (1, 4, 4), (2, 4, 2)], counters, version=5, elapsed_s=2.0)
    assert row["reward_mean"] == pytest.approx((1.0 * 4 + 0.0 * 4 + 2.0 * 4) / 12)
    assert row["reward_correct"] == pytest.approx(0.5 * 8 / 12 + 1.0 * 4 / 12) == row["accuracy"]
    assert row["response_length_mean"] == pytest.approx((3.0 * 8 + 6.0 * 4) / 12)
    assert row["samples_per_s"] == pytest.approx(6.0) and row["trained_samples"] == 12
    assert row["policy_lag_mean"] == pytest.approx((0 + 0 + 2 * 4) / 12) and row["policy_lag_max"] == 2
    assert row["failed_samples"] == 2 and row["tokens_generated"] == 90


def test_an_eval_row_is_accuracy_and_reward_over_the_scored_samples_with_the_unscored_apart():
    # 2 of 10 samples failed a reward (a flaky scorer, a timeout): they are not wrong answers, 4 of the 8 were right
    row = eval_row({"samples": 10, "failed": 2, "correct_sum": 4.0, "reward_sum": 6.0}, "step_25")
    assert row == {
        "phase": "eval",
        "label": "step_25",
        "eval_accuracy": 0.5,
        "eval_reward_mean": 0.75,
        "eval_failed": 2,
        "eval_samples": 10,
    }
    assert progress_line({**row, "step": 25, "time_s": 12.0}) == (
        "eval step    25 | held-out accuracy 0.500 (2 of 10 unscored) |     12s"
    )
    nothing = eval_row({"samples": 3, "failed": 3, "reward_sum": 0.0}, "final")
    assert nothing["eval_accuracy"] is None and nothing["eval_reward_mean"] is None
    assert progress_line({**nothing, "step": 50, "time_s": 3.0}) == (
        "eval step    50 | held-out accuracy n/a (3 of 3 unscored) |      3s"
    )


def test_held_out_rows_of_several_data_sources_are_summed_and_reported_per_source():
    # 5 samples: gsm8k right, gsm8k wrong (reward 0.5 from a format bonus), math failed by a reward, math right,
    # one row without a source, wrong
    sources = data_sources([{"data_source": "gsm8k"}] * 2 + [{"data_source": "math"}] * 2 + [{"prompt": "x"}])
    assert sources == ["gsm8k", "gsm8k", "math", "math", "none"]
    sums = sums_by_source(
        sources,
        [{"correct": 1.0}, {"correct": 0.0, "format": 0.5}, None, {"correct": 1.0}, {"correct": 0.0}],
        [1.0, 0.5, None, 1.0, 0.0],
    )
    assert sums == {
        "gsm8k": {"samples": 2, "scored": 2, "reward_sum": 1.5, "correct_sum": 1.0},
        "math": {"samples": 2, "scored": 1, "reward_sum": 1.0, "correct_sum": 1.0},
        "none": {"samples": 1, "scored": 1, "reward_sum": 0.0, "correct_sum": 0.0},
    }
    assert data_sources([{"data_source": "gsm8k"}] * 2) is None  # one source: the totals say it
    meta = {"samples": 5, "failed": 1, "correct_sum": 2.0, "reward_sum": 2.5, "by_source": sums}
    row = eval_row(meta, "final")
    assert row["eval_accuracy"] == 0.5
    assert (row["eval_accuracy/gsm8k"], row["eval_accuracy/math"], row["eval_accuracy/none"]) == (0.5, 1.0, 0.0)
    assert (row["eval_reward_mean/gsm8k"], row["eval_reward_mean/math"]) == (0.75, 1.0)
    assert progress_line({**row, "step": 9, "time_s": 4.0}) == (
        "eval step     9 | held-out accuracy 0.500 (gsm8k 0.500, math 1.000, none 0.000) (1 of 5 unscored) |      4s"
    )
    unscored = eval_row({**meta, "by_source": {"a": {"samples": 1, "scored": 0, "reward_sum": 0.0}}}, "final")
    assert unscored["eval_accuracy/a"] is None and unscored["eval_reward_mean/a"] is None
    # a text env gives 'correct' only to the episodes it counts right: a source with none solved is 0, not n/a
    none_solved = {"b": {"samples": 2, "scored": 2, "reward_sum": 0.0}, "c": {**sums["math"]}}
    row = eval_row({**meta, "by_source": none_solved}, "final")
    assert row["eval_accuracy/b"] == 0.0 and row["eval_accuracy/c"] == 1.0
    without_accuracy = eval_row({"samples": 2, "failed": 0, "reward_sum": 1.0, "by_source": none_solved}, "final")
    assert without_accuracy["eval_accuracy/b"] is None  # no reward gives 'correct': n/a, as the total


def test_without_a_correct_component_held_out_accuracy_is_n_a_not_zero():
    # the rollout reports correct_sum only when some scored sample has a 'correct' component
    meta = {"samples": 8, "failed": 0, "reward_sum": 4.0, "component_means": {"score": 0.5}}
    row = eval_row(meta, "initial")
    assert row["eval_accuracy"] is None and row["eval_reward_mean"] == 0.5
    assert eval_row({**meta, "correct_sum": 0.0}, "initial")["eval_accuracy"] == 0.0  # all wrong: 0, not n/a
    assert progress_line({**row, "step": 0, "time_s": 1.0}) == "eval before training | held-out accuracy n/a |      1s"
    step = step_row(
        [{**rollout(4, [0.5], correct=0.0, length=2.0), "component_means": {"score": 0.5}}],
        [(0, 4, 0)],
        Counters(),
        version=1,
        elapsed_s=1.0,
    )
    line = progress_line({**step, "step": 1, "time_s": 1.0, "policy_version": 1})
    assert "| acc   n/a |" in line and "nan" not in line
    summary = run_summary("t", Counters(), 1, {"initial": row["eval_accuracy"], "final": None}, 1.0, {})
    assert summary["eval_accuracy_initial"] is None and summary["eval_accuracy_final"] is None


def test_a_summary_reports_counters_evaluations_and_the_sample_rate():
    counters = Counters(step=7, samples=448, resampled_samples=3, trained_samples=440)
    summary = run_summary("task:arithmetic", counters, 1007, {"initial": 0.0, "final": 0.5}, 4.0, {"final_model": "m"})
    assert summary["steps"] == 7 and summary["policy_version"] == 1007 and summary["samples_per_s"] == 112.0
    assert summary["eval_accuracy_final"] == 0.5 and summary["resampled_samples"] == 3
    assert summary["trained_samples"] == 440 and summary["final_model"] == "m"
    assert not any(key.startswith("eval_failed_") for key in summary)  # said only where a reward failed
    failed = run_summary("t", counters, 1, {"initial": 0.5, "final": 0.5}, 4.0, {}, {"initial": 0, "final": 3})
    assert failed["eval_failed_final"] == 3 and "eval_failed_initial" not in failed


def score_only(inputs: list) -> list[dict[str, float]]:
    """A reward with no ``correct`` component."""
    return [{"score": float(len(s.completion))} for s in inputs]


def test_a_run_whose_reward_gives_no_correct_says_once_why_its_accuracy_is_n_a(local_ray, tmp_path):
    from grpo_runs import run_grpo

    from rlfabric.grpo_report import NO_ACCURACY_NOTE
    from rlfabric.rewards import register_reward

    register_reward("score_only", score_only)
    run = run_grpo(tmp_path / "run", quiet=False, rewards={"functions": [{"name": "score_only"}]})
    assert run.summary["eval_accuracy_initial"] is None and run.summary["eval_accuracy_final"] is None
    assert [r["eval_accuracy"] for r in run.phase("eval")] == [None, None]
    assert run.console.count(NO_ACCURACY_NOTE) == 1


def test_a_log_file_gets_the_last_row_before_a_note_and_at_the_end(tmp_path, capsys):
    """Written to a file (not a terminal), progress lines come every 2 s at most; the newest row skipped is
    printed before a note and at the end, so a short run still shows its last step."""
    from rlfabric.config import config_from_dict
    from rlfabric.run.log import RunLog

    cfg = config_from_dict({})
    log = RunLog(tmp_path / "run", cfg, step_key="step", progress_line=lambda r: f"step {r['step']}")
    for step in (1, 2, 3):
        log.log({"iteration": step, "step": step})
    log.note("evaluating")
    log.log({"iteration": 4, "step": 4})
    log.log({"iteration": 5, "step": 5})
    log.close()
    assert capsys.readouterr().err.splitlines() == ["step 1", "step 3", "rlfabric: evaluating", "step 5"]
