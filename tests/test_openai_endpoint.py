"""The OpenAI-compatible endpoint: agents written against the ``openai`` client are the rollout, and what the
endpoint records is, token for token, what the generator sampled (the learner's logprobs of the record agree);
a harness that rewrites its history gets exact segments; bad agents and bad requests cost only their episode."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import openai
import pytest
import ray
from grpo_runs import TINY

from rlfabric.actors.generator import Generator
from rlfabric.actors.llm_learner import LLMLearnerCore
from rlfabric.agent_trace import AgentTrace, assistant_message
from rlfabric.agents import play_agent, register_agent, resolve_agent
from rlfabric.config import ConfigError
from rlfabric.grpo_config import GRPOConfig
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.hf import build_char_tokenizer, build_small_model_dir, builtin_alphabet
from rlfabric.models.packed_batch import pack_trajectories
from rlfabric.openai_endpoint import OpenAIEndpoint, new_run_token
from rlfabric.policies import ActBatcher
from rlfabric.policies.served import ServedLLMPolicy
from rlfabric.tools import ToolCall
from rlfabric.trajectory import from_turns

TOKEN = new_run_token()


def client_for(base_url: str, token: str = TOKEN) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=60)


async def chatty_agent(task: dict, client: openai.AsyncOpenAI) -> dict:
    """Three calls, each continuing the conversation the way agents do: the reply appended as the SDK returned
    it, then the next user message."""
    messages = [{"role": "user", "content": f"say {task['word']}"}]
    for turn in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [
            reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": f"more {turn}"},
        ]
    return {"correct": float(task["word"] in (reply.choices[0].message.content or ""))}


async def forgetful_agent(task: dict, client: openai.AsyncOpenAI) -> float:
    """Keeps only the last exchange: from its third call on, its history is not what it was sent before."""
    history: list[dict] = []
    for turn in range(3):
        messages = [*history[-2:], {"role": "user", "content": f"step {turn}"}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        history = [messages[-1], reply.choices[0].message.model_dump(exclude_none=True)]
    return 1.0


@pytest.fixture
def served(local_ray, tmp_path):
    """A generator actor on a tiny builtin model as a served policy, its chat pieces, and a learner on the same
    weights: (policy, chat, learner). Each event loop gets an ActBatcher of its own over the policy."""
    model_dir = build_small_model_dir(tmp_path / "model", **{**TINY, "max_positions": 256})
    gen = Generator.options(num_cpus=0.5).remote("torch", str(model_dir), {"max_batch_size": 16}, num_threads=1)
    learner = LLMLearnerCore(str(model_dir), {**GRPOConfig().__dict__, "norm_length": 8}, {"lr": 1e-3}, temperature=1.0)
    policy = ServedLLMPolicy([(0, 0, gen)], {"max_new_tokens": 8, "temperature": 1.0}, timeout_s=120)
    yield policy, ChatTokens(learner.tokenizer), learner
    ray.kill(gen, no_restart=True)


async def play_all(policy, chat, agent, tasks: list[dict], deadline_s: float = 60.0):
    """Every task's episode at once, each in a session of its own, on an endpoint built on this loop: (the
    episodes in task order, the endpoint)."""
    endpoint = OpenAIEndpoint(ActBatcher(policy), chat, token=TOKEN)
    await endpoint.start()
    try:

        async def one(i: int, task: dict):
            key = f"episode-{i}"
            url, trace = endpoint.open(key)
            try:
                return await play_agent(agent, task, i, client_for(url), trace, deadline_s)
            finally:
                endpoint.close(key)

        return await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))), endpoint
    finally:
        await endpoint.stop()


def record_of(episodes) -> object:
    """The trajectory record of the episodes' segments (one row per segment)."""
    segments = [(e, s) for e in episodes for s in e.trace.segments]
    return from_turns(
        [s.prompt for _, s in segments],
        [s.turns for _, s in segments],
        episode_ids=[e.task_index for e, _ in segments],
        group_ids=[0] * len(segments),
        truncated=[False] * len(segments),
    )


