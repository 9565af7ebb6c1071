"""An agent episode's model calls as exact token segments, from the chat messages an outside agent sends.

An agent written against an OpenAI client sends its whole conversation with every call. Re-rendering and
re-tokenizing that conversation each call would not reproduce what the model sampled: the client hands back the
assistant's message as parsed text and tool calls, which the chat template renders its own way. So the trace keeps
the tokens: each call's context is the previous call's context, then the sampled ids exactly as sampled, then only
the *new* messages (tool results, the user's reply) rendered by the template and the opening of the next assistant
turn, the way ``rlfabric.models.chat_tokens`` appends an env's reply.

A call continues the current segment when its messages are the segment's messages (those sent before, then the
assistant replies as the endpoint returned them) followed by new ones, and the template renders the longer
conversation as an extension of the shorter. Anything else (a harness that edits, drops or summarises history,
or changes its tools) opens a new segment from the call's own rendering: every segment is exact on its own, and
``rewrites`` counts the splits. Each segment becomes one trajectory row (its prompt and turns, as
``rlfabric.trajectory.from_turns`` takes them).

A call is two steps: ``prepare`` works out its context without touching the trace, and ``commit`` records it
with the policy's answer, so a call the policy failed leaves nothing behind. Calls of one episode must not
overlap (the endpoint holds a lock per session); ``commit`` refuses a call prepared before another was committed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.tools import ToolCall
from rlfabric.trajectory import TurnTokens

Message = dict[str, Any]


class BadMessages(ValueError):
    """The request's messages cannot be rendered: what is wrong, for the caller's 400 reply."""

    code = "invalid_request_error"


class ContextTooLong(BadMessages):
    """The call's context and the tokens a turn may sample do not fit the model."""

    code = "context_length_exceeded"


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, None (no text), or OpenAI content parts of type "text"."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadMessages(f"{where}.content: expected a string or a list of text parts")


def tool_call_arguments(arguments: Any, where: str) -> dict[str, Any]:
    """A tool call's arguments as an object: OpenAI sends them as a JSON string."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            raise BadMessages(f"{where}.function.arguments: not JSON ({exc.msg})") from None
    if not isinstance(arguments, dict):
        raise BadMessages(f"{where}.function.arguments: expected a JSON object")
    return arguments


def normalized(message: Any, where: str) -> Message:
    """The parts of a chat message that decide what the model sees, in the chat template's form: role, content as
    text, tool calls as ``{"type": "function", "function": {"name", "arguments": {...}}}``, and a tool result's
    ``tool_call_id`` / ``name``. Fields a client adds (refusal, audio, annotations, call ids, a ``name`` on other
    roles) are dropped, so the assistant message a client hands back equals the one the endpoint returned."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadMessages(f"{where}: expected an object with a string 'role'")
    out: Message = {
        "role": message["role"],
        "content": message_text(message.get("content"), where),
    }
    calls = message.get("tool_calls") or []
    if calls:
        if not isinstance(calls, list):
            raise BadMessages(f"{where}.tool_calls: expected a list")
        parsed = []
        for k, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise BadMessages(
                    f"{where}.tool_calls[{k}]: expected {{'function': {{'name': ..., 'arguments': ...}}}}"
                )
            arguments = tool_call_arguments(function.get("arguments", "{}"), f"{where}.tool_calls[{k}]")
            parsed.append(ToolCall(function["name"], arguments))
        out["tool_calls"] = template_calls(parsed)
    if out["role"] == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
    return out


def template_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Tool calls in the form chat templates render: ``{"type": "function", "function": {"name", "arguments"}}``
    with the arguments as an object."""
    return [{"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}} for c in calls]


def assistant_message(content: str, calls: Sequence[ToolCall]) -> Message:
    """The normalized assistant message for a reply of ``content`` and ``calls`` (what a client hands back)."""
    out: Message = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = template_calls(calls)
    return out


@dataclass
class Segment:
    """A run of calls whose contexts extend each other: the first call's prompt, then one turn per call."""

    prompt: list[int]
    tools: Any
    messages: list[Message]  # what the context renders: the calls' messages and the assistant replies
    context: list[int]  # prompt, then each turn's sampled ids and observation so far
    turns: list[TurnTokens] = field(default_factory=list)
    truncated: bool = False  # its last turn ran out of tokens (sampling's max_new_tokens)
    # where each turn's assistant reply sits in ``messages`` (a client may add assistant messages of its own)
    replies_at: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PendingCall:
    """A call's context, not yet part of the trace (``AgentTrace.prepare``): the segment it continues (None: it
    opens one) and the tokens it appends to that segment's last turn, or the new segment's prompt."""

    context: list[int]
    messages: list[Message]
    tools: Any
    continues: Segment | None
    added: list[int]


