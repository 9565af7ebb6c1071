"""Policies behind one interface: scripted, neural-net (numpy, weight-synced by version) and a language model
served by a generator actor, each called in batches across many episodes in flight (``ActBatcher``)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import ray
import torch
from grpo_runs import TINY

from rlfabric.actors.generator import Generator
from rlfabric.models import ActionSpec, ActorCritic
from rlfabric.models.hf import build_small_model_dir, load_causal_lm, load_tokenizer
from rlfabric.policies import ActBatcher, LocalPolicy, NeuralNetPolicy, Policy, PolicyOutput, ScriptedPolicy
from rlfabric.policies.served import GeneratorsFailed, PendingWeights, ServedLLMPolicy


class CountingRule:
    """Doubles each observation; records the size of every batch it was called with."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def __call__(self, observations):
        if any(o < 0 for o in observations):
            raise ValueError("negative observation")
        self.batches.append(len(observations))
        return [2 * o for o in observations]


async def play(batcher: ActBatcher, start: int, turns: int) -> list[int]:
    """An episode: each turn acts on the last action plus one, then yields to the loop (an env step)."""
    seen, obs = [], start
    for _ in range(turns):
        out = await batcher.act(obs)
        assert len(out) == 1
        seen.append(out.actions[0])
        obs = out.actions[0] + 1
        await asyncio.sleep(0)
    return seen


def run_episodes(batcher: ActBatcher, starts: list[int], turns: int) -> list:
    async def main():
        return await asyncio.gather(*(play(batcher, s, turns) for s in starts), return_exceptions=True)

    return asyncio.run(main())


def expected(start: int, turns: int) -> list[int]:
    out, obs = [], start
    for _ in range(turns):
        out.append(2 * obs)
        obs = 2 * obs + 1
    return out


def test_episodes_in_flight_share_one_policy_call_per_turn():
    rule = CountingRule()
    batcher = ActBatcher(ScriptedPolicy(rule))
    starts = list(range(12))
    results = run_episodes(batcher, starts, turns=3)
    assert results == [expected(s, 3) for s in starts]  # each episode got the answer to its own observation
    assert rule.batches == [12, 12, 12]
    assert (batcher.calls, batcher.requests) == (3, 36)


def test_batches_are_capped_at_max_batch():
    rule = CountingRule()
    batcher = ActBatcher(ScriptedPolicy(rule), max_batch=5)
    results = run_episodes(batcher, list(range(12)), turns=2)
    assert results == [expected(s, 2) for s in range(12)]
    assert rule.batches == [5, 5, 2, 5, 5, 2]


def test_a_failing_call_fails_only_the_episodes_in_its_batch():
    batcher = ActBatcher(ScriptedPolicy(CountingRule()), max_batch=4)
    starts = [0, 1, 2, 3, 4, -5, 6, 7, 8, 9]  # the second batch (4, -5, 6, 7) holds a bad observation
    results = run_episodes(batcher, starts, turns=1)
    for start, result in zip(starts, results, strict=True):
        if start in (4, -5, 6, 7):
            assert isinstance(result, ValueError) and "negative observation" in str(result)
        else:
            assert result == expected(start, 1)


def test_policy_output_rejects_columns_of_the_wrong_length():
    with pytest.raises(ValueError, match="PolicyOutput.versions has 1 entries for 2 actions"):
        PolicyOutput([1, 2], [0.0, 0.0], [0])


def test_act_batcher_rejects_an_empty_batch_size():
    with pytest.raises(ValueError, match="max_batch = 0"):
        ActBatcher(ScriptedPolicy(CountingRule()), max_batch=0)


# -- neural net ---------------------------------------------------------------------------------------------


def published(model: ActorCritic, version: int, obs_stats=None) -> dict:
    return {"actor": model.actor_arrays(), "version": version, "obs_stats": obs_stats}