def test_an_openai_client_agent_is_recorded_exactly_as_the_generator_sampled_it(served):
    policy, chat, learner = served
    tasks = [{"word": w} for w in ("abc", "xyz", "hello", "ok")]
    episodes, endpoint = asyncio.run(play_all(policy, chat, chatty_agent, tasks))
    assert [e.error for e in episodes] == [None] * 4
    assert all(len(e.trace.segments) == 1 and e.trace.calls == 3 and e.trace.rewrites == 0 for e in episodes)
    assert endpoint.batcher.calls < endpoint.batcher.requests  # the episodes' calls reached the generator in batches
    for e in episodes:  # each context is the previous one, the sampled ids as sampled, then the new message
        segment = e.trace.segments[0]
        assert segment.prompt == chat.prompt([{"role": "user", "content": f"say {tasks[e.task_index]['word']}"}])
        for turn, k in zip(segment.turns[:-1], range(2), strict=True):
            assert chat.tokenizer.decode(turn.observation).endswith(f"user: more {k}<eos>\nassistant: ")
        assert "correct" in segment.turns[-1].rewards and not segment.turns[0].rewards
    record = record_of(episodes)
    batch = pack_trajectories(record, chat.tokenizer.pad_token_id)
    mask = batch["response_mask"] > 0
    assert mask.sum() == sum(len(t.sampled) for e in episodes for t in e.trace.segments[0].turns)
    recomputed = learner.logprobs(batch)
    np.testing.assert_allclose(recomputed[mask], batch["behaviour_logprobs"][mask], atol=2e-4)


def test_a_harness_that_rewrites_its_history_gets_exact_segments_and_counts_them(served):
    policy, chat, learner = served
    episodes, _ = asyncio.run(play_all(policy, chat, forgetful_agent, [{}, {}]))
    for e in episodes:
        # calls 1 and 2 continue one segment; call 3 drops the first exchange: a new segment from its own prompt
        assert e.error is None and e.trace.rewrites == 1
        assert [len(s.turns) for s in e.trace.segments] == [2, 1]
        assert all(s.turns[-1].rewards == {"reward": 1.0} for s in e.trace.segments)  # each row has the outcome
    batch = pack_trajectories(record_of(episodes), chat.tokenizer.pad_token_id)
    mask = batch["response_mask"] > 0
    np.testing.assert_allclose(learner.logprobs(batch)[mask], batch["behaviour_logprobs"][mask], atol=2e-4)


async def parallel_agent(task: dict, client: openai.AsyncOpenAI) -> float:
    """Two calls at once on the same opening, as sub-agents or a client's retry would make them."""
    opening = [{"role": "user", "content": "go"}]
    await asyncio.gather(*(client.chat.completions.create(model="policy", messages=opening) for _ in range(2)))
    return 1.0


def test_overlapping_calls_of_one_episode_each_get_an_exact_record(served):
    policy, chat, learner = served
    (episode,), _ = asyncio.run(play_all(policy, chat, parallel_agent, [{}]))
    assert episode.error is None and episode.trace.calls == 2
    assert [len(s.turns) for s in episode.trace.segments] == [1, 1] and episode.trace.rewrites == 1
    batch = pack_trajectories(record_of([episode]), chat.tokenizer.pad_token_id)
    mask = batch["response_mask"] > 0
    np.testing.assert_allclose(learner.logprobs(batch)[mask], batch["behaviour_logprobs"][mask], atol=2e-4)


async def raises(task, client):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    raise KeyError("the agent's own bug")


async def hangs(task, client):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    await asyncio.sleep(3600)


async def never_calls(task, client):
    return {"correct": 1.0}


async def returns_text(task, client):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    return "done"


def test_bad_agent_code_is_a_recorded_failure_of_its_episode_alone(served):
    policy, chat, _ = served
    for agent, deadline_s, error in [
        (raises, 60.0, 'the agent raised KeyError: "the agent\'s own bug"'),
        (hangs, 5.0, "the agent missed its 5s episode deadline"),
        (never_calls, 60.0, "the agent made no model call"),
        (returns_text, 60.0, "the agent returned str, expected a dict of reward components or a number"),
    ]:
        (episode,), _ = asyncio.run(play_all(policy, chat, agent, [{}], deadline_s=deadline_s))
        assert episode.error == error


