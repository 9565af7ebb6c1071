"""Multi-turn text episodes built token by token: chat delimiters from the template, the trajectory record of
several turns, episodes in flight together, env failures as recorded errors, and the learner's logprobs equal to
the generator's on what was sampled."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest
import ray
import torch
from grpo_runs import TINY

from rlfabric.actors.generator import Generator
from rlfabric.actors.llm_learner import LLMLearnerCore
from rlfabric.agent_loop import EpisodeLimits, ScriptedTurns, episodes_to_trajectories, run_episodes
from rlfabric.envs.guess_number import GuessNumber, bisection_player
from rlfabric.grpo_config import GRPOConfig
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import build_char_tokenizer, build_small_model_dir, builtin_alphabet, load_tokenizer
from rlfabric.models.packed_batch import pack_trajectories
from rlfabric.policies import ActBatcher, PolicyOutput
from rlfabric.policies.served import ServedLLMPolicy
from rlfabric.registry import register_env
from rlfabric.text_env import TextStep, make_text_env
from rlfabric.trajectory import NO_VERSION, TurnTokens, from_turns, sampled_version

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer():
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


# -- chat delimiters ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [build_char_tokenizer, chatml_tokenizer], ids=["char", "chatml"])
def test_appended_turns_equal_the_template_rendering_of_the_whole_chat(make):
    tok = make()
    chat = ChatTokens(tok)
    end_of_turn = chat.turn_close[0]
    ids = chat.prompt([{"role": "user", "content": "Guess."}])
    for said, heard in (("8", "higher"), ("12", "lower")):
        sampled = tok(said, add_special_tokens=False).input_ids + [end_of_turn]  # stopped on the turn's end
        ids += sampled + chat.reply(sampled, heard)
    whole = tok.apply_chat_template(
        [
            {"role": "user", "content": "Guess."},
            {"role": "assistant", "content": "8"},
            {"role": "user", "content": "higher"},
            {"role": "assistant", "content": "12"},
            {"role": "user", "content": "lower"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ids == tok(whole, add_special_tokens=False).input_ids


@pytest.mark.parametrize("alphabet", ["default", "tool"])
def test_a_saved_builtin_tokenizer_loads_back_with_every_character(tmp_path, alphabet):
    """Spaces, newlines and the chat template survive save and load: one token per character, decoded back
    exactly, the same ids as the tokenizer that was saved."""
    text = "user: what is 12 + 3?<eos>\nassistant: 15, (a b)"
    built = build_char_tokenizer(builtin_alphabet(alphabet))
    loaded = load_tokenizer(build_small_model_dir(tmp_path / "model", alphabet=alphabet, **TINY))
    ids = loaded(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) - len("<eos>") + 1
    assert ids == built(text, add_special_tokens=False).input_ids
    assert loaded.decode(ids) == text
    assert len(loaded) == len(built) and loaded.pad_token_id == built.pad_token_id
    assert loaded.apply_chat_template([{"role": "user", "content": "a b"}], tokenize=False) == "user: a b<eos>\n"


def test_a_turn_cut_before_its_end_token_gets_the_whole_closing_delimiter():
    tok = chatml_tokenizer()
    chat = ChatTokens(tok)
    cut = tok("12", add_special_tokens=False).input_ids  # hit the token budget: no <|im_end|>
    reply = chat.reply(cut, "lower")
    assert reply[: len(chat.turn_close)] == chat.turn_close
    assert tok.decode(reply).startswith("<|im_end|>\n<|im_start|>user\nlower<|im_end|>")


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line():
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        ChatTokens(tok)


# -- the record of several turns -------------------------------------------------------------------------------


def test_turns_lay_out_sampled_tokens_under_the_loss_mask_and_replies_outside_it():
    traj = from_turns(
        [[1, 2], [3]],
        [
            [TurnTokens([10, 11], [-0.5, -0.25], 4, [7, 7, 7], {"invalid": 1.0}), TurnTokens([12], [-1.0], 5)],
            [TurnTokens([13, 14, 15], [-0.1, -0.2, -0.3], 4, (), {"solved": 1.0})],
        ],
        episode_ids=[0, 1],
        group_ids=[9, 9],
        truncated=[True, False],
    )
    np.testing.assert_array_equal(traj.tokens[0, :8], [1, 2, 10, 11, 7, 7, 7, 12])
    np.testing.assert_array_equal(traj.loss_mask[0, :8], [0, 0, 1, 1, 0, 0, 0, 1])
    np.testing.assert_array_equal(traj.policy_version[0, :8], [NO_VERSION] * 2 + [4, 4] + [NO_VERSION] * 3 + [5])
    np.testing.assert_allclose(traj.logprobs[0, :8], [0, 0, -0.5, -0.25, 0, 0, 0, -1.0])
    np.testing.assert_array_equal(traj.step_spans, [[0, 2, 4], [0, 7, 8], [1, 1, 4]])
    np.testing.assert_array_equal(traj.step_rewards["invalid"], [1, 0, 0])
    np.testing.assert_array_equal(traj.final_rewards["solved"], [0, 1])
    np.testing.assert_array_equal(traj.length, [8, 4])
    assert traj.truncated[0, 7] and not traj.terminated[0].any() and traj.terminated[1, 3]
    batch = pack_trajectories(traj, pad_id=0)  # the learner's view: loss only on the sampled tokens
    np.testing.assert_array_equal(batch["response_mask"][0, :6], [1, 1, 0, 0, 0, 1])


# -- episodes in flight, with a scripted player ------------------------------------------------------------------


class SayOne:
    """A policy over token contexts that always answers "1" (and closes its turn)."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.version = tokenizer, 0

    def act(self, observations):
        ids = [self.tok("1", add_special_tokens=False).input_ids + [self.tok.eos_token_id] for _ in observations]
        return PolicyOutput(ids, [[0.0] * len(i) for i in ids], [self.version] * len(ids), {"text": ["1"] * len(ids)})


