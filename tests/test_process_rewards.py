"""Process rewards: completions cut into steps whose token spans are exact, per-step scores from functions and a
process reward model landing on those spans, and advantages from per-step rewards (outcome on the answer span,
process on the reasoning spans) checked against hand-computed numbers, and a short GRPO run whose config carries the
process settings to the rollout worker and the learner.

The step functions live in this test file, which the reward actors cannot import: they arrive through the
registry snapshot.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import ray
import torch

from rlfabric.actors.reward_service import RewardServiceCore
from rlfabric.config import ConfigError, load_config
from rlfabric.models.llm_batch import grpo_batch
from rlfabric.rewards import RewardInput, Unscored, pointwise, process_reward, register_reward, snapshot
from rlfabric.rewards.process import split_completion, step_starts
from rlfabric.trajectory import from_token_sequences

# -- steps and their token spans ---------------------------------------------------------------------------------

# A hand-built vocabulary with multi-character tokens: token 4 holds the end of one step ("\n\n") and the start of
# the next ("The"); token 8 decodes to nothing (an end-of-sequence token, skipped like a special token).
VOCAB = ["12", "+", "3", "=15", "\n\nThe", " sum", "\n\n", "ok", "", "\n", "<step>", "a", "b"]


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids)


def split(ids: list[int], how: str) -> tuple[list[str], list[int]]:
    return split_completion(ids, decode(ids), decode, how)


def test_a_boundary_inside_a_token_gives_the_token_to_the_step_that_starts_in_it():
    # "12+3=15\n\nThe sum\n\nok<eos>": steps "12+3=15\n\n" | "The sum\n\n" | "ok"
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    texts, ends = split(ids, "blank_line")
    assert texts == ["12+3=15\n\n", "The sum\n\n", "ok"]
    # token 4 ("\n\nThe") holds the first step's last characters and the second's first: it starts the second;
    # token 6 ("\n\n") ends the second step exactly; the empty end-of-sequence token 8 stays with the last step
    assert ends == [4, 7, 9]


def test_a_response_without_a_marker_is_one_step_and_an_empty_one_too():
    assert split([0, 1, 2, 3, 8], "blank_line") == (["12+3=15"], [5])
    assert split([0, 1, 2, 3], "none") == (["12+3=15"], [4])
    assert split([], "newline") == ([""], [0])
    assert split([6, 6], "blank_line") == (["\n\n\n\n"], [2])  # only markers: one step, nothing to cut


def test_empty_steps_join_the_next_step_and_a_trailing_one_the_step_before():
    # leading blank lines join the first step; the marker run at the end stays with the last step
    assert split([6, 7, 6, 0, 6], "blank_line") == (["\n\nok\n\n", "12\n\n"], [3, 5])
    # a step of only a tag joins the step after it
    assert split([10, 11, 10, 10, 12], "tag:<step>") == (["<step>a", "<step><step>b"], [2, 5])
    assert split([11, 10, 12], "tag:<step>") == (["a", "<step>b"], [1, 3])
    assert split([11, 10, 12, 10], "end_tag:<step>") == (["a<step>", "b<step>"], [2, 4])
    # newline: a run of line breaks ends one step
    assert split([7, 9, 9, 0, 9, 2], "newline") == (["ok\n\n", "12\n", "3"], [3, 5, 6])


def test_a_step_that_lies_inside_one_token_joins_the_next_step():
    # "a\nb\nc" with "b\nc" in one token: the step "b\n" has no token of its own (the step "c" starts in it)
    vocab = ["a\n", "b\nc"]
    dec = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    assert split_completion([0, 1], "a\nb\nc", dec, "newline") == (["a\n", "b\nc"], [1, 2])
    assert step_starts("a\nb\nc", "newline") == [2, 4]  # two boundaries in the text, one between tokens


def test_tokens_that_end_inside_a_multibyte_character_cover_none_of_it_yet():
    # byte-level tokens: "é" is two bytes in two tokens; decoding half of it gives a replacement character
    pieces = [b"x", b"\n", b"\xc3", b"\xa9", b"y", b"\n", b"z"]

    def byte_decode(ids) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    ids = list(range(len(pieces)))
    text = byte_decode(ids)
    assert text == "x\n\u00e9y\nz"
    assert split_completion(ids, text, byte_decode, "newline") == (["x\n", "\u00e9y\n", "z"], [2, 6, 7])
    # a boundary right after the two-byte character lies in the token that completes it
    assert split_completion(ids, text, byte_decode, "tag:y") == (["x\n\u00e9", "y\nz"], [4, 7])


def test_per_step_scores_land_on_the_step_spans_and_the_outcome_on_the_answer_span():
    record = from_token_sequences(
        [[1, 2], [3]],
        [[10, 11, 12, 13, 14], [20, 21]],
        [[-0.1] * 5, [-0.2] * 2],
        [[4] * 5, [5] * 2],
        episode_ids=[7, 8],
        group_ids=[0, 0],
        final_rewards={"correct": [1.0, 0.0]},
        truncated=[False, True],
        step_ends=[[2, 4, 5], [2]],
        step_rewards=[[{"p": 0.5}, {"p": -1.0}, {"p": 2.0}], [{"p": 3.0}]],
    )
    # record positions: row 0's prompt has 2 tokens, row 1's one
    assert record.step_spans.tolist() == [[0, 2, 4], [0, 4, 6], [0, 6, 7], [1, 1, 3]]
    assert record.step_rewards["p"].tolist() == [0.5, -1.0, 2.0, 3.0]
    assert record.step_rewards["correct"].tolist() == [0.0, 0.0, 1.0, 0.0]  # the outcome on each answer span
    assert record.final_rewards == {"correct": pytest.approx(np.array([1.0, 0.0]))}  # outcome only
    assert record.loss_mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert record.tokens[0, 2:7].tolist() == [10, 11, 12, 13, 14]
    with pytest.raises(ValueError, match=r"step_ends\[0\] = \[1\]: must ascend to the response length 2"):
        from_token_sequences(
            [[1]], [[10, 11]], [[0.0, 0.0]], [[0, 0]], episode_ids=[0], group_ids=[0], final_rewards={},
            truncated=[False], step_ends=[[1]],
        )  # fmt: skip


def test_dynamic_sampling_keeps_a_group_whose_steps_get_advantages_though_its_outcomes_are_equal():
    """One step per row, so each step's reward is its process score plus the outcome. Both groups' outcomes are
    equal: outcome rewards alone give neither any signal. With step credit, group 5's steps score 1 + 1 and 0 + 1,
    so its steps get advantages; group 6's score 0.5 + 0 twice, so they get none."""
    from rlfabric.actors.rollout_meta import group_statistics, step_credit_signal

    record = from_token_sequences(
        [[1], [1], [2], [2]],
        [[10, 11], [12, 13], [14, 15], [16, 17]],
        [[0.0, 0.0]] * 4,
        [[0, 0]] * 4,
        episode_ids=[0, 1, 2, 3],
        group_ids=[5, 5, 6, 6],
        final_rewards={"correct": [1.0, 1.0, 0.0, 0.0]},
        truncated=[False] * 4,
        step_ends=[[2]] * 4,
        step_rewards=[[{"p": 1.0}], [{"p": 0.0}], [{"p": 0.5}], [{"p": 0.5}]],
    )
    outcome = np.array([1.0, 1.0, 0.0, 0.0], np.float32)
    spec = {
        "reward_weights": {},
        "step_credit": "step_mix",
        "advantage": "grpo",
        "step_credit_weight": 1.0,
        "step_gamma": 0.95,
        "scale_by_std": True,
        "process": None,
    }
    signal_column = 2

    def signal(step_signal):
        stats = group_statistics(record.group_id, outcome, np.zeros(4, np.int64), [5, 6], step_signal)
        return stats[:, signal_column].tolist()

    assert step_credit_signal(record, outcome, spec).tolist() == [True, True, False, False]
    assert signal(step_credit_signal(record, outcome, spec)) == [1.0, 0.0]
    assert signal(None) == [0.0, 0.0]  # without step credit: the outcomes alone
    assert signal(step_credit_signal(record, outcome, {**spec, "reward_weights": {"p": 0.0}})) == [0.0, 0.0]


