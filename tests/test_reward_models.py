"""Reward models: trained from preference pairs (a run's first stage, or ``rlfabric train-rm`` alone), served by
the reward service with their heads as components (some heads kept, ensembles), batched across groups, checked
before any actor starts, and a model-backed reward worker killed mid-scoring survived."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from grpo_runs import run_grpo

from rlfabric.actors.reward_service import RewardServiceCore
from rlfabric.cli import main
from rlfabric.config import ConfigError
from rlfabric.data import load_prompts
from rlfabric.llm_driver import GRPOTrainer
from rlfabric.reward_pool import RewardPool
from rlfabric.rewards import RewardInput, pointwise, register_reward, resolve_reward


@pytest.fixture(scope="module")
def trained(rm_example_run) -> tuple[Path, list[dict]]:
    """The reward model examples/rm_grpo.yaml trains from arithmetic pairs in its first stage (conftest.py), the
    same stage ``rlfabric train-rm`` runs alone: (the model folder, the run's rows of that stage)."""
    run_dir, _ = rm_example_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir / "reward_model", [r for r in rows if r.get("phase", "").startswith("rm")]


def inputs_of(rows: list[dict], completions: list[str]) -> list[RewardInput]:
    return [
        RewardInput(r["prompt"], c, {"answer": r["answer"]}, "stop", len(c))
        for r, c in zip(rows, completions, strict=True)
    ]


def direct_scores(folder: Path, texts: list[str]) -> np.ndarray:
    """Each text alone through transformers (no batching, no padding): [N, heads]."""
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    with torch.no_grad():
        return np.stack(
            [
                model(input_ids=torch.tensor([tokenizer(t, add_special_tokens=False).input_ids])).logits[0].numpy()
                for t in texts
            ]
        )


def test_a_reward_model_trained_from_pairs_ranks_held_out_pairs_well_above_chance(trained):
    folder, rows = trained
    assert (folder / "config.json").is_file() and not (folder / "backbone").exists()
    assert json.loads((folder / "config.json").read_text())["id2label"] == {"0": "answer", "1": "brevity"}
    ranking = [r for r in rows if r["phase"] == "rm_eval"]
    assert ranking[0]["rm_eval_accuracy_answer"] < 0.7  # an untrained score layer: about chance
    assert ranking[-1]["rm_eval_accuracy_answer"] >= 0.75  # right answer over a near miss, on new prompts
    assert ranking[-1]["rm_eval_accuracy_brevity"] >= 0.9
    assert sum(r["phase"] == "rm_lm" for r in rows) == 1000 and sum(r["phase"] == "rm" for r in rows) == 300


def test_the_service_serves_the_kept_heads_batched_across_groups_as_a_direct_forward_scores(trained):
    folder, _ = trained
    rows = load_prompts("task:arithmetic?max_operand=49&ops=+", num_rows=6, seed=11)
    completions = [r["answer"] for r in rows[:3]] + [
        str(int(r["answer"]) + 1) + "x" * k for k, r in enumerate(rows[3:])
    ]
    samples = inputs_of(rows, completions)
    service = RewardServiceCore([{"name": "reward_model", "kwargs": {"path": str(folder), "heads": ["answer"]}}], 30.0)
    results = service.score([samples[:2], samples[2:5], samples[5:]])
    assert [len(g) for g in results] == [2, 3, 1]
    got = np.array([r.components["answer"] for g in results for r in g])
    assert all(set(r.components) == {"answer"} for g in results for r in g)  # the brevity head is dropped
    expected = direct_scores(folder, [s.prompt + s.completion for s in samples])[:, 0]
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_an_ensemble_gives_the_mean_the_min_and_the_disagreement_of_its_members(trained, tmp_path):
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    folder, _ = trained
    doubled = AutoModelForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        doubled.score.weight.mul_(2.0)  # a member whose every score is twice the first's (the score layer has no bias)
    doubled.save_pretrained(tmp_path / "doubled")
    PreTrainedTokenizerFast.from_pretrained(folder).save_pretrained(tmp_path / "doubled")
    rows = load_prompts("task:arithmetic?max_operand=49&ops=+", num_rows=4, seed=12)
    samples = inputs_of(rows, [r["answer"] for r in rows])
    spec = {"name": "reward_model", "kwargs": {"path": [str(folder), str(tmp_path / "doubled")], "heads": ["brevity"]}}
    results = RewardServiceCore([spec], 30.0).score([samples])[0]
    single = direct_scores(folder, [s.prompt + s.completion for s in samples])[:, 1]
    # members s and 2s: mean 1.5 s, min min(s, 2s), population std |2s - s| / 2
    np.testing.assert_allclose([r.components["brevity"] for r in results], 1.5 * single, atol=1e-4)
    np.testing.assert_allclose(
        [r.components["brevity_min"] for r in results], np.minimum(single, 2 * single), atol=1e-4
    )
    np.testing.assert_allclose([r.components["brevity_disagreement"] for r in results], np.abs(single) / 2, atol=1e-4)


def test_a_bad_reward_model_spec_is_one_config_error_on_the_driver(trained, tmp_path):
    folder, _ = trained
    with pytest.raises(
        ConfigError, match=r"rewards.functions\[0\].kwargs: reward 'reward_model': path = .* no reward model"
    ):
        resolve_reward({"name": "reward_model", "kwargs": {"path": str(tmp_path / "nowhere")}}, "rewards.functions[0]")
    with pytest.raises(
        ConfigError, match=r"heads = \['helpful'\]: \['helpful'\] not among the model's heads \['answer', 'brevity'\]"
    ):
        resolve_reward({"name": "reward_model", "kwargs": {"path": str(folder), "heads": ["helpful"]}})
    with pytest.raises(ConfigError, match="or set reward_model.pairs to train one in this run"):
        resolve_reward({"name": "reward_model"})


CALLS: list[int] = []


@pointwise
def counted(inputs: list[RewardInput]) -> list[dict[str, float]]:
    CALLS.append(len(inputs))
    if any(s.completion == "boom" for s in inputs):
        raise RuntimeError("boom")
    return [{"len": float(len(s.completion))} for s in inputs]


def per_group(inputs: list[RewardInput]) -> list[dict[str, float]]:
    return [{"size": float(len(inputs))} for _ in inputs]


register_reward("counted", counted)
register_reward("per_group", per_group)


def test_pointwise_rewards_run_once_per_call_across_groups_and_a_failure_fails_every_group():
    groups = [inputs_of([{"prompt": "p", "answer": ""}] * n, ["ab"] * n) for n in (2, 3, 1)]
    CALLS.clear()
    results = RewardServiceCore(["counted", "per_group"], 5.0).score(groups)
    assert CALLS == [6]
    assert [[r.components for r in g] for g in results] == [
        [{"len": 2.0, "size": 2.0}] * 2,
        [{"len": 2.0, "size": 3.0}] * 3,
        [{"len": 2.0, "size": 1.0}],
    ]
    groups[1][0].completion = "boom"
    results = RewardServiceCore(["counted", "per_group"], 5.0).score(groups)
    assert all(r.error == "counted: RuntimeError: boom" for g in results for r in g)


def test_a_killed_model_backed_reward_worker_is_replaced_and_its_groups_scored_again(trained, local_ray):
    folder, _ = trained
    spec = {"name": "reward_model", "kwargs": {"path": str(folder), "heads": ["answer"]}}
    pool = RewardPool([spec], num_workers=1, timeout_s=60.0, num_cpus_per_worker=0.5, grace_s=30.0)
    rows = load_prompts("task:arithmetic?max_operand=49&ops=+", num_rows=4, seed=13)
    groups = [inputs_of(rows[:2], ["1", "2"]), inputs_of(rows[2:], ["3", "4"])]
    try:
        first = pool.score(groups)
        assert all(r.error is None for g in first for r in g)
        victim = pool.pids()[0]
        os.kill(victim, signal.SIGKILL)
        again = pool.score(groups)  # the call to the dead worker, sent again to its replacement (which loads the model)
        assert pool.worker_restarts == 1 and victim not in pool.pids()
        assert [[r.components for r in g] for g in again] == [[r.components for r in g] for g in first]
    finally:
        pool.shutdown()


def test_a_reward_model_scores_a_text_envs_episodes_beside_the_envs_components(trained, local_ray, tmp_path):
    """A model-backed reward service on multi-turn episodes: each episode (opening, turns and replies) is one
    sample of its group, the model's head a component beside the env's correct and invalid."""
    folder, _ = trained
    run = run_grpo(
        tmp_path / "run",
        model={"builtin": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "max_positions": 256}},
        data={"train": "task:guess_number?min_high=4&max_high=10", "num_train": 16, "num_eval": 6},
        env={"id": "rlfabric/GuessNumber-v0", "max_turns": 3, "step_timeout_s": 5.0},
        rewards={
            "functions": [{"name": "reward_model", "kwargs": {"path": str(folder), "heads": ["answer"]}}],
            "weights": {"invalid": -0.5, "answer": 0.1},
        },
        sampling={"max_new_tokens": 4},
        training={"total_steps": 2},
    )
    steps = run.phase("grpo")
    assert len(steps) == 2 and all(r["failed_samples"] == 0 for r in steps)
    assert all(np.isfinite(r["reward_answer"]) and r["reward_answer"] != 0.0 for r in steps)