def test_episodes_in_flight_send_their_turns_to_the_policy_together():
    tok = build_char_tokenizer()
    batcher = ActBatcher(SayOne(tok))
    tasks = [{"secret": s} for s in range(1, 17)]
    episodes = asyncio.run(
        run_episodes(lambda: GuessNumber(16), tasks, batcher, ChatTokens(tok), EpisodeLimits(max_turns=5))
    )
    assert [len(e.turns) for e in episodes] == [1] + [5] * 15  # only secret 1 is found; the rest run out of turns
    assert [e.truncated for e in episodes] == [False] + [True] * 15
    assert batcher.requests == 76 and batcher.calls < batcher.requests / 2  # batched, not one call per turn


def test_the_scripted_bisection_player_solves_every_task_and_its_record_is_the_templated_chat():
    tok = build_char_tokenizer()
    chat = ChatTokens(tok)
    tasks = [{"secret": s} for s in range(1, 17)]
    turns = ScriptedTurns(bisection_player, chat)
    episodes = asyncio.run(run_episodes(lambda: GuessNumber(16), tasks, turns, chat, EpisodeLimits(max_turns=5)))
    assert all(e.error is None and e.rewards == {"correct": 1.0} and not e.truncated for e in episodes)
    assert max(len(e.turns) for e in episodes) == 5 and min(len(e.turns) for e in episodes) == 1
    traj = episodes_to_trajectories(episodes, list(range(16)), [0] * 16)
    assert len(traj.step_spans) == sum(len(e.turns) for e in episodes)
    for row, e in enumerate(episodes):  # the row is the template's rendering of the episode's chat
        messages = [{"role": "user", "content": "Guess my number, 1 to 16."}]
        for turn, text in zip(e.turns, e.texts, strict=True):
            messages.append({"role": "assistant", "content": text})
            if turn.observation:
                messages.append(
                    {"role": "user", "content": tok.decode(turn.observation).split("user: ")[1].split("<eos>")[0]}
                )
        whole = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        # the same, but for the newline the template puts after the last turn's end: nothing follows it here
        assert tok.decode(traj.tokens[row, : traj.length[row]]) + "\n" == whole
        assert int(traj.loss_mask[row].sum()) == sum(len(t.sampled) for t in e.turns)