# -- the reward service: process rewards beside outcome rewards --------------------------------------------------


@process_reward
def step_lengths(inputs: list[RewardInput]) -> list:
    """Per step its length in characters; the group tagged "short" gets one dict too few for its first sample,
    "word" a string for a step, "nan" a NaN, "unscored" an Unscored first sample."""
    tag = inputs[0].metadata.get("tag")
    out: list = [[{"chars": float(len(step))} for step in sample.steps] for sample in inputs]
    if tag == "short":
        out[0] = out[0][1:]
    elif tag == "word":
        out[0][0] = "long"
    elif tag == "nan":
        out[0][0] = {"chars": math.nan}
    elif tag == "unscored":
        out[0] = Unscored("cannot read it")
    return out


def ends_in_digit(inputs: list[RewardInput]) -> list[dict[str, float]]:
    return [{"digit": float(s.completion[-1:].isdigit())} for s in inputs]


@pointwise
@process_reward
def named_like_the_outcome(inputs: list[RewardInput]) -> list:
    return [[{"digit": 0.0} for _ in s.step_texts()] for s in inputs]


register_reward("step_lengths", step_lengths)
register_reward("ends_in_digit", ends_in_digit)
register_reward("named_like_the_outcome", named_like_the_outcome)


def sample(completion: str, steps: list[str] | None, tag: str = "") -> RewardInput:
    return RewardInput("q:", completion, {"tag": tag}, "stop", len(completion), steps=steps)