def test_neural_net_policy_acts_with_the_installed_version_and_matches_the_torch_model():
    torch.manual_seed(0)
    model = ActorCritic(3, ActionSpec("discrete", 4), [8])
    policy = NeuralNetPolicy(obs_clip=10.0, seed=0)
    assert isinstance(policy, LocalPolicy) and isinstance(policy, Policy)
    with pytest.raises(RuntimeError, match="before set_weights"):
        policy.act(np.zeros((2, 3)))
    assert policy.set_weights(published(model, 4)) == 4
    obs = np.random.default_rng(1).standard_normal((6, 3)).astype(np.float32)
    out = policy.act(obs)
    assert list(out.versions) == [4] * 6
    logp, _, _ = model.evaluate(torch.as_tensor(obs), torch.as_tensor(out.actions))
    np.testing.assert_allclose(out.logprobs, logp.detach().numpy(), atol=1e-5)
    greedy = policy.act(obs, greedy=True).actions
    np.testing.assert_array_equal(greedy, model.actor(torch.as_tensor(obs)).argmax(-1).numpy())


def test_neural_net_policy_normalizes_with_its_version_statistics():
    model = ActorCritic(2, ActionSpec("continuous", 1), [4])
    stats = {"count": 10.0, "mean": np.array([100.0, -1.0]), "m2": np.array([40.0, 10.0])}  # var 4 and 1
    policy = NeuralNetPolicy(obs_clip=5.0, seed=0)
    policy.set_weights(published(model, 1, stats))
    out = policy.act(np.array([[104.0, -1.5], [0.0, 0.0]]))
    np.testing.assert_allclose(out.info["inputs"], [[2.0, -0.5], [-5.0, 1.0]], atol=1e-6)  # clipped at 5


# -- a language model served by a generator actor -------------------------------------------------------------


@pytest.fixture(scope="module")
def served(local_ray, tmp_path_factory):
    model_dir = build_small_model_dir(tmp_path_factory.mktemp("policy") / "model", **TINY)
    gen = Generator.options(num_cpus=0.5).remote("torch", str(model_dir), {"max_batch_size": 16}, num_threads=1)
    yield model_dir, gen
    ray.kill(gen, no_restart=True)


GREEDY = {"max_new_tokens": 5, "temperature": 0.0}


def greedy_continuation(model: torch.nn.Module, context: list[int], pad_id: int) -> list[int]:
    """transformers' own greedy decoding of ``GREEDY``'s 5 tokens after ``context``."""
    ids = torch.tensor([context])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=pad_id
        )
    return out[0, len(context) :].tolist()


def test_served_policy_batches_episodes_in_flight_into_one_generator_call_per_turn(served):
    model_dir, gen = served
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in ["1+2=", "40+9=", "hello", "7*7=", "(3)"]]
    policy = ServedLLMPolicy([(0, 0, gen)], GREEDY, timeout_s=120)
    batcher = ActBatcher(policy)
    reused_before = ray.get(gen.stats.remote())["reused_tokens"]

    async def episode(i, prompt):  # two turns: the second prompt is the first plus what was sampled
        first = await batcher.act(prompt, session=f"policy-test-{i}")
        second = await batcher.act(prompt + first.actions[0], session=f"policy-test-{i}")
        return first, second

    async def main():
        return await asyncio.gather(*(episode(i, p) for i, p in enumerate(prompts)))

    turns = asyncio.run(main())
    assert batcher.calls == 2 and batcher.requests == 2 * len(prompts)
    # the second turns continued the first turns' stored KV: all of it but the last sampled token (never fed back)
    reused = ray.get(gen.stats.remote())["reused_tokens"] - reused_before
    assert reused == sum(len(p) + len(first.actions[0]) - 1 for p, (first, _) in zip(prompts, turns, strict=True))
    model = load_causal_lm(model_dir)
    for prompt, (first, second) in zip(prompts, turns, strict=True):
        for context, out in ((prompt, first), (prompt + first.actions[0], second)):
            sampled = out.actions[0]
            assert len(out.logprobs[0]) == len(sampled) and list(out.versions) == [0]
            # batched with the others, each episode still gets exactly its own greedy continuation
            assert sampled == greedy_continuation(model, context, tokenizer.pad_token_id)
            assert out.info["text"][0] == tokenizer.decode(sampled, skip_special_tokens=True)
    assert policy.version == 0


