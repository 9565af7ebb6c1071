"""verl compatibility: verl's compute_score functions used unchanged (rlfabric.rewards.verl_compat), verl's config
names answered in the unknown-key error (rlfabric.config_aliases), and a GRPO run on a verl-style parquet file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import verl_style_rewards
from grpo_runs import TINY, run_grpo

from rlfabric.config import ConfigError, config_from_dict
from rlfabric.rewards import RewardInput, Unscored, declared_weights, describe_reward, register_reward, resolve_reward
from rlfabric.rewards.verl_compat import ground_truth, is_verl_reward, verl_components, verl_scores


def sample(completion: str, **metadata: Any) -> RewardInput:
    return RewardInput("prompt", completion, metadata, "stop", 3)


def verl_row(truth: str, source: str = "openai/gsm8k") -> dict[str, Any]:
    return {
        "data_source": source,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": 0},
    }


# -- the wrapper ------------------------------------------------------------------------------------------------


def test_a_verl_function_is_found_by_its_first_three_parameters():
    assert is_verl_reward(verl_style_rewards.compute_score)
    assert is_verl_reward(lambda data_source, solution_str, ground_truth: 0.0)
    assert not is_verl_reward(lambda inputs, **kwargs: [])
    assert not is_verl_reward(lambda solution_str, data_source, ground_truth: 0.0)  # another order: not verl's


def test_a_number_is_the_score_and_a_dict_gives_score_and_acc_as_correct_only():
    assert verl_components(0.5) == {"score": 0.5}
    assert verl_components(1) == {"score": 1.0}
    # "pred" (a string) and "bonus" (a number rlfabric cannot weigh up front) are dropped, "acc" is "correct"
    assert verl_components({"score": 1.0, "acc": True, "pred": "4", "bonus": 5.0}) == {"score": 1.0, "correct": 1.0}
    assert verl_components({"score": -1.0, "acc": None}) == {"score": -1.0}


@pytest.mark.parametrize(
    "result, says",
    [
        (None, "returned None"),
        ("1.0", "returned '1.0'"),
        ({"acc": 1.0}, "a dict without a finite number under 'score' (keys: acc)"),
        ({"score": "high"}, "a dict without a finite number under 'score' (keys: score)"),
        (math.nan, "returned nan"),
    ],
    ids=["none", "str", "no-score", "str-score", "nan"],
)
def test_any_other_result_fails_the_sample_saying_verls_contract(result, says):
    out = verl_components(result)
    assert isinstance(out, Unscored)
    assert says in out.error and "returns a number or a dict with a numeric 'score'" in out.error
    assert "\n" not in out.error


def test_the_ground_truth_is_the_nested_column_else_the_flat_one():
    assert ground_truth(verl_row("42")) == "42"
    assert ground_truth({"ground_truth": "7"}) == "7"
    assert ground_truth({"reward_model": {"style": "rule"}, "ground_truth": "7"}) == "7"  # nested without it
    with pytest.raises(KeyError) as info:
        ground_truth({"answer": "7"})
    assert "metadata['reward_model']['ground_truth'] or metadata['ground_truth']" in info.value.args[0]
    assert "its columns: answer" in info.value.args[0]


def test_the_wrapper_passes_the_row_as_verl_does_and_fails_only_the_bad_sample():
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
        seen.append((data_source, solution_str, ground_truth, extra_info, scale))
        if solution_str == "boom":
            raise RuntimeError("cannot parse")
        return scale * float(solution_str == ground_truth)

    group = [sample("42", **verl_row("42")), sample("7", ground_truth="7"), sample("1", answer="1"), sample("boom")]
    group[3].metadata.update(verl_row("3"))
    out = verl_scores(compute_score, group, scale=2.0)
    assert out[:2] == [{"score": 2.0}, {"score": 2.0}]
    assert isinstance(out[2], Unscored) and out[2].error.startswith("no ground truth")
    assert isinstance(out[3], Unscored) and out[3].error.startswith("RuntimeError: cannot parse (at ")
    assert seen[0] == ("openai/gsm8k", "42", "42", {"split": "train", "index": 0}, 2.0)
    assert seen[1] == (None, "7", "7", None, 2.0)  # a flat row: no data_source, no extra_info


def test_a_verl_function_without_extra_info_is_called_without_it():
    assert verl_scores(lambda data_source, solution_str, ground_truth: 1.0, [sample("x", ground_truth="x")]) == [
        {"score": 1.0}
    ]


# -- resolving a verl spec --------------------------------------------------------------------------------------


def test_a_spec_naming_a_verl_function_resolves_to_the_wrapper_with_correct_weighing_zero():
    fn = resolve_reward({"name": "verl_style_rewards:compute_score", "kwargs": {"bonus": 1.0}})
    assert declared_weights(fn) == {"correct": 0.0}
    assert fn.reward_components == frozenset({"score", "correct"})
    assert fn([sample("4", **verl_row("4")), sample("5", **verl_row("4"))]) == [
        {"score": 1.0, "correct": 1.0},
        {"score": -0.5, "correct": 0.0},
    ]
    register_reward("verl_test_float", verl_style_rewards.compute_score_float)
    assert resolve_reward("verl_test_float")([sample("4", **verl_row("4"))]) == [{"score": 1.0}]
    assert describe_reward("verl_test_float") == "gives correct (weighs 0), score; kwargs: none"


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"scale": 2}, "got an unexpected keyword argument 'scale'"),
        ({"extra_info": {}}, "extra_info: filled in from each row, not the config"),
    ],
    ids=["unknown", "filled"],
)
def test_a_verl_functions_kwargs_are_checked_at_resolve_time(kwargs, says):
    with pytest.raises(ConfigError) as info:
        resolve_reward({"name": "verl_style_rewards:compute_score", "kwargs": kwargs}, "rewards.functions[0]")
    message = str(info.value)
    assert message.startswith(f"rewards.functions[0].kwargs = {kwargs!r}: verl reward ")
    assert says in message and "its parameters besides data_source, solution_str, ground_truth, extra_info: " in message
    assert message.endswith("extra_info: bonus=0.0")


# -- verl's config names ----------------------------------------------------------------------------------------


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"algo": "grpo", **data})
    return str(info.value)


def test_a_verl_name_under_a_known_section_is_answered_with_rlfabrics_key():
    assert _error({"data": {"train_batch_size": 16}}) == (
        "unknown config key 'data.train_batch_size' (verl's name; rlfabric's is 'grpo.prompts_per_step', see "
        "docs/migrating.md); allowed here: train, eval, prompt_key, chat_template, num_train, num_eval"
    )


def test_each_leaf_of_an_unknown_verl_section_gets_its_own_hint_in_one_line():
    message = _error(
        {
            "actor_rollout_ref": {
                "rollout": {"n": 8, "mode": "sync"},
                "actor": {"optim": {"lr": 1e-6}, "kl_loss_type": "low_var_kl", "loss_agg_mode": "token-mean"},
            },
            "algorithm": {"adv_estimator": "reinforce_plus_plus", "filter_groups": {"enable": True}},
            "trainer": {"save_freq": 10, "logger": ["console"]},
            "critic": {"optim": {"lr": 1e-5}},
        }
    )
    assert "\n" not in message
    assert message.startswith("unknown config keys 'actor_rollout_ref.rollout.n' (verl's name; rlfabric's is 'grpo.")
    for hint in (
        "'actor_rollout_ref.rollout.n' (verl's name; rlfabric's is 'grpo.group_size')",
        "'actor_rollout_ref.rollout.mode', ",  # no row: named, without a hint
        "'actor_rollout_ref.actor.optim.lr' (verl's name; rlfabric's is 'grpo.lr')",
        "'actor_rollout_ref.actor.kl_loss_type' (verl's name; in rlfabric it is 'grpo.kl_estimator': low_var_kl is k3",
        "'actor_rollout_ref.actor.loss_agg_mode' (verl's name; in rlfabric it is 'grpo.loss_aggregation'",
        "'algorithm.adv_estimator' (verl's name; in rlfabric it is 'grpo.advantage': grpo, rloo, reinforce_pp",
        "'algorithm.filter_groups' (verl's name; in rlfabric it is 'grpo.dynamic_sampling: true'",  # a section: once
        "'trainer.save_freq' (verl's name; rlfabric's is 'training.checkpoint_every')",
        "'trainer.logger', ",
        "'critic' (verl's name; in rlfabric GRPO-family runs have no critic",
    ):
        assert hint in message, hint
    assert message.count("docs/migrating.md") == 1 and "filter_groups.enable" not in message
    assert "; other libraries' names: see docs/migrating.md; allowed here: algo, model, " in message


def test_trl_names_and_spelling_hints_still_work_beside_verl_names():
    message = _error({"num_generations": 4, "grpo": {"lrr": 1.0}, "custom_reward_function": {"path": "r.py"}})
    assert "'num_generations' (TRL's name; rlfabric's is 'grpo.group_size')" in message
    assert "'grpo.lrr' (did you mean 'grpo.lr'?)" in message
    assert "'custom_reward_function.path' (verl's name; in rlfabric it is 'rewards.functions: [{name: " in message
    assert _error({"foo": {"a": 1}}).startswith("unknown config key 'foo'; allowed here: algo, ")  # no rows under it


# -- a GRPO run on verl's data and reward -----------------------------------------------------------------------


def write_verl_parquet(
    path: Path, pairs: list[tuple[int, int]], split: str, sources: tuple[str, ...] = ("sums",)
) -> str:
    """verl's preprocessed parquet: chat-message prompts, the ground truth in the reward_model struct; rows take
    their ``data_source`` from ``sources`` in turn."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": sources[i % len(sources)],
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i},
        }
        for i, (a, b) in enumerate(pairs)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_grpo_trains_on_a_verl_parquet_with_a_verl_reward_unchanged(tmp_path):
    pairs = [(a, b) for a in range(6) for b in range(6)]
    train = write_verl_parquet(tmp_path / "train.parquet", pairs[:32], "train")
    heldout = write_verl_parquet(tmp_path / "test.parquet", pairs[32:], "test", sources=("sums", "more_sums"))
    run = run_grpo(
        tmp_path / "run",
        data={"train": train, "eval": heldout, "num_train": None, "num_eval": None},
        model={"path": "builtin", "builtin": {**TINY, "max_positions": 128}},
        rewards={"functions": [{"name": "verl_style_rewards:compute_score"}]},
        training={"total_steps": 2, "eval_every": 2},
    )
    assert run.summary["steps"] == 2
    samples = [json.loads(line) for line in (run.run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["metadata"]["reward_model"]["ground_truth"] for s in samples)
    assert all(set(s["components"]) == {"score", "correct"} for s in samples if not s["error"]), samples
    # the reward is "score" alone, never score + bonus (5, dropped) or + acc (as "correct", weight 0)
    rows = run.phase("grpo")
    assert len(rows) == 2
    for row in rows:
        assert row["reward_mean"] == pytest.approx(row["reward_score"], abs=1e-6), row
        assert "reward_correct" in row and "reward_bonus" not in row, row
    # verl's data_source column: each evaluation's accuracy per source too, 2 held-out rows each
    evals = run.phase("eval")
    assert evals
    for row in evals:
        per_source = [row["eval_accuracy/sums"], row["eval_accuracy/more_sums"]]
        assert sum(per_source) / 2 == pytest.approx(row["eval_accuracy"]), row
        assert all(accuracy in (0.0, 0.5, 1.0) for accuracy in per_source), row


def test_verl_rows_without_a_ground_truth_are_one_line_before_ray(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml
    from grpo_runs import setup_error

    rows = [
        {"data_source": "sums", "prompt": f"{i}+1=", "reward_model": {"style": "rule"}, "answer": str(i + 1)}
        for i in range(40)
    ]
    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train)
    cfg = {
        "algo": "grpo",
        "model": {"path": "builtin", "builtin": dict(TINY)},
        "data": {"train": str(train), "num_train": 30, "num_eval": 10},
        "rewards": {"functions": [{"name": "verl_style_rewards:compute_score"}]},
        "training": {"total_steps": 1},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    message = setup_error(tmp_path, tmp_path / "config.yaml")
    assert message == (
        f"rewards.functions[0] = 'verl_style_rewards:compute_score' is not valid for data.train = {str(train)!r}: "
        "no ground truth: a verl reward reads metadata['reward_model']['ground_truth'] or metadata['ground_truth'], "
        "and the row has neither (its columns: data_source, reward_model, answer)"
    )