def test_the_service_gives_per_step_components_beside_the_outcome_ones():
    service = RewardServiceCore(["step_lengths", "ends_in_digit"], 5.0)
    (results,) = service.score([[sample("ab\nc1", ["ab\n", "c1"]), sample("xyz", None)]])
    assert [r.error for r in results] == [None, None]
    assert results[0].components == {"digit": 1.0}
    assert results[0].step_components == [{"chars": 3.0}, {"chars": 2.0}]
    assert results[1].step_components == [{"chars": 3.0}]  # no steps given: the whole completion is one
    (plain,) = RewardServiceCore(["ends_in_digit"], 5.0).score([[sample("a1", None)]])
    assert plain[0].step_components is None  # outcome rewards alone: nothing per step, as before


@pytest.mark.parametrize(
    ("tag", "error"),
    [
        ("short", "step_lengths: sample 0 got 1 dicts, expected a list of 2 dicts (one per step)"),
        ("word", "step_lengths: sample 0 step 0 got a str, expected a dict"),
        ("nan", "step_lengths: component 'chars' is nan, expected a finite number"),
    ],
)
def test_malformed_per_step_output_fails_its_group_only(tag, error):
    service = RewardServiceCore(["step_lengths", "ends_in_digit"], 5.0)
    good, bad = service.score([[sample("ab\nc1", ["ab\n", "c1"])] * 2, [sample("ab\nc1", ["ab\n", "c1"], tag)] * 2])
    assert [r.error for r in good] == [None, None]
    assert [r.error for r in bad] == [error, error] and all(not r.components for r in bad)


def test_an_unscored_sample_fails_alone_and_a_clash_with_an_outcome_component_fails_the_group():
    service = RewardServiceCore(["step_lengths"], 5.0)
    (results,) = service.score([[sample("ab", ["ab"], "unscored"), sample("cd", ["cd"], "unscored")]])
    assert [r.error for r in results] == ["step_lengths: cannot read it", None]
    clash = RewardServiceCore(["named_like_the_outcome", "ends_in_digit"], 5.0).score([[sample("a1", None)]])
    assert clash[0][0].error == "component 'digit' comes from a pointwise and a per-group reward"


def test_arithmetic_steps_checks_each_equation():
    from rlfabric.rewards.process import arithmetic_steps

    steps = ["12+35=47\n", "47+7=55\n", "(2+3)*4=20", "so 20", "=5", "3-5=-2"]
    got = arithmetic_steps([sample("".join(steps), steps)])
    assert [s["step_correct"] for s in got[0]] == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


