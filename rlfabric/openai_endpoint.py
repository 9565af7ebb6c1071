"""An OpenAI-compatible chat-completions endpoint in front of the policy, recording exact token traces.

An agent written against any OpenAI client (the ``openai`` package, agent SDKs, LangGraph) is the rollout: the
rollout worker opens a session per episode and hands the agent a client whose base URL names it
(``http://127.0.0.1:PORT/s/<session>/v1``) and whose API key is the run's token. Each ``POST
.../chat/completions`` renders the agent's messages into the episode's token context (``rlfabric.agent_trace``:
sampled ids kept as sampled, only new messages tokenized), asks the policy for one turn through the worker's
``ActBatcher`` under the session's key (so the generator continues the conversation's stored KV and the calls of
all episodes in flight are batched), records the sampled ids, behaviour logprobs and policy version, and answers
in OpenAI's format, with tool calls parsed from the model's text by the configured parser.

Safety: the server listens on loopback unless told another host, and every request must carry the run's token
(``Authorization: Bearer <token>``, compared in constant time): a request without it gets 401, a session that is
not open (never opened, or its episode has ended) 404. Sampling is the run's (``sampling`` section), not the
request's: the learner trains on what the configured policy sampled, so ``temperature`` and the like are ignored;
``n`` > 1 and ``stream`` are refused with 400, and so is a conversation that with a turn's tokens would not fit the
model (``max_context_tokens``; code ``context_length_exceeded``), before it reaches a generator. The calls of one
session run one at a time (a lock per session), so parallel calls or a client's retries each get an exact record.

The endpoint lives on the event loop that ran ``start``: create it, its ``ActBatcher`` and the agents' clients
there, and run agents as coroutines that never block that loop (an async client, no blocking I/O).

Given a scripted ``player`` instead of a policy, the endpoint answers each call with the player's text for the
session's task and the conversation so far (``rlfabric.agent_loop.ScriptedTurns``): the agent's episodes through
it are demonstrations in the agent's own format, for a supervised warm-up.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rlfabric.agent_loop import Player, PolicyTurns, ScriptedTurns
from rlfabric.agent_trace import AgentTrace, BadMessages, assistant_message
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.policies.batching import ActBatcher
from rlfabric.tools import ParsedCalls, tool_call_parser

_TOOL_BLOCK_PREFIX = "<tool_call>"  # hermes blocks: the text before the first one is the message's content
_SESSION_KEY = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # one path segment of the base URL


def new_run_token() -> str:
    """A fresh secret for a run's endpoint (what its agents pass as the API key)."""
    return secrets.token_urlsafe(24)


def openai_error(status: int, message: str, kind: str) -> web.Response:
    """An error reply in OpenAI's shape, so clients raise their usual exception with ``message``."""
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


@dataclass
class Session:
    """An open episode: the trace its calls fill, the lock that runs them one at a time, what answers them (the
    policy under the session's key, or a scripted player) and the episode's task (what a player is given)."""

    trace: AgentTrace
    lock: asyncio.Lock
    turns: PolicyTurns | ScriptedTurns
    task: dict[str, Any]


