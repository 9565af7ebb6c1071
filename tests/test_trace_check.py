"""Checked traces: a record whose tokens are not what the generator sampled (here: the chat re-tokenized, as a
producer working from text would build it) is caught on arrival, gets no loss, is counted, and the first is
described readably; records built token by token pass."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
from grpo_runs import TINY

from rlfabric.actors.llm_learner import LLMLearnerCore
from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, episodes_to_trajectories, run_episodes
from rlfabric.envs.guess_number import GuessNumber, bisection_player
from rlfabric.grpo_config import GRPOConfig
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import build_small_model_dir, load_tokenizer
from rlfabric.models.llm_batch import grpo_batch
from rlfabric.trajectory import concat, drifted_rows

SPEC = {"reward_weights": {}, "advantage": "grpo", "scale_by_std": True, "overlong_filter": False}


def played(tokenizer, secrets: list[int], first_episode: int = 0):
    chat = ChatTokens(tokenizer)
    tasks = [{"secret": s} for s in secrets]
    episodes = asyncio.run(
        run_episodes(lambda: GuessNumber(16), tasks, ScriptedTurns(bisection_player, chat), chat, EpisodeLimits(5))
    )
    ids = list(range(first_episode, first_episode + len(secrets)))
    return episodes_to_trajectories(episodes, ids, [first_episode] * len(secrets))


def retokenized(traj, tokenizer):
    """The same episodes as a text-based producer would record them: each row's chat decoded to text and
    tokenized again (the sampled end-of-turn tokens are special, so they do not survive the round trip)."""
    rows = []
    for i in range(traj.num_rows):
        text = tokenizer.decode(traj.tokens[i, : traj.length[i]], skip_special_tokens=True)
        rows.append(tokenizer(text, add_special_tokens=False).input_ids)
    tokens = np.zeros_like(traj.tokens)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row[: tokens.shape[1]]
    return dataclasses.replace(traj, tokens=tokens)


def test_records_built_token_by_token_pass_and_a_retokenized_one_is_caught_with_a_readable_report(tmp_path):
    tokenizer = load_tokenizer(build_small_model_dir(tmp_path / "m", **{**TINY, "max_positions": 256}))
    good = played(tokenizer, [3, 11, 16])
    bad_rows, report = drifted_rows(good)
    assert not bad_rows.any() and report is None
    drifted = retokenized(played(tokenizer, [5, 9], first_episode=10), tokenizer)
    bad_rows, report = drifted_rows(drifted)
    assert bad_rows.tolist() == [True, True]
    assert report.startswith("episode 10 (row 0), position ") and "where the generator sampled" in report


def test_the_learner_trains_on_the_rows_that_check_and_counts_the_ones_that_do_not(tmp_path):
    model_dir = build_small_model_dir(tmp_path / "m", **{**TINY, "max_positions": 256})
    tokenizer = load_tokenizer(model_dir)
    good = played(tokenizer, [3, 11, 16, 7])
    drifted = retokenized(played(tokenizer, [5, 9, 12, 2], first_episode=10), tokenizer)
    # rewards that differ within each group, so every row has an advantage and would be trained
    for traj in (good, drifted):
        traj.final_rewards["correct"] = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    batch = grpo_batch([good, drifted], None, pad_id=tokenizer.pad_token_id, **SPEC)
    assert int(batch["drifted_rows"]) == 4 and batch["drift_report"].startswith("episode 10 ")
    assert batch["response_mask"][:4].sum() > 0 and batch["response_mask"][4:].sum() == 0
    learner = LLMLearnerCore(
        str(model_dir),
        {**dataclasses.asdict(GRPOConfig()), "norm_length": 6},
        {"lr": 1e-3},
        temperature=1.0,
        batch_spec=SPEC,
    )
    metrics = learner.train_on([concat([good]), drifted], None, lr=1e-3)
    assert metrics["drifted_trajectories"] == 4
    assert metrics["trained_rows"] == 4  # the drifted rows have no loss and no advantage: skipped


def test_a_producer_may_leave_sampled_tokens_out_of_the_loss_but_never_put_others_in(tmp_path):
    tokenizer = load_tokenizer(build_small_model_dir(tmp_path / "m", **{**TINY, "max_positions": 256}))
    record = played(tokenizer, [3, 11])
    record.loss_mask[0] = 0.0  # e.g. an overlong or otherwise filtered episode: still a faithful trace
    assert not drifted_rows(record)[0].any()
    prompt_end = int(record.prompt_length[1])
    record.loss_mask[1, prompt_end - 1] = 1.0  # a prompt token under the loss: not something the policy sampled
    bad, report = drifted_rows(record)
    assert bad.tolist() == [False, True] and f"position {prompt_end - 1}" in report
