"""``rlfabric eval``: the best-of-N expectations against hand-computed values and subset enumeration, an evaluation
of a small trained run end to end (files, their structure, and what a selector with a known choice picks), a
policy likelihood reward scored with the evaluated model, what the actors ask Ray for, selectors that mean the
run's own model, and bad input as one line before Ray starts."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import ray
from grpo_runs import run_grpo

from rlfabric.algorithms.best_of_n import (
    accuracy_by_source,
    best_of_n,
    length_bins,
    pass_at_n,
    pick_probabilities,
    step_aggregate,
)
from rlfabric.cli import main
from rlfabric.config import ConfigError, config_from_dict
from rlfabric.data import data_sources
from rlfabric.eval_report import format_report
from rlfabric.eval_selectors import VERIFIER, check_selectors, parse_selector
from rlfabric.evaluation import eval_actor_requests
from rlfabric.rewards import RewardInput, process_reward, register_reward
from rlfabric.rewards.process import step_starts


def char_sum_verifier(inputs: list[RewardInput]) -> list[dict[str, float]]:
    """A verifier whose verdicts vary between completions of an untrained model: about a third are correct."""
    return [{"correct": float(sum(map(ord, x.completion)) % 3 == 0), "format": 1.0} for x in inputs]


def shortness(inputs: list[RewardInput]) -> list[dict[str, float]]:
    """A selector whose choice is known: the shortest completion."""
    return [{"shortness": -float(x.num_tokens)} for x in inputs]


def always_fails(inputs: list[RewardInput]) -> list[dict[str, float]]:
    raise RuntimeError("verifier is down")


@process_reward
def step_count(inputs: list[RewardInput]) -> list[list[dict[str, float]]]:
    return [[{"step": 1.0} for _ in x.step_texts()] for x in inputs]


register_reward("char_sum_verifier", char_sum_verifier)
register_reward("shortness", shortness)
register_reward("always_fails", always_fails)
register_reward("step_count", step_count)


# -- the math ---------------------------------------------------------------------------------------------------


def test_pick_probabilities_without_ties_by_hand():
    # n = 2 of scores [3, 2, 1]: {3,2} -> 3, {3,1} -> 3, {2,1} -> 2
    assert pick_probabilities(np.array([3.0, 2.0, 1.0]), 1) == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    assert pick_probabilities(np.array([3.0, 2.0, 1.0]), 2) == pytest.approx([2 / 3, 1 / 3, 0])
    assert pick_probabilities(np.array([1.0, 3.0, 2.0]), 3) == pytest.approx([0, 1, 0])
    assert best_of_n(np.array([3.0, 2.0, 1.0]), np.array([1, 0, 1]), 2) == pytest.approx(2 / 3)


def test_pick_probabilities_with_ties_by_hand():
    # scores [2, 1, 1, 0], n = 2: {A,B} {A,C} {A,D} -> A; {B,C} -> B or C, half each; {B,D} -> B; {C,D} -> C
    scores = np.array([2.0, 1.0, 1.0, 0.0])
    assert pick_probabilities(scores, 2) == pytest.approx([1 / 2, 1 / 4, 1 / 4, 0])
    assert best_of_n(scores, np.array([0, 1, 0, 1]), 2) == pytest.approx(1 / 4)
    # n = 3: {A,B,C} {A,B,D} {A,C,D} -> A; {B,C,D} -> B or C
    assert pick_probabilities(scores, 3) == pytest.approx([3 / 4, 1 / 8, 1 / 8, 0])
    assert best_of_n(scores, np.array([0, 1, 0, 1]), 3) == pytest.approx(1 / 8)
    # all tied: a uniform pick whatever n
    assert pick_probabilities(np.ones(4), 3) == pytest.approx([1 / 4] * 4)


def test_a_failed_score_ranks_below_every_scored_one():
    # {nan,1} -> 1, {nan,0} -> 0, {1,0} -> 1
    assert pick_probabilities(np.array([np.nan, 1.0, 0.0]), 2) == pytest.approx([0, 2 / 3, 1 / 3])


def test_best_of_n_equals_the_mean_over_every_subset():
    rng = np.random.default_rng(0)
    for _ in range(20):
        m = int(rng.integers(1, 8))
        scores = rng.integers(0, 3, m).astype(float)  # few values: many ties
        values = rng.normal(size=m)
        for n in range(1, m + 1):
            picks = []
            for subset in itertools.combinations(range(m), n):
                top = max(scores[i] for i in subset)
                picks.append(np.mean([values[i] for i in subset if scores[i] == top]))
            assert best_of_n(scores, values, n) == pytest.approx(np.mean(picks))


def test_step_scores_aggregate_by_hand():
    steps = np.array([0.5, -1.0, 2.0])
    assert [step_aggregate(steps, how) for how in ("min", "mean", "last", "sum")] == [-1.0, 0.5, 2.0, 1.5]
    assert np.isnan(step_aggregate(np.array([]), "min"))
    with pytest.raises(ValueError, match="aggregate = 'max': expected one of min, mean, last, sum"):
        step_aggregate(steps, "max")


def test_pass_at_n_by_hand():
    assert pass_at_n(np.array([1, 0, 0, 0]), 2) == pytest.approx(1 / 2)  # 1 - C(3,2)/C(4,2)
    assert pass_at_n(np.array([1, 1, 0, 0]), 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_n(np.array([0, 1, 0]), 3) == 1.0
    assert pass_at_n(np.array([0, 0, 0]), 2) == 0.0
    with pytest.raises(ValueError, match=r"n = 4: must be an integer in \[1, 3\]"):
        pass_at_n(np.array([0, 1, 0]), 4)


def test_accuracy_by_data_source_by_hand():
    correct = np.array([[1, 0], [1, 1], [0, 0], [0, 1]])  # two completions of each of four prompts
    sources = data_sources([{"data_source": "gsm8k"}, {"data_source": "math"}, {"data_source": "gsm8k"}, {}])
    by_source = accuracy_by_source(sources, correct, [1, 2])
    assert by_source == {
        "gsm8k": {
            "prompts": 2,
            "accuracy": 0.25,
            "pass_at_n": [{"n": 1, "accuracy": 0.25}, {"n": 2, "accuracy": 0.5}],  # prompt 0 has one right
        },
        "math": {"prompts": 1, "accuracy": 1.0, "pass_at_n": [{"n": 1, "accuracy": 1.0}, {"n": 2, "accuracy": 1.0}]},
        "none": {"prompts": 1, "accuracy": 0.5, "pass_at_n": [{"n": 1, "accuracy": 0.5}, {"n": 2, "accuracy": 1.0}]},
    }
    assert data_sources([{"data_source": "gsm8k"}] * 4) is None  # one source: the totals say it all
    report = {
        "policy": "p",
        "config": "c",
        "data": "d",
        "prompts": 4,
        "samples_per_prompt": 2,
        "sampling": {"temperature": 1.0},
        "correct_component": "correct",
        "verifier_failed_samples": 0,
        "n": [1, 2],
        "selectors": {
            "train": {
                "best_of_n": [{"n": n, "accuracy": 0.5, "response_tokens": 3.0} for n in (1, 2)],
                "length_score_correlation": None,
                "length_bins": [],
            }
        },
        "pass_at_n": [{"n": 1, "accuracy": 0.5}, {"n": 2, "accuracy": 0.75}],
        "accuracy": 0.5,
        "by_source": by_source,
    }
    assert "  gsm8k (2 prompts): accuracy 25.0%, pass@1 25.0%, pass@2 50.0%" in format_report(report).splitlines()


def test_length_bins_by_hand():
    bins = length_bins(
        np.array([1, 2, 3, 4, 10]), np.array([1.0, 2.0, np.nan, 4.0, 5.0]), np.array([1, 0, 1, 0, 1]), num_bins=2
    )
    assert bins == [
        {"tokens_min": 1, "tokens_max": 5, "samples": 4, "score_mean": pytest.approx(7 / 3), "accuracy": 0.5},
        {"tokens_min": 6, "tokens_max": 10, "samples": 1, "score_mean": 5.0, "accuracy": 1.0},
    ]


# -- end to end -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, local_ray) -> Path:
    """A small GRPO run of one step, with a checkpoint and its final model."""
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    run_grpo(run_dir, sampling={"max_new_tokens": 6}, training={"total_steps": 1, "checkpoint_every": 1})
    return run_dir


def test_eval_of_a_run_writes_its_report_and_the_selectors_pick_as_they_should(trained_run, capsys):
    argv = ["eval", "--run-dir", str(trained_run), "--n", "1,2,4", "--num-prompts", "6", "--quiet"]
    argv += ["rewards.functions=[{name: char_sum_verifier}]", "--selector", "train", "--selector", "shortness"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "final_model of run" in printed and "pass@N" in printed

    out = trained_run / "eval"
    report = json.loads((out / "eval.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert (out / "best_of_n.png").stat().st_size > 0 and (out / "reward_vs_length.png").stat().st_size > 0
    assert report["model"] == str(trained_run / "final_model")
    assert (report["prompts"], report["samples_per_prompt"], report["n"]) == (6, 4, [1, 2, 4])
    assert list(report["selectors"]) == ["train", "shortness"]
    assert len(samples) == 24 and report["verifier_failed_samples"] == 0
    assert report["by_source"] == {}  # a generated task: no data_source column

    correct = np.array([s["correct"] for s in samples]).reshape(6, 4)
    tokens = np.array([s["response_tokens"] for s in samples]).reshape(6, 4)
    assert report["accuracy"] == pytest.approx(correct.mean())
    for k, row in enumerate(report["pass_at_n"]):  # pass@1 is the mean accuracy; pass@4 any correct of the 4
        assert row["n"] == [1, 2, 4][k]
    assert report["pass_at_n"][0]["accuracy"] == pytest.approx(correct.mean())
    assert report["pass_at_n"][2]["accuracy"] == pytest.approx(correct.any(axis=1).mean())

    # the training reward is the verifier's `correct` (format has weight 0, the run's arithmetic reward's default,
    # saved with its config): best-of-N by it is pass@N
    assert report["selectors"]["train"]["weights"] == {"format": 0.0}
    train = report["selectors"]["train"]["best_of_n"]
    assert [r["accuracy"] for r in train] == pytest.approx([r["accuracy"] for r in report["pass_at_n"]])

    # the shortness selector keeps the shortest: of all 4, exactly the shortest (ties: their mean correctness)
    short = report["selectors"]["shortness"]["best_of_n"]
    assert short[0]["response_tokens"] == pytest.approx(tokens.mean())
    assert short[2]["response_tokens"] == pytest.approx(tokens.min(axis=1).mean())
    assert short[2]["response_tokens"] <= short[1]["response_tokens"] <= short[0]["response_tokens"]
    shortest = [correct[k][tokens[k] == tokens[k].min()].mean() for k in range(6)]
    assert short[2]["accuracy"] == pytest.approx(np.mean(shortest))
    assert all(s["scores"]["shortness"] == -s["response_tokens"] for s in samples)
    bins = report["selectors"]["shortness"]["length_bins"]
    assert sum(b["samples"] for b in bins) == 24


def test_a_process_reward_selects_by_its_steps_scores_aggregated(trained_run, tmp_path):
    """step_count gives each step 1; cut at every "e" (the selector's own split) and summed, a completion's score
    is its number of steps. The character tokenizer cuts no step inside a token, so the steps are the text's."""
    selector = "{name: step_count, aggregate: sum, split: 'tag:e', label: steps}"
    argv = ["eval", "--run-dir", str(trained_run), "--n", "1,4", "--samples", "8", "--num-prompts", "8", "--quiet"]
    argv += [
        "--out",
        str(tmp_path / "eval"),
        "sampling.max_new_tokens=24",
        "rewards.functions=[{name: char_sum_verifier}]",
    ]
    assert main([*argv, "--selector", selector]) == 0
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    counts = [len(step_starts(s["completion"], "tag:e")) + 1 for s in samples]
    assert [s["step_scores"]["steps"] for s in samples] == [[1.0] * k for k in counts]
    assert [s["scores"]["steps"] for s in samples] == counts
    assert max(counts) > 1  # some completion has several steps, so the split reached the reward


@pytest.mark.parametrize("initial_model", [False, True])
def test_an_eval_whose_verifier_fails_every_sample_exits_1_and_leaves_no_folder(
    trained_run, tmp_path, capsys, initial_model
):
    """With the config's initial builtin model, the model is built into the output folder before sampling: a
    failed evaluation removes it with the folders it created."""
    policy = [] if initial_model else ["--checkpoint", str(trained_run / "final_model")]
    argv = ["eval", *policy, "--n", "1", "--num-prompts", "2", "rewards.functions=[{name: always_fails}]"]
    argv += ["--out", str(tmp_path / "evals" / "out"), "--quiet"]
    assert main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("rlfabric: eval failed: every completion failed its verifier"), err
    assert "verifier is down" in err[-1]
    assert not (tmp_path / "evals").exists()


def test_a_policy_likelihood_reward_scores_with_the_evaluated_model(trained_run, tmp_path):
    # weights: policy (the default) in the verifier and as a selector: the policy is frozen, so its log-probs are
    # the evaluated model's, checked against a forward pass of that model by hand
    import torch

    from rlfabric.models.hf import load_causal_lm, load_tokenizer

    argv = ["eval", "--run-dir", str(trained_run), "--n", "1,2", "--num-prompts", "2", "--quiet"]
    argv += ["--out", str(tmp_path), "rewards.functions=[{name: char_sum_verifier}, {name: likelihood}]"]
    argv += ["--selector", "{name: likelihood, kwargs: {target: answer, reduce: sum}, label: ll}"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert report["verifier_failed_samples"] == 0 and report["selectors"]["ll"]["failed_samples"] == 0

    model_dir = trained_run / "final_model"
    model, tokenizer = load_causal_lm(model_dir), load_tokenizer(model_dir)
    for sample in samples:
        a, b = sample["prompt"][:-1].split("+")
        context = tokenizer(sample["prompt"] + sample["completion"], add_special_tokens=False).input_ids
        target = tokenizer(str(int(a) + int(b)), add_special_tokens=False).input_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([context + target])).logits[0]
        per_token = [torch.log_softmax(logits[len(context) + t - 1], -1)[tok].item() for t, tok in enumerate(target)]
        assert sample["components"]["likelihood"] == pytest.approx(np.mean(per_token), abs=1e-4)
        assert sample["scores"]["ll"] == pytest.approx(np.sum(per_token), abs=1e-4)


def test_judge_generators_are_counted_in_what_an_eval_asks_ray_for():
    cfg = config_from_dict({"algo": "grpo", "rewards": {"num_workers": 3, "num_cpus": 0.25}})
    judge = {"name": "judge", "kwargs": {"model": "j", "num_generators": 2, "num_cpus": 1.5}}
    pools = {VERIFIER: [{"name": "arithmetic"}, {"name": "judge", "kwargs": {"model": "j"}}], "jd": [judge]}
    requests = {r.role: (r.count, r.resources) for r in eval_actor_requests(cfg, pools)}
    assert requests["rewards"] == (6, {"CPU": 0.25, "GPU": 0.0})  # 3 workers for each of the 2 pools
    # every worker of a pool with a judge starts its own judge generators: 0.5 CPU and one generator by default
    assert requests["judge generators (rewards.functions[1].kwargs.num_generators/num_cpus)"] == (3, {"CPU": 0.5})
    assert requests["judge generators (--selector 'jd' kwargs.num_generators/num_cpus)"] == (6, {"CPU": 1.5})
    assert len(requests) == 4


def test_a_selector_weighs_a_component_it_leaves_out_as_its_function_declares():
    """The verifiers' format weighs 0 (``@default_weights``) unless the selector's weights name it, as in training:
    a well-formed wrong answer scores 0, not 1."""
    [plain, weighted] = check_selectors(
        [parse_selector("arithmetic"), parse_selector("{name: arithmetic, weights: {format: 0.5}, label: a}")],
        None,
        "classifier",
    )
    assert plain.weights == {"format": 0.0} and weighted.weights == {"format": 0.5}
    assert plain.score_of({"correct": 0.0, "format": 1.0}) == 0.0
    assert plain.score_of({"correct": 1.0, "format": 1.0}) == 1.0
    assert weighted.score_of({"correct": 1.0, "format": 1.0}) == 1.5


def test_a_selector_without_its_model_is_the_runs_own_model_of_its_kind(tmp_path):
    (tmp_path / "reward_model").mkdir()
    (tmp_path / "reward_model" / "config.json").write_text("{}")
    [judge] = check_selectors([parse_selector("judge")], tmp_path, "judge")
    assert judge.spec.kwargs == {"model": str(tmp_path / "reward_model")}
    with pytest.raises(ConfigError, match=r"--selector 'reward_model'.* judge \(reward_model.kind\).*kwargs.path"):
        check_selectors([parse_selector("reward_model")], tmp_path, "judge")
    with pytest.raises(ConfigError, match=r"--selector 'j': 'judge' .* classifier \(reward_model.kind\).*kwargs.model"):
        check_selectors([parse_selector("{name: judge, label: j}")], tmp_path, "classifier")


def test_a_selector_of_the_other_kind_than_the_runs_model_is_one_line(trained_run, capsys):
    argv = ["eval", "--run-dir", str(trained_run), "reward_model.kind=judge", "--selector", "reward_model"]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--selector 'reward_model'" in err[0] and "reward_model.kind" in err[0], err


# -- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, names",
    [
        (["--n", "1,0,4"], ["--n '1,0,4'", "positive integers"]),
        (["--n", "1,x"], ["--n '1,x'"]),
        (["--selector", "no_such_reward"], ["--selector = 'no_such_reward' is not valid", "not a registered reward"]),
        # the verifier and a selector's reward declare their components (@gives): names checked before sampling
        (["--correct", "corect"], ["--correct names 'corect' (did you mean 'correct'?)", "gives only correct, format"]),
        # a process reward's components are per step, not a completion's: not what --correct can name
        (
            ["--correct", "step_correct", "rewards.functions=[{name: arithmetic}, {name: arithmetic_steps}]"],
            ["--correct names 'step_correct'", "gives only correct, format"],
        ),
        (
            ["--selector", "{name: arithmetic, weights: {corect: 1}}"],
            ["--selector 'arithmetic' weights names 'corect' (did you mean 'correct'?)"],
        ),
        (["rewards.functions=[{name: arithmetic}, {name: math}]"], ["both give component 'correct'"]),
        (["env.agent=my_agent", "sft.steps=0"], ["env.agent = 'my_agent'", "not episodes of a text env, an agent"]),
        (["--selector", "{name: shortness, oops: 1}"], ["--selector", "oops"]),
        (["--selector", "{name: reward_model, kwargs: {path: no/such/folder}}"], ["--selector 'reward_model'"]),
        (["--selector", "{name: shortness, aggregate: min}"], ["--selector 'shortness'", "aggregate", "outcome"]),
        (["--selector", "{name: step_count, aggregate: max}"], ["--selector", "aggregate must be one of min"]),
        (["--selector", "{name: step_count, split: lines}"], ["--selector", "split 'lines': must be one of"]),
        (["--run-dir", "no/such/run"], ["--run-dir 'no/such/run'", "no such directory"]),
        (["--checkpoint", "./no/such/model"], ["--checkpoint"]),
        (["--n", "1,8", "--samples", "4"], ["--samples 4", "largest N (8)"]),
        (["--num-prompts", "0"], ["--num-prompts 0"]),
        (["model.path=./no/such/model"], ["model.path", "./no/such/model"]),
    ],
)
def test_bad_input_is_one_line_before_ray_starts(args, names, capsys, no_ray):
    assert main(["eval", *args]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("rlfabric: config error: "), lines
    for name in names:
        assert name in lines[0], lines
    assert not ray.is_initialized()


def test_a_run_dir_without_a_model_is_one_line(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("algo: grpo\n")
    assert main(["eval", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "holds no trained model" in err[0], err