# -- a process reward model served like the reward model ---------------------------------------------------------


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    """A tiny sequence-classification model with two heads over the character tokenizer, saved as a folder."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rlfabric.models.hf import build_char_tokenizer, save_pretrained

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, num_labels=2, id2label={0: "step_ok", 1: "other"},
        label2id={"step_ok": 0, "other": 1}, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return save_pretrained(Qwen2ForSequenceClassification(config).eval(), tokenizer, tmp_path_factory.mktemp("prm"))


def direct_forward(folder, texts: list[str]) -> np.ndarray:
    """Each text alone through transformers (no batch, no padding): [N, heads]."""
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    with torch.no_grad():
        rows = [torch.tensor([tokenizer(t, add_special_tokens=False).input_ids]) for t in texts]
        return np.stack([model(input_ids=row).logits[0].numpy() for row in rows])


def test_a_process_reward_model_scores_each_step_prefix_as_a_direct_forward_does(prm_dir):
    groups = [
        [sample("1+2=3\n3+4=7", ["1+2=3\n", "3+4=7"]), sample("9", None)],
        [sample("5\n\n6\n7", ["5\n\n", "6\n", "7"])],
    ]
    spec = {"name": "process_reward_model", "kwargs": {"path": str(prm_dir), "heads": ["step_ok"], "batch_size": 2}}
    results = RewardServiceCore([spec, "ends_in_digit"], 30.0).score(groups)
    prefixes = ["q:1+2=3\n", "q:1+2=3\n3+4=7", "q:9", "q:5\n\n", "q:5\n\n6\n", "q:5\n\n6\n7"]
    expected = direct_forward(prm_dir, prefixes)[:, 0]
    got = [step["step_ok"] for group in results for r in group for step in r.step_components]
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert [len(r.step_components) for group in results for r in group] == [2, 1, 3]
    assert all(r.components.keys() == {"digit"} for group in results for r in group)  # the outcome beside it


def positions_run(model) -> list[int]:
    """A counter of the token positions the model's base runs over (padding included), from now on."""
    ran = [0]
    base = getattr(model, model.base_model_prefix)
    base.register_forward_pre_hook(
        lambda _m, _a, kw: ran.__setitem__(0, ran[0] + kw["input_ids"].numel()), with_kwargs=True
    )
    return ran


def test_every_prefix_score_comes_from_one_forward_over_the_whole_text(prm_dir):
    from rlfabric.rewards.prefix_scores import score_step_prefixes
    from rlfabric.rewards.reward_model import load_reward_model

    model, tokenizer, _ = load_reward_model(str(prm_dir))
    shared = "q: what are 1+2, 3+4 and 7+1? "  # four samples behind it (a GRPO group), two alone
    prompts = [shared] * 4 + ["q: 2+2? ", "q: add 5 and 6 "]
    steps = [
        ["1+2=3\n", "3+4=7\n", "7+1=8"],
        ["1+2=4\n", "3+4=7\n", "7+1=8"],
        ["1+2=3\n", "3+4=6\n\n", "7+1=9"],
        ["12\n", "7", "\n8"],
        ["2+2=4"],
        ["5+6=11\n", "11"],
    ]
    ran = positions_run(model)
    got = score_step_prefixes(model, tokenizer, prompts, steps, batch_size=8, max_length=None)
    prefixes = [p + "".join(s[: k + 1]) for p, s in zip(prompts, steps, strict=True) for k in range(len(s))]
    np.testing.assert_allclose(np.concatenate(got), direct_forward(prm_dir, prefixes), atol=1e-4)
    assert [len(g) for g in got] == [3, 3, 3, 3, 1, 2]
    # each whole text once at most (the shared prompt once for its group): fewer than the prefixes one by one
    wholes = [len(p) + len("".join(s)) for p, s in zip(prompts, steps, strict=True)]
    assert ran[0] < sum(wholes) < sum(len(t) for t in prefixes)