def test_turn_and_token_limits_truncate_the_episode():
    tok = build_char_tokenizer()
    chat = ChatTokens(tok)
    never = SayOne(tok)
    limits = EpisodeLimits(max_turns=2)
    (short,) = asyncio.run(run_episodes(lambda: GuessNumber(16), [{"secret": 2}], ActBatcher(never), chat, limits))
    assert short.truncated and len(short.turns) == 2 and short.rewards == {}
    prompt_len = len(chat.prompt([{"role": "user", "content": "Guess my number, 1 to 16."}]))
    tight = EpisodeLimits(max_turns=5, turn_tokens=4, max_episode_tokens=prompt_len + 4 + 20)
    (cut,) = asyncio.run(run_episodes(lambda: GuessNumber(16), [{"secret": 2}], ActBatcher(never), chat, tight))
    assert cut.truncated and len(cut.turns) == 1


class Faulty:
    """A text env whose step raises, hangs (blocking or awaiting), or returns the wrong type, by task."""

    def reset(self, task):
        self.kind = task["kind"]
        if self.kind == "reset":
            raise RuntimeError("no table")
        return "go"

    async def _hang(self):
        await asyncio.sleep(30)

    def step(self, action):
        if self.kind == "raise":
            raise RuntimeError("tool down")
        if self.kind == "block":
            time.sleep(3)
        if self.kind == "await":
            return self._hang()
        if self.kind == "wrong":
            return "not a TextStep"
        return TextStep("ok", {"r": 1.0}, terminated=True)


@pytest.mark.parametrize("on_env_error", ["fail", "observe"])
def test_env_failures_end_as_recorded_errors_never_a_crash_or_a_hang(on_env_error):
    tok = build_char_tokenizer()
    kinds = ["reset", "raise", "block", "await", "wrong", "fine"]
    limits = EpisodeLimits(max_turns=2, step_timeout_s=0.3, on_env_error=on_env_error)
    started = time.monotonic()
    episodes = asyncio.run(
        run_episodes(Faulty, [{"kind": k} for k in kinds], ActBatcher(SayOne(tok)), ChatTokens(tok), limits)
    )
    assert time.monotonic() - started < 2.5  # the hung steps hit their deadline; nothing waited them out
    by_kind = dict(zip(kinds, episodes, strict=True))
    assert by_kind["reset"].error == "reset RuntimeError: no table"
    assert by_kind["fine"].error is None and by_kind["fine"].rewards == {"r": 1.0}
    expected = {
        "raise": "RuntimeError: tool down",
        "block": "missed its 0.3s deadline",
        "await": "missed its 0.3s deadline",
        "wrong": "TypeError: step returned str",
    }
    for kind, fragment in expected.items():
        e = by_kind[kind]
        if on_env_error == "fail":
            assert e.error is not None and fragment in e.error, (kind, e.error)
        else:  # shown to the agent, who plays on until the turns run out
            assert e.error is None and e.env_errors == 2 and len(e.turns) == 2 and e.truncated
            assert fragment in tok.decode(e.turns[0].observation)
    traj = episodes_to_trajectories(episodes, list(range(6)), list(range(6)))
    assert traj.num_rows == (1 if on_env_error == "fail" else 5)  # failed episodes are never trained on


def test_a_factory_that_is_not_a_text_env_is_named():
    with pytest.raises(TypeError, match="env.id = 'rlfabric/PointMass-v0' is a Gymnasium env, not a text env"):
        make_text_env("rlfabric/PointMass-v0")
    register_env("not-a-text-env", lambda: object())
    with pytest.raises(TypeError, match="env.id = 'not-a-text-env': its factory returned object, which has no reset"):
        make_text_env("not-a-text-env")
    assert make_text_env("rlfabric/GuessNumber-v0", {"high": 8}).reset({"secret": 8}) == "Guess my number, 1 to 8."


# -- a real generator and the learner -----------------------------------------------------------------------------


