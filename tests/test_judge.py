"""LLM judges: rubric prompts and verdict parsing, a judge trained by ``rlfabric train-rm`` (``reward_model.kind:
judge``) served on its own generator actors in pointwise, pairwise and listwise modes, garbage retried and then
recorded as failed, a killed judge generator started again, and a GRPO run that goes on when its judge fails some
samples."""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
from pathlib import Path

import pytest
import yaml
from grpo_runs import run_grpo

from rlfabric.actors.reward_service import RewardServiceCore
from rlfabric.cli import main
from rlfabric.config import ConfigError
from rlfabric.grpo_config import DEFAULT_ALPHABET
from rlfabric.judge import JUDGE_CPUS, JUDGE_TIMEOUT_S, judge_generators, judge_stats
from rlfabric.rewards import RewardInput, resolve_reward
from rlfabric.rewards.judge_format import (
    comparison_pairs,
    listwise_prompt,
    make_rubric,
    pairwise_prompt,
    parse_listwise,
    parse_pairwise,
    parse_scores,
    pointwise_prompt,
    win_rates,
)

# -- prompts and verdicts --------------------------------------------------------------------------------------


def test_prompts_name_the_rubric_and_the_candidates():
    rubric = make_rubric({"answer": "the sum is right", "format": ""})
    assert pointwise_prompt("1+2=", "3", rubric) == "1+2=3\nJudge answer (the sum is right), format:\n"
    assert pairwise_prompt("1+2=", "3", "4", rubric) == "1+2=\nA) 3\nB) 4\nJudge answer (the sum is right), format:\n"
    assert listwise_prompt("1+2=", ["3", "4"], make_rubric(["answer"])) == "1+2=\n1) 3\n2) 4\nJudge answer:\n"


def test_verdicts_parse_only_when_every_criterion_has_an_allowed_value():
    rubric = make_rubric(["answer", "format"], scale=4)
    assert parse_scores("format=4 answer=3 and more", rubric) == {"answer": 0.75, "format": 1.0}
    assert parse_scores("answer=3", rubric) is None  # format missing
    assert parse_scores("answer=5 format=1", rubric) is None  # above the scale
    assert parse_scores("answer=x format=1", rubric) is None
    two = make_rubric(["answer", "format"])
    assert parse_pairwise("answer=B format=tie", two) == {"answer": "B", "format": "tie"}
    assert parse_pairwise("answer=C format=A", two) is None
    one = make_rubric(["answer"])
    assert parse_listwise("1) answer=1\n3) answer=0\n2) junk\n1) answer=0", 4, one) == [
        {"answer": 1.0},  # the first line for a candidate counts
        None,
        {"answer": 0.0},
        None,
    ]


def test_comparison_pairs_cover_the_group_once_and_alternate_who_is_shown_first():
    assert comparison_pairs(4, None) == [(0, 1), (2, 0), (0, 3), (2, 1), (1, 3), (3, 2)]
    assert comparison_pairs(5, 1) == [(0, 1), (2, 1), (2, 3), (4, 3), (0, 4)]


def test_win_rates_count_ties_as_half_and_skip_comparisons_without_a_verdict():
    rubric = make_rubric(["a"])
    rates = win_rates(4, [(0, 1), (2, 0), (1, 2), (3, 1)], [{"a": "A"}, {"a": "tie"}, {"a": "B"}, None], rubric)
    # 0: beat 1, tied 2 -> 1.5 / 2; 1: lost to 0 and to 2 -> 0 / 2; 2: tied 0, beat 1 -> 1.5 / 2; 3: no verdict
    assert rates == [{"a": 0.75}, {"a": 0.0}, {"a": 0.75}, None]


@pytest.mark.parametrize(
    ("criteria", "scale", "message"),
    [
        ([], 1, "criteria is empty"),
        (["a_b"], 1, "letters and digits"),
        (["a", "a"], 1, "distinct"),
        (["a"], 10, "1 to 9"),
    ],
)
def test_bad_rubrics_are_refused_in_one_line(criteria, scale, message):
    with pytest.raises(ValueError, match=message):
        make_rubric(criteria, scale)