def test_a_rope_that_rescales_with_the_length_scores_each_prefix_alone():
    """Dynamic RoPE rotates a prefix inside a longer text otherwise than alone: no reading off one forward."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rlfabric.rewards.prefix_scores import reads_prefixes_off_one_forward

    def model(rope: dict) -> Qwen2ForSequenceClassification:
        config = Qwen2Config(
            vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=64, num_labels=1, pad_token_id=0,
            rope_parameters={"rope_theta": 10000.0, **rope},
        )  # fmt: skip
        return Qwen2ForSequenceClassification(config)

    assert reads_prefixes_off_one_forward(model({"rope_type": "default"}))
    assert not reads_prefixes_off_one_forward(model({"rope_type": "dynamic", "factor": 2.0}))


def test_a_tokenizer_that_merges_across_a_step_end_gets_each_prefix_scored_alone(tmp_path):
    """ "\n7" is one token: the whole text's tokens do not start with the first prefix's ("...\n" ends it), so
    that sample's prefixes are scored as texts of their own; the other sample still takes one forward."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForSequenceClassification

    from rlfabric.models.hf import save_pretrained
    from rlfabric.rewards.prefix_scores import score_step_prefixes
    from rlfabric.rewards.reward_model import load_reward_model

    chars = ["<pad>", "<eos>", *"q: 0123456789+=\n"]
    vocab = {c: i for i, c in enumerate(chars)} | {"\n7": len(chars)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("\n", "7")]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")
    config = Qwen2Config(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(1)
    folder = save_pretrained(Qwen2ForSequenceClassification(config).eval(), tokenizer, tmp_path / "prm")
    model, loaded, _ = load_reward_model(str(folder))
    prompts, steps = ["q: 3+4 ", "q: 1+1 "], [["3+4=\n", "7"], ["1+1=\n", "2"]]
    assert loaded("q: 3+4 3+4=\n7", add_special_tokens=False).input_ids[-1] == vocab["\n7"]
    ran = positions_run(model)
    got = score_step_prefixes(model, loaded, prompts, steps, batch_size=8, max_length=None)
    prefixes = [p + "".join(s[: k + 1]) for p, s in zip(prompts, steps, strict=True) for k in range(len(s))]
    np.testing.assert_allclose(np.concatenate(got), direct_forward(folder, prefixes), atol=1e-4)
    # the merged sample's two prefixes as texts of their own, behind one copy of their prompt (7 + 5 + 5 tokens);
    # the other sample's whole text once (13 tokens)
    assert ran[0] == 7 + 5 + 5 + 13


def test_a_process_reward_model_without_a_path_is_one_config_error():
    from rlfabric.rewards import resolve_reward

    with pytest.raises(ConfigError, match=r"rewards.functions\[0\].kwargs: reward 'process_reward_model': path:"):
        resolve_reward({"name": "process_reward_model"}, "rewards.functions[0]")


# -- the rollout worker: real generator, real reward service ------------------------------------------------------


@pointwise
@process_reward
def step_shape(inputs: list[RewardInput]) -> list:
    """Per step its length and whether it ends with a line break."""
    return [[{"chars": float(len(s)), "ends_line": float(s.endswith("\n"))} for s in x.steps] for x in inputs]


def last_char_is_digit(inputs: list[RewardInput]) -> list[dict[str, float]]:
    return [{"correct": float(s.completion[-1:].isdigit())} for s in inputs]


register_reward("step_shape", step_shape)
register_reward("last_char_is_digit", last_char_is_digit)


def test_a_rollout_puts_each_steps_scores_on_its_exact_token_span(local_ray, tmp_path):
    from rlfabric.actors.generator import Generator
    from rlfabric.actors.llm_rollout import LLMRolloutWorker, PromptSet, RolloutRequest
    from rlfabric.actors.rollout_meta import decode_meta
    from rlfabric.models.hf import build_small_model_dir, load_tokenizer

    # a small alphabet, so that line breaks are common in a random model's completions
    model_dir = build_small_model_dir(
        tmp_path / "model", alphabet="0123456789+=" + "systemuserassistant: \n", num_layers=1, hidden_size=32,
        num_heads=2, max_positions=64,
    )  # fmt: skip
    tokenizer = load_tokenizer(model_dir)
    rows = [{"prompt": p} for p in ("1+2=", "30+4=", "7=")]
    gen = Generator.options(num_cpus=0.5).remote("torch", str(model_dir), {"max_batch_size": 16, "seed": 3}, 1)
    worker = LLMRolloutWorker.options(num_cpus=0).remote(
        reward_functions=[{"name": "step_shape", "kwargs": {}}, {"name": "last_char_is_digit", "kwargs": {}}],
        reward_weights={},
        num_reward_workers=1,
        reward_timeout_s=30.0,
        reward_cpus=0.5,
        reward_registry=snapshot(),
        prompt_key="prompt",
        process={"split": "newline", "outcome_spans": "all", "process_spans": "all"},
        model_dir=str(model_dir),
    )
    try:
        ray.get(worker.set_prompts.remote("train", PromptSet(rows, [tokenizer(r["prompt"]).input_ids for r in rows])))
        request = RolloutRequest(
            "train", [0, 1, 2], 4, {"max_new_tokens": 24, "temperature": 1.0}, 0, [(0, 0, gen)], 120.0
        )
        meta_ref, record_ref = worker.rollout.remote(request)
        meta, record = decode_meta(ray.get(meta_ref, timeout=300)), ray.get(record_ref, timeout=60)
    finally:
        ray.get(worker.shutdown.remote(), timeout=60)
        ray.kill(worker, no_restart=True)
        ray.kill(gen, no_restart=True)
    assert meta["failed"] == 0 and record.num_rows == 12
    spans = record.step_spans.tolist()
    assert max(np.bincount(record.step_spans[:, 0])) > 1  # some completions have several steps
    for i in range(record.num_rows):
        mine = [(s, start, end) for s, (row, start, end) in enumerate(spans) if row == i]
        bounds = [start for _, start, _ in mine] + [mine[-1][2]]
        assert bounds[0] == record.prompt_length[i] and bounds[-1] == record.length[i]  # they tile the response
        texts = [tokenizer.decode(record.tokens[i, a:b], skip_special_tokens=True) for _, a, b in mine]
        for k, (s, _, _) in enumerate(mine):
            assert record.step_rewards["chars"][s] == len(texts[k])  # the score of the text the span holds
            assert record.step_rewards["ends_line"][s] == float(texts[k].endswith("\n"))
            last = k == len(mine) - 1
            # the outcome sits on the answer span alone
            assert record.step_rewards["correct"][s] == (record.final_rewards["correct"][i] if last else 0.0)
            if not last:  # a step ends after a run of line breaks, and has more than whitespace in it
                assert texts[k].endswith("\n") and not texts[k + 1].startswith("\n") and texts[k].strip()
    # process components are logged as the mean over rows of each row's mean over its steps
    per_row = [
        np.mean([record.step_rewards["chars"][s] for s, (r, _, _) in enumerate(spans) if r == i]) for i in range(12)
    ]
    assert meta["component_means"]["chars"] == pytest.approx(np.mean(per_row))


# -- advantages from per-step rewards, by hand ------------------------------------------------------------------


def two_row_group():
    """One group of two rows. Row 0: steps [2, 2] tokens, process p = [0, 1], outcome correct = 1; row 1: steps
    [1, 1, 1] tokens, p = [1, 0, 1], correct = 0. Step rewards r (p, plus the outcome on the answer span):
    row 0 [0, 2], row 1 [1, 0, 1]."""
    return from_token_sequences(
        [[1], [1]],
        [[5, 6, 7, 8], [5, 6, 7]],
        [[-1.0] * 4, [-1.0] * 3],
        [[0] * 4, [0] * 3],
        episode_ids=[0, 1],
        group_ids=[3, 3],
        final_rewards={"correct": [1.0, 0.0]},
        truncated=[False, False],
        step_ends=[[2, 4], [1, 2, 3]],
        step_rewards=[[{"p": 0.0}, {"p": 1.0}], [{"p": 1.0}, {"p": 0.0}, {"p": 1.0}]],
    )


# gamma = 0.5: returns G = row 0 [0 + 0.5 * 2, 2] = [1, 2]; row 1 [1 + 0.5 * 0.5, 0 + 0.5 * 1, 1] = [1.25, 0.5, 1]
# over the group's 5 steps: mean 1.15, unbiased variance 1.2 / 4 = 0.3
A_S = [(g - 1.15) / (math.sqrt(0.3) + 1e-6) for g in (1.0, 2.0, 1.25, 0.5, 1.0)]
# outcome R = [1, 0]: mean 0.5, unbiased std sqrt(0.5)
A_E = [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)]