class AgentTrace:
    """One episode's calls as exact segments (see the module docstring); ``chat`` renders and tokenizes."""

    def __init__(self, chat: ChatTokens) -> None:
        self.chat = chat
        self.segments: list[Segment] = []
        self.rewrites = 0  # calls whose history did not continue the trace: each opened a new segment
        self.tool_calls = 0  # tool calls in the replies recorded
        self.policy_error: BaseException | None = None  # a call the policy failed (a lost generator)
        self.closed = False  # the episode ended: no call is recorded any more

    def _render(self, messages: list[Message], tools: Any, generation_prompt: bool) -> str:
        try:
            return self.chat.render(messages, generation_prompt, tools)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's, told to the agent
            raise BadMessages(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from None

    def _ids(self, text: str) -> list[int]:
        try:
            return self.chat.text_ids(text)
        except Exception as exc:  # noqa: BLE001 - e.g. a character the tokenizer has no token for
            raise BadMessages(f"the messages cannot be tokenized: {type(exc).__name__}: {exc}") from None

    def _continuation(self, messages: list[Message], tools: Any) -> list[int] | None:
        """The tokens to append to the current segment for a call with ``messages``, or None when the call does
        not continue it."""
        if not self.segments or not self.segments[-1].turns:
            return None
        segment = self.segments[-1]
        known = segment.messages
        if tools != segment.tools or len(messages) <= len(known) or messages[: len(known)] != known:
            return None
        before = self._render(known, tools, generation_prompt=False)
        after = self._render(messages, tools, generation_prompt=True)
        if not after.startswith(before):
            return None
        return [*self.chat.close_after(segment.turns[-1].sampled), *self._ids(after[len(before) :])]

    def prepare(self, raw_messages: Any, tools: Any, max_tokens: int | None = None) -> PendingCall:
        """The token context of a call with ``raw_messages`` (the request's): the current segment's context and
        the new messages' tokens, or a new segment's prompt (see the module docstring). The trace is unchanged.
        BadMessages for messages that cannot be rendered; ContextTooLong past ``max_tokens``."""
        if not isinstance(raw_messages, list) or not raw_messages:
            raise BadMessages("messages: expected a non-empty list")
        messages = [normalized(m, f"messages[{i}]") for i, m in enumerate(raw_messages)]
        observation = self._continuation(messages, tools)
        if observation is not None:
            segment = self.segments[-1]
            call = PendingCall(segment.context + observation, messages, tools, segment, observation)
        else:
            prompt = self._ids(self._render(messages, tools, generation_prompt=True))
            call = PendingCall(prompt, messages, tools, None, prompt)
        if max_tokens is not None and len(call.context) > max_tokens:
            raise ContextTooLong(
                f"the conversation is {len(call.context)} tokens; with a turn's new tokens the model takes at most "
                f"{max_tokens} before them"
            )
        return call

    def commit(
        self,
        call: PendingCall,
        sampled: Sequence[int],
        logprobs: Sequence[float],
        version: int,
        reply: Message,
        truncated: bool = False,
    ) -> bool:
        """Record ``call`` with the policy's answer: its sampled ids, their behaviour logprobs and version, the
        assistant message returned, and whether the turn ran out of tokens. False, recording nothing, when the
        episode has ended or another call of it was committed since ``prepare``."""
        current = self.segments[-1] if self.segments else None
        # another call committed since prepare: the segment moved on (or a newer one began)
        stale = call.continues is not None and (
            call.continues is not current or len(current.context) != len(call.context) - len(call.added)
        )
        if self.closed or stale:
            return False
        turn = TurnTokens(list(sampled), list(logprobs), int(version))
        if call.continues is None:
            self.rewrites += bool(self.segments)
            self.segments.append(
                Segment(
                    call.added,
                    call.tools,
                    call.messages,
                    [*call.added, *sampled],
                    [turn],
                    replies_at=[len(call.messages)],
                )
            )
        else:
            segment = call.continues
            last = segment.turns[-1]
            segment.turns[-1] = TurnTokens(last.sampled, last.logprobs, last.version, call.added, last.rewards)
            segment.turns.append(turn)
            segment.replies_at.append(len(call.messages))
            segment.context = [*call.context, *sampled]
        self.segments[-1].messages = [*call.messages, reply]
        self.segments[-1].truncated = truncated
        self.tool_calls += len(reply.get("tool_calls") or [])
        return True

    def add_rewards(self, rewards: dict[str, float]) -> None:
        """The episode's reward components, on the last turn of every segment: each segment is a row of its own,
        and each trains on the outcome of the episode it belongs to."""
        for segment in self.segments:
            if segment.turns:
                last = segment.turns[-1]
                merged = {**last.rewards, **{k: float(v) for k, v in rewards.items()}}
                segment.turns[-1] = TurnTokens(last.sampled, last.logprobs, last.version, last.observation, merged)

    def add_step_rewards(self, steps: Sequence[dict[str, float]]) -> dict[str, float]:
        """A process reward's components, one dict per turn of the last segment (the conversation the episode ended
        with), added to those turns' rewards; each earlier segment's row gets the episode's totals on its last turn,
        as it gets the outcome's. Returns the totals."""
        last = self.segments[-1]
        if len(steps) != len(last.turns):
            raise ValueError(f"a process reward scored {len(steps)} steps of a conversation of {len(last.turns)} turns")
        totals: dict[str, float] = {}
        for k, step in enumerate(steps):
            turn = last.turns[k]
            merged = dict(turn.rewards)
            for name, value in step.items():
                merged[name] = merged.get(name, 0.0) + float(value)
                totals[name] = totals.get(name, 0.0) + float(value)
            last.turns[k] = TurnTokens(turn.sampled, turn.logprobs, turn.version, turn.observation, merged)
        for segment in self.segments[:-1]:
            if segment.turns:
                turn = segment.turns[-1]
                merged = {**turn.rewards, **totals}
                segment.turns[-1] = TurnTokens(turn.sampled, turn.logprobs, turn.version, turn.observation, merged)
        return totals

    @property
    def calls(self) -> int:
        return sum(len(s.turns) for s in self.segments)
