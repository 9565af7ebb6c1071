"""A text env whose agent may call tools before it answers.

``ToolEnv(task_env, tools)`` wraps a task env that poses a question on ``reset(task)`` and scores a final answer
with ``answer(text) -> TextStep``. Each turn, the agent's text is parsed for tool calls (``parser``, Hermes-style
by default): calls are checked against their schemas and run under ``tool_timeout_s``, and their results (or
errors) come back as the next observation, wrapped in ``<tool_response>`` tags the way Qwen's chat template
renders tool messages; a turn without a call is the answer. Every bad call becomes an error observation and is
counted in ``TextStep.info["invalid_tool_calls"]`` by kind (``rlfabric.tools.ERROR_KINDS``), the first text of each
kind in ``TextStep.info["tool_errors"]``; none ends the episode.
``McpToolEnv`` takes its tools from an MCP server instead, one session per episode.
"""

from __future__ import annotations

from typing import Any, Protocol

from rlfabric.mcp_tools import McpSession, is_url, server_command
from rlfabric.text_env import TextStep, call_env
from rlfabric.tools import ToolSet, tool_call_parser


class AnswerTask(Protocol):
    """What ``ToolEnv`` wraps: ``reset(task) -> question`` and ``answer(text) -> TextStep`` (the final score)."""

    def reset(self, task: dict[str, Any]) -> Any: ...

    def answer(self, text: str) -> Any: ...


class ToolEnv:
    """See the module docstring. ``system_prompt`` lists the tools and the call format for the agent."""

    def __init__(self, task_env: AnswerTask, tools: ToolSet, parser: str = "hermes", tool_timeout_s: float = 10.0):
        self.task_env, self.tools = task_env, tools
        self.parse = tool_call_parser(parser, "ToolEnv parser")
        self.tool_timeout_s = tool_timeout_s
        self.system_prompt = tools_prompt(tools)

    async def reset(self, task: dict[str, Any]) -> str:
        return str(await call_env(self.task_env.reset, task))

    async def step(self, action: str) -> TextStep:
        parsed = self.parse(action)
        malformed = f"error: malformed tool call: {parsed.malformed}"
        if parsed.malformed is not None and not parsed.calls:
            return TextStep(
                _responses([malformed]),
                info={"invalid_tool_calls": {"malformed": 1}, "tool_errors": {"malformed": malformed}},
            )
        if not parsed.calls:
            return await call_env(self.task_env.answer, action)
        invalid: dict[str, int] = {"malformed": 1} if parsed.malformed else {}
        errors: dict[str, str] = {"malformed": malformed} if parsed.malformed else {}
        texts = []
        for call in parsed.calls:
            outcome = await self.tools.call(call, self.tool_timeout_s)
            texts.append(outcome.text)
            if outcome.error:
                invalid[outcome.error] = invalid.get(outcome.error, 0) + 1
                errors.setdefault(outcome.error, outcome.text)
        info = {"tool_calls": len(parsed.calls), "invalid_tool_calls": invalid, "tool_errors": errors}
        return TextStep(_responses(texts), info=info)


class McpToolEnv(ToolEnv):
    """A ``ToolEnv`` whose tools an MCP server serves (``rlfabric.mcp_tools``): each episode opens its own session
    at ``reset`` (what one episode writes, no other sees) and closes it at ``close``. ``server`` is the server's
    command line (a process per episode), the URL of a running streamable HTTP server (a session per episode), or
    a ``ToolServer`` actor (``rlfabric.actors.tool_server``) that supervises one and gives its URL; ``start_timeout_s``
    bounds the start and handshake. A server lost mid-episode fails the episode (``McpSessionLost``)."""

    def __init__(
        self,
        task_env: AnswerTask,
        server: str | list[str] | Any,
        parser: str = "hermes",
        tool_timeout_s: float = 10.0,
        start_timeout_s: float = 30.0,
    ):
        super().__init__(task_env, ToolSet([]), parser, tool_timeout_s)
        self.server = server_address(server)
        self.start_timeout_s = start_timeout_s
        self.session: McpSession | None = None

    async def reset(self, task: dict[str, Any]) -> str:
        await self.close()
        self.session = await McpSession.open(await resolve_server(self.server), self.start_timeout_s)
        self.tools = ToolSet(self.session.tools())
        self.system_prompt = tools_prompt(self.tools)
        return await super().reset(task)

    async def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            await session.close()


def is_supervised(server: Any) -> bool:
    """Whether ``server`` is a ``ToolServer`` actor handle (it answers ``address``) rather than a command or URL."""
    return callable(getattr(getattr(server, "address", None), "remote", None))


def server_address(server: Any) -> Any:
    """``server`` as a session opens it: a URL or actor handle as given, a command line as its argv (a bad command
    fails here, when the env is built, not at its first episode)."""
    return server if is_url(server) or is_supervised(server) else server_command(server)


async def resolve_server(server: Any) -> str | list[str]:
    """The URL or argv a session opens now: a ``ToolServer`` actor is asked for its running server's URL (it waits
    for one that is restarting)."""
    if is_supervised(server):
        url, _generation = await server.address.remote()
        return str(url)
    return server


def tools_prompt(tools: ToolSet) -> str:
    """The system message that lists ``tools`` with their parameters and shows the Hermes call format."""
    names = ", ".join(f"{t.name}({', '.join(t.parameters.get('properties', {}))})" for t in tools.tools.values())
    return f'Tools: {names}. Call one as <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>.'


def _responses(texts: list[str]) -> str:
    return "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in texts)