def batch_of(process=None):
    return grpo_batch(
        [two_row_group()],
        None,
        pad_id=0,
        reward_weights={},
        advantage="grpo",
        scale_by_std=True,
        overlong_filter=False,
        step_credit="step_mix",
        step_gamma=0.5,
        process=process,
    )


def test_step_mix_on_process_and_outcome_rewards_gives_the_hand_computed_advantages():
    batch = batch_of()
    expected = [
        [A_E[0] + A_S[0], A_E[0] + A_S[0], A_E[0] + A_S[1], A_E[0] + A_S[1]],
        [A_E[1] + A_S[2], A_E[1] + A_S[3], A_E[1] + A_S[4], 0.0],
    ]
    np.testing.assert_allclose(batch["advantages"], expected, rtol=1e-5, atol=1e-6)
    assert batch["response_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]


def test_outcome_on_the_answer_span_and_process_on_the_reasoning_spans():
    batch = batch_of({"split": "newline", "outcome_spans": "answer", "process_spans": "reasoning"})
    expected = [[A_S[0], A_S[0], A_E[0], A_E[0]], [A_S[2], A_S[3], A_E[1], 0.0]]
    np.testing.assert_allclose(batch["advantages"], expected, rtol=1e-5, atol=1e-6)
    assert batch["response_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]


def test_a_span_neither_term_reaches_gets_no_loss():
    batch = batch_of({"split": "newline", "outcome_spans": "answer", "process_spans": "none"})
    np.testing.assert_allclose(batch["advantages"], [[0, 0, A_E[0], A_E[0]], [0, 0, A_E[1], 0]], rtol=1e-5, atol=1e-6)
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    only_process = batch_of({"split": "newline", "outcome_spans": "none", "process_spans": "all"})
    expected = [[A_S[0], A_S[0], A_S[1], A_S[1]], [A_S[2], A_S[3], A_S[4], 0.0]]
    np.testing.assert_allclose(only_process["advantages"], expected, rtol=1e-5, atol=1e-6)


# -- config ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rewards.process.split=lines", "grpo.step_credit=step_mix"],
            "rewards.process.split = 'lines' is not valid: must be one of none, newline, blank_line, 'tag:TEXT'",
        ),
        (
            ["rewards.process.outcome_spans=last", "grpo.step_credit=step_mix"],
            "rewards.process.outcome_spans = 'last' is not valid: must be one of all, answer, none",
        ),
        (
            ["rewards.process.split=newline"],
            "rewards.process.split = 'newline' is not valid: acts through per-step advantages: set grpo.step_credit",
        ),
        (
            ["rewards.process.split=newline", "grpo.step_credit=step_mix", "env.id=rlfabric/GuessNumber-v0"],
            "rewards.process.split = 'newline' is not valid: must be 'none' with env.id",
        ),
        (
            ["rewards.process.outcome_spans=none", "rewards.process.process_spans=none", "grpo.step_credit=step_mix"],
            "rewards.process.process_spans = 'none' is not valid: must not be 'none' when",
        ),
    ],
)
def test_bad_process_settings_are_one_line_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_process_settings_load():
    cfg = load_config(None, ["rewards.process.split=tag:<step>", "grpo.step_credit=step_mix"])
    assert cfg.rewards.process.split == "tag:<step>"
    assert cfg.rewards.process.outcome_spans == "all" and cfg.rewards.process.process_spans == "all"