def test_served_policy_names_a_dead_generator_by_slot_and_generation(served):
    model_dir, _ = served
    doomed = Generator.options(num_cpus=0.5).remote("torch", str(model_dir), {"max_batch_size": 4}, num_threads=1)
    ray.get(doomed.version.remote(), timeout=120)
    ray.kill(doomed, no_restart=True)
    policy = ServedLLMPolicy([(3, 2, doomed)], GREEDY, timeout_s=60)
    with pytest.raises(GeneratorsFailed) as failed:
        policy.act([[5, 6, 7]])
    assert [(slot, gen) for slot, gen, _ in failed.value.failures] == [(3, 2)]
    with pytest.raises(GeneratorsFailed, match="generator 3 \\(generation 2\\)"):
        asyncio.run(policy.act_async([[5, 6, 7]]))


@ray.remote(num_cpus=0)
def load_later(generator, weights, version, delay_s):
    """The weights loaded into ``generator`` after ``delay_s``: a learner still training them."""
    time.sleep(delay_s)
    return ray.get(generator.update_weights.remote(weights, version))


def test_a_policy_sent_before_its_weights_generates_with_them_once_they_are_loaded(served):
    model_dir, _ = served
    gen = Generator.options(num_cpus=0.5).remote("torch", str(model_dir), {"max_batch_size": 4}, num_threads=1)
    try:
        model = load_causal_lm(model_dir).eval()
        prompt = [5, 6, 7, 8]
        for version, asynchronous in ((1, False), (2, True)):
            torch.manual_seed(version)
            with torch.no_grad():  # new weights, which greedy decoding tells apart from the old
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.5)
            weights = [ray.put({k: v.clone() for k, v in model.state_dict().items()})]
            loads = [load_later.remote(gen, weights, version, 3.0)]
            # the deadline (2 s) is shorter than the wait for the weights (3 s): it counts from their loads
            policy = ServedLLMPolicy([(0, 0, gen)], GREEDY, timeout_s=2, after=PendingWeights(version, loads))
            out = asyncio.run(policy.act_async([prompt])) if asynchronous else policy.act([prompt])
            assert list(out.versions) == [version]
            assert out.actions[0] == greedy_continuation(model, prompt, pad_id=0)
    finally:
        ray.kill(gen, no_restart=True)


def test_served_policy_keeps_each_session_on_one_generator(served):
    model_dir, gen = served
    other = Generator.options(num_cpus=0.5).remote("torch", str(model_dir), {"max_batch_size": 16}, num_threads=1)
    try:
        generators = [gen, other]
        before = sum(stats["reused_tokens"] for stats in ray.get([g.stats.remote() for g in generators]))
        policy = ServedLLMPolicy([(0, 0, gen), (1, 0, other)], GREEDY, timeout_s=120)
        prompts = [[5 + i, 6, 7, 8] for i in range(8)]
        sessions = [f"spread-{i}" for i in range(8)]
        first = policy.act(prompts, sessions)
        seconds = [p + a for p, a in zip(prompts, first.actions, strict=True)]
        policy.act(seconds[::-1], sessions[::-1])  # another order: rows move, sessions stay on their generator
        reused = sum(stats["reused_tokens"] for stats in ray.get([g.stats.remote() for g in generators])) - before
        assert reused == sum(len(p) + len(a) - 1 for p, a in zip(prompts, first.actions, strict=True))
        assert all(stats["sessions"] > 0 for stats in ray.get([g.stats.remote() for g in generators]))  # both used
    finally:
        ray.kill(other, no_restart=True)


def test_a_generators_failure_crosses_processes_with_the_generators_it_names():
    import pickle

    from rlfabric.policies.served import GeneratorsFailed

    failed = pickle.loads(pickle.dumps(GeneratorsFailed([(0, 2, "the actor died"), (1, 0, "missed its 60s deadline")])))
    assert failed.failures == [(0, 2, "the actor died"), (1, 0, "missed its 60s deadline")]
    assert str(failed) == (
        "generator 0 (generation 2): the actor died; generator 1 (generation 0): missed its 60s deadline"
    )