def sampled_episodes(tmp_path):
    """Six GuessNumber episodes of up to 3 turns, sampled by a generator actor at version 0: (model dir, the
    episodes, their record, a learner at version 0)."""
    model_dir = build_small_model_dir(tmp_path / "model", **{**TINY, "max_positions": 256})
    gen = Generator.options(num_cpus=0.5).remote("torch", str(model_dir), {"max_batch_size": 16}, num_threads=1)
    try:
        learner = LLMLearnerCore(
            str(model_dir), {**GRPOConfig().__dict__, "norm_length": 6}, {"lr": 1e-3}, temperature=1.0
        )
        chat = ChatTokens(learner.tokenizer)
        policy = ServedLLMPolicy([(0, 0, gen)], {"max_new_tokens": 6, "temperature": 1.0}, timeout_s=120)
        batcher = ActBatcher(policy)
        limits = EpisodeLimits(max_turns=3, turn_tokens=6, max_episode_tokens=256)
        tasks = [{"secret": s} for s in (3, 7, 11, 15, 2, 9)]
        episodes = asyncio.run(run_episodes(lambda: GuessNumber(16), tasks, batcher, chat, limits))
        traj = episodes_to_trajectories(episodes, list(range(6)), [0] * 6)
    finally:
        ray.kill(gen, no_restart=True)
    return model_dir, episodes, traj, learner


def test_the_learner_recomputes_the_generators_logprobs_on_a_multi_turn_record(local_ray, tmp_path):
    _, episodes, traj, learner = sampled_episodes(tmp_path)
    assert traj.num_rows == 6 and sum(len(e.turns) for e in episodes) >= 7  # several episodes took several turns
    multi = [i for i, e in enumerate(episodes) if len(e.turns) > 1]
    for i in multi:  # an observation lies between turns, outside the loss mask and without a version
        first = episodes[i].turns[0]
        start = len(episodes[i].prompt) + len(first.sampled)
        gap = slice(start, start + len(first.observation))
        assert traj.loss_mask[i, gap].sum() == 0 and (traj.policy_version[i, gap] == NO_VERSION).all()
    batch = pack_trajectories(traj, learner.tokenizer.pad_token_id)
    recomputed = learner.logprobs(batch)
    mask = batch["response_mask"] > 0
    np.testing.assert_allclose(recomputed[mask], batch["behaviour_logprobs"][mask], atol=2e-4)
    assert mask.sum() == sum(len(t.sampled) for e in episodes for t in e.turns)


def test_the_learner_rejects_a_row_whose_logprobs_drifted_and_checks_only_rows_of_its_own_version(
    local_ray, tmp_path, capsys
):
    model_dir, _, traj, _ = sampled_episodes(tmp_path)
    # The rewards set outright, so every row has an advantage: the env's own ``invalid`` counts, summed in, put a
    # row on its group's mean now and then, and a zero-advantage row is skipped before the check sees it.
    traj.final_rewards = {"correct": np.array([1.0, 0.0] * 3, np.float32)}
    traj.step_rewards = {}

    def learner():
        config = {**GRPOConfig().__dict__, "norm_length": 6}
        return LLMLearnerCore(str(model_dir), config, {"lr": 1e-3}, temperature=1.0)

    assert learner().train_on([traj], None, lr=1e-3)["drifted_trajectories"] == 0  # faithful rows all train
    off = dataclasses.replace(traj, logprobs=traj.logprobs.copy())
    off.logprobs[4] = np.where(off.loss_mask[4] > 0, off.logprobs[4] - 1.0, off.logprobs[4])  # as at another T
    core = learner()
    metrics = core.train_on([off], None, lr=1e-3)
    assert metrics["drifted_trajectories"] == 1 and metrics["trained_rows"] == 6  # in the batch, without loss
    printed = capsys.readouterr().out
    assert "rejected a trajectory whose logprobs drifted from the sampled ones: episode 4, version 0" in printed
    # the learner is at version 1 now: rows sampled by version 0 are no longer held to its logprobs
    assert core.train_on([off], None, lr=1e-3)["drifted_trajectories"] == 0