# -- a GRPO run: the config's process settings reach the rollout worker and the learner --------------------------


@process_reward
def line_shape(inputs: list[RewardInput]) -> list:
    """Per step its length in characters, and whether the completion is a single step."""
    return [[{"line_chars": float(len(s)), "single_step": float(len(x.steps) == 1)} for s in x.steps] for x in inputs]


register_reward("line_shape", line_shape)


def newline_steps(text: str) -> list[str]:
    """The documented ``newline`` split, written out: a step ends after each run of line breaks; a step of only
    whitespace joins the step after it (the last such step joins the one before)."""
    pieces = re.findall(r"[^\n]*\n+|[^\n]+", text)
    steps: list[str] = []
    carry = ""
    for piece in pieces:
        if piece.strip():
            steps.append(carry + piece)
            carry = ""
        else:
            carry += piece
    if carry:
        steps = [*steps[:-1], steps[-1] + carry] if steps else [carry]
    return steps or [""]


def test_newline_steps_as_documented():
    assert newline_steps("12+35=47\n47+7=54") == ["12+35=47\n", "47+7=54"]
    assert newline_steps("\n\nok\n\n12\n") == ["\n\nok\n\n", "12\n"]
    assert newline_steps("a\n \n") == ["a\n \n"] and newline_steps("") == [""] and newline_steps("\n") == ["\n"]