def test_a_grpo_run_trains_its_reward_model_first_scores_with_it_and_keeps_it_on_resume(tmp_path, local_ray):
    run_dir = tmp_path / "run"
    run = run_grpo(
        run_dir,
        rewards={"functions": [{"name": "arithmetic"}, {"name": "reward_model"}], "weights": {"correct": 0.0}},
        reward_model={
            "pairs": "task:arithmetic_pairs?max_operand=9",
            "num_pairs": 40,
            "num_eval": 20,
            "heads": ["answer"],
            "lm_steps": 4,
            "steps": 3,
            "eval_every": 3,
        },
        training={"total_steps": 2, "checkpoint_every": 1},
    )
    folder = run_dir / "reward_model"
    assert json.loads((folder / "config.json").read_text())["id2label"] == {"0": "answer"}
    assert [len(run.phase(p)) for p in ("rm_lm", "rm", "rm_eval")] == [4, 3, 2]
    assert all("reward_answer" in r for r in run.phase("grpo"))  # the reward model's head, a component
    trained_at = (folder / "model.safetensors").stat().st_mtime_ns
    trainer = GRPOTrainer.from_run_dir(run_dir, ["training.total_steps=3"], quiet=True)
    try:
        trainer.train()
    finally:
        trainer.close()
    assert (folder / "model.safetensors").stat().st_mtime_ns == trained_at  # kept, not trained again
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("phase") == "rm" for r in rows) == 3 and max(r["step"] for r in rows) == 3


