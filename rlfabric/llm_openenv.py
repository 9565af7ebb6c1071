"""A GRPO run on an OpenEnv environment server (``env.openenv``): its host actor started in the library's own
Python packages (launching the server when the run starts it), and the text env the rollout worker plays through
it (``rlfabric.openenv_env.OpenEnvTextEnv``)."""

from __future__ import annotations

import uuid
from typing import Any

import ray

from rlfabric.actor_slots import remote_cause
from rlfabric.actors.openenv_host import HOST_NAME_PREFIX, OpenEnvHost
from rlfabric.config import ConfigError
from rlfabric.grpo_config import LLMConfig
from rlfabric.llm_resources import SETUP_TIMEOUT_S
from rlfabric.tools import tool_call_parser

TEXT_ENV_SPEC = "rlfabric.openenv_env:OpenEnvTextEnv"
TOOL_ENV_SPEC = "rlfabric.openenv_env:OpenEnvToolEnv"  # with env.openenv.tools


def start_openenv(cfg: LLMConfig) -> tuple[Any, str, dict[str, Any]]:
    """Start the host actor with ``env.openenv.pip`` as its runtime env and wait until its server answers (one
    error naming ``env.openenv`` when it cannot): (the actor, the text env spec for the episodes, its kwargs)."""
    o = cfg.env.openenv
    if o.tools:  # the episodes' ToolEnv parses the calls with it: a bad name is one line naming the field
        try:
            tool_call_parser(cfg.env.tool_parser, "env.tool_parser")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    name = f"{HOST_NAME_PREFIX}{uuid.uuid4().hex[:8]}"
    runtime_env = {"pip": list(o.pip)} if o.pip else None
    host = OpenEnvHost.options(name=name, runtime_env=runtime_env).remote(
        o.command, o.url, o.start_timeout_s, o.tools, o.health_interval_s, o.ping_timeout_s
    )
    what = f"env.openenv.command = {o.command!r}" if o.command else f"env.openenv.url = {o.url!r}"
    try:
        ray.get(host.start.remote(), timeout=SETUP_TIMEOUT_S + o.start_timeout_s)
    except Exception as exc:  # noqa: BLE001 - the server's or its packages' failure: named, one line
        ray.kill(host, no_restart=True)
        raise ConfigError(
            f"{what}: starting it (with env.openenv.pip = {list(o.pip)}) failed: {remote_cause(exc)}"
        ) from None
    kwargs = {
        "host_name": name,
        "action_key": o.action_key,
        "observation_key": o.observation_key,
        "reward_component": o.reward_component,
        "components": list(o.components),
    }
    if o.tools:
        return host, TOOL_ENV_SPEC, {**kwargs, "parser": cfg.env.tool_parser}
    return host, TEXT_ENV_SPEC, kwargs


def openenv_server_restarts(host: Any) -> dict[str, int]:
    """``openenv_server_restarts`` for a step row or the summary: how many times the started server exited or hung
    and was started again (empty when the host does not answer within 10 s)."""
    try:
        return {"openenv_server_restarts": int(ray.get(host.health.remote(), timeout=10)["restarts"])}
    except Exception:  # noqa: BLE001 - a figure for the metrics, not worth failing a step for
        return {}


def stop_openenv(host: Any) -> None:
    """End the host's sessions and the server it started, then the actor."""
    try:
        ray.get(host.stop.remote(), timeout=15)
    except Exception:  # noqa: BLE001, S110 - killed below either way; its server is its child
        pass
    ray.kill(host, no_restart=True)