def test_requests_without_the_token_for_an_unknown_or_ended_session_or_unsupported_are_refused(served):
    policy, chat, _ = served
    hello = [{"role": "user", "content": "hi"}]

    async def scenario() -> tuple[list[str], OpenAIEndpoint]:
        endpoint = OpenAIEndpoint(ActBatcher(policy), chat, token=TOKEN, max_context_tokens=40)
        await endpoint.start()
        seen = []
        try:
            url, _ = endpoint.open("live")
            for client, kwargs in [
                (client_for(url, token="wrong"), {}),
                (client_for(url.replace("/live/", "/nobody/")), {}),
                (client_for(url), {"n": 2}),
                (client_for(url), {"messages": []}),
                # "user: " + 40 x + <eos> + "\n" + "assistant: " = 59 tokens
                (client_for(url), {"messages": [{"role": "user", "content": "x" * 40}]}),
            ]:
                try:
                    await client.chat.completions.create(model="policy", **{"messages": hello, **kwargs})
                except openai.APIStatusError as exc:
                    seen.append(f"{exc.status_code}: {exc.message}")
            trace = endpoint.close("live")
            try:  # a call after its episode ended
                await client_for(url).chat.completions.create(model="policy", messages=hello)
            except openai.NotFoundError as exc:
                seen.append(f"{exc.status_code}: {exc.message}")
            assert trace.calls == 0
            with pytest.raises(ValueError, match="session key 'a/b': must be new and 1-128 characters"):
                endpoint.open("a/b")  # not one path segment
        finally:
            await endpoint.stop()
        return seen, endpoint

    seen, endpoint = asyncio.run(scenario())
    ended = "404: Error code: 404 - no open session with this key (its episode may have ended)"
    assert seen == [
        "401: Error code: 401 - missing or wrong API key: use the run's token",
        ended,
        "400: Error code: 400 - n = 2: this endpoint returns one choice per call",
        "400: Error code: 400 - messages: expected a non-empty list",
        "400: Error code: 400 - the conversation is 59 tokens; with a turn's new tokens the model takes at most 40 "
        "before them",
        ended,
    ]
    assert endpoint.refused == {"unauthorized": 1, "unknown_session": 2, "bad_request": 3}


def test_an_assistant_tool_call_handed_back_by_a_client_continues_the_trace():
    """The client hands back the tool call as OpenAI JSON (string arguments, its call id, null fields) and adds
    the tool's result: the context goes on from the sampled ids, the new tokens being the tool message alone."""
    chat = ChatTokens(build_char_tokenizer(builtin_alphabet("tool")))
    trace = AgentTrace(chat)
    opening = [{"role": "user", "content": "add 2 and 3"}]
    first = trace.prepare(opening, tools=None)
    prompt = first.context
    sampled = chat.text_ids('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    sampled.append(chat.turn_close[0])  # the model stopped on its end-of-turn token
    reply = assistant_message("", [ToolCall("add", {"a": 2, "b": 3})])
    assert trace.segments == [] and trace.commit(first, sampled, [-0.5] * len(sampled), 7, reply)
    assert trace.segments[0].prompt == prompt
    handed_back = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}
        ],
    }
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    second = trace.prepare([*opening, handed_back, tool], tools=None)
    observation = chat.turn_close[1:] + chat.text_ids("tool: 5<eos>\nassistant: ")
    assert second.context == prompt + sampled + observation and not trace.segments[0].turns[0].observation
    assert trace.commit(second, [5], [-0.1], 8, assistant_message("5", []))
    assert trace.segments[0].turns[0].observation == observation and trace.rewrites == 0
    assert not trace.commit(second, [5], [-0.1], 8, assistant_message("5", []))  # prepared before the last commit
    # the same call with its arguments changed is another history: a new segment, rendered from its own messages
    edited = {
        **handed_back,
        "tool_calls": [{**handed_back["tool_calls"][0], "function": {"name": "add", "arguments": "{}"}}],
    }
    third = trace.prepare([*opening, edited, tool], tools=None)
    assert third.continues is None and third.context[: len(prompt)] == prompt
    assert trace.commit(third, [5], [-0.1], 9, assistant_message("5", []))
    assert trace.rewrites == 1 and len(trace.segments) == 2
    trace.closed = True  # the episode ended: a late answer is not recorded
    assert not trace.commit(trace.prepare([{"role": "user", "content": "late"}], None), [5], [-0.1], 9, reply)


def test_agents_resolve_by_name_or_path_and_anything_else_is_one_config_error():
    register_agent("chatty", chatty_agent)
    assert resolve_agent("chatty") is chatty_agent
    assert resolve_agent("rlfabric.agents:play_agent") is play_agent
    with pytest.raises(ConfigError, match=r"env.agent = 'nobody': not a registered agent \(chatty"):
        resolve_agent("nobody")
    with pytest.raises(ConfigError, match="env.agent = 'rlfabric.agents:register_agent': must be an async function"):
        resolve_agent("rlfabric.agents:register_agent")