class OpenAIEndpoint:
    """The endpoint of one rollout worker (see the module docstring). ``batcher``: the worker's ``ActBatcher`` over
    its policy (None with a ``player``); ``chat``: the policy's chat template pieces; ``tool_parser``: a name in
    ``rlfabric.tools``; ``player``: answer calls with this scripted player instead of the policy."""

    def __init__(
        self,
        batcher: ActBatcher | None,
        chat: ChatTokens,
        *,
        token: str,
        player: Player | None = None,
        tool_parser: str = "hermes",
        host: str = "127.0.0.1",
        model_name: str = "rlfabric-policy",
        max_context_tokens: int | None = None,
    ) -> None:
        if not token:
            raise ValueError("OpenAIEndpoint needs a token: requests without it are refused")
        if (batcher is None) == (player is None):
            raise ValueError("OpenAIEndpoint answers with a policy (batcher) or a scripted player: give one of them")
        self.batcher = batcher
        self.player = player
        self.chat = chat
        self.token = token
        self.parse: Callable[[str], ParsedCalls] = tool_call_parser(tool_parser)
        self.host = host
        self.model_name = model_name
        self.max_context_tokens = max_context_tokens  # the model's positions less a turn's new tokens
        self.sessions: dict[str, Session] = {}  # open sessions by key
        self.refused = {"unauthorized": 0, "unknown_session": 0, "bad_request": 0}
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on ``host`` at a free port (``self.port``)."""
        app = web.Application(client_max_size=16 * 2**20)
        app.router.add_post("/s/{session}/v1/chat/completions", self._chat_completions)
        app.router.add_get("/s/{session}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, session: str, task: dict[str, Any] | None = None) -> tuple[str, AgentTrace]:
        """Open an episode's session on ``task``: the base URL its client uses, and the trace its calls fill."""
        if self._runner is None:
            raise RuntimeError("OpenAIEndpoint.open before start")
        if not _SESSION_KEY.fullmatch(session) or session in self.sessions:
            raise ValueError(f"session key {session!r}: must be new and 1-128 characters of A-Z a-z 0-9 _ . -")
        trace = AgentTrace(self.chat)
        if self.player is not None:
            turns: PolicyTurns | ScriptedTurns = ScriptedTurns(self.player, self.chat)
        else:
            assert self.batcher is not None
            turns = PolicyTurns(self.batcher, session)  # the key: the generator continues the session's stored KV
        self.sessions[session] = Session(trace, asyncio.Lock(), turns, task or {})
        return f"http://{self.host}:{self.port}/s/{session}/v1", trace

    def close(self, session: str) -> AgentTrace:
        """End a session: its trace; later calls under its key, and answers still on their way, are refused (404)."""
        trace = self.sessions.pop(session).trace
        trace.closed = True
        return trace

    # -- requests -------------------------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        given = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
        return hmac.compare_digest(given.encode(), self.token.encode())

    def _session(self, request: web.Request) -> tuple[Session | None, web.Response | None]:
        if not self._authorized(request):
            self.refused["unauthorized"] += 1
            return None, openai_error(401, "missing or wrong API key: use the run's token", "invalid_api_key")
        session = self.sessions.get(request.match_info["session"])
        if session is None:
            self.refused["unknown_session"] += 1
            return None, openai_error(404, "no open session with this key (its episode may have ended)", "not_found")
        return session, None

    async def _models(self, request: web.Request) -> web.Response:
        _, refusal = self._session(request)
        if refusal is not None:
            return refusal
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    async def _chat_completions(self, request: web.Request) -> web.Response:
        session, refusal = self._session(request)
        if refusal is not None:
            return refusal
        assert session is not None
        trace = session.trace
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
            return self._bad_request("the request body is not JSON (UTF-8)", "invalid_request_error")
        problem = _unsupported(body)
        if problem is not None:
            return self._bad_request(problem, "invalid_request_error")
        async with session.lock:
            try:
                call = trace.prepare(body.get("messages"), body.get("tools"), self.max_context_tokens)
            except BadMessages as exc:
                return self._bad_request(str(exc), exc.code)
            try:
                turn = await session.turns.next_turn(call.context, call.messages, session.task)
            except Exception as exc:  # noqa: BLE001 - a generator's failure: the worker decides (agents.play_agent)
                trace.policy_error = exc
                return openai_error(503, f"the policy could not answer: {exc}", "server_error")
            calls = self.parse(turn.text).calls
            content = turn.text.split(_TOOL_BLOCK_PREFIX, 1)[0].strip() if calls else turn.text
            reply = assistant_message(content, calls)
            cut = turn.finish_reason == "length"
            if not trace.commit(call, turn.sampled, turn.logprobs, turn.version, reply, truncated=cut):
                self.refused["unknown_session"] += 1
                return openai_error(404, "the episode ended while this call was answered", "not_found")
        finish = _finish_reason(turn.finish_reason, calls)
        completion = _completion(self.model_name, content, calls, finish, len(call.context), len(turn.sampled))
        return web.json_response(completion)

    def _bad_request(self, message: str, code: str) -> web.Response:
        self.refused["bad_request"] += 1
        return openai_error(400, message, code)


def _unsupported(body: Any) -> str | None:
    """Why the request asks for what the endpoint does not do, or None."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    if body.get("stream"):
        return "stream: streaming is not supported by this endpoint; send stream=false"
    if body.get("n", 1) != 1:
        return f"n = {body.get('n')!r}: this endpoint returns one choice per call"
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        return "tools: expected a list of tool definitions"
    return None


def _finish_reason(engine_reason: str, calls: list) -> str:
    if calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def _completion(
    model: str, content: str, calls: list, finish: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A chat.completion object: one choice, tool calls with ids of their own and JSON-string arguments."""
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
        ]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