def test_train_rm_refuses_a_config_without_pairs_in_one_line(tmp_path, capsys):
    assert main(["train-rm", "--run-dir", str(tmp_path / "rm"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [  # the one line: no "training ... on" before it
        "rlfabric: config error: reward_model.pairs = '' is not valid for train-rm: name the preference pairs to "
        "train on"
    ]


def test_train_rm_names_reward_model_num_eval_when_the_pairs_leave_too_few_held_out_prompts(tmp_path, capsys):
    config = tmp_path / "rm.yaml"  # 16 prompts in all, every one among 200 training pairs
    config.write_text(
        yaml.safe_dump({"reward_model": {"pairs": "task:arithmetic_pairs?max_operand=3", "num_pairs": 200}})
    )
    assert main(["train-rm", str(config), "--run-dir", str(tmp_path / "rm"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rlfabric: config error: reward_model.pairs = 'task:arithmetic_pairs?max_operand=3': found only 0 prompts "
        "that are not among the 16 training prompts, 200 asked for (reward_model.num_eval); ask for fewer rows or "
        "widen the task's options"
    )


def tiny_classifier(tokenizer, attention: str = "sdpa", seed: int = 0):
    """A 2 x 64 Qwen2 sequence classifier with two heads and grouped KV heads, randomly initialised."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=2,
        attn_implementation=attention,
    )
    torch.manual_seed(seed)
    return Qwen2ForSequenceClassification(config).eval()


def alone(model, tokenizer, prompts: list[str], completions: list[str], max_length: int | None = None) -> np.ndarray:
    """Each prompt + completion through the model by itself (batch of one, no padding), cut to its last
    ``max_length`` tokens: [N, heads]."""
    rows = [tokenizer(p + c, add_special_tokens=False).input_ids for p, c in zip(prompts, completions, strict=True)]
    with torch.no_grad():
        return np.stack(
            [model(input_ids=torch.tensor([row[-(max_length or len(row)) :]])).logits[0].numpy() for row in rows]
        )


def real_tokens_seen(model) -> list[int]:
    """A list that collects the non-pad tokens of every input the model's decoder runs on."""
    seen: list[int] = []
    pad = model.config.pad_token_id
    model.get_decoder().register_forward_pre_hook(
        lambda _module, args, kwargs: seen.append(
            int(((kwargs.get("input_ids", args[0] if args else None)) != pad).sum())
        ),
        with_kwargs=True,
    )
    return seen


def shared_groups(sizes: tuple[int, ...], seed: int, prompt_chars: tuple[int, int], completion_chars: tuple[int, int]):
    """(prompts, completions): one random prompt per group, ``sizes[g]`` completions behind it; groups
    interleaved (sample k of every group, then k + 1...) so no group arrives contiguous."""
    rng = np.random.default_rng(seed)
    letters = list("abcdefghij 0123456789+=")
    text = lambda bounds: "".join(rng.choice(letters, int(rng.integers(*bounds))))  # noqa: E731
    groups = [(text(prompt_chars), [text(completion_chars) for _ in range(n)]) for n in sizes]
    pairs = [(p, cs[k]) for k in range(max(sizes)) for p, cs in groups if k < len(cs)]
    return [p for p, _ in pairs], [c for _, c in pairs]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("batch_size", [64, 5])
def test_completions_behind_a_shared_prompt_score_as_prompt_plus_completion_alone(attention, batch_size):
    from rlfabric.models.hf import build_char_tokenizer
    from rlfabric.rewards.reward_model import score_samples

    tokenizer = build_char_tokenizer()
    model = tiny_classifier(tokenizer, attention)
    # groups of 1 (nothing to share), 3, 8 and 5; prompts of 30-60 characters, completions of 1-40
    prompts, completions = shared_groups((1, 3, 8, 5), seed=3, prompt_chars=(30, 60), completion_chars=(1, 40))
    seen = real_tokens_seen(model)
    got = score_samples(model, tokenizer, prompts, completions, batch_size, None)
    ran = sum(seen)
    np.testing.assert_allclose(got, alone(model, tokenizer, prompts, completions), atol=1e-4)
    every_text = sum(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))  # one token per character
    assert ran < every_text  # some prompts ran once for several completions


def test_one_group_runs_its_prompt_once():
    from rlfabric.models.hf import build_char_tokenizer
    from rlfabric.rewards.reward_model import score_samples

    tokenizer = build_char_tokenizer()
    model = tiny_classifier(tokenizer)
    prompts, completions = shared_groups((8,), seed=4, prompt_chars=(40, 41), completion_chars=(1, 12))
    seen = real_tokens_seen(model)
    got = score_samples(model, tokenizer, prompts, completions, 64, None)
    ran = list(seen)
    np.testing.assert_allclose(got, alone(model, tokenizer, prompts, completions), atol=1e-4)
    assert ran == [40 + sum(len(c) for c in completions)]  # one forward: the prompt once, then each completion


def merging_tokenizer():
    """A BPE tokenizer over a few characters with one merge, a + b -> ab: a prompt ending in a and a completion
    starting with b tokenize apart differently than together."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", *"abxyz =+0123", "ab"])}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")])), pad_token="<pad>"
    )


def test_samples_that_cannot_share_their_prompt_score_alone_and_still_right():
    from rlfabric.rewards.reward_model import score_samples

    tokenizer = merging_tokenizer()
    model = tiny_classifier(tokenizer)
    prompt, other = "xyz = 12 + 30 " * 3 + "a", "zz yy xx 0 = 1 + 2 " * 2
    completions = [
        "b",  # merges with the prompt's last a: tokens differ apart and together
        "bxy",  # merges too
        "xyz",
        "=2+3 ab",
        "",  # empty: the score is the prompt's last token's
        "yyy",
    ]
    prompts = [prompt] * len(completions) + [other] * 3
    completions = completions + ["0", "a" * 30, "zz"]  # with max_length 60, the second is cut at its start
    seen = real_tokens_seen(model)
    every_text = sum(len(tokenizer(p + c).input_ids) for p, c in zip(prompts, completions, strict=True))
    for max_length in (None, 60):
        got = score_samples(model, tokenizer, prompts, completions, 64, max_length)
        ran = sum(seen)
        seen.clear()
        np.testing.assert_allclose(got, alone(model, tokenizer, prompts, completions, max_length), atol=1e-4)
        seen.clear()
        assert ran < every_text  # the samples that could share did


def test_the_service_scores_each_groups_completions_behind_one_prompt(tmp_path):
    from rlfabric.models.hf import build_char_tokenizer, save_pretrained

    tokenizer = build_char_tokenizer()
    model = tiny_classifier(tokenizer)
    save_pretrained(model, tokenizer, tmp_path / "rm")
    prompts, completions = shared_groups((4, 4, 2), seed=5, prompt_chars=(50, 80), completion_chars=(1, 20))
    samples = [RewardInput(p, c, {}, "stop", len(c)) for p, c in zip(prompts, completions, strict=True)]
    spec = {"name": "reward_model", "kwargs": {"path": str(tmp_path / "rm"), "heads": ["LABEL_1"]}}
    results = RewardServiceCore([spec], 30.0).score([samples[:5], samples[5:]])
    got = [r.components["LABEL_1"] for g in results for r in g]
    expected = alone(model, tokenizer, prompts, completions)
    np.testing.assert_allclose(got, expected[:, 1], atol=1e-4)


def test_a_reward_model_stage_cut_short_leaves_no_folder_a_resumed_run_would_take(tmp_path):
    from rlfabric.config import config_from_dict
    from rlfabric.reward_model_stage import REWARD_MODEL_DIR, ensure_reward_model, policy_tokenizer

    cfg = config_from_dict(
        {
            "model": {"path": "builtin", "builtin": {"num_layers": 1, "hidden_size": 32}},
            "reward_model": {
                "pairs": "task:arithmetic_pairs?max_operand=9",
                "num_pairs": 40,
                "num_eval": 20,
                "heads": ["answer"],
                "lm_steps": 2,
                "steps": 3,
                "eval_every": 3,
            },
        }
    )

    def stop_at_the_first_ranking_step(row: dict) -> None:
        if row["phase"] == "rm":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ensure_reward_model(cfg, tmp_path, policy_tokenizer(cfg), stop_at_the_first_ranking_step)
    assert not (tmp_path / REWARD_MODEL_DIR).exists()
    folder = ensure_reward_model(cfg, tmp_path, policy_tokenizer(cfg), lambda row: None)  # trained again, whole
    assert (folder / "model.safetensors").is_file() and not (tmp_path / "reward_model.partial").exists()