# -- a trained judge on its own generators ---------------------------------------------------------------------


def easy_pairs(path: Path, n: int, seed: int) -> None:
    """Pairs a tiny judge learns in a few hundred steps: the right sum over 1 to 4 characters that are no digits
    (as an untrained policy writes)."""
    rng = random.Random(seed)
    letters = [c for c in DEFAULT_ALPHABET if not c.isdigit() and c != "\n"]
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        rejected = "".join(rng.choice(letters) for _ in range(rng.randint(1, 4)))
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": rejected})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> Path:
    """``rlfabric train-rm`` with ``reward_model.kind: judge`` on the easy pairs: the judge's model folder."""
    root = tmp_path_factory.mktemp("judge")
    easy_pairs(root / "pairs.jsonl", 400, seed=0)
    config = {
        "model": {"path": "builtin"},
        "grpo": {"group_size": 4},
        "reward_model": {
            "kind": "judge",
            "pairs": str(root / "pairs.jsonl"),
            "heads": ["answer"],
            "num_pairs": 300,
            "num_eval": 50,
            "lm_steps": 0,
            "steps": 200,
            "eval_every": 200,
            "batch_size": 16,
        },
    }
    (root / "judge.yaml").write_text(yaml.safe_dump(config))
    printed = io.StringIO()  # not --quiet: the progress lines are a judge's, not a classifier's
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        assert main(["train-rm", str(root / "judge.yaml"), "--run-dir", str(root / "run")]) == 0
    lines = printed.getvalue().splitlines()
    assert any(re.fullmatch(r"rm +\d+/200 \| loss \d+\.\d{3} \| +\d+s \| ETA .*", line) for line in lines), lines
    assert any(re.fullmatch(r"rm eval +\d+ \| held-out verdict accuracy \d\.\d{3}", line) for line in lines), lines
    summary = json.loads((root / "run" / "summary.json").read_text())
    assert summary["rm_eval_accuracy_initial"] == 0.0 and summary["rm_eval_accuracy_final"] >= 0.9
    return root / "run" / "reward_model"


def groups() -> list[list[RewardInput]]:
    """Two groups of four: right sums and words."""
    return [
        [RewardInput(p, c, {}, "stop", len(c)) for c in cs]
        for p, cs in (("12+35=", ["47", "no", "47", "abc"]), ("20+21=", ["x", "41", "zz", "41"]))
    ]


RIGHT = [[True, False, True, False], [False, True, False, True]]


def judge_spec(model: Path, **kwargs) -> dict:
    return {"name": "judge", "kwargs": {"model": str(model), "criteria": ["answer"], **kwargs}}


def test_a_trained_judge_scores_pointwise_and_pairwise_as_the_verifier_does(judge_dir, local_ray):
    pointwise = RewardServiceCore([judge_spec(judge_dir, mode="pointwise")], group_timeout_s=120).score(groups())
    assert [[r.components["judge_answer"] for r in g] for g in pointwise] == [[float(x) for x in row] for row in RIGHT]
    pairwise = RewardServiceCore([judge_spec(judge_dir, mode="pairwise")], group_timeout_s=120).score(groups())
    for group, right in zip(pairwise, RIGHT, strict=True):
        rates = [r.components["judge_answer"] for r in group]
        assert min(x for x, ok in zip(rates, right, strict=True) if ok) > max(
            x for x, ok in zip(rates, right, strict=True) if not ok
        )


def test_listwise_judges_a_whole_group_in_one_call(judge_dir, local_ray):
    before = judge_stats().calls
    results = RewardServiceCore([judge_spec(judge_dir, mode="listwise")], group_timeout_s=120).score(groups())
    assert judge_stats().calls - before == 2  # one judge prompt per group: nothing failed to parse
    assert all(r.error is None and r.components["judge_answer"] in (0.0, 1.0) for g in results for r in g)


