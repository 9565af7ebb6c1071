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
from rlfabric.models.llm_batch import pack_trajectories
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
    """A generator actor on a tiny builtin model, its ActBatcher and chat pieces, and a learner on the same
    weights: (batcher, chat, learner)."""
    model_dir = build_small_model_dir(tmp_path / "model", **{**TINY, "max_positions": 256})
    gen = Generator.options(num_cpus=0.5).remote("torch", str(model_dir), {"max_batch_size": 16}, num_threads=1)
    learner = LLMLearnerCore(str(model_dir), {**GRPOConfig().__dict__, "norm_length": 8}, {"lr": 1e-3}, temperature=1.0)
    policy = ServedLLMPolicy([(0, 0, gen)], {"max_new_tokens": 8, "temperature": 1.0}, timeout_s=120)
    yield ActBatcher(policy), ChatTokens(learner.tokenizer), learner
    ray.kill(gen, no_restart=True)


async def play_all(endpoint: OpenAIEndpoint, agent, tasks: list[dict], deadline_s: float = 60.0, token=TOKEN):
    """Every task's episode at once, each in a session of its own; the episodes in task order."""
    await endpoint.start()
    try:

        async def one(i: int, task: dict):
            key = f"episode-{i}"
            url, trace = endpoint.open(key)
            try:
                return await play_agent(agent, task, i, client_for(url, token), trace, deadline_s)
            finally:
                endpoint.close(key)

        return await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
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
    batcher, chat, learner = served
    endpoint = OpenAIEndpoint(batcher, chat, token=TOKEN)
    tasks = [{"word": w} for w in ("abc", "xyz", "hello", "ok")]
    episodes = asyncio.run(play_all(endpoint, chatty_agent, tasks))
    assert [e.error for e in episodes] == [None] * 4
    assert all(len(e.trace.segments) == 1 and e.trace.calls == 3 and e.trace.rewrites == 0 for e in episodes)
    assert batcher.calls < batcher.requests  # the episodes' calls reached the generator in batches
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
    batcher, chat, learner = served
    endpoint = OpenAIEndpoint(batcher, chat, token=TOKEN)
    episodes = asyncio.run(play_all(endpoint, forgetful_agent, [{}, {}]))
    for e in episodes:
        # calls 1 and 2 continue one segment; call 3 drops the first exchange: a new segment from its own prompt
        assert e.error is None and e.trace.rewrites == 1
        assert [len(s.turns) for s in e.trace.segments] == [2, 1]
        assert all(s.turns[-1].rewards == {"reward": 1.0} for s in e.trace.segments)  # each row has the outcome
    batch = pack_trajectories(record_of(episodes), chat.tokenizer.pad_token_id)
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
    batcher, chat, _ = served
    for agent, deadline_s, error in [
        (raises, 60.0, 'the agent raised KeyError: "the agent\'s own bug"'),
        (hangs, 5.0, "the agent missed its 5s episode deadline"),
        (never_calls, 60.0, "the agent made no model call"),
        (returns_text, 60.0, "the agent returned str, expected a dict of reward components or a number"),
    ]:
        endpoint = OpenAIEndpoint(batcher, chat, token=TOKEN)
        (episode,) = asyncio.run(play_all(endpoint, agent, [{}], deadline_s=deadline_s))
        assert episode.error == error


def test_requests_without_the_token_for_an_unknown_or_ended_session_or_unsupported_are_refused(served):
    batcher, chat, _ = served
    endpoint = OpenAIEndpoint(batcher, chat, token=TOKEN)
    hello = [{"role": "user", "content": "hi"}]

    async def scenario() -> list[str]:
        await endpoint.start()
        seen = []
        try:
            url, _ = endpoint.open("live")
            for client, kwargs in [
                (client_for(url, token="wrong"), {}),
                (client_for(url.replace("/live/", "/nobody/")), {}),
                (client_for(url), {"n": 2}),
                (client_for(url), {"messages": []}),
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
        finally:
            await endpoint.stop()
        return seen

    seen = asyncio.run(scenario())
    ended = "404: Error code: 404 - no open session with this key (its episode may have ended)"
    assert seen == [
        "401: Error code: 401 - missing or wrong API key: use the run's token",
        ended,
        "400: Error code: 400 - n = 2: this endpoint returns one choice per call",
        "400: Error code: 400 - messages: expected a non-empty list",
        ended,
    ]
    assert endpoint.refused == {"unauthorized": 1, "unknown_session": 2, "bad_request": 2}


def test_an_assistant_tool_call_handed_back_by_a_client_continues_the_trace():
    """The client hands back the tool call as OpenAI JSON (string arguments, its call id, null fields) and adds
    the tool's result: the context goes on from the sampled ids, the new tokens being the tool message alone."""
    chat = ChatTokens(build_char_tokenizer(builtin_alphabet("tool")))
    trace = AgentTrace(chat)
    opening = [{"role": "user", "content": "add 2 and 3"}]
    prompt = trace.context_for(opening, tools=None)
    sampled = chat.text_ids('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    sampled.append(chat.turn_close[0])  # the model stopped on its end-of-turn token
    trace.record(sampled, [-0.5] * len(sampled), 7, assistant_message("", [ToolCall("add", {"a": 2, "b": 3})]))
    handed_back = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}
        ],
    }
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    context = trace.context_for([*opening, handed_back, tool], tools=None)
    observation = chat.turn_close[1:] + chat.text_ids("tool: 5<eos>\nassistant: ")
    assert context == prompt + sampled + observation and trace.rewrites == 0
    assert trace.segments[0].turns[0].observation == observation
    # the same call with its arguments changed is another history: a new segment, rendered from scratch
    edited = {
        **handed_back,
        "tool_calls": [{**handed_back["tool_calls"][0], "function": {"name": "add", "arguments": "{}"}}],
    }
    assert trace.context_for([*opening, edited, tool], tools=None)[: len(prompt)] == prompt
    assert trace.rewrites == 1 and len(trace.segments) == 2


def test_agents_resolve_by_name_or_path_and_anything_else_is_one_config_error():
    register_agent("chatty", chatty_agent)
    assert resolve_agent("chatty") is chatty_agent
    assert resolve_agent("rlfabric.agents:play_agent") is play_agent
    with pytest.raises(ConfigError, match=r"env.agent = 'nobody': not a registered agent \(chatty"):
        resolve_agent("nobody")
    with pytest.raises(ConfigError, match="env.agent = 'rlfabric.agents:register_agent': must be an async function"):
        resolve_agent("rlfabric.agents:register_agent")