def test_a_grpo_run_splits_scores_and_trains_on_the_reasoning_spans(local_ray, tmp_path):
    from grpo_runs import run_grpo

    # A supervised warm-up on two demonstrations per prompt, one of two lines ("3+4\n7") and one of one line ("7"),
    # so that sampled completions are of one step or of several; the alphabet holds just the prompts' characters and
    # the chat template's.
    rows = [{"prompt": f"{a}+{b}=", "work": [f"{a}+{b}\n{a + b}", f"{a + b}"]} for a in range(10) for b in range(10)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    # The outcome trains no span and the process term only the reasoning spans (all steps but the last): a
    # completion of one step has no loss, so its row's advantages are all 0 and the learner skips it.
    run = run_grpo(
        tmp_path / "run",
        model={"builtin": {"alphabet": "0123456789+=" + "systemuserassistant: \n", "max_positions": 96}},
        data={"train": str(tmp_path / "sums.jsonl")},
        sampling={"max_new_tokens": 20},
        sft={"steps": 60, "lr": 0.01, "answer_key": "work"},
        rewards={
            "functions": [{"name": "line_shape"}, {"name": "last_char_is_digit"}],
            "weights": {"single_step": 0.0},
            "process": {"split": "newline", "outcome_spans": "none", "process_spans": "reasoning"},
        },
        grpo={"step_credit": "step_mix", "step_gamma": 0.0, "skip_zero_advantage_rows": True, "entropy_coef": 0.0},
    )
    grpo = run.phase("grpo")
    assert len(grpo) == 3 and run.summary["trained_samples"] == 24
    for row in grpo:
        # the process components reached the run's metrics
        assert row["reward_line_chars"] > 0 and 0 <= row["reward_single_step"] <= 1 and "reward_correct" in row
        # the rollout worker split (without rewards.process every completion is one step: single_step 1)
        assert row["reward_single_step"] < 1
        # the learner got rewards.process (with the default all/all a one-step row trains): the rows it skipped
        # are at least those of one step (a multi-step row is skipped too where its group's steps score alike)
        assert row["skipped_rows"] >= round(row["reward_single_step"] * 8)
        assert row["trained_rows"] + row["skipped_rows"] == 8 and math.isfinite(row["pg_loss"])
    assert sum(round(row["reward_single_step"] * 8) for row in grpo) > 0  # so the check above could fail
    assert any(row["pg_loss"] != 0 for row in grpo)  # nonzero advantages reached the loss
    shown = [json.loads(line) for line in (run.run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(shown) == 8 and any(len(s["steps"]) > 1 for s in shown)
    for s in shown:
        steps = newline_steps(s["completion"])
        assert s["steps"] == steps
        assert s["step_components"] == [{"line_chars": len(t), "single_step": float(len(steps) == 1)} for t in steps]
        assert s["components"] == {"correct": float(s["completion"][-1:].isdigit())}