def test_the_careless_player_bisects_on_most_turns_and_guesses_in_range_on_the_others():
    from rlfabric.envs.guess_number import careless_player

    opening = [{"role": "user", "content": "Guess my number, 1 to 12."}]
    guesses = [int(careless_player({}, opening)) for _ in range(600)]
    assert all(1 <= g <= 12 for g in guesses)
    slips = sum(g != 6 for g in guesses)  # bisection says 6; a random guess is 6 one time in 12
    assert 600 * (1 / 3) * (11 / 12) * 0.75 < slips < 600 * (1 / 3) * (11 / 12) * 1.25


class GatedGuess(GuessNumber):
    """GuessNumber whose first step waits at ``gate`` after saying it arrived: the test updates the generator's
    weights while every episode is between its first and second turn."""

    def __init__(self, arrived: list, gate: asyncio.Event) -> None:
        super().__init__(16)
        self.arrived, self.gate, self.waited = arrived, gate, False

    async def step(self, action: str) -> TextStep:
        if not self.waited:
            self.waited = True
            self.arrived.append(self)
            await self.gate.wait()
        return super().step(action)


def test_an_episode_spanning_a_weight_update_keeps_each_tokens_version_and_is_one_row(local_ray, tmp_path):
    """Partial rollouts at turn boundaries: episodes in flight when new weights arrive go on under them, and
    every sampled token keeps the version (and the logprobs) of the weights that produced it."""
    from transformers import AutoModelForCausalLM

    model_dir = build_small_model_dir(tmp_path / "model", **{**TINY, "max_positions": 256})
    old = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    new = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.5 * p.std() * torch.randn_like(p))
    gen = Generator.options(num_cpus=0.5).remote("torch", str(model_dir), {"max_batch_size": 16}, num_threads=1)
    chat = ChatTokens(load_tokenizer(model_dir))
    policy = ServedLLMPolicy([(0, 0, gen)], {"max_new_tokens": 6, "temperature": 1.0}, timeout_s=120)
    tasks = [{"secret": s} for s in (3, 7, 11, 15)]
    limits = EpisodeLimits(max_turns=3, turn_tokens=6, max_episode_tokens=256)

    async def scenario():
        arrived, gate = [], asyncio.Event()
        playing = asyncio.ensure_future(
            run_episodes(lambda: GatedGuess(arrived, gate), tasks, ActBatcher(policy), chat, limits)
        )
        while len(arrived) < len(tasks):
            await asyncio.sleep(0.01)
        await gen.update_weights.remote([ray.put(new.state_dict())], 1)
        gate.set()
        return await playing

    try:
        episodes = asyncio.run(scenario())
    finally:
        ray.kill(gen, no_restart=True)
    spanning = [e for e in episodes if len(e.turns) > 1]
    assert len(spanning) >= 2
    for e in spanning:
        assert [t.version for t in e.turns] == [0] + [1] * (len(e.turns) - 1)
    traj = episodes_to_trajectories(episodes, list(range(4)), [0] * 4)
    assert traj.num_rows == 4  # one row per episode, however many versions it spans
    for row in range(traj.num_rows):
        ids = torch.tensor(traj.tokens[row : row + 1, : traj.length[row]].astype(np.int64))
        sampled = traj.loss_mask[row, : traj.length[row]] > 0
        versions = traj.policy_version[row, : traj.length[row]]
        for model, version in ((old, 0), (new, 1)):
            with torch.no_grad():
                logp = model(ids).logits[0, :-1].float().log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
            at = np.flatnonzero(sampled & (versions == version))
            if len(at):  # each token's logprob is that of the weights that sampled it
                np.testing.assert_allclose(logp[at - 1].numpy(), traj.logprobs[row, at], atol=2e-4)
    assert sampled_version(traj).tolist() == [0 if len(e.turns) == 1 else NO_VERSION for e in episodes]


def test_an_episode_spans_the_asked_tokens_the_context_or_the_default_and_never_more_than_the_context():
    from rlfabric.agent_loop import episode_token_limit
    from rlfabric.config import ConfigError

    assert episode_token_limit(100, 256) == 100
    assert episode_token_limit(None, 256) == 256
    assert episode_token_limit(None, None) == 2048
    with pytest.raises(ConfigError, match="env.max_episode_tokens = 500 is not valid: the model's context is 256"):
        episode_token_limit(500, 256)