def test_unparsable_verdicts_are_retried_then_only_those_samples_fail(judge_dir, local_ray):
    # Two verdict lines fit in 24 new tokens: candidates 3 and 4 never get theirs.
    spec = judge_spec(judge_dir, mode="listwise", max_new_tokens=24, retries=2)
    before = judge_stats()
    results = RewardServiceCore([spec], group_timeout_s=120).score(groups())
    after = judge_stats()
    for group in results:
        assert [r.error is None for r in group] == [True, True, False, False]
        assert group[2].error.startswith("judge: no verdict that parses after 3 tries; it wrote '1) answer=")
    assert after.calls - before.calls == 6  # each group asked three times
    assert after.unparsed - before.unparsed == 6


def test_a_killed_judge_generator_is_started_again_and_its_prompts_asked_again(judge_dir, local_ray):
    import ray

    spec = judge_spec(judge_dir, mode="pointwise", seed=7)  # a pool of its own
    service = RewardServiceCore([spec], group_timeout_s=120)
    pool = judge_generators(str(judge_dir), 1, JUDGE_CPUS, JUDGE_TIMEOUT_S, 7)
    ray.kill(pool.actors[0], no_restart=True)
    results = service.score(groups())
    assert pool.stats.restarts == 1
    assert [[r.components["judge_answer"] for r in g] for g in results] == [[float(x) for x in row] for row in RIGHT]


def test_a_judge_prompt_longer_than_the_judges_context_fails_its_sample_at_once(judge_dir, local_ray):
    long = [RewardInput("12+35=", "4" * 300, {}, "stop", 300), RewardInput("12+35=", "47", {}, "stop", 2)]
    before = judge_stats().calls
    results = RewardServiceCore([judge_spec(judge_dir, mode="pointwise")], group_timeout_s=120).score([long])
    assert results[0][0].error == (
        "judge: a judge prompt of 321 tokens leaves no room for a verdict in the judge's 128 positions"
    )
    assert results[0][1].components == {"judge_answer": 1.0}
    assert judge_stats().calls - before == 1  # the long prompt was never sent, nor asked again


def test_bad_judge_kwargs_are_one_config_error_naming_the_spec(judge_dir, tmp_path):
    classifier = tmp_path / "classifier"  # what train-rm leaves for reward_model.kind: classifier
    classifier.mkdir()
    (classifier / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"]}))
    cases = [
        ({"model": str(tmp_path)}, "must be a Hugging Face causal-LM folder"),
        ({"model": str(classifier)}, "a sequence-classification model (a classifier reward model), which cannot"),
        ({"model": str(judge_dir), "mode": "ranked"}, "mode = 'ranked': must be one of pointwise, pairwise, listwise"),
        ({"model": str(judge_dir), "criteria": ["a_b"]}, "letters and digits"),
        ({"model": str(judge_dir), "retries": -1}, "retries = -1: must be an integer >= 0"),
        ({"model": str(judge_dir), "rubric": "x"}, "cannot take them"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=r"rewards\.functions\[0\]\.kwargs") as info:
            resolve_reward({"name": "judge", "kwargs": kwargs}, "rewards.functions[0]")
        assert message in str(info.value) and "\n" not in str(info.value)


def test_a_grpo_run_goes_on_when_its_judge_fails_some_samples(judge_dir, tmp_path, local_ray):
    """The judge reads only two verdict lines of each group of four: half the samples fail every step, the
    rest train."""
    run = run_grpo(
        tmp_path / "run",
        rewards={
            "functions": [{"name": "arithmetic"}, judge_spec(judge_dir, mode="listwise", max_new_tokens=24, retries=0)],
            "weights": {"correct": 0.0, "format": 0.0},
        },
        data={"train": "task:arithmetic?max_operand=49&ops=+"},
        training={"total_steps": 2},
    )
    steps = run.phase("grpo")
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["failed_samples"] for r in steps] == [4, 8]  # 2 groups x 2 unscored samples a step
    assert [r["trained_samples"] for r in steps] == [4, 4]
    assert all("reward_judge_answer" in r for r in steps)
